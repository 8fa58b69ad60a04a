"""FP8Linear: a drop-in for torch.nn.Linear that computes in FP8 inside fp8_autocast.

One training step of a layer y = x W^T + b inside fp8_autocast (HYBRID: E4M3 forward, E5M2 backward):
    forward   x8, x8^T = cast_transpose(x)          (one pass over x; amax recorded)
              W8, W8^T = cast_transpose(W)          (reused across micro-batches while W is unchanged)
              y  = gemm(x8, W8) + b                 (fast accumulation, as Transformer Engine's forward)
              saved for backward: x8^T and W8^T, FP8, with the scale_inv each was cast with
    backward  dy8, dy8^T = cast_transpose(dy)       (E5M2)
              dx = gemm(dy8, W8^T)                  dgrad
              dW = gemm(dy8^T, x8^T)                wgrad, accumulated in float32 by the tensor cores
cuBLASLt on sm_90 takes FP8 only as "TN" (both operands K-major), which is why the transposed copies are
made by the casts rather than by the GEMM. The weight-gradient GEMM contracts over the tokens, so their
count is padded with zero rows to a multiple of 16 when it is not one (zeros add nothing).
Outside fp8_autocast the layer is exactly nn.Linear (F.linear in high precision). Parameters are named
`weight` and `bias` as in nn.Linear, so state dicts move between the two (see load_state_dict notes).

The scaling state (scales and amax slots in the recipe's FP8ScalingManager) is not saved for backward with
save_for_backward: it is state that the manager updates in place between steps, not an input whose value
autograd must freeze. Backward finds the gradient's slot through the context, and again in the manager when
the manager's buffers grew after the forward.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import _C, debug
from ._boundary import _raw_stream, refuse_broadcast, stream_of
from .context import activation_dtype, current_context, get_scaling_manager
from .formats import FP8Format, format_of_code
from .ops import amax as _amax
from .ops import cast_transpose, cast_transpose_dbias, scale_from_amax
from ._gemm import _workspace, gemm_eager
from .profiling import profiled
from .recipe import DelayedScaling

__all__ = ["FP8Linear", "Linear"]

_to_dl = torch._C._to_dlpack


def _cast(t2d: torch.Tensor, fmt: FP8Format, scale: Optional[torch.Tensor], amax_slot: Optional[torch.Tensor],
          margin: float):
    """(q, q^T, scale_inv) of a 2-D tensor: delayed scaling with the manager's scale (recording the amax in
    its slot), or current scaling from the tensor's own amax when scale is None."""
    if scale is None:
        scale, _ = scale_from_amax(_amax(t2d), fmt, margin)
    scale_inv = torch.empty((), dtype=torch.float32, device=t2d.device)
    q, qt = cast_transpose(t2d, fmt, scale, amax_out=amax_slot, scale_inv_out=scale_inv)
    return q, qt, scale_inv


def _cast_dbias(t2d: torch.Tensor, fmt: FP8Format, scale: Optional[torch.Tensor], amax_slot: Optional[torch.Tensor],
                margin: float):
    """_cast of the output gradient with the bias gradient from the same pass: (q, q^T, scale_inv, dbias), dbias the
    float32 column sums of t2d (cast_transpose_dbias)."""
    if scale is None:
        scale, _ = scale_from_amax(_amax(t2d), fmt, margin)
    dev = t2d.device
    m, n = t2d.shape
    scale_inv = torch.empty((), dtype=torch.float32, device=dev)
    out = (torch.empty((m, n), dtype=fmt.torch_dtype, device=dev),
           torch.empty((n, m), dtype=fmt.torch_dtype, device=dev), torch.empty((n,), dtype=torch.float32, device=dev))
    q, qt, db = cast_transpose_dbias(t2d, fmt, scale, amax_slot, scale_inv_out=scale_inv, out=out)
    return q, qt, scale_inv, db


def _gemm(a, b, a_sinv, b_sinv, out_dtype, bias=None, fast=False):
    """fp8ext.gemm without the public wrapper's argument checks (C checks everything anyway), or the torch op
    under torch.compile."""
    if torch.compiler.is_compiling():
        return torch.ops.fp8ext.gemm(a, b, a_sinv, b_sinv, out_dtype, bias, fast, None, None, False)[0]
    return gemm_eager(a, b, a_sinv, b_sinv, out_dtype, bias, fast, None, False, None, None)


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    return F.pad(t, (0, 0, 0, pad)) if pad else t


class _FP8LinearFunction(torch.autograd.Function):
    """The three FP8 GEMMs of a linear layer (see the module docstring). Tensor arguments only (and constants),
    so that torch.compile can trace it: the weight's cast (w8, w8t, w_sinv) comes from FP8Linear, the scales and
    amax slots from the scaling manager (None for current scaling). grad_slot: (manager, slot, generation) of
    the gradient's slot in eager mode, so that backward can find it again if the manager grew."""

    @staticmethod
    def forward(ctx, x, weight, bias, w8, w8t, w_sinv, x_scale, x_amax, g_scale, g_amax, fwd_code, bwd_code, margin,
                out_dtype, grad_slot, main_grad=None):
        in_features = weight.shape[1]
        refuse_broadcast(x, "FP8Linear", "input")  # a strided x is copied below; a broadcast view (maybe huge) is not
        x2 = x.reshape(-1, in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m = x2.shape[0]
        x8, x8t, x_sinv = _cast(_pad_rows(x2), format_of_code(fwd_code), x_scale, x_amax, margin)
        # cuBLASLt's FP8 bias epilogue wants a bfloat16 bias (float16 for a float16 output); otherwise add it after.
        fuse_bias = (bias is not None and out_dtype != torch.float32
                     and bias.dtype == (torch.float16 if out_dtype == torch.float16 else torch.bfloat16))
        y = _gemm(x8, w8, x_sinv, w_sinv, out_dtype, bias if fuse_bias else None, fast=True)[:m]
        if bias is not None and not fuse_bias:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x8t, x_sinv, w8t, w_sinv)
        ctx.g_state, ctx.grad_slot = (g_scale, g_amax), grad_slot
        ctx.m, ctx.x_shape, ctx.x_dtype = m, x.shape, x.dtype
        ctx.bwd, ctx.margin = format_of_code(bwd_code), margin
        ctx.w_dtype, ctx.b_dtype = weight.dtype, (bias.dtype if bias is not None else None)
        ctx.main_grad, ctx.weight_ref = main_grad, (weight if main_grad is not None else None)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x8t, x_sinv, w8t, w_sinv = ctx.saved_tensors
        dx, dw, db = _fp8_linear_backward(ctx, dy, x8t, x_sinv, w8t, w_sinv, *ctx.needs_input_grad[:3])
        if dx is not None:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None, None, None, None


def _grad_views(ctx):
    """(scale, amax) of the gradient's slot as backward finds it: the forward's views, or fresh ones when the
    manager's buffers were reallocated after that forward."""
    g_scale, g_amax = ctx.g_state
    if ctx.grad_slot is not None:
        mgr, slot, generation = ctx.grad_slot
        if mgr.generation != generation:
            g_scale, _, g_amax = mgr.views(slot)
    return g_scale, g_amax


def _fp8_linear_backward(ctx, dy, x8t, x_sinv, w8t, w_sinv, need_dx, need_dw, need_db, dy_cast=None):
    """(dx [m, k] or None, dw, db) of an FP8 linear layer from its forward's saved FP8 operands: dy cast to the
    backward format (with the bias gradient from the same pass), then the dgrad and wgrad GEMMs. ctx holds g_state,
    grad_slot, m, bwd, margin, x_dtype, w_dtype, b_dtype, main_grad and weight_ref, as the forward set them.
    dy_cast: (dy8, dy8^T, scale_inv) already cast by the caller (with the gradient's slot; no bias gradient), dy
    then unused."""
    want_db = ctx.b_dtype is not None and need_db
    if dy_cast is not None:
        if want_db:
            raise RuntimeError("FP8Linear backward: a bias gradient needs dy itself, not its FP8 cast")
        g8, g8t, g_sinv = dy_cast
    else:
        g_scale, g_amax = _grad_views(ctx)
        n = w8t.shape[1]
        dy2 = dy.reshape(-1, n)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        if debug.enabled():
            debug.check_finite(dy2, "FP8Linear backward", "grad_output")
            debug.check_scale(g_scale, "FP8Linear backward", "the gradient's scale")
        if want_db:  # the bias gradient from the cast's own pass over dy
            g8, g8t, g_sinv, db32 = _cast_dbias(_pad_rows(dy2), ctx.bwd, g_scale, g_amax, ctx.margin)
        else:
            g8, g8t, g_sinv = _cast(_pad_rows(dy2), ctx.bwd, g_scale, g_amax, ctx.margin)
    dx = dw = db = None
    if need_dx:
        dx = _gemm(g8, w8t, g_sinv, w_sinv, ctx.x_dtype)[: ctx.m]
    if ctx.main_grad is not None:  # fuse_wgrad_accumulation: main_grad += dW in the GEMM itself (beta = 1)
        if torch.compiler.is_compiling():
            ctx.main_grad.add_(_gemm(g8t, x8t, g_sinv, x_sinv, torch.float32))
        else:
            gemm_eager(g8t, x8t, g_sinv, x_sinv, torch.float32, None, False, ctx.main_grad, True, None, None)
        dw = _wgrad_placeholder(ctx.weight_ref)
    elif need_dw:
        dw = _gemm(g8t, x8t, g_sinv, x_sinv, ctx.w_dtype)
    if want_db:
        db = db32.to(ctx.b_dtype)
    return dx, dw, db


def _wgrad_placeholder(weight):
    """What backward returns as the weight's gradient once it went into main_grad: None, or, for a weight marked
    with `grad_added_to_main_grad` (Megatron-LM's convention, which Transformer Engine follows), zeros after
    setting that flag, so that frameworks expecting a gradient tensor get one that adds nothing."""
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return torch.zeros_like(weight)
    return None


class _MainGradLinearFunction(torch.autograd.Function):
    """Outside fp8_autocast with fuse_wgrad_accumulation: y = x W^T + b in high precision, with the weight's
    gradient added into main_grad (float32) instead of returned."""

    @staticmethod
    def forward(ctx, x, weight, bias, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.main_grad, ctx.has_bias = main_grad, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy @ weight.to(dy.dtype)) if ctx.needs_input_grad[0] else None
        ctx.main_grad.addmm_(dy2.t().float(), x.reshape(-1, x.shape[-1]).float())
        db = dy2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, _wgrad_placeholder(weight), db, None


# ---- the fast path: one C call per pass ------------------------------------------------------------------
# In the common training case (eager, delayed scaling, the weight recast every step, contiguous input, a token
# count that is a multiple of 16, fp8ext.debug off) FP8Linear skips the composed path above and runs each pass
# as one fp8ext._C call (csrc/py_linear.c): the forward's two cast_transposes and its GEMM, the backward's
# cast_transpose (cast_transpose_dbias with a bias) and its two GEMMs. The FP8 tensors live in two byte buffers
# per pass (one kept for backward: the scale_invs, x8^T and W8^T; one dropped: x8 and W8), and the capsules of
# the layer's scale and amax slots are made once and reused. Same kernels, same cuBLASLt calls, same bytes as the
# composed path (tests compare the two bit for bit); the host work per step is a fraction.
_LEAN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FAST_PATH = True  # tests switch it off to compare the two paths
_SINV_BYTES = 768  # the saved buffer starts with the float32 scale_invs of x, W and dy, 256 bytes apart
_graphs_possible = torch.cuda.is_available()


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph: graphs take the composed path (a captured step has
    no host work to save, and the composed path is the one graph capture is tested with)."""
    return _graphs_possible and torch.cuda.is_current_stream_capturing()


def _r256(n: int) -> int:
    return (n + 255) & ~255


class _LeanState:
    """The layer's FP8 slots as the fast path uses them: the manager, its buffers' generation, and DLPack
    capsules of the scale and amax slots (long-lived tensors: C borrows a capsule and never consumes it)."""

    __slots__ = ("recipe", "mgr", "generation", "device", "slots", "xs", "xa", "ws", "wa", "gs", "ga", "fwd_code",
                 "bwd_code")

    def __init__(self, recipe, mgr, views, generation, slots):
        (xs, _, xa), (ws, _, wa), (gs, _, ga) = views
        self.recipe, self.mgr, self.generation, self.slots, self.device = recipe, mgr, generation, slots, xs.device
        self.xs, self.xa, self.ws, self.wa, self.gs, self.ga = (_to_dl(t) for t in (xs, xa, ws, wa, gs, ga))
        self.fwd_code, self.bwd_code = recipe.fp8_format.fwd.code, recipe.fp8_format.bwd.code

    def grad_slot_capsules(self):
        """(scale, amax) capsules of the gradient's slot, fresh when the manager's buffers grew since."""
        if self.mgr.generation == self.generation:
            return self.gs, self.ga
        scale, _, amax = self.mgr.views(self.slots[2])
        return _to_dl(scale), _to_dl(amax)


def _fp8_view(buf: torch.Tensor, offset: int, rows: int, cols: int, code: int) -> torch.Tensor:
    """The FP8 matrix [rows, cols] at `offset` bytes into a byte buffer of the fast path."""
    return buf[offset:offset + rows * cols].view(format_of_code(code).torch_dtype).view(rows, cols)


def _pass_stream(device: torch.device):
    """(stream, workspace capsule) of a pass on `device`: the caller's current CUDA stream and its cuBLASLt
    workspace, or (0, None) on the CPU."""
    if device.type != "cuda":
        return 0, None
    stream = _raw_stream(device.index)
    return stream, _workspace(device, stream)


class _LeanLinearFunction(torch.autograd.Function):
    """FP8Linear's fast path (see above): each pass one fp8ext._C call. On the CPU the C calls do the casts and
    the GEMMs are emulated here, from the same buffers."""

    @staticmethod
    def forward(ctx, x, weight, bias, st, out_dtype, fuse_bias, main_grad):
        n, k = weight.shape
        m = x.numel() // k
        dev = x.device
        rmk = _r256(m * k)
        saved = torch.empty(_SINV_BYTES + rmk + n * k, dtype=torch.uint8, device=dev)
        scratch = torch.empty(rmk + n * k, dtype=torch.uint8, device=dev)
        y = torch.empty((m, n), dtype=out_dtype, device=dev)
        stream, ws = _pass_stream(dev)
        b = bias if fuse_bias else None
        if not _C.linear_fwd(_to_dl(x.view(m, k)), _to_dl(weight), _to_dl(saved), _to_dl(scratch), _to_dl(y), st.xs,
                             st.xa, st.ws, st.wa, st.fwd_code, None if b is None else _to_dl(b), ws, stream):
            sinv = saved[:_SINV_BYTES].view(torch.float32)
            gemm_eager(_fp8_view(scratch, 0, m, k, st.fwd_code), _fp8_view(scratch, rmk, n, k, st.fwd_code), sinv[0:1],
                       sinv[64:65], out_dtype, b, True, y, False, None, None)
        if bias is not None and not fuse_bias:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(saved)
        ctx.st, ctx.dims, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = st, (m, k, n), x.shape, x.dtype, weight.dtype
        ctx.b_dtype = None if bias is None else bias.dtype
        ctx.main_grad, ctx.weight_ref = main_grad, (weight if main_grad is not None else None)
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        saved, = ctx.saved_tensors
        st = ctx.st
        m, k, n = ctx.dims
        dy2 = dy.reshape(m, n)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        dev = dy2.device
        rmn = _r256(m * n)
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        want_db = ctx.b_dtype is not None and need_db
        # dy8 and dy8^T, then (with a bias) the float32 per-64-row-tile column sums of cast_transpose_dbias
        scratch = torch.empty(2 * rmn + 4 * ((m + 63) // 64) * n if want_db else rmn + m * n, dtype=torch.uint8,
                              device=dev)
        db32 = torch.empty((n,), dtype=torch.float32, device=dev) if want_db else None
        dx = torch.empty((m, k), dtype=ctx.x_dtype, device=dev) if need_dx else None
        main_grad = ctx.main_grad
        if main_grad is not None:
            dw = main_grad
        else:
            dw = torch.empty((n, k), dtype=ctx.w_dtype, device=dev) if need_dw else None
        gs, ga = st.grad_slot_capsules()
        stream, ws = _pass_stream(dev)
        if not _C.linear_bwd(_to_dl(dy2), _to_dl(saved), _to_dl(scratch), m, k, n, st.fwd_code, gs, ga, st.bwd_code,
                             None if dx is None else _to_dl(dx), None if dw is None else _to_dl(dw),
                             main_grad is not None, ws, stream, None if db32 is None else _to_dl(db32)):
            sinv = saved[:_SINV_BYTES].view(torch.float32)
            rmk = _r256(m * k)
            if dx is not None:
                w8t = _fp8_view(saved, _SINV_BYTES + rmk, k, n, st.fwd_code)
                gemm_eager(_fp8_view(scratch, 0, m, n, st.bwd_code), w8t, sinv[128:129], sinv[64:65], dx.dtype, None,
                           False, dx, False, None, None)
            if dw is not None:
                gemm_eager(_fp8_view(scratch, rmn, n, m, st.bwd_code), _fp8_view(saved, _SINV_BYTES, k, m, st.fwd_code),
                           sinv[128:129], sinv[0:1], dw.dtype, None, False, dw, main_grad is not None, None, None)
        db = db32.to(ctx.b_dtype) if want_db else None
        if main_grad is not None:
            dw = _wgrad_placeholder(ctx.weight_ref)
        return None if dx is None else dx.view(ctx.x_shape), dw, db, None, None, None, None


_ids = itertools.count()  # FP8Linear slot names are unique for the life of the process (id() is reused)

# Transformer Engine's te.Linear arguments that fp8ext takes only at their defaults (no tensor or sequence
# parallelism, no userbuffers overlap): what each would need.
_TE_DEFAULTS = {
    "sequence_parallel": (False, "sequence parallelism"),
    "tp_group": (None, "tensor parallelism"),
    "tp_size": (1, "tensor parallelism"),
    "parallel_mode": (None, "tensor parallelism (column/row parallel layers)"),
    "get_rng_state_tracker": (None, "tensor-parallel RNG tracking"),
    "rng_tracker_name": (None, "tensor-parallel RNG tracking"),
    "skip_weight_param_allocation": (False, "externally allocated weights"),
    "parameters_split": (None, "split parameters"),
    "ub_overlap_ag": (False, "userbuffers communication overlap"),
    "ub_overlap_rs": (False, "userbuffers communication overlap"),
    "ub_overlap_rs_dgrad": (False, "userbuffers communication overlap"),
    "ub_bulk_dgrad": (False, "userbuffers communication overlap"),
    "ub_bulk_wgrad": (False, "userbuffers communication overlap"),
    "ub_name": (None, "userbuffers communication overlap"),
    "delay_wgrad_compute": (False, "delayed weight-gradient computation"),
    "symmetric_ar_type": (None, "symmetric all-reduce"),
}


def _check_te_kwargs(kwargs: dict) -> None:
    for key, value in kwargs.items():
        if key not in _TE_DEFAULTS:
            raise TypeError(f"FP8Linear() got an unexpected keyword argument {key!r}")
        default, what = _TE_DEFAULTS[key]
        if value != default:
            raise NotImplementedError(f"FP8Linear: {key}={value!r} asks for {what}, which fp8ext does not have; "
                                      f"leave {key} at its default ({default!r})")


class FP8Linear(nn.Module):
    """y = x W^T + b like torch.nn.Linear (same parameters, same initialisation), in FP8 inside fp8_autocast.

    Also available as fp8ext.Linear, with Transformer Engine's te.Linear arguments: params_dtype (or dtype) is
    the parameters' dtype (default torch.get_default_dtype()); device defaults to torch's default device (TE's
    to "cuda"); init_method(weight), when given, initialises the weight and the bias starts at zero (as in
    TE; without it, nn.Linear's initialisation); return_bias=True returns (x W^T, b) with the bias not added.
    TE's parallelism and communication-overlap arguments are accepted only at their defaults.
    fuse_wgrad_accumulation=True (TE's and Megatron-LM's convention): the weight's gradient is added into
    `weight.main_grad` (float32, the weight's shape, allocated by the caller) by the weight-gradient GEMM itself
    (cuBLASLt with beta = 1: no extra pass per micro-batch), and weight.grad is left alone (zeros are returned
    instead when the weight has a `grad_added_to_main_grad` attribute, which is then set to True).

    in_features and out_features must be multiples of 16 for FP8 (cuBLASLt's rule; convert_to_fp8 skips
    layers that are not). Inside torch.autocast the output has the autocast dtype. An empty batch gives an
    empty output and zero gradients without running a GEMM; meta tensors give the output's shape. The FP8
    scaling state (amax histories, scales) is saved as extra state; see load_state_dict for how checkpoints
    move to and from nn.Linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 params_dtype: Optional[torch.dtype] = None, *, dtype: Optional[torch.dtype] = None,
                 init_method=None, return_bias: bool = False, name: Optional[str] = None,
                 fuse_wgrad_accumulation: bool = False, **te_kwargs):
        super().__init__()
        _check_te_kwargs(te_kwargs)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        if dtype is not None and params_dtype is not None and dtype != params_dtype:
            raise TypeError(f"FP8Linear: dtype={dtype} and params_dtype={params_dtype} disagree; give one")
        self.in_features, self.out_features = in_features, out_features
        self.init_method, self.return_bias, self.name = init_method, bool(return_bias), name
        dtype = params_dtype or dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._init_fp8_runtime(None)

    def _init_fp8_runtime(self, pending) -> None:
        self._fp8_id = next(_ids)
        self._weight_cache = None  # (key, w8, w8t, scale_inv) of the last weight cast kept for reuse
        self._fp8_views = {}  # recipe -> (manager, slot views, manager generation, slots)
        self._leases = {}  # id(manager) -> the finalizer that releases this layer's slots there
        self._manager = None  # the manager of the last recipe used (for get_extra_state)
        self._pending_fp8_state = pending  # loaded extra state, applied when the layer gets its slots
        self._lean = None  # _LeanState of the fast path, made by the first FP8 step with delayed scaling

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation, or init_method(weight) and a zero bias when init_method was given."""
        if self.init_method is not None:
            with torch.no_grad():
                self.init_method(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)
            return
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    # ---- copies: a copy (deepcopy, pickle) is a new layer with its own slots and the same FP8 state ----------
    def __getstate__(self):
        state = self.__dict__.copy()
        for key in ("_weight_cache", "_fp8_views", "_leases", "_manager", "_fp8_id", "_lean"):
            state.pop(key, None)
        state["_pending_fp8_state"] = self.get_extra_state() or None
        return state

    def __setstate__(self, state):
        pending = state.pop("_pending_fp8_state", None)
        super().__setstate__(state)
        self._init_fp8_runtime(pending)

    # ---- FP8 state --------------------------------------------------------------------------------
    def _slot_names(self):
        base = f"fp8linear.{self._fp8_id}"
        return [base + ".input", base + ".weight", base + ".grad_output"]

    def _manager_views(self, recipe: DelayedScaling):
        """(manager, [(scale, scale_inv, amax) for input, weight, grad_output]) for `recipe`: cached on the
        layer, so that the steady state reads attributes only (and torch.compile traces it)."""
        st = self._fp8_views.get(recipe)
        if st is None or st[0].generation != st[2]:
            st = self.init_fp8(recipe)
        self._manager = st[0]
        return st[0], st[1]

    def _grad_slot(self, recipe: DelayedScaling):
        """(manager, slot, generation) of the gradient's slot, for backward to find it again."""
        mgr, _, generation, slots = self._fp8_views[recipe]
        return mgr, slots[2], generation

    @torch.compiler.disable  # registration changes the manager: done eagerly, never traced
    def init_fp8(self, recipe: DelayedScaling, device=None):
        """Registers the layer's three tensors with the recipe's FP8ScalingManager (made on first use) on
        `device` (the weight's by default); the slots are released when the layer is garbage-collected.
        forward does this on first use; fp8ext.prepare_fp8(model) does it ahead of time (optional: it saves
        torch.compile a graph break on the first step)."""
        mgr = get_scaling_manager(recipe, device if device is not None else self.weight.device)
        names = self._slot_names()
        fmt = recipe.fp8_format
        slots = [mgr.register(names[0], fmt.fwd), mgr.register(names[1], fmt.fwd), mgr.register(names[2], fmt.bwd)]
        if id(mgr) not in self._leases:
            fin = weakref.finalize(self, mgr.release, names)
            fin.atexit = False
            self._leases[id(mgr)] = fin
        if self._pending_fp8_state is not None:
            pending, self._pending_fp8_state = self._pending_fp8_state, None
            mgr.load_slots(names, pending["amax_history"], pending["scale"], pending["scale_inv"], pending.get("steps"))
        self._manager = mgr
        st = self._fp8_views[recipe] = (mgr, [mgr.views(s) for s in slots], mgr.generation, slots)
        return st

    def get_extra_state(self):
        """The layer's FP8 scaling state ({} before its first FP8 step), on the CPU, as its next step will use it
        (see FP8ScalingManager.slots_state): a run resumed from it scales exactly as the one that saved it."""
        mgr = self._manager
        if mgr is None:
            return self._pending_fp8_state or {}
        st = mgr.slots_state(self._slot_names())
        st["names"] = ["input", "weight", "grad_output"]
        return st

    def set_extra_state(self, state) -> None:
        if not state:
            return
        pending = {k: state[k] for k in ("amax_history", "scale", "scale_inv")}
        pending["steps"] = state.get("steps")
        if self._manager is None:
            self._pending_fp8_state = pending
        else:
            self._manager.load_slots(self._slot_names(), pending["amax_history"], pending["scale"],
                                     pending["scale_inv"], pending["steps"])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A plain nn.Linear checkpoint (no FP8 state) loads strictly: the FP8 state then starts fresh."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._weight_cache = None
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)

    # ---- forward ----------------------------------------------------------------------------------
    def _weight_fp8(self, fmt: FP8Format, scale, amax_slot, margin, is_first_microbatch):
        """The weight's FP8 cast. As in Transformer Engine: recast on every forward by default (so a weight
        changed in any way, `.data` writes included, is never served stale); is_first_microbatch=True casts and
        keeps the cast, False reuses the kept one across the micro-batches of a step. A kept cast is still
        recast when the weight provably changed (another tensor, an in-place update such as an optimizer step
        or load_state_dict, another format or scale slot, inference mode)."""
        w = self.weight
        keep = is_first_microbatch is not None and not torch.compiler.is_compiling() and not (
            w.is_cuda and torch.cuda.is_current_stream_capturing())
        if not keep:
            self._weight_cache = None
            return _cast(w.detach(), fmt, scale, amax_slot, margin)
        key = (id(w), w.data_ptr(), w._version, fmt.code, id(scale), torch.is_inference_mode_enabled())
        c = self._weight_cache
        if is_first_microbatch is False and c is not None and c[0] == key:
            return c[1], c[2], c[3]
        w8, w8t, sinv = _cast(w.detach(), fmt, scale, amax_slot, margin)
        self._weight_cache = (key, w8, w8t, sinv)
        return w8, w8t, sinv

    @profiled("FP8Linear.forward")
    def forward(self, input: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """y = input W^T + b (a tuple (input W^T, b) with return_bias=True). is_first_microbatch (Transformer
        Engine's argument): None (default) casts the weight on every call; True casts it and keeps the cast;
        False reuses the kept cast for the next micro-batches of the same step."""
        ctx = current_context()
        if ctx is not None and ctx.enabled and is_first_microbatch is None and not ctx.calibrating and _FAST_PATH \
                and not torch.compiler.is_compiling() and not _capturing():
            st = self._lean
            if st is not None and st.recipe is ctx.recipe and st.mgr.generation == st.generation:
                y = self._lean_forward(input, st)
                if y is not None:
                    return y
        bias = None if self.return_bias else self.bias
        main_grad = self._main_grad() if self.fuse_wgrad_accumulation and torch.is_grad_enabled() else None
        if ctx is None or not (ctx.enabled or ctx.calibrating):
            if main_grad is not None:
                return self._output(_MainGradLinearFunction.apply(input, self.weight, bias, main_grad))
            return self._output(F.linear(input, self.weight, bias))
        if input.dim() == 0 or input.numel() == 0 or input.is_meta or self.weight.is_meta:
            return self._output(self._no_gemm(input, bias))
        if input.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear: input has {input.shape[-1]} features, the layer takes {self.in_features}")
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(f"FP8Linear({self.in_features}, {self.out_features}): FP8 GEMMs need in_features and "
                             "out_features to be multiples of 16; compute this layer outside fp8_autocast")
        if input.dtype not in _LEAN_DTYPES or self.weight.dtype not in _LEAN_DTYPES:
            raise TypeError(f"FP8Linear({self.in_features}, {self.out_features}): in FP8 the input and the weight must be "
                            f"float32, bfloat16 or float16, got input {str(input.dtype).removeprefix('torch.')} and weight "
                            f"{str(self.weight.dtype).removeprefix('torch.')}; compute this layer outside fp8_autocast")
        recipe = ctx.recipe
        delayed = isinstance(recipe, DelayedScaling)
        if ctx.calibrating and not ctx.enabled:
            if delayed:  # record the amaxes for the scales FP8 will use, compute in high precision
                mgr, views = self._manager_views(recipe)
                x2 = input.detach().reshape(-1, self.in_features)
                _C.amax(_to_dl(x2.contiguous()), _to_dl(views[0][2]), stream=stream_of(x2.device))
                _C.amax(_to_dl(self.weight.detach()), _to_dl(views[1][2]), stream=stream_of(x2.device))
                mgr.dirty = True
            return self._output(F.linear(input, self.weight, bias))
        fwd, bwd = recipe.fp8_format.fwd, recipe.fp8_format.bwd
        if delayed:
            (xs, xa, ws, wa, gs, ga), grad_slot = self._delayed_slots(recipe)
        else:
            xs = xa = ws = wa = gs = ga = grad_slot = None
        if debug.enabled():
            self._debug_checks(input, xs, ws, gs)
        w8, w8t, w_sinv = self._weight_fp8(fwd, ws, wa, recipe.margin, is_first_microbatch)
        y = _FP8LinearFunction.apply(input, self.weight, bias, w8, w8t, w_sinv, xs, xa, gs, ga, fwd.code, bwd.code,
                                     float(recipe.margin), activation_dtype(input), grad_slot, main_grad)
        return self._output(y)

    def _delayed_slots(self, recipe: DelayedScaling):
        """((x scale, x amax, W scale, W amax, dy scale, dy amax), grad_slot) of a forward with delayed scaling,
        the manager marked for its next update; grad_slot (see _grad_slot) is None under torch.compile."""
        mgr, views = self._manager_views(recipe)
        (xs, _, xa), (ws, _, wa), (gs, _, ga) = views
        mgr.dirty = True
        grad_slot = None
        if not torch.compiler.is_compiling():
            grad_slot = self._grad_slot(recipe)
            _, _, generation, slots = self._fp8_views[recipe]
            if self._lean is None or self._lean.recipe is not recipe or self._lean.generation != generation:
                self._lean = _LeanState(recipe, mgr, views, generation, slots)
        return (xs, xa, ws, wa, gs, ga), grad_slot

    def _lean_forward(self, input, st: _LeanState):
        """The fast path's forward (see _LeanLinearFunction), or None when this input needs the composed path."""
        if debug.enabled() or not isinstance(input, torch.Tensor):
            return None
        w = self.weight
        k = self.in_features
        if input.dtype not in _LEAN_DTYPES or w.dtype not in _LEAN_DTYPES or input.device != st.device or \
                w.device != st.device or not input.is_contiguous() or not w.is_contiguous() or input.dim() == 0 or \
                input.shape[-1] != k:
            return None
        m = input.numel() // k
        if m == 0 or m % 16 or k % 16 or self.out_features % 16:
            return None
        if self._weight_cache is not None:
            self._weight_cache = None
        out_dtype = activation_dtype(input)
        bias = None if self.return_bias else self.bias
        fuse_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == (
            torch.float16 if out_dtype == torch.float16 else torch.bfloat16) and bias.is_contiguous()
        main_grad = self._main_grad() if self.fuse_wgrad_accumulation and torch.is_grad_enabled() else None
        st.mgr.dirty = True
        y = _LeanLinearFunction.apply(input, w, bias, st, out_dtype, fuse_bias, main_grad)
        return (y, self.bias) if self.return_bias else y

    def _main_grad(self) -> torch.Tensor:
        """weight.main_grad, checked: fuse_wgrad_accumulation adds the weight's gradient into it (a float32 tensor of
        the weight's shape on its device, allocated by the training framework, as Megatron-LM does)."""
        mg = getattr(self.weight, "main_grad", None)
        if not isinstance(mg, torch.Tensor):
            raise RuntimeError("FP8Linear(fuse_wgrad_accumulation=True): weight.main_grad is not set; allocate it "
                               "(weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)) before the forward")
        if mg.dtype != torch.float32 or mg.shape != self.weight.shape or mg.device != self.weight.device \
                or not mg.is_contiguous():
            raise ValueError(f"FP8Linear(fuse_wgrad_accumulation=True): weight.main_grad must be a contiguous float32 "
                             f"tensor of shape {list(self.weight.shape)} on {self.weight.device}, got {mg.dtype} "
                             f"{list(mg.shape)} on {mg.device}")
        return mg

    def _output(self, y):
        return (y, self.bias) if self.return_bias else y

    def _no_gemm(self, input: torch.Tensor, bias):
        """An empty batch, a 0-d input or meta tensors: nothing to compute in FP8. F.linear gives the output's
        shape (and nn.Linear's error for a 0-d input); gradients of an empty batch are zero."""
        dtype = activation_dtype(input)
        w = self.weight.to(dtype)
        return F.linear(input.to(dtype), w, bias.to(dtype) if bias is not None else None)

    def _debug_checks(self, input, xs, ws, gs) -> None:
        fn = "FP8Linear"
        debug.check_finite(input, fn, "input")
        debug.check_finite(self.weight, fn, "weight")
        for scale, what in ((xs, "the input's scale"), (ws, "the weight's scale"), (gs, "the gradient's scale")):
            if scale is not None:
                debug.check_scale(scale, fn, what)


Linear = FP8Linear  # Transformer Engine's name
