"""The FP8 linear layer's autograd Function: LinearFunction.forward(ctx, x, weight, bias, plan[, gamma]).

One Function serves every linear layer of fp8ext in training (FP8Linear, LayerNormLinear's norm-in-the-cast path,
the SwiGLU-in-the-cast path); what differs between them is the LinearPlan, chosen per call by choose_plan
(fp8ext.modules.linear):
    backend    COMPOSED: the casts and the GEMMs as separate ops (eager, or traced by torch.compile);
               ONE_CALL: each pass one fp8ext._C call (csrc/py_linear.c; the eager fast path);
               ONE_CALL_OP: those two calls as the torch ops fp8ext::linear_fwd / linear_bwd (the fast path under
               torch.compile);
               HIGH_PRECISION: outside fp8_autocast with fuse_wgrad_accumulation, y = x W^T + b in high precision
               with the weight's gradient added into main_grad
    input, weight, grad   the Quantizers of the layer's three tensor roles (fp8ext.tensor)
    w8         the weight's FP8 cast (COMPOSED; kept across micro-batches by FP8Linear when asked)
    out_dtype, main_grad (and the weight it belongs to), the weight's and the bias's dtypes
    recast     under torch.compile, save x and W and cast them again in backward (see recast_in_backward)
    prologue   None, or the step computed inside the input's cast (fp8ext.modules.fused_linear's Prologue: RMSNorm,
               whose gamma is the Function's fifth input, or SwiGLU)
The three GEMMs of a step (module docstring of fp8ext.linear) are written once here: forward_gemm and
linear_backward, which LayerNormMLP's fused Function (fp8ext.modules.fused_linear) uses for each of its two layers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..core import debug
from ..core.boundary import refuse_broadcast
from ..core.casts import PROLOGUE_SWIGLU
from ..ops import fused, linear_pass
from ..ops.linear_pass import CUR_SCALE as _CUR_SCALE, SINV_STEP as _SINV_STEP
from ..ops.matmul import bias_epilogue
from ..ops.matmul import gemm_fp8 as _gemm
from ..core.tensor import BLOCK_1x128, BLOCK_128x128, TENSOR, FP8Tensor, Quantizer

__all__ = ["LinearPlan", "LinearFunction", "COMPOSED", "ONE_CALL", "ONE_CALL_OP", "HIGH_PRECISION", "forward_gemm",
           "recast_in_backward", "linear_backward", "SWIGLU_PROLOGUE"]

_BLOCKS = (BLOCK_1x128, BLOCK_128x128)
SWIGLU_PROLOGUE = PROLOGUE_SWIGLU  # csrc/cast.h's FP8EXT_PROLOGUE_SWIGLU: the only prologue of the one-call passes


class LinearPlan:
    """Everything of one linear call that autograd does not differentiate (see the module docstring)."""

    __slots__ = ("backend", "input", "weight", "grad", "w8", "out_dtype", "main_grad", "weight_ref", "w_dtype",
                 "b_dtype", "prologue", "fuse_bias", "recast")

    def __init__(self, backend, quantizers, weight: torch.Tensor, bias: Optional[torch.Tensor], *,
                 out_dtype: Optional[torch.dtype] = None, w8: Optional[FP8Tensor] = None,
                 main_grad: Optional[torch.Tensor] = None, prologue=None, fuse_bias: bool = False,
                 recast: bool = False):
        self.backend = backend
        self.input, self.weight, self.grad = quantizers
        self.w8, self.out_dtype, self.prologue, self.fuse_bias, self.recast = w8, out_dtype, prologue, fuse_bias, recast
        self.main_grad, self.weight_ref = main_grad, (weight if main_grad is not None else None)
        self.w_dtype, self.b_dtype = weight.dtype, (bias.dtype if bias is not None else None)


class LinearFunction(torch.autograd.Function):
    """y = x W^T + b as the plan says (see the module docstring). gamma: the RMSNorm prologue's scale, else unused.
    backward returns (dx, dW, db, None, dgamma)."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, gamma=None):
        ctx.plan = plan
        return plan.backend.forward(ctx, x, weight, bias, gamma)

    @staticmethod
    def backward(ctx, dy):
        if ctx.plan.prologue is not None:
            return _once_differentiable_backward(ctx, dy)
        return ctx.plan.backend.backward(ctx, dy)


@once_differentiable  # the fused prologues' backward kernels: a second derivative raises instead of coming out wrong
def _once_differentiable_backward(ctx, dy):
    return ctx.plan.backend.backward(ctx, dy)


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


def forward_gemm(x8: FP8Tensor, w8: FP8Tensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor],
                 rows: int) -> torch.Tensor:
    """The first `rows` rows of x8 @ w8^T + bias in out_dtype, with fast accumulation (as TE's forward) except with
    block scales (cuBLASLt has none there); with per-tensor scales the bias is added by cuBLASLt's epilogue where it
    takes it (fp8ext._gemm.bias_epilogue), after the GEMM otherwise."""
    per_tensor = x8.layout == TENSOR
    fuse = per_tensor and bias_epilogue(bias, out_dtype)
    y = _gemm(x8, w8, out_dtype, bias if fuse else None, fast=x8.layout not in _BLOCKS)[:rows]
    if bias is not None and not fuse:
        y = y + bias.to(y.dtype)
    return y


def linear_backward(plan: LinearPlan, dy: Optional[torch.Tensor], x_t: FP8Tensor, w_t: FP8Tensor, need, *, m: int,
                    dx_dtype: torch.dtype, dy8: Optional[FP8Tensor] = None):
    """(dx [m, k] or None, dW, db) of one FP8 linear layer from its forward's FP8 operands x_t (x8^T) and w_t (W8^T):
    dy cast by the plan's grad quantizer (with the bias gradient from the same pass), then the dgrad and wgrad GEMMs.
    need: (dx, dW, db) wanted. dy8: dy already cast by the caller (no bias gradient then), dy unused."""
    need_dx, need_dw, need_db = need
    want_db = plan.b_dtype is not None and need_db
    if dy8 is not None:
        if want_db:
            raise RuntimeError("FP8Linear backward: a bias gradient needs dy itself, not its FP8 cast")
        g8 = dy8
    else:
        dy2 = dy.reshape(-1, dy.shape[-1])  # n, the output features (w_t is None when no dx is wanted)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        if debug.enabled():
            debug.check_finite(dy2, "FP8Linear backward", "grad_output")
            debug.check_scale(plan.grad.slot_views()[0], "FP8Linear backward", "the gradient's scale")
        if want_db:  # the bias gradient from the cast's own pass over dy
            g8, db32 = plan.grad.quantize_dbias(_pad_rows(dy2))
        else:
            g8 = plan.grad.quantize(_pad_rows(dy2))
    dx = dw = db = None
    if need_dx:
        dx = _gemm(g8, w_t, dx_dtype)[:m]
    if plan.main_grad is not None:  # fuse_wgrad_accumulation: main_grad += dW in the GEMM itself (beta = 1)
        if torch.compiler.is_compiling():  # the functional op, then the add
            plan.main_grad.add_(_gemm(g8.t(), x_t, torch.float32))
        else:
            _gemm(g8.t(), x_t, torch.float32, out=plan.main_grad, accumulate=True)
        dw = _wgrad_placeholder(plan.weight_ref)
    elif need_dw:
        dw = _gemm(g8.t(), x_t, plan.w_dtype)
    if want_db:
        db = db32.to(plan.b_dtype)
    return dx, dw, db


def _wgrad_placeholder(weight):
    """What backward returns as the weight's gradient once it went into main_grad: None, or, for a weight marked
    with `grad_added_to_main_grad` (Megatron-LM's convention, which Transformer Engine follows), zeros after
    setting that flag, so that frameworks expecting a gradient tensor get one that adds nothing."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


def recast_in_backward(requested: bool) -> bool:
    """Whether the composed path saves x and W with their forward scales and casts x8^T and W8^T again in backward
    (per-tensor scales, no prologue) instead of saving the FP8 copies: when the layer asks for it
    (FP8Linear.fp8_recast_in_backward, set by prepare_fp8(..., recast_in_backward=True)) and under torch.compile, as
    torchao does. There the partitioner sees a high-precision x that the layers reading it share (q/k/v, gate/up)
    and may recompute from the norm before them, and W is the parameter itself. The composed path recasts with
    current scaling only (choose_plan decides): each cast's scale is then its own tensor, which no later
    step changes; the fast path's recast (ONE_CALL_OP) takes delayed scaling too. In eager mode the FP8 copies are
    always saved (nothing else may hold x, and one FP8 copy is half of it)."""
    return requested and torch.compiler.is_compiling()


class COMPOSED:
    """The casts and the GEMMs as separate ops: FP8Tensors from the plan's quantizers, forward_gemm, linear_backward.
    Tensor ops only, so that torch.compile can trace it."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma):
        plan = ctx.plan
        if plan.prologue is None:
            refuse_broadcast(x, "FP8Linear", "input")  # a strided x is copied below; a broadcast view is not
            x2 = x.reshape(-1, weight.shape[1])
            if not x2.is_contiguous():
                x2 = x2.contiguous()
            x8, kept = plan.input.quantize(_pad_rows(x2), recast_in_backward(plan.recast)), ()
        else:  # kept: what the prologue's backward reads
            x8, kept = plan.prologue.cast(x, gamma, plan.input)
            x2 = kept[0]
        m = x2.shape[0]
        y = forward_gemm(x8, plan.w8, plan.out_dtype, bias, m)
        ctx.recast = plan.prologue is None and x8.scale is not None and plan.w8.scale is not None
        if ctx.recast:  # see recast_in_backward: x, W (no new memory) and two scales; backward casts x8^T, W8^T again
            ctx.save_for_backward(x, x8.scale, x8.scale_inv, weight, plan.w8.scale, plan.w8.scale_inv)
        else:
            x_t, w_t = x8.t(), plan.w8.t()
            ctx.save_for_backward(x_t.data, x_t.scale_inv, w_t.data, w_t.scale_inv, *kept)
        # backward reads what was saved; the row-wise weight copy is freed now, not kept through ctx.plan
        ctx.m, ctx.x_shape, ctx.x_dtype, ctx.fmt = m, x.shape, x.dtype, x8.fmt
        ctx.layouts = (x8.layout, plan.w8.layout)
        plan.w8 = None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def _recast_operands(ctx, need_x: bool, need_w: bool):
        """(x_t, w_t) cast again from the saved x and W with their forward scales (the bytes forward made), each
        only where its GEMM runs: x8^T for the weight gradient, W8^T for the input gradient."""
        x, x_scale, x_sinv, weight, w_scale, w_sinv = ctx.saved_tensors
        x_t = w_t = None
        if need_w:
            x2 = x.reshape(-1, weight.shape[1])
            x_t = Quantizer.recast_t(_pad_rows(x2 if x2.is_contiguous() else x2.contiguous()), ctx.fmt, x_scale,
                                     x_sinv)
        if need_x:
            w_t = Quantizer.recast_t(weight.detach(), ctx.fmt, w_scale, w_sinv)
        return x_t, w_t, ()

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_g = len(ctx.needs_input_grad) > 4 and ctx.needs_input_grad[4]  # RMSNorm's gamma
        if ctx.recast:
            x_t, w_t, kept = COMPOSED._recast_operands(ctx, need_x or need_g, need_w or plan.main_grad is not None)
        else:
            x8t, x_sinv, w8t, w_sinv, *kept = ctx.saved_tensors
            x_t = FP8Tensor(x8t, None, x_sinv, ctx.fmt, ctx.layouts[0])
            w_t = FP8Tensor(w8t, None, w_sinv, ctx.fmt, ctx.layouts[1])
        dx, dw, db = linear_backward(plan, dy, x_t, w_t, (need_x or need_g, need_w, need_b), m=ctx.m,
                                     dx_dtype=ctx.x_dtype)
        dgamma = None
        if plan.prologue is not None and dx is not None:
            dx, dgamma = plan.prologue.backward(kept, dx)
        return (None if dx is None or not need_x else dx.reshape(ctx.x_shape), dw, db, None,
                dgamma if need_g else None)


class HIGH_PRECISION:
    """Outside fp8_autocast with fuse_wgrad_accumulation: y = x W^T + b in high precision, with the weight's
    gradient added into main_grad (float32) instead of returned."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy @ weight.to(dy.dtype)) if ctx.needs_input_grad[0] else None
        ctx.plan.main_grad.addmm_(dy2.t().float(), x.reshape(-1, x.shape[-1]).float())
        db = dy2.sum(0).to(weight.dtype) if ctx.plan.b_dtype is not None and ctx.needs_input_grad[2] else None
        return dx, _wgrad_placeholder(weight), db, None, None


# ---- ONE_CALL: one C call per pass -----------------------------------------------------------------------
# FP8Linear's fast path (fp8ext.ops.linear_pass: the two C calls, the layout of their buffers, the CPU emulation of
# their GEMMs; the torch ops fp8ext::linear_fwd / linear_bwd are registered in fp8ext.ops._library).


def _backward_args(ctx, dy, saved=None):
    """(plan, the saved buffer (or `saved`), dy as a contiguous [m, n], dx wanted, dW wanted, db's dtype out of the
    call (see linear_pass.linear_bwd_call) or None when no bias gradient is wanted). With a SwiGLU prologue dx is
    SwiGLU's output's gradient, wanted when the layer's input (SwiGLU's) is."""
    plan = ctx.plan
    m, k, n = ctx.dims
    if saved is None:
        saved = ctx.saved_tensors[-1]
    dy2 = dy.reshape(m, n)
    if not dy2.is_contiguous():
        dy2 = dy2.contiguous()
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    db_dtype = None
    if plan.b_dtype is not None and need_db:
        db_dtype = plan.b_dtype if plan.b_dtype == dy2.dtype else torch.float32
    return plan, saved, dy2, need_dx, need_dw, db_dtype


class ONE_CALL:
    """FP8Linear's fast path (see above): each pass one fp8ext._C call. Delayed scaling passes the scaling slots'
    capsules; current scaling passes the margin instead, and the call computes each tensor's amax and scale first
    (the composed path's amax and scale_from_amax kernels, into the saved buffer). A plan with a prologue (SwiGLU's
    only, delayed scaling: fp8ext.modules.fused_linear) takes x = [gate, up] and computes SwiGLU inside x's cast;
    backward then turns the input gradient into SwiGLU's (fp8ext.fused's backward kernel)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma):
        plan = ctx.plan
        n, k = weight.shape
        swiglu = plan.prologue is not None
        x2 = fused.kernel_rows(x, 2 * k, "FP8Linear", "input") if swiglu else x.view(-1, k)
        y, saved = ONE_CALL.fwd(plan, x2, weight, bias)
        return _after_forward(ctx, x, bias, y, saved, (x2.shape[0], k, n), h=x2 if swiglu else None)

    @staticmethod
    def fwd(plan, x2, weight, bias):
        """The forward call: (y [m, n] without an unfused bias, the saved buffer)."""
        q, b = plan.input, bias if plan.fuse_bias else None
        if q.manager is None:  # current scaling: the call computes the scales from the tensors' amaxes
            return linear_pass.linear_fwd_call(x2, weight, b, None, None, None, None, q.fmt, q.margin, plan.out_dtype,
                                               swiglu=plan.prologue is not None)
        (xs, xa), (wsc, wa) = q.capsules, plan.weight.capsules  # delayed: choose_plan checked that they are current
        return linear_pass.linear_fwd_call(x2, weight, b, xs, xa, wsc, wa, q.fmt, None, plan.out_dtype,
                                           swiglu=plan.prologue is not None)

    @staticmethod
    def backward(ctx, dy):
        plan, saved, dy2, need_dx, need_dw, db_dtype = _backward_args(ctx, dy)
        dx, dw, db = ONE_CALL.bwd(plan, dy2, saved, ctx.dims, need_dx, need_dw, db_dtype, ctx.x_dtype)
        if dx is not None and plan.prologue is not None:  # SwiGLU's gradient from its output's (prologue's backward)
            dx, _ = plan.prologue.backward((ctx.saved_tensors[0], None, None), dx)
        if db is not None and db.dtype != plan.b_dtype:  # (_after_backward's, without the call)
            db = db.to(plan.b_dtype)
        return None if dx is None else dx.view(ctx.x_shape), dw, db, None, None

    @staticmethod
    def bwd(plan, dy2, saved, dims, need_dx, need_dw, db_dtype, x_dtype, swiglu_da=None):
        """The backward call: (dx or None, dW (or main_grad's placeholder) or None, db or None)."""
        g = plan.grad
        if g.manager is None:  # current scaling: the call computes the scale
            gs, ga, margin = None, None, g.margin
        else:  # the slot's capsules, made again when the manager's buffers grew since the forward
            (gs, ga), margin = g.capsules if g.manager.generation == g._generation else g.slot_capsules(), None
        dx, dw, db = linear_pass.linear_bwd_call(dy2, saved, dims, plan.input.fmt, g.fmt, gs, ga, margin, need_dx,
                                                 need_dw, db_dtype, x_dtype, plan.w_dtype, plan.main_grad,
                                                 swiglu_da=swiglu_da)
        if plan.main_grad is not None:
            dw = _wgrad_placeholder(plan.weight_ref)
        return dx, dw, db


def _after_forward(ctx, x, bias, y, saved, dims, weight=None, h=None):
    """saved: the buffer kept for backward; or, given the weight (recast_in_backward), its header only, kept with x
    and W. h: with the SwiGLU prologue, [gate, up] as the kernels read it (SwiGLU's backward reads it)."""
    if bias is not None and not ctx.plan.fuse_bias:
        y = y + bias.to(y.dtype)
    if h is not None:
        ctx.save_for_backward(h, saved)
        ctx.recast_fmt = None
    elif weight is None:
        ctx.save_for_backward(saved)
        ctx.recast_fmt = None
    else:
        ctx.save_for_backward(x, weight, saved)
        ctx.recast_fmt = ctx.plan.input.fmt
    ctx.dims, ctx.x_shape, ctx.x_dtype = dims, x.shape, x.dtype
    return y.view(*x.shape[:-1], dims[2])


def _after_backward(ctx, plan, dx, dw, db):
    if db is not None and db.dtype != plan.b_dtype:
        db = db.to(plan.b_dtype)  # the float32 sum, for a bias of another dtype than dy's
    return None if dx is None else dx.view(ctx.x_shape), dw, db, None, None


class ONE_CALL_OP:
    """ONE_CALL under torch.compile: its two C calls as the torch ops fp8ext::linear_fwd and fp8ext::linear_bwd
    (fp8ext.ops.linear_pass, registered in fp8ext.ops._library), which compiled code calls without a graph break.
    The slots' scales and amaxes cross as tensors, and an updated amax comes back as an output that is copied into
    its slot (as fp8ext's other ops do: custom ops with mutated arguments trip inductor). The same kernels and bytes
    as an eager step; no main_grad.
    With recast_in_backward (plan.recast) the forward op keeps only the saved buffer's header (the scale_invs and
    the scales it cast with) and backward casts x8^T and W8^T again from x and W with torch ops (_recast_t),
    which the partitioner can fuse with whatever recomputes x (the norm before q/k/v), as torchao's casts: no FP8
    copy lives from the forward to the backward. The scales come out of the forward op, which the partitioner never
    moves, so a delayed slot updated between a forward and its backward changes nothing the recast reads."""

    @staticmethod
    def forward(ctx, x, weight, bias, gamma):
        plan = ctx.plan
        n, k = weight.shape
        swiglu = plan.prologue is not None
        x2 = x.reshape(-1, 2 * k) if swiglu else x.view(-1, k)
        y, saved = ONE_CALL_OP.fwd(plan, x2, weight, bias)
        return _after_forward(ctx, x, bias, y, saved, (x2.shape[0], k, n), weight if plan.recast else None,
                              h=x2 if swiglu else None)

    @staticmethod
    def fwd(plan, x2, weight, bias):
        """The forward op: (y [m, n] without an unfused bias, the saved buffer); the amaxes copied into the slots."""
        delayed = plan.input.manager is not None
        (xs, xa), (wsc, wa) = (plan.input.slot_views(), plan.weight.slot_views()) if delayed else ((None,) * 2,) * 2
        y, saved, xa_new, wa_new = torch.ops.fp8ext.linear_fwd(x2, weight, bias if plan.fuse_bias else None, xs, xa,
                                                               wsc, wa, plan.input.fmt.code, plan.input.margin,
                                                               plan.out_dtype, not plan.recast,
                                                               SWIGLU_PROLOGUE if plan.prologue is not None else 0)
        if delayed:
            xa.copy_(xa_new)
            wa.copy_(wa_new)
        return y, saved

    @staticmethod
    def backward(ctx, dy):
        if ctx.recast_fmt is not None:  # x, W and the forward's header: cast x8^T and W8^T again
            x, weight, header = ctx.saved_tensors
            plan, saved, dy2, need_dx, need_dw, db_dtype = _backward_args(ctx, dy, header)
            m, k, n = ctx.dims
            scales = header.view(torch.float32)
            x_t = _recast_t(x.view(m, k), scales[_CUR_SCALE], ctx.recast_fmt) if need_dw else None
            w_t = _recast_t(weight, scales[_SINV_STEP + _CUR_SCALE], ctx.recast_fmt) if need_dx else None
        else:
            plan, saved, dy2, need_dx, need_dw, db_dtype = _backward_args(ctx, dy)
            x_t = w_t = None
        dx, dw, db = ONE_CALL_OP.bwd(plan, dy2, saved, ctx.dims, need_dx, need_dw, db_dtype, ctx.x_dtype, x_t, w_t)
        if dx is not None and plan.prologue is not None:  # SwiGLU's gradient from its output's
            dx = torch.ops.fp8ext.swiglu_backward(ctx.saved_tensors[0], dx)
        return _after_backward(ctx, plan, dx, dw, db)

    @staticmethod
    def bwd(plan, dy2, saved, dims, need_dx, need_dw, db_dtype, x_dtype, x_t=None, w_t=None, swiglu_da=None):
        """The backward op: (dx or None, dW or None, db or None); the gradient's amax copied into its slot."""
        m, k, n = dims
        gs, ga = plan.grad.slot_views() if plan.grad.manager is not None else (None, None)
        dx, dw, db, ga_new = torch.ops.fp8ext.linear_bwd(
            dy2, saved, m, k, n, plan.input.fmt.code, plan.grad.fmt.code, gs, ga, plan.grad.margin, need_dx, need_dw,
            db_dtype is not None, db_dtype or dy2.dtype, x_dtype, plan.w_dtype, x_t, w_t, swiglu_da)
        if ga is not None:
            ga.copy_(ga_new)
        return dx if need_dx else None, dw if need_dw else None, db if db_dtype is not None else None


def _as_stored(t2d: torch.Tensor) -> torch.Tensor:
    """t2d's values in float32 as its dtype holds them. Where the compiler computes t2d again in the backward (a
    norm's output, recomputed inside the recast's kernel) it keeps the value in float32 and skips the rounding to
    bfloat16 that storing it did in the forward; the rounding is redone here in integer ops, which it cannot skip
    (round to nearest even on the 16 bits bfloat16 drops; NaN left as it is). A no-op on stored bfloat16 values;
    float32 needs none."""
    v = t2d.float()
    return _bf16_rounded(v) if t2d.dtype == torch.bfloat16 else v


def _bf16_rounded(v: torch.Tensor) -> torch.Tensor:
    """float32 v rounded to bfloat16's values (nearest, ties to even; past the largest, infinity; NaN kept), in
    float32, by integer ops on its bits."""
    bits = v.view(torch.int32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).view(torch.float32)  # -65536: 0xFFFF0000
    return torch.where(torch.isnan(v), v, rounded)


def _recast_t(t2d: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    """The bytes [cols, rows] of t2d's transposed FP8 cast by `scale`, in torch ops (inductor fuses them with what
    produces t2d): fp8ext's cast rule (fp8ext.core numerics: the float32 product, round to nearest even,
    saturating; NaN -> x's sign | 0x7F), bit for bit the C cast's, on t2d as its dtype stores it (_as_stored).
    bfloat16 or float32 (FP8Linear recasts no other dtype: a compiler may skip float16's rounding too)."""
    v = _as_stored(t2d) * scale
    q = v.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).view(torch.uint8)
    nan = (torch.signbit(t2d).to(torch.uint8) << 7) | fmt.nan_code
    return torch.where(torch.isnan(v), nan, q).t().contiguous()
