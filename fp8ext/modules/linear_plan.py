"""Which path an FP8 call of an FP8Linear takes: choose_plan is the one function that decides it, and returns the
LinearPlan (fp8ext/modules/linear_autograd.py) that LinearFunction runs:
    ONE_CALL      eager: each pass one fp8ext._C call (the casts and the GEMMs of the pass inside C)
    ONE_CALL_OP   under torch.compile: the same two calls as the torch ops fp8ext::linear_fwd / linear_bwd
    COMPOSED      the casts and the GEMMs as separate ops (every recipe; what the one-call passes do not take)
The one-call passes take what csrc/py_linear.c implements, checked here once (C checks again only what memory
safety needs): per-tensor quantizers of the two built-in kinds (a manager's slots: delayed scaling; or the tensor's
own amax: current scaling), a contiguous input of a float dtype whose row count is a nonzero multiple of 16, the
weight on the input's device, in_features and out_features multiples of 16, the weight recast every call
(is_first_microbatch None), no CUDA-graph capture (graphs take the composed path), fp8ext.debug off, a weight that
FSDP did not gather already cast, and as prologue SwiGLU only (delayed scaling, no recast in backward). Under
torch.compile the slots must have been registered before tracing (prepare_fp8, or an eager step) and
fuse_wgrad_accumulation is the composed path's. A recipe's own quantizer kinds take the composed path.
Whether torch.compile is tracing is read once per call, in choose_plan: compiled code can neither register scaling
slots nor keep host-side caches, so the compiled plan reads only what was set up eagerly. FP8Linear._steady_plan
reuses the previous call's eager one-call plan while these conditions hold (read without calling out), and
FP8Linear keeps its calls off the one-call passes while fp8ext.modules.linear._FAST_PATH is False (tests compare the
two eager paths that way).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..core import debug
from ..core.context import activation_dtype
from ..core.tensor import TENSOR, Float8CurrentScalingQuantizer, Float8Quantizer
from ..ops.matmul import bias_epilogue
from .fp8_weights import FP8GatheredWeight
from .linear_autograd import COMPOSED, ONE_CALL, ONE_CALL_OP, SWIGLU_PROLOGUE, LinearPlan

__all__ = ["choose_plan", "one_call_plan", "mark_recorded"]

_LEAN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_graphs_possible = torch.cuda.is_available()


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph: graphs take the composed path (a captured step has
    no host work to save, and the composed path is the one graph capture is tested with)."""
    return _graphs_possible and torch.cuda.is_current_stream_capturing()


_ONE_CALL_KINDS = (Float8Quantizer, Float8CurrentScalingQuantizer)  # the kinds csrc/py_linear.c casts itself


def mark_recorded(mgr, quantizers, compiling: bool, prepared: bool = False) -> None:
    """Marks the quantizers' slots for their update at this thread's next step boundary (this step records amaxes
    in them). Under torch.compile the whole manager is marked (a compiled graph keeps no per-slot bookkeeping), and
    a manager that prepare_fp8 prepared is marked by fp8_autocast's exit instead (FP8ScalingManager.compiled_steps):
    the flag is a side effect that compiled code cannot keep inside a checkpointed region (torch.compile's
    activation checkpointing), where it would break the graph. A CUDA graph being captured marks the whole manager
    too (its replays mark it themselves). `prepared`: the layer's slots are prepare_fp8's
    (FP8Linear._fp8_compiled_manager)."""
    if compiling:
        if not prepared:
            mgr.dirty = True
    elif _capturing():
        mgr.dirty = True
    else:
        mgr.record((quantizers[0]._slot, quantizers[1]._slot, quantizers[2]._slot))


def choose_plan(layer, recipe, x: torch.Tensor, is_first_microbatch: Optional[bool] = None, prologue=None, *,
                one_call: Optional[bool] = None) -> Optional[LinearPlan]:
    """The LinearPlan of an FP8 call of `layer` (an FP8Linear) on x with `recipe` (fp8_autocast's, enabled): the
    one-call passes where they take the call (see above), else the composed path. one_call=True: the one-call plan
    or None (the fused SwiGLU path falls back on its own); False: the composed plan (the fused norm paths).
    prologue: the step fp8ext's fused paths compute inside the input's cast."""
    compiling, only_one_call = torch.compiler.is_compiling(), one_call is True
    if compiling and recipe.stateful and recipe not in layer._fp8_views:
        if only_one_call:
            return None
        one_call = False  # tracing never registers slots: a graph break (init_fp8), and the composed path
    quantizers = layer.quantizers(recipe, _compiling=compiling)
    plan = None
    if one_call is not False and isinstance(x, torch.Tensor) and not x.is_meta and x.is_contiguous() and \
            x.dim() != 0 and x.shape[-1] == (2 if prologue is not None else 1) * layer.in_features:
        plan = one_call_plan(layer, quantizers, x.dtype, activation_dtype(x), x.device, x.numel() // x.shape[-1],
                             is_first_microbatch, prologue, compiling)
    if plan is None and not only_one_call:
        plan = _composed_plan(layer, recipe, x, quantizers, is_first_microbatch, prologue, compiling)
    return plan


def one_call_plan(layer, quantizers, in_dtype, out_dtype, device, m: int, is_first_microbatch=None, prologue=None,
                  compiling: bool = False) -> Optional[LinearPlan]:
    """The one-call plan of `layer` for a contiguous input of m rows in in_dtype on `device` (of the width the layer
    and the prologue take) with its output in out_dtype, or None where the one-call passes do not take the call."""
    if is_first_microbatch is not None or debug.enabled():
        return None
    q = quantizers[0]
    if type(q) not in _ONE_CALL_KINDS or any(type(o) is not type(q) for o in quantizers):
        return None
    if (compiling and layer.fuse_wgrad_accumulation) or (not compiling and _capturing()):
        return None
    w, mgr = layer.weight, q.manager
    if w.is_meta or isinstance(w, FP8GatheredWeight):
        return None
    if prologue is not None and (prologue.op != SWIGLU_PROLOGUE or mgr is None or layer.fp8_recast_in_backward):
        return None
    k, n = layer.in_features, layer.out_features
    dev = w.device if mgr is None else q.scale.device
    if in_dtype not in _LEAN_DTYPES or w.dtype not in _LEAN_DTYPES or device != dev or w.device != dev or \
            not w.is_contiguous() or m == 0 or m % 16 or k % 16 or n % 16:
        return None
    layer._weight_cache = None
    bias = None if layer.return_bias else layer.bias
    main_grad = layer._main_grad() if layer.fuse_wgrad_accumulation and torch.is_grad_enabled() else None
    # recast: bfloat16 and float32 inputs (see linear_autograd._recast_t); float16 keeps its FP8 copies
    recast = compiling and layer.fp8_recast_in_backward and in_dtype != torch.float16
    if mgr is not None:
        mark_recorded(mgr, quantizers, compiling, layer._fp8_compiled_manager is mgr)
    return LinearPlan(ONE_CALL_OP if compiling else ONE_CALL, quantizers, w, bias, out_dtype=out_dtype,
                      main_grad=main_grad, fuse_bias=bias_epilogue(bias, out_dtype) and bias.is_contiguous(),
                      recast=recast, prologue=prologue)


def _composed_plan(layer, recipe, x, quantizers, is_first_microbatch, prologue, compiling) -> LinearPlan:
    """The composed path's plan: the weight's FP8 cast (see FP8Linear._weight_fp8), main_grad, the output dtype.
    It recasts in backward with current scaling only: its copy of a delayed slot's scale is an op the partitioner
    may move into the backward, after the manager has updated the slot (the one-call path's scales come out of its
    forward op, which the partitioner never moves)."""
    per_tensor = quantizers[0].granularity == TENSOR
    if layer.fp8_recast_in_backward and not per_tensor:
        raise ValueError(f"FP8Linear({layer.in_features}, {layer.out_features}): fp8_recast_in_backward (set by "
                         f"prepare_fp8) needs per-tensor scales (DelayedScaling or Float8CurrentScaling), got "
                         f"{type(recipe).__name__}")
    recast = layer.fp8_recast_in_backward and not recipe.stateful
    if debug.enabled():
        layer._debug_checks(x, quantizers)
    w8 = layer._weight_fp8(quantizers[1], is_first_microbatch, recast, compiling)
    main_grad = layer._main_grad() if layer.fuse_wgrad_accumulation and torch.is_grad_enabled() else None
    mgr = quantizers[0].manager
    if mgr is not None:
        mark_recorded(mgr, quantizers, compiling, layer._fp8_compiled_manager is mgr)
    return LinearPlan(COMPOSED, quantizers, layer.weight, None if layer.return_bias else layer.bias,
                      out_dtype=activation_dtype(x), w8=w8, main_grad=main_grad, prologue=prologue, recast=recast)
