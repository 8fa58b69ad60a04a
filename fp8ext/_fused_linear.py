"""FP8 layers whose input is made by the step before them in the same pass as the input's FP8 cast: RMSNorm
(LayerNormLinear, and LayerNormMLP's fc1) or SwiGLU (LayerNormMLP's fc2), as Transformer Engine fuses its norms and
activations with the cast of the next GEMM's input; and, in LayerNormMLP's backward, SwiGLU's gradient with the cast
of fc1's output gradient (TE's dswiglu + cast_transpose).

    forward   RMSNorm: rstd of every row (rms_norm_fwd without its output), then x8, x8^T = cast_transpose(RMSNorm(x)),
              the norm computed inside the cast (csrc/fp8ext.h's prologues): the high-precision output is never
              written or read back. SwiGLU: h8, h8^T = cast_transpose(silu(gate) * up), likewise.
              Then the layer's GEMM, as FP8Linear's.
    backward  the layer's dgrad and wgrad GEMMs, as FP8Linear's, then the step's own backward kernel (rms_norm_bwd:
              dx and dgamma; swiglu_backward: dh).
    the MLP   RMSNorm -> fc1 -> SwiGLU -> fc2 as one autograd node (fused_mlp): forward as above; backward fc2's
              GEMMs, then dh8, dh8^T = cast_transpose(dswiglu(h, d_a)) with SwiGLU's gradient computed inside fc1's
              gradient cast (dh is never written in high precision), fc1's GEMMs, rms_norm_bwd.

The bytes are those of the unfused composition (the step's fused kernel writing x's dtype, then FP8Linear): the
prologue computes the step's output as that kernel does and rounds it to x's dtype before the cast, and the amax
recorded in the input's slot is that of the rounded output. Per element of a bf16 norm output this saves its write
and its read by the cast (8 bytes moved become 6: read x twice, write x8 and x8^T); per element of a SwiGLU output,
10 become 6; per element of fc1's output gradient (bf16), 9 become 4.5 (benchmarks/bench_fused_cast.py).

Taken by the layer-norm modules and fp8ext's transformer on a GPU in eager training with delayed scaling
(fused.TRAINING, no autocast dtype change, a token count that is a multiple of 16, rows of at most 8192 for RMSNorm,
FP8Linear layers without hooks, fp8ext.debug off); everything else takes the unfused composition, with the same
results. Current scaling needs the output's amax before its cast, one
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
from .linear import FP8Linear, _cast, _fp8_linear_backward, _gemm, _grad_views
from .profiling import profiled
from .recipe import DelayedScaling

RMSNORM, SWIGLU, DSWIGLU = 1, 2, 3  # csrc/fp8ext.h's FP8EXT_PROLOGUE_RMSNORM, _SWIGLU, _DSWIGLU
ENABLED = True  # False: the layer-norm modules run their steps separately (for comparisons and debugging)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cast_with_prologue(op, x2, g, eps, fmt, scale, amax_slot, margin, dy=None):
    """(x8, x8^T, scale_inv, rstd or None) of the step's output for x2 (SwiGLU: [m, 2k]; RMSNorm: [m, k]; SwiGLU's
    gradient: h [m, k] and dy [m, k / 2])."""
    m, k = x2.shape[0], x2.shape[1] // (2 if op == SWIGLU else 1)
    if not x2.is_cuda:  # the reference definitions, then the cast
        rstd = None
        if op == RMSNORM:
            y, rstd = fused._rms_norm_train_reference(x2, g, eps, x2.dtype)
        elif op == SWIGLU:
            y = fused._swiglu_reference(x2)
        else:
            y = fused._swiglu_backward_reference(x2, dy)
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
                            amax_out=dl(amax_slot), stream=stream, scale_inv_out=dl(sinv),
                            dy=None if dy is None else dl(fused._aligned(dy, x2.dtype)))
    return x8, x8t, sinv, rstd


def _gemm_bias(a8, w8, a_sinv, w_sinv, dtype, bias):
    """The forward GEMM with the bias added by cuBLASLt's epilogue where it takes it (bf16, or fp16 for fp16 output)."""
    fuse = bias is not None and dtype != torch.float32 and bias.dtype == (
        torch.float16 if dtype == torch.float16 else torch.bfloat16)
    y = _gemm(a8, w8, a_sinv, w_sinv, dtype, bias if fuse else None, fast=True)
    return y + bias.to(y.dtype) if bias is not None and not fuse else y


class _FusedInputLinearFunction(torch.autograd.Function):
    """y = op(x) W^T + b with op(x) cast to FP8 in the pass that computes it (see the module docstring). gamma is the
    norm's float32 scale (RMSNorm) or None (SwiGLU); the scaling arguments are _FP8LinearFunction's."""

    @staticmethod
    def forward(ctx, x, gamma, weight, bias, w8, w8t, w_sinv, x_scale, x_amax, g_scale, g_amax, fwd_code, bwd_code,
                margin, grad_slot, main_grad, op, eps):
        width = x.shape[-1]
        x2 = fused._rows(x, width, "LayerNormLinear", "input")
        m, k = x2.shape[0], weight.shape[1]
        g = None if gamma is None else fused._aligned(gamma.detach(), torch.float32)
        x8, x8t, x_sinv, rstd = _cast_with_prologue(op, x2, g, eps, format_of_code(fwd_code), x_scale, x_amax, margin)
        y = _gemm_bias(x8, w8, x_sinv, w_sinv, x.dtype, bias)
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


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` would run forward hooks (its own or global ones, e.g. FSDP's on a sharded layer): the
    fused paths use the layers' parameters without calling them, so they step aside for such modules."""
    glob = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or getattr(glob, "_global_forward_hooks", None)
                or getattr(glob, "_global_forward_pre_hooks", None))


def _eligible(x: torch.Tensor, width: int, linears, reference: bool) -> bool:
    """Whether this call is one the fused paths take (see the module docstring): x [..., width] feeding the first
    of `linears` (FP8Linear, without forward hooks), inside fp8_autocast with delayed scaling."""
    if not all(isinstance(lin, FP8Linear) and not has_hooks(lin) for lin in linears):
        return False  # e.g. fp8ext.inference's quantized layers, or a layer sharded or observed through hooks
    ctx = current_context()
    if ctx is None or not ctx.enabled or ctx.calibrating or not isinstance(ctx.recipe, DelayedScaling):
        return False
    if not ENABLED or not fused.TRAINING or torch.compiler.is_compiling() or debug.enabled():
        return False
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != width or x.dtype not in _DTYPES \
            or activation_dtype(x) != x.dtype or x.is_meta:
        return False
    for lin in linears:
        w = lin.weight
        if w.device != x.device or w.is_meta or lin.in_features % 16 or lin.out_features % 16:
            return False
    m = x.numel() // width
    if m == 0 or m % 16:
        return False
    return fused.available(x, linears[0].in_features) or (reference and x.device.type == "cpu")


def _operands(linear: FP8Linear, recipe, is_first_microbatch):
    """(slots (x scale, x amax, dy scale, dy amax), grad_slot, (w8, w8^T, scale_inv), main_grad, bias) of a forward
    of `linear` with delayed scaling."""
    (xs, xa, ws, wa, gs, ga), grad_slot = linear._delayed_slots(recipe)
    w_cast = linear._weight_fp8(recipe.fp8_format.fwd, ws, wa, recipe.margin, is_first_microbatch)
    main_grad = linear._main_grad() if linear.fuse_wgrad_accumulation and torch.is_grad_enabled() else None
    return (xs, xa, gs, ga), grad_slot, w_cast, main_grad, (None if linear.return_bias else linear.bias)


@profiled("fp8ext.fused_input_linear")
def fused_input_linear(linear: FP8Linear, op: int, x: torch.Tensor, gamma: Optional[torch.Tensor] = None,
                       eps: float = 0.0, is_first_microbatch: Optional[bool] = None, *, reference: bool = False):
    """linear(op(x)) in FP8 with op's output cast in the pass that computes it, or None when this call is not one the
    fused path takes (see the module docstring): the caller then runs op and the layer separately, with the same
    result. op is RMSNORM (gamma: the norm's scale as a float32 tensor, eps) or SWIGLU (x holds gate, then up).
    reference=True takes the path on a CPU too, with fp8ext.fused's reference definitions (for tests)."""
    if torch.compiler.is_compiling():  # nothing of this path is traced: the separate steps' ops are
        return None
    k = linear.in_features
    if not _eligible(x, 2 * k if op == SWIGLU else k, (linear,), reference):
        return None
    if op == RMSNORM and (gamma is None or gamma.numel() != k or k > 8192):
        return None
    recipe = current_context().recipe
    (xs, xa, gs, ga), grad_slot, (w8, w8t, w_sinv), main_grad, bias = _operands(linear, recipe, is_first_microbatch)
    fmt = recipe.fp8_format
    y = _FusedInputLinearFunction.apply(x, None if op == SWIGLU else gamma.reshape(k), linear.weight, bias, w8, w8t,
                                        w_sinv, xs, xa, gs, ga, fmt.fwd.code, fmt.bwd.code, float(recipe.margin),
                                        grad_slot, main_grad, op, float(eps))
    return linear._output(y)


class _LayerState:
    """What _fp8_linear_backward reads of one layer of the MLP (the attributes _FP8LinearFunction keeps on its ctx)."""

    def __init__(self, m, x_dtype, weight, bias, slots, grad_slot, main_grad, bwd_code, margin):
        self.m, self.x_dtype, self.w_dtype = m, x_dtype, weight.dtype
        self.b_dtype = None if bias is None else bias.dtype
        self.g_state, self.grad_slot = (slots[2], slots[3]), grad_slot
        self.bwd, self.margin = format_of_code(bwd_code), margin
        self.main_grad, self.weight_ref = main_grad, (weight if main_grad is not None else None)


class _FusedMLPFunction(torch.autograd.Function):
    """fc2(swiglu(fc1(rmsnorm(x)))) in FP8 as one node (see the module docstring); fc1 has no bias."""

    @staticmethod
    def forward(ctx, x, gamma, w1, w2, b2, cast1, cast2, slots1, slots2, grad_slots, main_grads, fwd_code, bwd_code,
                margin, eps):
        k = w1.shape[1]
        x2 = fused._rows(x, k, "LayerNormMLP", "input")
        m, dtype = x2.shape[0], x.dtype
        fmt = format_of_code(fwd_code)
        g = fused._aligned(gamma.detach(), torch.float32)
        x8, x8t, x_sinv, rstd = _cast_with_prologue(RMSNORM, x2, g, eps, fmt, slots1[0], slots1[1], margin)
        h = _gemm(x8, cast1[0], x_sinv, cast1[2], dtype, None, fast=True)  # [m, 2 f]
        a8, a8t, a_sinv, _ = _cast_with_prologue(SWIGLU, h, None, 0.0, fmt, slots2[0], slots2[1], margin)
        y = _gemm_bias(a8, cast2[0], a_sinv, cast2[2], dtype, b2)
        ctx.save_for_backward(x2, g, rstd, x8t, x_sinv, cast1[1], cast1[2], a_sinv, cast2[2])
        # Intermediates (no input or output of this node) kept as attributes, so that backward can release each once
        # used: h (the largest) after SwiGLU's gradient, fc2's FP8 operands after its GEMMs. Saved tensors would live
        # until the whole node's backward returns, above the separate layers' peak.
        ctx.fc2_fp8, ctx.h = (a8t, cast2[1]), h
        ctx.layers = (_LayerState(m, dtype, w1, None, slots1, grad_slots[0], main_grads[0], bwd_code, margin),
                      _LayerState(m, dtype, w2, b2, slots2, grad_slots[1], main_grads[1], bwd_code, margin))
        ctx.shape = x.shape
        return y.reshape(*x.shape[:-1], w2.shape[0])

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming out silently wrong
    def backward(ctx, dy):
        x2, g, rstd, x8t, x_sinv, w1_8t, w1_sinv, a_sinv, w2_sinv = ctx.saved_tensors
        if ctx.h is None:
            raise RuntimeError("LayerNormMLP's fused FP8 backward releases its intermediates as it goes, so it runs "
                               "once per forward; to backward through one forward several times (retain_graph=True), "
                               "run the steps separately: fp8ext.fused.TRAINING = False")
        (a8t, w2_8t), h = ctx.fc2_fp8, ctx.h
        ctx.fc2_fp8 = ctx.h = None
        need_x, need_g, need_w1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        l1, l2 = ctx.layers
        upstream = need_x or need_g or need_w1
        d_a, dw2, db2 = _fp8_linear_backward(l2, dy, a8t, a_sinv, w2_8t, w2_sinv, upstream, need_w2, need_b2)
        del a8t, w2_8t
        dx = dgamma = dw1 = None
        if upstream:
            g_scale, g_amax = _grad_views(l1)
            rows, cols = h.shape
            dh8, dh8t, dh_sinv, _ = _cast_with_prologue(DSWIGLU, h, None, 0.0, l1.bwd, g_scale, g_amax, l1.margin,
                                                         dy=d_a.reshape(rows, cols // 2))
            del h, d_a
            d_ln, dw1, _ = _fp8_linear_backward(l1, None, x8t, x_sinv, w1_8t, w1_sinv, need_x or need_g, need_w1,
                                                False, dy_cast=(dh8, dh8t, dh_sinv))
            del dh8, dh8t
            if d_ln is not None:
                if x2.is_cuda:
                    dx, dgamma = fused._rms_norm_train_backward_gpu(x2, d_ln, g, rstd)
                else:
                    dx, dgamma = fused._rms_norm_train_backward_reference(x2, d_ln, g, rstd)
        return (dx.reshape(ctx.shape) if dx is not None and need_x else None, dgamma if need_g else None, dw1, dw2,
                db2, *([None] * 10))


@profiled("fp8ext.fused_mlp")
def fused_mlp(fc1: FP8Linear, fc2: FP8Linear, x: torch.Tensor, gamma: torch.Tensor, eps: float,
              is_first_microbatch: Optional[bool] = None, *, reference: bool = False):
    """fc2(swiglu(fc1(rmsnorm(x, gamma, eps)))) in FP8 as one autograd node with every step fused into a cast (see the
    module docstring), or None when the call is not one this path takes (fc1 with a bias, fc1 not 2 x fc2's
    inputs, or what fused_input_linear refuses): the caller then runs the steps separately, with the same result."""
    if torch.compiler.is_compiling() or not (isinstance(fc1, FP8Linear) and isinstance(fc2, FP8Linear)):
        return None  # (nothing of this path is traced: under torch.compile the separate steps' ops are)
    k, f = fc1.in_features, fc2.in_features
    if fc1.bias is not None or fc1.return_bias or fc1.out_features != 2 * f or k > 8192 or gamma.numel() != k:
        return None
    if not _eligible(x, k, (fc1, fc2), reference):
        return None
    recipe = current_context().recipe
    slots1, grad1, cast1, mg1, _ = _operands(fc1, recipe, is_first_microbatch)
    slots2, grad2, cast2, mg2, b2 = _operands(fc2, recipe, is_first_microbatch)
    fmt = recipe.fp8_format
    y = _FusedMLPFunction.apply(x, gamma.reshape(k), fc1.weight, fc2.weight, b2, cast1, cast2, slots1, slots2,
                                (grad1, grad2), (mg1, mg2), fmt.fwd.code, fmt.bwd.code, float(recipe.margin),
                                float(eps))
    return fc2._output(y)
