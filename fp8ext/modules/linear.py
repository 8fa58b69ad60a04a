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
autograd must freeze. Backward finds the gradient's slot through its Quantizer (fp8ext/core/tensor.py), and again in
the manager when the manager's buffers grew after the forward. This file holds the module (slots, the weight's
cast, which path a call takes); the autograd Function and its plan are in fp8ext/modules/linear_autograd.py.
"""

from __future__ import annotations

import itertools
import math
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import _C
from ..core import debug, profiling
from ..core.boundary import stream_of
from ..core.context import activation_dtype, get_scaling_manager, thread_state
from .checkpoint import forward_context
from .fp8_weights import FP8GatheredWeight  # FSDP2's FP8 all-gather: a weight that arrives already cast
from .linear_plan import _LEAN_DTYPES, _graphs_possible, choose_plan, mark_recorded
from .linear_autograd import HIGH_PRECISION, ONE_CALL, LinearFunction, LinearPlan, recast_in_backward
from ..core.profiling import profiled
from ..core.recipe import DelayedScaling, Recipe
from ..core.scaling import pack_slots_state, unpack_slots_state
from ..core.tensor import FP8Tensor, Quantizer, role_quantizers

__all__ = ["FP8Linear", "Linear"]

_to_dl = torch._C._to_dlpack
_FAST_PATH = True  # tests switch it off to compare FP8Linear's two eager paths (ONE_CALL and COMPOSED)


def _cast(t2d: torch.Tensor, quantizer: Quantizer, keep_scale: bool = False) -> FP8Tensor:
    """t2d's FP8 cast by `quantizer` (the weight's casts go through here: tests count them)."""
    return quantizer.quantize(t2d, keep_scale)


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

    fp8_recast_in_backward = False  # compiled: keep x and W, recast them in backward (prepare_fp8 sets it)
    _fp8_compiled_manager = None  # prepare_fp8's manager: compiled steps record its slots at fp8_autocast's exit

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
        self._fp8_views = {}  # recipe -> (manager, slot views, manager generation, (input, weight, grad) Quantizers)
        self._leases = {}  # id(manager) -> the finalizer that releases this layer's slots there
        self._manager = None  # the manager of the last recipe used (for fp8_state)
        self._pending_fp8_state = pending  # loaded extra state, applied when the layer gets its slots
        self._lean = None  # (recipe, quantizers) of the fast path, set by the first FP8 step (delayed or current)
        self._fp8_forward = None  # the context of the last forward, for a checkpointed rerun (fp8ext.checkpoint)
        self._steady = None  # the last eager one-call plan and what it was chosen on (_steady_plan)

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
        for key in ("_weight_cache", "_fp8_views", "_leases", "_manager", "_fp8_id", "_lean", "_fp8_forward",
                    "_fp8_compiled_manager", "_steady"):  # a copy has new slots: prepare_fp8 it again to compile it
            state.pop(key, None)
        state["_pending_fp8_state"] = self.fp8_state() or None
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
        if st is None or not st[3][0].current():
            st = self.init_fp8(recipe)
        self._manager = st[0]
        return st[0], st[1]

    def scaling_manager(self, recipe: Recipe):
        """The FP8ScalingManager that holds this layer's scales for `recipe` (made on first use; None for a meta
        weight, which is never cast)."""
        lean = self._lean  # the fast path's: an equal recipe made anew each step finds it too (no dictionary lookup)
        if lean is not None and (lean[0] is recipe or lean[0] == recipe) and lean[1][0].manager is not None:
            return lean[1][0].manager
        return None if self.weight.is_meta else get_scaling_manager(recipe, self.weight.device)

    def quantizers(self, recipe: Recipe, *, _compiling: Optional[bool] = None):
        """The layer's (input, weight, grad_output) Quantizers for `recipe` as forward uses them: a stateful recipe's
        over the layer's slots, registered (again, when the manager's buffers were reallocated since); a stateless
        one's shared by all layers (role_quantizers). The last recipe's are kept on the layer, so that the steady
        state reads an attribute (an equal recipe made anew each step finds them too); not under torch.compile,
        whose graph would guard on that attribute."""
        compiling = torch.compiler.is_compiling() if _compiling is None else _compiling
        lean = None if compiling else self._lean
        if lean is not None and (lean[0] is recipe or lean[0] == recipe) and lean[1][0].current():
            return lean[1]
        if recipe.stateful:  # compiled: the views registered before tracing, read without writing the layer
            st = self._fp8_views.get(recipe) if compiling else None
            if st is None:
                self._manager_views(recipe)
                st = self._fp8_views[recipe]
            quantizers = st[3]
        else:
            quantizers = role_quantizers(recipe)
        if not compiling:
            self._lean = (recipe, quantizers)
        return quantizers

    @torch.compiler.disable  # registration changes the manager: done eagerly, never traced
    def init_fp8(self, recipe: Recipe, device=None):
        """Registers the layer's three tensors with the recipe's FP8ScalingManager (made on first use) on
        `device` (the weight's by default); the slots are released when the layer is garbage-collected.
        forward does this on first use; fp8ext.prepare_fp8(model) does it ahead of time (optional: it saves
        torch.compile a graph break on the first step)."""
        mgr = get_scaling_manager(recipe, device if device is not None else self.weight.device)
        names = self._slot_names()
        slots = [mgr.register(name, fmt) for name, fmt in zip(names, recipe.role_formats())]
        if id(mgr) not in self._leases:
            fin = weakref.finalize(self, mgr.release, names)
            fin.atexit = False
            self._leases[id(mgr)] = fin
        if self._pending_fp8_state is not None:
            pending, self._pending_fp8_state = self._pending_fp8_state, None
            mgr.load_slots(names, pending["amax_history"], pending["scale"], pending["scale_inv"], pending.get("steps"))
        self._manager = mgr
        quantizers = tuple(recipe.make_quantizers(mgr, slots))
        st = self._fp8_views[recipe] = (mgr, [mgr.views(s) for s in slots], mgr.generation, quantizers)
        return st

    def fp8_state(self) -> dict:
        """The layer's FP8 scaling state ({} before its first FP8 step) as a dict, on the CPU, as its next step will
        use it (see FP8ScalingManager.slots_state): 'names' (input, weight, grad_output), 'amax_history' [3, len],
        'scale', 'scale_inv' [3] and 'steps'. A run resumed from it scales exactly as the one that saved it."""
        mgr = self._manager
        if mgr is None:
            return self._pending_fp8_state or {}
        st = mgr.slots_state(self._slot_names())
        st["names"] = ["input", "weight", "grad_output"]
        return st

    def get_extra_state(self) -> torch.Tensor:
        """fp8_state() as one int32 tensor (fp8ext.core.scaling.pack_slots_state), so that every saver takes it:
        torch.save, safetensors and transformers' save_pretrained (sharded too), distributed checkpoints."""
        return pack_slots_state(self.fp8_state())

    def set_extra_state(self, state) -> None:
        """Loads get_extra_state()'s tensor (or the dict of fp8ext's earlier checkpoints)."""
        state = unpack_slots_state(state, f"FP8Linear({self.in_features}, {self.out_features}).set_extra_state", 3)
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
        """A plain nn.Linear checkpoint (no FP8 state) loads strictly: the FP8 state then starts fresh. A malformed
        FP8 state raises naming its key."""
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                          error_msgs)
        except ValueError as e:
            raise ValueError(f"{prefix}_extra_state: {e}") from None
        self._weight_cache = None
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)

    # ---- forward ----------------------------------------------------------------------------------
    def _weight_fp8(self, quantizer: Quantizer, is_first_microbatch, recast: bool = False,
                    compiling: bool = False) -> FP8Tensor:
        """The weight's FP8 cast. As in Transformer Engine: recast on every forward by default (so a weight
        changed in any way, `.data` writes included, is never served stale); is_first_microbatch=True casts and
        keeps the cast, False reuses the kept one across the micro-batches of a step. A kept cast is still
        recast when the weight provably changed (another tensor, an in-place update such as an optimizer step
        or load_state_dict, another format, quantizer or scale slot, inference mode)."""
        w = self.weight
        if isinstance(w, FP8GatheredWeight):  # FSDP2 gathered it in FP8 (fp8ext/modules/fsdp.py): already cast
            return w.fp8_tensor(quantizer)
        keep = is_first_microbatch is not None and not compiling and not (
            w.is_cuda and torch.cuda.is_current_stream_capturing())
        if not keep:  # cast for this call only; compiled, its scale is kept for backward's recast of W8^T
            self._weight_cache = None
            return _cast(w.detach(), quantizer, recast_in_backward(recast))
        key = (id(w), w.data_ptr(), w._version, quantizer.fmt.code, id(quantizer.scale), id(quantizer),
               torch.is_inference_mode_enabled())
        c = self._weight_cache
        if is_first_microbatch is False and c is not None and c[0] == key:
            return c[1]
        w8 = _cast(w.detach(), quantizer)
        self._weight_cache = (key, w8)
        return w8

    def forward(self, input: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """y = input W^T + b (a tuple (input W^T, b) with return_bias=True). is_first_microbatch (Transformer
        Engine's argument): None (default) casts the weight on every call; True casts it and keeps the cast;
        False reuses the kept cast for the next micro-batches of the same step. Under activation checkpointing the
        recomputed forward runs in the fp8_autocast context of the original one (fp8ext/modules/checkpoint.py)."""
        if is_first_microbatch is None and not profiling.ranges_on:
            plan = self._steady_plan(input)
            if plan is not None:  # the steady state: the one-call plan of the previous call holds
                y = LinearFunction.apply(input, self.weight, None if self.return_bias else self.bias, plan)
                return (y, self.bias) if self.return_bias else y
        return self._forward(input, is_first_microbatch)

    def _steady_plan(self, x: torch.Tensor) -> Optional[LinearPlan]:
        """The previous call's one-call plan when everything it was chosen on still holds (choose_plan's conditions,
        read from the layer, the input and the context without calling out), else None. Records this call's context
        (forward_context) and its slots (mark_recorded) as the full path would."""
        st = self._steady
        stack = thread_state.stack
        if st is None or not stack or torch.compiler.is_compiling() or not _FAST_PATH or debug.checks_on:
            return None
        plan, recipe, gen, dtype, device, w, w_dtype, bias, slots = st
        ctx, mgr = stack[-1], plan.input.manager
        if (ctx.recipe is not recipe and ctx.recipe != recipe) or not ctx.enabled or ctx.calibrating or \
                (mgr is not None and mgr.generation != gen):
            return None
        k = self.in_features
        if not isinstance(x, torch.Tensor) or x.dtype is not dtype or x.device != device or not x.is_contiguous() or \
                x.dim() == 0 or x.shape[-1] != k or x.numel() % (16 * k) or x.numel() == 0:
            return None
        b = None if self.return_bias else self.bias
        if self.weight is not w or w.dtype is not w_dtype or not w.is_contiguous() or b is not bias or \
                (b is not None and b.dtype is not plan.b_dtype):
            return None
        t = device.type
        if (torch.get_autocast_dtype(t) if torch.is_autocast_enabled(t) else dtype) is not plan.out_dtype or \
                (_graphs_possible and torch.cuda.is_current_stream_capturing()):
            return None
        self.__dict__["_fp8_forward"] = (ctx, mgr, mgr.steps if mgr is not None else 0)  # as forward_context records
        if mgr is not None:
            mgr.record(slots)
        return plan

    def _keep_steady(self, recipe, x: torch.Tensor, plan: LinearPlan) -> None:
        """Keeps an eager one-call plan for _steady_plan (not with main_grad: it is checked on every call)."""
        if plan.main_grad is None and plan.prologue is None:
            q = plan.input
            slots = (q._slot, plan.weight._slot, plan.grad._slot) if q.manager is not None else None
            self.__dict__["_steady"] = (plan, recipe, q.manager.generation if q.manager is not None else None,
                                        x.dtype, x.device, self.weight, self.weight.dtype,
                                        None if self.return_bias else self.bias, slots)
        else:
            self.__dict__["_steady"] = None

    @profiled("FP8Linear.forward")
    def _forward(self, input: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """forward through choose_plan (and the cases outside FP8: high precision, empty batches, calibration)."""
        ctx = forward_context(self)
        bias = None if self.return_bias else self.bias
        if ctx is None or not (ctx.enabled or ctx.calibrating):
            if self.fuse_wgrad_accumulation and torch.is_grad_enabled():
                plan = LinearPlan(HIGH_PRECISION, (None, None, None), self.weight, bias, main_grad=self._main_grad())
                return self.returned(LinearFunction.apply(input, self.weight, bias, plan))
            return self.returned(F.linear(input, self.weight, bias))
        if input.dim() == 0 or input.numel() == 0 or input.is_meta or self.weight.is_meta:
            return self.returned(self._no_gemm(input, bias))
        self._check_fp8_input(input)
        if not ctx.enabled:  # calibrating
            return self.returned(self._calibrate(ctx.recipe, input, bias))
        plan = choose_plan(self, ctx.recipe, input, is_first_microbatch, one_call=None if _FAST_PATH else False)
        if plan.backend is ONE_CALL and is_first_microbatch is None:  # eager: never while torch.compile traces
            self._keep_steady(ctx.recipe, input, plan)
        return self.returned(LinearFunction.apply(input, self.weight, bias, plan))

    def _check_fp8_input(self, input: torch.Tensor) -> None:
        if input.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear: input has {input.shape[-1]} features, the layer takes {self.in_features}")
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(f"FP8Linear({self.in_features}, {self.out_features}): FP8 GEMMs need in_features and "
                             "out_features to be multiples of 16; compute this layer outside fp8_autocast")
        if input.dtype not in _LEAN_DTYPES or self.weight.dtype not in _LEAN_DTYPES:
            raise TypeError(f"FP8Linear({self.in_features}, {self.out_features}): in FP8 the input and the weight must be "
                            f"float32, bfloat16 or float16, got input {str(input.dtype).removeprefix('torch.')} and weight "
                            f"{str(self.weight.dtype).removeprefix('torch.')}; compute this layer outside fp8_autocast")

    def _calibrate(self, recipe, input: torch.Tensor, bias):
        """fp8_autocast(calibrating=True, enabled=False): a stateful recipe records the amaxes for the scales FP8 will
        use; the layer computes in high precision."""
        if recipe.stateful:
            mgr, views = self._manager_views(recipe)
            x2 = input.detach().reshape(-1, self.in_features)
            _C.amax(_to_dl(x2.contiguous()), _to_dl(views[0][2]), stream=stream_of(x2.device))
            _C.amax(_to_dl(self.weight.detach()), _to_dl(views[1][2]), stream=stream_of(x2.device))
            mark_recorded(mgr, self._fp8_views[recipe][3], torch.compiler.is_compiling(),
                          self._fp8_compiled_manager is mgr)
        return F.linear(input, self.weight, bias)

    def fp8_plan(self, recipe, input: torch.Tensor, is_first_microbatch: Optional[bool] = None, *,
                 prologue=None) -> LinearPlan:
        """The composed path's LinearPlan (choose_plan) of an FP8 forward of this layer on `input` with `recipe`
        (fp8ext's fused norm paths, whose prologue the one-call passes do not take)."""
        return choose_plan(self, recipe, input, is_first_microbatch, prologue, one_call=False)

    def fast_forward(self, ctx, input, is_first_microbatch=None, prologue=None):
        """forward on the one-call passes inside the fp8_autocast context `ctx` (choose_plan), or None where they do
        not take this call. prologue: fp8ext.modules.fused_linear's SwiGLU step, computed inside the input's cast."""
        plan = self.fast_plan(ctx, input, is_first_microbatch, prologue)
        if plan is None:
            return None
        y = LinearFunction.apply(input, self.weight, None if self.return_bias else self.bias, plan)
        return (y, self.bias) if self.return_bias else y

    def fast_plan(self, ctx, input, is_first_microbatch=None, prologue=None) -> Optional[LinearPlan]:
        """The one-call LinearPlan of fast_forward's call, or None."""
        if not _FAST_PATH:
            return None
        return choose_plan(self, ctx.recipe, input, is_first_microbatch, prologue, one_call=True)

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

    def returned(self, y: torch.Tensor):
        """What forward returns for the output y: y, or (y, bias) with return_bias=True (fp8ext's fused paths)."""
        return (y, self.bias) if self.return_bias else y

    def _no_gemm(self, input: torch.Tensor, bias):
        """An empty batch, a 0-d input or meta tensors: nothing to compute in FP8. F.linear gives the output's
        shape (and nn.Linear's error for a 0-d input); gradients of an empty batch are zero."""
        dtype = activation_dtype(input)
        w = self.weight.to(dtype)
        return F.linear(input.to(dtype), w, bias.to(dtype) if bias is not None else None)

    def _debug_checks(self, input, quantizers) -> None:
        fn = "FP8Linear"
        debug.check_finite(input, fn, "input")
        debug.check_finite(self.weight, fn, "weight")
        for q, what in zip(quantizers, ("the input's scale", "the weight's scale", "the gradient's scale")):
            scale = q.scale
            if scale is not None:
                debug.check_scale(scale, fn, what)


Linear = FP8Linear  # Transformer Engine's name
