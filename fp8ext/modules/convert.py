"""convert_to_fp8: swap a model's nn.Linear layers for FP8Linear, in place, keeping their parameters; with a recipe,
the converted model computes in FP8 on every call without fp8_autocast (for training loops that other code owns:
transformers' Trainer, accelerate, Lightning). prepare_fp8: register the layers' scaling slots ahead of time."""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Callable, List, Optional

from torch import nn

from ..core.context import mark_compiled_steps, resolve_recipe
from ..core.recipe import check_recipe
from ..core.tensor import role_quantizers
from .linear import FP8Linear

__all__ = ["convert_to_fp8", "prepare_fp8", "set_forward_recipe", "FP8ConversionWarning"]


class FP8ConversionWarning(UserWarning):
    """convert_to_fp8 left some nn.Linear layers in high precision."""


def convert_to_fp8(module: nn.Module, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None, *,
                   fp8_recipe=None, convert_head: bool = False) -> nn.Module:
    """Replaces every nn.Linear in `module` (recursively, in place) by an FP8Linear that holds the same
    Parameter objects (so an optimizer made before the conversion still updates them) and returns the module
    (a new FP8Linear when `module` itself is an nn.Linear).

    filter_fn(layer, fully_qualified_name) -> bool chooses which layers to convert (torchao's convention).
    The model's output head stays in high precision unless convert_head=True, as fp8ext's own Transformer keeps
    it (and torchao's and Transformer Engine's recipes do): the layer that `module.get_output_embeddings()` returns
    (a transformers model's lm_head, tied to the embedding or not), else a child Linear named `lm_head`. Its
    name is in `module._fp8_kept_head` (None when there is none).
    Layers whose in_features or out_features is not a multiple of 16 cannot run FP8 GEMMs: they are left as
    they are and reported in one FP8ConversionWarning; the list is also in `module._fp8_skipped`.

    fp8_recipe: the returned module then computes in FP8 with that recipe on every call, as if each call were
    wrapped in `fp8_autocast(fp8_recipe=fp8_recipe)` (each call is a step: delayed scales update when it begins),
    for code that calls the model itself (transformers' Trainer, accelerate, Lightning). An fp8_autocast the caller
    entered around the call takes precedence (enabled=False computes in high precision). Converting again with
    fp8_recipe=None removes it.
    """
    _check_recipe(fp8_recipe, "convert_to_fp8")
    skipped: List[str] = []
    head = None if convert_head else _output_head(module)

    def make(layer: nn.Linear, name: str) -> Optional[nn.Module]:
        if type(layer) is not nn.Linear or (filter_fn is not None and not filter_fn(layer, name)) or layer is head:
            return None
        if layer.in_features % 16 or layer.out_features % 16:
            skipped.append(f"{name or '<root>'} ({layer.in_features} -> {layer.out_features})")
            return None
        new = FP8Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta",
                        params_dtype=layer.weight.dtype)
        new.weight = layer.weight
        new.bias = layer.bias
        new.train(layer.training)
        return new

    def walk(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            name = f"{prefix}.{child_name}" if prefix else child_name
            new = make(child, name) if isinstance(child, nn.Linear) else None
            if new is not None:
                setattr(parent, child_name, new)
            else:
                walk(child, name)

    root = make(module, "") if isinstance(module, nn.Linear) else None
    if root is None:
        walk(module, "")
        root = module
    if skipped:
        warnings.warn("convert_to_fp8: kept in high precision (FP8 GEMMs need in/out features divisible by 16): "
                      + ", ".join(skipped), FP8ConversionWarning, stacklevel=2)
    root._fp8_skipped = skipped
    root._fp8_kept_head = None if head is None else next(n for n, m in module.named_modules() if m is head)
    set_forward_recipe(root, fp8_recipe)
    return root


def _output_head(module: nn.Module) -> Optional[nn.Linear]:
    """The model's output head (see convert_to_fp8), or None."""
    get = getattr(module, "get_output_embeddings", None)
    head = None
    if callable(get):
        try:
            head = get()
        except NotImplementedError:  # transformers' base class, for models without an output embedding
            head = None
    if head is None:
        head = getattr(module, "lm_head", None)
    return head if isinstance(head, nn.Linear) and not isinstance(module, nn.Linear) else None


def _check_recipe(fp8_recipe, who: str) -> None:
    check_recipe(fp8_recipe, f"{who}()", none_ok=True)


class _CallScope(threading.local):
    def __init__(self):
        self.entered = []  # per call of a module with a forward recipe: its fp8_autocast, or None (the caller's won)


_scope = _CallScope()


class _ForwardRecipe:
    """The forward pre-hook and forward hook (always called, exceptions included) that run a module's calls inside
    fp8_autocast(fp8_recipe=recipe) unless the caller is inside one already. Holds only the recipe (copies and
    pickles of the module take it along)."""

    def __init__(self, recipe):
        self.recipe = recipe

    def enter(self, module, args):
        from ..core.context import current_context, fp8_autocast
        ctx = None
        if current_context() is None:
            ctx = fp8_autocast(enabled=True, fp8_recipe=self.recipe)
            ctx.__enter__()
        _scope.entered.append(ctx)

    def exit(self, module, args, output):
        ctx = _scope.entered.pop()
        if ctx is not None:
            ctx.__exit__(*sys.exc_info())  # inside the forward's exception handler when the forward raised


def set_forward_recipe(module: nn.Module, fp8_recipe) -> None:
    """Makes every call of `module` compute in FP8 with `fp8_recipe` (see convert_to_fp8), or with None, stops it."""
    _check_recipe(fp8_recipe, "set_forward_recipe")
    for handle in getattr(module, "_fp8_recipe_hooks", ()):
        handle.remove()
    module._fp8_recipe_hooks = ()
    if fp8_recipe is None:
        return
    hooks = _ForwardRecipe(fp8_recipe)
    module._fp8_recipe_hooks = (module.register_forward_pre_hook(hooks.enter),
                                module.register_forward_hook(hooks.exit, always_call=True))


def prepare_fp8(module: nn.Module, fp8_recipe=None, *, recast_in_backward: bool = False) -> nn.Module:
    """Gives every FP8Linear in `module` its slots in the recipe's scaling manager now (each layer on its
    weight's device), instead of on its first forward. Optional: under torch.compile the layers register
    eagerly on their first step (a graph break there); after prepare_fp8 even the first step compiles as one
    graph (fullgraph=True works).
    recast_in_backward=True: under torch.compile each layer keeps its high-precision input and weight for backward
    and casts them to FP8 again there (as torchao does), instead of keeping FP8 copies: the partitioner can then
    recompute an input from the norm or activation that made it, so that no copy of it lives from the forward to
    the backward: less memory, some more time (benchmarks/bench_hf.py measures both). Per-tensor scales
    (DelayedScaling or Float8CurrentScaling; the backward recasts with the scales its forward used, even when a
    later forward has updated a delayed slot); with delayed scaling only the layers on the fast path recast
    (contiguous inputs with a token count that is a multiple of 16); layers with a fused norm or activation keep
    their FP8 copies; eager steps are unchanged.
    With delayed scaling, compiled steps then mark the recipe's managers for their next update when the step's
    outermost fp8_autocast exits, rather than from inside the compiled graph (torch.compile keeps no such flag
    inside a checkpointed region: activation checkpointing would break the graph)."""
    recipe = resolve_recipe(fp8_recipe, "prepare_fp8()")
    if recast_in_backward and not recipe.per_tensor:
        raise ValueError(f"prepare_fp8: recast_in_backward=True needs per-tensor scales (DelayedScaling or "
                         f"Float8CurrentScaling), got {type(recipe).__name__} (row-wise and block scales are not "
                         f"recast)")
    layers = [m for m in module.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.fp8_recast_in_backward = bool(recast_in_backward)
    if recipe.stateful:
        for m in layers:
            m.init_fp8(recipe)
            mgr = m.scaling_manager(recipe)
            if mgr is not None:
                mark_compiled_steps(mgr, m._slot_names())
                m._fp8_compiled_manager = mgr
        # Registering may grow the manager's buffers, which makes the views the earlier layers took stale (a
        # compiled forward would re-register them: a graph break); a second pass takes them from the final buffers.
        for m in layers:
            m.quantizers(recipe)
    else:
        # The stateless recipes' quantizers are made once per recipe and cached: made now, not by the first compiled
        # step, whose guard on that cache would fail on the next step (a second compilation of the whole model).
        role_quantizers(recipe)
    return module
