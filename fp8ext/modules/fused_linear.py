"""FP8 layers whose input is made by the step before them in the same pass as the input's FP8 cast: RMSNorm
(LayerNormLinear, and LayerNormMLP's fc1) or SwiGLU (LayerNormMLP's fc2), as Transformer Engine fuses its norms and
activations with the cast of the next GEMM's input; and, in LayerNormMLP's backward, SwiGLU's gradient with the cast
of fc1's output gradient (TE's dswiglu + cast_transpose).

    forward   RMSNorm: rstd of every row (rms_norm_fwd without its output), then x8, x8^T = cast_transpose(RMSNorm(x)),
              the norm computed inside the cast (csrc/cast.h's prologues): the high-precision output is never
              written or read back. SwiGLU: h8, h8^T = cast_transpose(silu(gate) * up), likewise.
              Then the layer's GEMM, as FP8Linear's.
    backward  the layer's dgrad and wgrad GEMMs, as FP8Linear's, then the step's own backward kernel (rms_norm_bwd:
              dx and dgamma; swiglu_backward: dh).
    the MLP   RMSNorm -> fc1 -> SwiGLU -> fc2 as one autograd node (fused_mlp): forward as above; backward fc2's
              GEMMs, then dh8, dh8^T = cast_transpose(dswiglu(h, d_a)) with SwiGLU's gradient computed inside fc1's
              gradient cast (dh is never written in high precision), fc1's GEMMs, rms_norm_bwd. fp8ext's
              transformer's MLP (w13 -> SwiGLU -> w2, no norm) is the same node run as FP8Linear's one-call passes
              (swiglu_mlp), eagerly and under torch.compile.

The bytes are those of the unfused composition (the step's fused kernel writing x's dtype, then FP8Linear): the
prologue computes the step's output as that kernel does and rounds it to x's dtype before the cast, and the amax
recorded in the input's slot is that of the rounded output. Per element of a bf16 norm output this saves its write
and its read by the cast (8 bytes moved become 6: read x twice, write x8 and x8^T); per element of a SwiGLU output,
10 become 6; per element of fc1's output gradient (bf16), 9 become 4.5 (benchmarks/bench_fused_cast.py).

Taken by the layer-norm modules and fp8ext's transformer on a GPU in eager training with delayed scaling
(fused.TRAINING, no autocast dtype change, a token count that is a multiple of 16, rows of at most 8192 for RMSNorm,
FP8Linear layers without hooks, fp8ext.debug off); everything else takes the unfused composition, with the same
results. SwiGLU's layer, where FP8Linear would take its fast path, runs its passes as FP8Linear's one C call each with
SwiGLU inside the cast (csrc/py_linear.c's prologue), and so also under torch.compile (the calls as torch ops;
the RMSNorm paths are not traced there: compiled code runs the norm and the layer separately). With block scaling
(Float8BlockScaling, bf16 or float16 activations) the RMSNorm and SwiGLU casts are fused the same way, each 128 x 128
tile of the step's output computed once and cast into both 1 x 128 layouts (csrc/kernels/quantize_blocks.cu);
SwiGLU's gradient is computed by its own kernel there, then cast. Current and row-wise scaling need the output's amax
(per tensor, per column) before its cast, one more pass over it, which is what the composition does. On a CPU the
same function computes the step with the reference definitions of fp8ext.fused (the tests use it there).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .. import _C
from ..core import debug
from ..ops import fused, quantize_blocks_t_eager
from ..core.boundary import dl, dl_fp8, stream_of
from ..core.casts import PROLOGUE_DSWIGLU, PROLOGUE_RMSNORM, PROLOGUE_SWIGLU
from ..core.context import activation_dtype
from .checkpoint import forward_context
from .linear import FP8Linear
from .linear_plan import one_call_plan
from .linear_autograd import ONE_CALL_OP, LinearFunction, forward_gemm, linear_backward
from ..core.profiling import profiled
from ..core.tensor import BLOCK_1x128, Float8BlockQuantizer, FP8Tensor, Quantizer, role_quantizers

RMSNORM, SWIGLU, DSWIGLU = PROLOGUE_RMSNORM, PROLOGUE_SWIGLU, PROLOGUE_DSWIGLU  # csrc/cast.h's, from fp8ext._C
ENABLED = True  # False: the layer-norm modules run their steps separately (for comparisons and debugging)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _cast_with_prologue(op, x2, g, eps, quantizer: Quantizer, dy=None):
    """(x8, rstd or None): the step's output for x2 cast by `quantizer` (SwiGLU: x2 [m, 2k]; RMSNorm: [m, k];
    SwiGLU's gradient: h [m, k] and dy [m, k / 2])."""
    m, k = x2.shape[0], x2.shape[1] // (2 if op == SWIGLU else 1)
    if not x2.is_cuda:  # the reference definitions, then the cast
        rstd = None
        if op == RMSNORM:
            y, rstd = fused.rms_norm_train_reference(x2, g, eps, x2.dtype)
        elif op == SWIGLU:
            y = fused.swiglu_reference(x2)
        else:
            y = fused.swiglu_backward_reference(x2, dy)
        return quantizer.quantize(y), rstd
    dev, stream, fmt = x2.device, stream_of(x2.device), quantizer.fmt
    scale, amax_slot = quantizer.slot_views()
    rstd = None
    if op == RMSNORM:
        rstd = torch.empty(m, dtype=torch.float32, device=dev)
        _C.rms_norm_fwd(dl(x2), dl(g), None, dl(rstd), float(eps), stream)
    if quantizer.granularity == BLOCK_1x128:  # block scaling: both 1 x 128 casts of the step's output, one kernel
        if op == DSWIGLU:  # (not fused: SwiGLU's gradient kernel, then the casts)
            return quantizer.quantize(fused.swiglu_backward_gpu(x2, dy)), None
        q, s, qt, st = quantize_blocks_t_eager(x2, fmt, BLOCK_1x128, quantizer.power_2_scale, quantizer.amax_epsilon,
                                               op, rstd, g)
        return FP8Tensor(q, qt, s, fmt, BLOCK_1x128, st), rstd
    x8 = torch.empty((m, k), dtype=fmt.torch_dtype, device=dev)
    x8t = torch.empty((k, m), dtype=fmt.torch_dtype, device=dev)
    sinv = torch.empty((), dtype=torch.float32, device=dev)
    _C.cast_transpose_fused(dl(x2), dl_fp8(x8), dl_fp8(x8t), fmt.code, dl(scale), op,
                            rstd=None if rstd is None else dl(rstd), gamma=None if g is None else dl(g),
                            amax_out=dl(amax_slot), stream=stream, scale_inv_out=dl(sinv),
                            dy=None if dy is None else dl(fused.contiguous_aligned(dy, x2.dtype)))
    return FP8Tensor(x8, x8t, sinv, fmt), rstd


class Prologue:
    """The step computed inside a linear layer's input cast (a LinearPlan's prologue): RMSNORM (gamma, eps) or
    SWIGLU; fn names the module in error messages."""

    __slots__ = ("op", "eps", "fn")

    def __init__(self, op: int, eps: float = 0.0, fn: str = "LayerNormLinear"):
        self.op, self.eps, self.fn = op, float(eps), fn

    def cast(self, x: torch.Tensor, gamma: Optional[torch.Tensor], quantizer: Quantizer):
        """(x8, kept): op(x) cast to FP8, and what backward() reads: (x2, gamma as float32, rstd)."""
        x2 = fused.kernel_rows(x, x.shape[-1], self.fn, "input")
        g = None if gamma is None else fused.contiguous_aligned(gamma.detach(), torch.float32)
        x8, rstd = _cast_with_prologue(self.op, x2, g, self.eps, quantizer)
        return x8, (x2, g, rstd)

    def backward(self, kept, d_op: torch.Tensor):
        """(dx, dgamma or None) from the gradient of op's output."""
        x2, g, rstd = kept
        if self.op == RMSNORM:
            if x2.is_cuda:
                return fused.rms_norm_train_backward_gpu(x2, d_op, g, rstd)
            return fused.rms_norm_train_backward_reference(x2, d_op, g, rstd)
        dx = fused.swiglu_backward_gpu(x2, d_op) if x2.is_cuda else fused.swiglu_backward_reference(x2, d_op)
        return dx, None


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling `module` would run hooks, forward or backward (its own or global ones, e.g. FSDP's on a sharded
    layer): the fused paths use the layers' parameters without calling them, so they step aside for such modules."""
    glob = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or getattr(glob, "_global_forward_hooks", None)
                or getattr(glob, "_global_forward_pre_hooks", None) or getattr(glob, "_global_backward_hooks", None)
                or getattr(glob, "_global_backward_pre_hooks", None))


def _eligible(x: torch.Tensor, width: int, linears, reference: bool, block_ok: bool = False,
              compiled: bool = False):
    """The fp8_autocast context of this call where it is one the fused paths take (see the module docstring), else
    None: x [..., width] feeding the first of `linears` (FP8Linear, without forward hooks), inside fp8_autocast (or
    rerunning a checkpointed forward that ran in one: fp8ext.modules.checkpoint) with delayed scaling, or block
    scaling (block_ok: 1 x 128 input tiles, a bf16 or float16 x on a GPU). compiled: the caller's path also runs
    while torch.compile traces (the one-call passes as torch ops)."""
    if not all(isinstance(lin, FP8Linear) and not has_hooks(lin) for lin in linears):
        return None  # e.g. fp8ext.inference's quantized layers, or a layer sharded or observed through hooks
    ctx = None
    for lin in linears:  # each layer records the context (a checkpointed rerun of this call finds it)
        ctx = forward_context(lin)
    if ctx is None or not ctx.enabled or ctx.calibrating:
        return None
    q = None if ctx.recipe.stateful else role_quantizers(ctx.recipe)[0]  # a stateful recipe's: its layers' slots
    block = block_ok and type(q) is Float8BlockQuantizer and q.granularity == BLOCK_1x128
    if not (block or ctx.recipe.stateful):
        return None
    if block and getattr(x, "dtype", None) not in (torch.bfloat16, torch.float16) and not reference:
        return None
    compiling = torch.compiler.is_compiling()
    if not ENABLED or not fused.TRAINING or (compiling and not compiled) or debug.enabled():
        return None
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != width or x.dtype not in _DTYPES \
            or activation_dtype(x) != x.dtype or x.is_meta:
        return None
    for lin in linears:
        w = lin.weight
        if w.device != x.device or w.is_meta or lin.in_features % 16 or lin.out_features % 16:
            return None
    m = x.numel() // width
    if m == 0 or m % 16:
        return None
    kernels = fused.train_available if compiling else fused.available
    return ctx if kernels(x, linears[0].in_features) or (reference and x.device.type == "cpu") else None


@profiled("fp8ext.fused_input_linear")
def fused_input_linear(linear: FP8Linear, op: int, x: torch.Tensor, gamma: Optional[torch.Tensor] = None,
                       eps: float = 0.0, is_first_microbatch: Optional[bool] = None, *, reference: bool = False):
    """linear(op(x)) in FP8 with op's output cast in the pass that computes it, or None when this call is not one the
    fused path takes (see the module docstring): the caller then runs op and the layer separately, with the same
    result. op is RMSNORM (gamma: the norm's scale as a float32 tensor, eps) or SWIGLU (x holds gate, then up).
    reference=True takes the path on a CPU too, with fp8ext.fused's reference definitions (for tests).
    SwiGLU with delayed scaling takes FP8Linear's fast path where the layer does (one C call per pass, eager, or the
    two as torch ops under torch.compile), SwiGLU inside its input's cast."""
    k = linear.in_features
    ctx = _eligible(x, 2 * k, (linear,), reference, compiled=True) if op == SWIGLU else None
    if ctx is not None and ctx.recipe.stateful:
        y = linear.fast_forward(ctx, x, is_first_microbatch, Prologue(SWIGLU))
        if y is not None:
            return y
    if torch.compiler.is_compiling():  # nothing else of this path is traced: the separate steps' ops are
        return None
    ctx = _eligible(x, 2 * k if op == SWIGLU else k, (linear,), reference, block_ok=True)
    if ctx is None:
        return None
    if op == RMSNORM and (gamma is None or gamma.numel() != k or k > 8192):
        return None
    plan = linear.fp8_plan(ctx.recipe, x, is_first_microbatch, prologue=Prologue(op, eps))
    bias = None if linear.return_bias else linear.bias
    if op == SWIGLU:
        return linear.returned(LinearFunction.apply(x, linear.weight, bias, plan))
    return linear.returned(LinearFunction.apply(x, linear.weight, bias, plan, gamma.reshape(k)))


class _NormMLPSteps:
    """LayerNormMLP's steps (eager; delayed, current or block scaling; see the module docstring): RMSNorm inside fc1's
    input cast, the GEMMs and casts as fp8ext's ops. plans: the two layers' LinearPlans, fc1's with the RMSNorm
    prologue; fc1 has no bias."""

    @staticmethod
    def forward(ctx, x, gamma, w1, w2, b2, plans):
        p1, p2 = plans
        dtype = x.dtype
        x8, (x2, g, rstd) = p1.prologue.cast(x, gamma, p1.input)
        m = x2.shape[0]
        h = forward_gemm(x8, p1.w8, dtype, None, m)  # [m, 2 f]
        a8, _ = _cast_with_prologue(SWIGLU, h, None, 0.0, p2.input)
        y = forward_gemm(a8, p2.w8, dtype, b2, m)
        x_t, w1_t, a_t, w2_t = x8.t(), p1.w8.t(), a8.t(), p2.w8.t()  # what the backward GEMMs read
        ctx.save_for_backward(x2, g, rstd, x_t.data, x_t.scale_inv, w1_t.data, w1_t.scale_inv, a_t.scale_inv,
                              w2_t.scale_inv)
        # Intermediates (no input or output of this node) kept as attributes, so that backward can release each once
        # used: h (the largest) after SwiGLU's gradient, fc2's FP8 operands after its GEMMs. Saved tensors would live
        # until the whole node's backward returns, above the separate layers' peak.
        ctx.fc2_fp8, ctx.h = (a_t.data, w2_t.data), h
        p1.w8 = p2.w8 = None  # the row-wise weight copies go now (backward reads the transposed ones kept above)
        ctx.plans, ctx.m, ctx.dtype, ctx.fmt, ctx.shape = plans, m, dtype, x8.fmt, x.shape
        ctx.layouts = (x_t.layout, w1_t.layout, a_t.layout, w2_t.layout)
        return y.reshape(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, g, rstd, x8t, x_sinv, w1_8t, w1_sinv, a_sinv, w2_sinv = ctx.saved_tensors
        if ctx.h is None:
            raise RuntimeError("LayerNormMLP's fused FP8 backward releases its intermediates as it goes, so it runs "
                               "once per forward; to backward through one forward several times (retain_graph=True), "
                               "run the steps separately: fp8ext.fused.TRAINING = False")
        (a8t, w2_8t), h = ctx.fc2_fp8, ctx.h
        ctx.fc2_fp8 = ctx.h = None
        need_x, need_g, need_w1, need_w2, need_b2 = ctx.needs_input_grad[:5]
        p1, p2 = ctx.plans
        fmt, m, dtype = ctx.fmt, ctx.m, ctx.dtype
        lx, lw1, la, lw2 = ctx.layouts
        upstream = need_x or need_g or need_w1
        d_a, dw2, db2 = linear_backward(p2, dy, FP8Tensor(a8t, None, a_sinv, fmt, la),
                                        FP8Tensor(w2_8t, None, w2_sinv, fmt, lw2), (upstream, need_w2, need_b2), m=m,
                                        dx_dtype=dtype)
        del a8t, w2_8t
        dx = dgamma = dw1 = None
        if upstream:
            rows, cols = h.shape
            dh8, _ = _cast_with_prologue(DSWIGLU, h, None, 0.0, p1.grad, dy=d_a.reshape(rows, cols // 2))
            del h, d_a
            d_ln, dw1, _ = linear_backward(p1, None, FP8Tensor(x8t, None, x_sinv, fmt, lx),
                                           FP8Tensor(w1_8t, None, w1_sinv, fmt, lw1), (need_x or need_g, need_w1, False),
                                           m=m, dx_dtype=dtype, dy8=dh8)
            del dh8
            if d_ln is not None:
                dx, dgamma = p1.prologue.backward((x2, g, rstd), d_ln)
        return (dx.reshape(ctx.shape) if dx is not None and need_x else None, dgamma if need_g else None, dw1, dw2,
                db2, None)


class _OneCallMLPSteps:
    """fp8ext's transformer's MLP w2(swiglu(w13(x))) as FP8Linear's one-call passes (ONE_CALL; ONE_CALL_OP, the same
    calls as torch ops, under torch.compile; delayed scaling, no norm): forward w13's call, then w2's with SwiGLU
    inside its input's cast; backward w2's call, then w13's with SwiGLU's gradient inside the cast of w13's output
    gradient (linear_bwd's d_a). plans: the two layers' LinearPlans (w2's with the SwiGLU prologue); w13 has no bias;
    gamma is None."""

    @staticmethod
    def forward(ctx, x, gamma, w13, w2, b2, plans):
        p13, p2 = plans
        calls = p13.backend
        k = w13.shape[1]
        x2 = x.view(-1, k)
        m = x2.shape[0]
        h, saved13 = calls.fwd(p13, x2, w13, None)
        y, saved2 = calls.fwd(p2, h, w2, b2)
        if b2 is not None and not p2.fuse_bias:
            y = y + b2.to(y.dtype)
        ctx.save_for_backward(saved13, h, saved2)
        ctx.plans, ctx.x_shape, ctx.dtype = plans, x.shape, h.dtype
        ctx.dims13, ctx.dims2 = (m, k, w13.shape[0]), (m, w2.shape[1], w2.shape[0])
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, dy):
        saved13, h, saved2 = ctx.saved_tensors
        p13, p2 = ctx.plans
        calls = p13.backend
        need_x, _, need_w13, need_w2, need_b2 = ctx.needs_input_grad[:5]
        m, _, n = ctx.dims2
        dy2 = dy.reshape(m, n)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        db_dtype = None
        if p2.b_dtype is not None and need_b2:
            db_dtype = p2.b_dtype if p2.b_dtype == dy2.dtype else torch.float32
        upstream = need_x or need_w13
        d_a, dw2, db2 = calls.bwd(p2, dy2, saved2, ctx.dims2, upstream, need_w2, db_dtype, ctx.dtype)
        dx = dw13 = None
        if upstream:
            dx, dw13, _ = calls.bwd(p13, h, saved13, ctx.dims13, need_x, need_w13, None, ctx.dtype, swiglu_da=d_a)
        if db2 is not None and db2.dtype != p2.b_dtype:
            db2 = db2.to(p2.b_dtype)
        return None if dx is None else dx.view(ctx.x_shape), None, dw13, dw2, db2, None


class _FusedMLPFunction(torch.autograd.Function):
    """fc2(swiglu(fc1([rmsnorm](x)))) in FP8 as one autograd node: SwiGLU computed inside fc2's input cast, its
    gradient inside the cast of fc1's output gradient, so that neither SwiGLU's output nor dh is written in high
    precision (9 bytes per element of dh become 4.5). plans: (steps, fc1's LinearPlan, fc2's), steps running the
    layers' passes: _NormMLPSteps (LayerNormMLP, with the norm) or _OneCallMLPSteps (fp8ext's transformer).
    backward returns (dx, dgamma, dW1, dW2, db2, None)."""

    @staticmethod
    def forward(ctx, x, gamma, w1, w2, b2, plans):
        ctx.steps = plans[0]
        return plans[0].forward(ctx, x, gamma, w1, w2, b2, plans[1:])

    @staticmethod
    @once_differentiable  # the fused casts' gradients: a second derivative raises instead of coming out wrong
    def backward(ctx, dy):
        return ctx.steps.backward(ctx, dy)


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
    ctx = _eligible(x, k, (fc1, fc2), reference, block_ok=True)
    if ctx is None:
        return None
    recipe = ctx.recipe
    p1 = fc1.fp8_plan(recipe, x, is_first_microbatch, prologue=Prologue(RMSNORM, eps, "LayerNormMLP"))
    p2 = fc2.fp8_plan(recipe, x, is_first_microbatch)
    b2 = None if fc2.return_bias else fc2.bias
    return fc2.returned(_FusedMLPFunction.apply(x, gamma.reshape(k), fc1.weight, fc2.weight, b2,
                                                (_NormMLPSteps, p1, p2)))


@profiled("fp8ext.swiglu_mlp")
def swiglu_mlp(w13: FP8Linear, w2: FP8Linear, x: torch.Tensor, is_first_microbatch: Optional[bool] = None, *,
               reference: bool = False):
    """w2(swiglu(w13(x))) in FP8 as one node of the one-call passes with SwiGLU and its gradient inside the casts
    (_FusedMLPFunction with _OneCallMLPSteps), eagerly or under torch.compile, or None when this call is not one the
    path takes: both layers on FP8Linear's fast path (delayed scaling, their slots registered), w13 without a bias,
    w13's outputs twice w2's inputs, neither returning its bias, and what fused_input_linear asks of x; the caller
    then runs the steps separately, with the same result. reference=True takes the path on a CPU too (fp8ext.fused's reference
    definitions, for tests)."""
    if not (isinstance(w13, FP8Linear) and isinstance(w2, FP8Linear)) or w13.bias is not None or w13.return_bias \
            or w2.return_bias or w13.out_features != 2 * w2.in_features:
        return None
    k = w13.in_features
    ctx = _eligible(x, k, (w13, w2), reference, compiled=True)
    if ctx is None or not x.is_contiguous() or not ctx.recipe.stateful:
        return None
    p13 = w13.fast_plan(ctx, x, is_first_microbatch)
    if p13 is None or p13.out_dtype != x.dtype or p13.recast:
        return None
    compiling = p13.backend is ONE_CALL_OP
    p2 = one_call_plan(w2, w2.quantizers(ctx.recipe, _compiling=compiling), x.dtype, x.dtype, x.device, x.numel() // k,
                       is_first_microbatch, Prologue(SWIGLU), compiling)
    if p2 is None or p2.backend is not p13.backend or (p13.main_grad is None) != (p2.main_grad is None):
        return None
    return _FusedMLPFunction.apply(x, None, w13.weight, w2.weight, w2.bias, (_OneCallMLPSteps, p13, p2))
