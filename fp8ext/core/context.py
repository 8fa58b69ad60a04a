"""fp8_autocast (and autocast, Transformer Engine 2.x's newer name): the context in which FP8Linear layers
compute in FP8.

    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.DelayedScaling()):
        loss = model(x).float().pow(2).mean()
    loss.backward()

Contexts nest (the innermost decides; enabled=False inside switches FP8 off for its body) and are per
thread (each thread has its own stack). With a DelayedScaling recipe, FP8Linear layers record their amaxes
in the recipe's FP8ScalingManager (one per recipe and device); the scales are updated, for every tensor in
one kernel, at the step boundary: when the next outermost fp8_autocast is entered, that is after the previous
step's backward pass has recorded the gradients' amaxes, so step t+1 scales with everything step t saw.

A step is the body of an outermost fp8_autocast entered outside a backward pass (an fp8_autocast entered while
autograd runs a backward, where activation checkpointing reruns a forward, updates no scales: the rerun computes
with the scales of the forward it repeats; fp8ext/modules/checkpoint.py). A boundary updates the slots that
the thread's previous step recorded, and no others: two models with equal recipes (one manager) that take turns,
or train in two threads, scale as each would alone (core/scaling.py). Each recipe in use has its own boundary: a recipe first
entered in a nested context (`with fp8_autocast(fp8_recipe=a): with fp8_autocast(fp8_recipe=b): ...`) is
updated when that nested context is entered for the first time in the step, so it scales as it would alone.
A step whose body raises leaves no trace: when an exception leaves the outermost context, the amaxes that the
step recorded are discarded from every recipe updated at its start, so the next steps scale as if the failed
step had never run. (Amaxes recorded by a backward pass that raises, outside any context, are kept; where
several threads share one recipe, the discard also drops what the other threads recorded since that update.)

calibrating=True computes in high precision while recording amaxes (to calibrate scales before FP8
inference). fp8_group: a torch.distributed group across which amaxes are max-reduced before the update.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, NamedTuple, Optional, Tuple, Union

import torch

from .recipe import DelayedScaling, Recipe, check_recipe
from .scaling import FP8ScalingManager, take_records

__all__ = ["fp8_autocast", "autocast", "activation_dtype", "is_fp8_enabled", "get_fp8_recipe", "get_scaling_manager",
           "in_backward", "resolve_recipe"]

_DEFAULT_RECIPE = DelayedScaling()


def resolve_recipe(fp8_recipe: Optional[Recipe], where: str) -> Recipe:
    """fp8_recipe, or the default recipe (DelayedScaling(), as Transformer Engine's) for None; a TypeError naming
    `where` for anything that is not a Recipe."""
    return _DEFAULT_RECIPE if fp8_recipe is None else check_recipe(fp8_recipe, where)


class _Context(NamedTuple):  # a NamedTuple: made on every entry, and cheaper to make than a frozen dataclass
    enabled: bool
    recipe: Recipe
    calibrating: bool
    group: object


class _ThreadState(threading.local):
    def __init__(self):
        self.stack = []
        self.step_recipes = []  # recipes whose scales were brought up to date in this thread's current step


thread_state = _ThreadState()  # read directly by FP8Linear's steady-state forward (fp8ext.modules.linear)
_managers: Dict[Tuple[Recipe, str], FP8ScalingManager] = {}
_managers_lock = threading.Lock()


def current_context() -> Optional[_Context]:
    """The innermost fp8_autocast of this thread, or None outside any."""
    stack = thread_state.stack
    return stack[-1] if stack else None


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread (where torch.utils.checkpoint reruns a
    checkpointed forward: fp8ext.modules.checkpoint)."""
    return torch._C._current_graph_task_id() != -1


def is_fp8_enabled() -> bool:
    ctx = current_context()
    return bool(ctx and ctx.enabled)


def activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype fp8ext's modules return for input x: x's dtype, or the autocast dtype inside torch.autocast
    (as Transformer Engine's modules and nn.Linear do)."""
    dev = x.device.type
    if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def get_fp8_recipe() -> Optional[Recipe]:
    ctx = current_context()
    return ctx.recipe if ctx else None


def get_scaling_manager(recipe: DelayedScaling, device: Union[str, torch.device]) -> FP8ScalingManager:
    """The FP8ScalingManager that layers use for `recipe` on `device` (made on first use)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (recipe, str(device))
    mgr = _managers.get(key)
    if mgr is None:
        with _managers_lock:
            mgr = _managers.setdefault(key, FP8ScalingManager(recipe, device=device))
    return mgr


def _managers_of(recipe: Recipe):
    return [mgr for (r, _), mgr in list(_managers.items()) if r is recipe or r == recipe]


def _update_pending(recipe: Recipe, group) -> None:
    """A step boundary of this thread: the managers of `recipe` update the slots that this thread's previous step
    recorded (every slot after a record that names none: a compiled or graphed step). Slots another thread or
    another model recorded wait for that step's own boundary (core/scaling.py)."""
    if not recipe.stateful:
        return
    for mgr in _managers_of(recipe):
        mine = take_records(mgr)
        if mgr._whole:
            mgr.update(group)
        elif mine:
            mgr.update(group, mine)


_compiled_managers = [0]  # how many managers have compiled_steps set (prepare_fp8): their exit marking is needed


def mark_compiled_steps(mgr, names) -> None:
    """Lets compiled steps leave the record of the slots `names` (a layer's, set by prepare_fp8) to the exit of the
    step's outermost fp8_autocast: a flag set inside a checkpointed region breaks torch.compile's graph there."""
    if not mgr.compiled_steps:
        mgr.compiled_steps = True
        _compiled_managers[0] += 1
    mgr.compiled_names.update(names)


def _mark_compiled_steps(recipes) -> None:
    """A step ended: its compiled layers recorded amaxes in the slots that prepare_fp8 prepared; they are recorded
    for this thread's next boundary (the slots of layers garbage-collected since are dropped)."""
    for recipe in recipes:
        if recipe.stateful:
            for mgr in _managers_of(recipe):
                if mgr.compiled_steps:
                    mgr.record_names(mgr.compiled_names)


def _discard_step(recipes) -> None:
    """A step raised: the managers of `recipes` (each updated at the step's start, so nothing was pending then)
    forget what the step recorded."""
    for recipe in recipes:
        if recipe.stateful:
            for mgr in _managers_of(recipe):
                mine = take_records(mgr)
                if mgr._whole:
                    mgr.discard_recorded()
                elif mine:
                    mgr.discard_recorded(mine)


class fp8_autocast(contextlib.ContextDecorator):  # noqa: N801 - Transformer Engine's name, used as a function
    """Compute FP8Linear layers in FP8 inside this context (see the module docstring). Transformer Engine's
    arguments. `_graph=True` is internal to fp8ext.make_graphed_callables (as TE's is to its own): the entry then
    leaves the pending scale update to the caller, which captures it in the graph behind the manager's dirty
    flag; any other use skips scale updates. Also a decorator. (A class rather than a generator: it is entered on
    every training step, and this costs a fraction of a generator-based context manager.)"""

    __slots__ = ("_ctx", "_update")

    def __init__(self, enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[Recipe] = None,
                 fp8_group=None, _graph: bool = False):
        recipe = resolve_recipe(fp8_recipe, "fp8_autocast()")
        self._ctx = _Context(bool(enabled), recipe, bool(calibrating), fp8_group)
        self._update = (enabled or calibrating) and not _graph

    def __enter__(self):
        state = thread_state
        stack = state.stack
        if not stack:
            state.step_recipes = []
        if self._update and not in_backward():  # in a backward: activation checkpointing reruns a forward
            recipe = self._ctx.recipe
            if recipe not in state.step_recipes:  # this recipe's first entry in the step: its step boundary
                _update_pending(recipe, self._ctx.group)
                state.step_recipes.append(recipe)
        stack.append(self._ctx)

    def __exit__(self, exc_type, exc, tb):
        state = thread_state
        state.stack.pop()
        if not state.stack:
            if exc_type is not None:
                _discard_step(state.step_recipes)
            elif _compiled_managers[0]:
                _mark_compiled_steps(state.step_recipes)
        return False


def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[Recipe] = None,
             amax_reduction_group=None, _graph: bool = False):
    """Transformer Engine 2.x's name for fp8_autocast: `recipe` is fp8_recipe, `amax_reduction_group` is
    fp8_group."""
    return fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe, fp8_group=amax_reduction_group,
                        _graph=_graph)
