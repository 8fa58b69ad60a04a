"""An FP8Linear whose input is made by the step before it in the same pass as the input's FP8 cast: RMSNorm
(LayerNormLinear, and LayerNormMLP's fc1) or SwiGLU (LayerNormMLP's fc2), as Transformer Engine fuses its norms and
activations with the cast of the next GEMM's input.

    forward   RMSNorm: rstd of every row (rms_norm_fwd without its output), then x8, x8^T = cast_transpose(RMSNorm(x)),
              the norm computed inside the cast (csrc/fp8ext.h's prologues): the high-precision output is never
              written or read back. SwiGLU: h8, h8^T = cast_transpose(silu(gate) * up), likewise.
              Then the layer's GEMM, as FP8Linear's.
    backward  the layer's dgrad and wgrad GEMMs, as FP8Linear's, then the step's own backward kernel (rms_norm_bwd:
              dx and dgamma; swiglu_backward: dh).

The bytes are those of the unfused composition (the step's fused kernel writing x's dtype, then FP8Linear): the
prologue computes the step's output as that kernel does and rounds it to x's dtype before the cast, and the amax
recorded in the input's slot is that of the rounded output. Per element of a bf16 norm output this saves its write
and its read by the cast (8 bytes moved become 6: read x twice, write x8 and x8^T); per element of a SwiGLU output,
4 of 10.

Taken by the layer-norm modules on a GPU in eager training with delayed scaling (fused.TRAINING, no autocast dtype
change, a token count that is a multiple of 16, rows of at most 8192 for RMSNorm, fp8ext.debug off); everything else
takes the unfused composition, with the same results. Current scaling needs the output's amax before its cast, one
more pass over it, which is what the composition does. On a CPU the same function computes the step with the
reference definitions of fp8ext.fused (the tests use it there).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import _C, debug, fused
from ._boundary import dl, dl_fp8, stream_of
from .context import activation_dtype, current_context
from .formats import format_of_code
from .linear import FP8Linear, _cast, _fp8_linear_backward, _gemm
from .recipe import DelayedScaling

RMSNORM, SWIGLU = 1, 2  # csrc/fp8ext.h's FP8EXT_PROLOGUE_RMSNORM, FP8EXT_PROLOGUE_SWIGLU
ENABLED = True  # False: the layer-norm modules run their steps separately (for comparisons and debugging)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cast_with_prologue(op, x2, g, eps, fmt, scale, amax_slot, margin):
    """(x8, x8^T, scale_inv, rstd or None) of the step's output for x2 (SwiGLU: [m, 2k]; RMSNorm: [m, k])."""
    m, k = x2.shape[0], x2.shape[1] // (2 if op == SWIGLU else 1)
    if not x2.is_cuda:  # the reference definitions, then the cast
        if op == RMSNORM:
            y, rstd = fused._rms_norm_train_reference(x2, g, eps, x2.dtype)
        else:
            y, rstd = fused._swiglu_reference(x2), None
        return (*_cast(y, fmt, scale, amax_slot, margin), rstd)
    dev, stream = x2.device, stream_of(x2.device)
    rstd = None
    if op == RMSNORM:
        rstd = torch.empty(m, dtype=torch.float32, device=dev)
        _C.rms_norm_fwd(dl(x2), dl(g), None, dl(rstd), float(eps), stream)
    x8 = torch.empty((m, k), dtype=fmt.torch_dtype, device=dev)
    x8t = torch.empty((k, m), dtype=fmt.torch_dtype, device=dev)
    sinv = torch.empty((), dtype=torch.float32, device=dev)
    _C.cast_transpose_fused(dl(x2), dl_fp8(x8), dl_fp8(x8t), fmt.code, dl(scale), op,
                            rstd=None if rstd is None else dl(rstd), gamma=None if g is None else dl(g),
                            amax_out=dl(amax_slot), stream=stream, scale_inv_out=dl(sinv))
    return x8, x8t, sinv, rstd


class _FusedInputLinearFunction(torch.autograd.Function):
    """y = op(x) W^T + b with op(x) cast to FP8 in the pass that computes it (see the module docstring). gamma is the
    norm's float32 scale (RMSNorm) or None (SwiGLU); the scaling arguments are _FP8LinearFunction's."""

    @staticmethod
    def forward(ctx, x, gamma, weight, bias, w8, w8t, w_sinv, x_scale, x_amax, g_scale, g_amax, fwd_code, bwd_code,
                margin, grad_slot, main_grad, op, eps):
        width = x.shape[-1]
        x2 = fused._rows(x, width)
        m, k = x2.shape[0], weight.shape[1]
        g = None if gamma is None else fused._aligned(gamma.detach(), torch.float32)
        x8, x8t, x_sinv, rstd = _cast_with_prologue(op, x2, g, eps, format_of_code(fwd_code), x_scale, x_amax, margin)
        fuse_bias = bias is not None and x.dtype != torch.float32 and bias.dtype == (
            torch.float16 if x.dtype == torch.float16 else torch.bfloat16)
        y = _gemm(x8, w8, x_sinv, w_sinv, x.dtype, bias if fuse_bias else None, fast=True)
        if bias is not None and not fuse_bias:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x2, g, rstd, x8t, x_sinv, w8t, w_sinv)
        ctx.op, ctx.shape = op, x.shape
        ctx.g_state, ctx.grad_slot = (g_scale, g_amax), grad_slot
        ctx.m, ctx.x_dtype = m, x.dtype
        ctx.bwd, ctx.margin = format_of_code(bwd_code), margin
        ctx.w_dtype, ctx.b_dtype = weight.dtype, (bias.dtype if bias is not None else None)
        ctx.main_grad, ctx.weight_ref = main_grad, (weight if main_grad is not None else None)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming out silently wrong
    def backward(ctx, dy):
        x2, g, rstd, x8t, x_sinv, w8t, w_sinv = ctx.saved_tensors
        need_x, need_g, need_w, need_b = ctx.needs_input_grad[:4]
        d_op, dw, db = _fp8_linear_backward(ctx, dy, x8t, x_sinv, w8t, w_sinv, need_x or need_g, need_w, need_b)
        dx = dgamma = None
        if d_op is not None and ctx.op == RMSNORM:
            if x2.is_cuda:
                dx, dgamma = fused._rms_norm_train_backward_gpu(x2, d_op, g, rstd)
            else:
                dx, dgamma = fused._rms_norm_train_backward_reference(x2, d_op, g, rstd)
        elif d_op is not None:
            dx = fused._swiglu_backward_gpu(x2, d_op) if x2.is_cuda else fused._swiglu_backward_reference(x2, d_op)
        return (None if dx is None or not need_x else dx.reshape(ctx.shape), dgamma if need_g else None, dw, db,
                *([None] * 14))


def fused_input_linear(linear: FP8Linear, op: int, x: torch.Tensor, gamma: Optional[torch.Tensor] = None,
                       eps: float = 0.0, is_first_microbatch: Optional[bool] = None, *, reference: bool = False):
    """linear(op(x)) in FP8 with op's output cast in the pass that computes it, or None when this call is not one the
    fused path takes (see the module docstring): the caller then runs op and the layer separately, with the same
    result. op is RMSNORM (gamma: the norm's scale as a float32 tensor, eps) or SWIGLU (x holds gate, then up).
    reference=True takes the path on a CPU too, with fp8ext.fused's reference definitions (for tests)."""
    ctx = current_context()
    if ctx is None or not ctx.enabled or ctx.calibrating or not isinstance(ctx.recipe, DelayedScaling):
        return None
    if not ENABLED or not fused.TRAINING or torch.compiler.is_compiling() or debug.enabled() or not isinstance(x, torch.Tensor):
        return None
    k = linear.in_features
    width = 2 * k if op == SWIGLU else k
    if x.dim() < 1 or x.shape[-1] != width or x.dtype not in _DTYPES or activation_dtype(x) != x.dtype:
        return None
    w = linear.weight
    if w.device != x.device or w.is_meta or x.is_meta or k % 16 or linear.out_features % 16:
        return None
    m = x.numel() // width
    if m == 0 or m % 16 or (op == RMSNORM and (gamma is None or gamma.numel() != k or k > 8192)):
        return None
    if not (fused.available(x, k) or (reference and x.device.type == "cpu")):
        return None
    recipe = ctx.recipe
    (xs, xa, ws, wa, gs, ga), grad_slot = linear._delayed_slots(recipe)
    fwd, bwd = recipe.fp8_format.fwd, recipe.fp8_format.bwd
    w8, w8t, w_sinv = linear._weight_fp8(fwd, ws, wa, recipe.margin, is_first_microbatch)
    main_grad = linear._main_grad() if linear.fuse_wgrad_accumulation and torch.is_grad_enabled() else None
    bias = None if linear.return_bias else linear.bias
    y = _FusedInputLinearFunction.apply(x, None if op == SWIGLU else gamma.reshape(k), w, bias, w8, w8t, w_sinv, xs,
                                        xa, gs, ga, fwd.code, bwd.code, float(recipe.margin), grad_slot, main_grad, op,
                                        float(eps))
    return linear._output(y)
