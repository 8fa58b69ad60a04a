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
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import _C
from ._boundary import stream_of
from .autocast import current_context, get_scaling_manager
from .formats import FP8Format, format_of_code
from .ops import amax as _amax
from .ops import cast_transpose, scale_from_amax
from ._gemm import gemm_eager
from .recipe import DelayedScaling

__all__ = ["FP8Linear"]

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
    """The three FP8 GEMMs of a linear layer (see the module docstring). Tensor arguments only, so that
    torch.compile can trace it: the weight's cast (w8, w8t, w_sinv) comes from FP8Linear, the scales and
    amax slots from the scaling manager (None for current scaling)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w8, w8t, w_sinv, x_scale, x_amax, g_scale, g_amax, fwd_code, bwd_code, margin):
        in_features = weight.shape[1]
        x2 = x.reshape(-1, in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m = x2.shape[0]
        x8, x8t, x_sinv = _cast(_pad_rows(x2), format_of_code(fwd_code), x_scale, x_amax, margin)
        # cuBLASLt's FP8 bias epilogue wants a bfloat16 bias (float16 for a float16 output); otherwise add it after.
        fuse_bias = (bias is not None and x.dtype != torch.float32
                     and bias.dtype == (torch.float16 if x.dtype == torch.float16 else torch.bfloat16))
        y = _gemm(x8, w8, x_sinv, w_sinv, x.dtype, bias if fuse_bias else None, fast=True)[:m]
        if bias is not None and not fuse_bias:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x8t, x_sinv, w8t, w_sinv, g_scale, g_amax)
        ctx.m, ctx.x_shape, ctx.x_dtype = m, x.shape, x.dtype
        ctx.bwd, ctx.margin = format_of_code(bwd_code), margin
        ctx.w_dtype, ctx.b_dtype = weight.dtype, (bias.dtype if bias is not None else None)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x8t, x_sinv, w8t, w_sinv, g_scale, g_amax = ctx.saved_tensors
        n = w8t.shape[1]
        dy2 = dy.reshape(-1, n)
        if not dy2.is_contiguous():
            dy2 = dy2.contiguous()
        g8, g8t, g_sinv = _cast(_pad_rows(dy2), ctx.bwd, g_scale, g_amax, ctx.margin)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _gemm(g8, w8t, g_sinv, w_sinv, ctx.x_dtype)[: ctx.m]
            dx = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = _gemm(g8t, x8t, g_sinv, x_sinv, ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None, None, None, None, None, None, None


class FP8Linear(nn.Module):
    """y = x W^T + b like torch.nn.Linear (same parameters, same initialisation), in FP8 inside fp8_autocast.

    in_features and out_features must be multiples of 16 for FP8 (cuBLASLt's rule; convert_to_fp8 skips
    layers that are not). params_dtype: the parameters' dtype (default torch.get_default_dtype()). The FP8
    scaling state (amax histories, scales) is saved as extra state; see load_state_dict for how checkpoints
    move to and from nn.Linear.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 params_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self._weight_cache = None  # (key, w8, w8t, scale_inv) of the last weight cast
        self._fp8_views = {}  # recipe -> (manager, slot views, manager generation)
        self._pending_fp8_state = None  # loaded extra state, applied when the layer gets its slots

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

    # ---- FP8 state --------------------------------------------------------------------------------
    def _slot_names(self):
        base = f"fp8linear.{id(self)}"
        return [base + ".input", base + ".weight", base + ".grad_output"]

    def _manager_views(self, recipe: DelayedScaling):
        """(manager, [(scale, scale_inv, amax) for input, weight, grad_output]) for `recipe`: cached on the
        layer, so that the steady state reads attributes only (and torch.compile traces it)."""
        st = self._fp8_views.get(recipe)
        if st is None or st[0].generation != st[2]:
            st = self.init_fp8(recipe)
        return st[0], st[1]

    def init_fp8(self, recipe: DelayedScaling, device=None):
        """Registers the layer's three tensors with the recipe's FP8ScalingManager (made on first use) on
        `device` (the weight's by default). forward does this on first use; fp8ext.prepare_fp8(model) does it
        ahead of time, e.g. before torch.compile, which cannot trace the registration."""
        mgr = get_scaling_manager(recipe, device if device is not None else self.weight.device)
        names = self._slot_names()
        fmt = recipe.fp8_format
        slots = [mgr.register(names[0], fmt.fwd), mgr.register(names[1], fmt.fwd), mgr.register(names[2], fmt.bwd)]
        if self._pending_fp8_state is not None:
            pending = self._pending_fp8_state
            self._pending_fp8_state = None
            mgr.load_slots(names, pending["amax_history"], pending["scale"], pending["scale_inv"])
        self._manager = mgr
        st = self._fp8_views[recipe] = (mgr, [mgr.views(s) for s in slots], mgr.generation)
        return st

    def get_extra_state(self):
        mgr = getattr(self, "_manager", None)
        if mgr is None:
            return self._pending_fp8_state or {}
        st = mgr.slots_state(self._slot_names())
        st["names"] = ["input", "weight", "grad_output"]
        return st

    def set_extra_state(self, state) -> None:
        if not state:
            return
        self._pending_fp8_state = {k: state[k] for k in ("amax_history", "scale", "scale_inv")}
        mgr = getattr(self, "_manager", None)
        if mgr is not None:
            st = self._pending_fp8_state
            self._pending_fp8_state = None
            mgr.load_slots(self._slot_names(), st["amax_history"], st["scale"], st["scale_inv"])

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A plain nn.Linear checkpoint (no FP8 state) loads strictly: the FP8 state then starts fresh."""
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)

    # ---- forward ----------------------------------------------------------------------------------
    def _weight_fp8(self, fmt: FP8Format, scale, amax_slot, margin, is_first_microbatch):
        w = self.weight
        reuse_ok = not torch.compiler.is_compiling() and not (
            w.is_cuda and torch.cuda.is_current_stream_capturing())
        key = (w._version, w.data_ptr(), fmt.code, id(scale)) if reuse_ok else None
        c = self._weight_cache
        if c is not None and reuse_ok and (is_first_microbatch is False or (is_first_microbatch is None and c[0] == key)):
            return c[1], c[2], c[3]
        w8, w8t, sinv = _cast(w.detach(), fmt, scale, amax_slot, margin)
        self._weight_cache = (key, w8, w8t, sinv) if reuse_ok else None
        return w8, w8t, sinv

    def forward(self, input: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        """is_first_microbatch (Transformer Engine's argument): True recasts the weight, False reuses the last
        cast; None (default) reuses it while the weight is unchanged (same tensor, same version)."""
        ctx = current_context()
        if ctx is None or not (ctx.enabled or ctx.calibrating):
            return F.linear(input, self.weight, self.bias)
        if input.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear: input has {input.shape[-1]} features, the layer takes {self.in_features}")
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(f"FP8Linear({self.in_features}, {self.out_features}): FP8 GEMMs need in_features and "
                             "out_features to be multiples of 16; compute this layer outside fp8_autocast")
        recipe = ctx.recipe
        delayed = isinstance(recipe, DelayedScaling)
        if ctx.calibrating and not ctx.enabled:
            if delayed:  # record the amaxes for the scales FP8 will use, compute in high precision
                mgr, views = self._manager_views(recipe)
                x2 = input.detach().reshape(-1, self.in_features)
                _C.amax(_to_dl(x2.contiguous()), _to_dl(views[0][2]), stream=stream_of(x2.device))
                _C.amax(_to_dl(self.weight.detach()), _to_dl(views[1][2]), stream=stream_of(x2.device))
                mgr.dirty = True
            return F.linear(input, self.weight, self.bias)
        fwd, bwd = recipe.fp8_format.fwd, recipe.fp8_format.bwd
        if delayed:
            mgr, ((xs, _, xa), (ws, _, wa), (gs, _, ga)) = self._manager_views(recipe)
            mgr.dirty = True
        else:
            xs = xa = ws = wa = gs = ga = None
        w8, w8t, w_sinv = self._weight_fp8(fwd, ws, wa, recipe.margin, is_first_microbatch)
        return _FP8LinearFunction.apply(input, self.weight, self.bias, w8, w8t, w_sinv, xs, xa, gs, ga, fwd.code,
                                        bwd.code, float(recipe.margin))
