"""convert_to_fp8: swap a model's nn.Linear layers for FP8Linear, in place, keeping their parameters."""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional

from torch import nn

from .linear import FP8Linear

__all__ = ["convert_to_fp8", "prepare_fp8", "FP8ConversionWarning"]


class FP8ConversionWarning(UserWarning):
    """convert_to_fp8 left some nn.Linear layers in high precision."""


def convert_to_fp8(module: nn.Module, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None) -> nn.Module:
    """Replaces every nn.Linear in `module` (recursively, in place) by an FP8Linear that holds the same
    Parameter objects (so an optimizer made before the conversion still updates them) and returns the module
    (a new FP8Linear when `module` itself is an nn.Linear).

    filter_fn(layer, fully_qualified_name) -> bool chooses which layers to convert (torchao's convention).
    Layers whose in_features or out_features is not a multiple of 16 cannot run FP8 GEMMs: they are left as
    they are and reported in one FP8ConversionWarning; the list is also in `module._fp8_skipped`.
    """
    skipped: List[str] = []

    def make(layer: nn.Linear, name: str) -> Optional[nn.Module]:
        if type(layer) is not nn.Linear or (filter_fn is not None and not filter_fn(layer, name)):
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
    return root


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
    their FP8 copies; eager steps are unchanged."""
    from ..core.context import _DEFAULT_RECIPE
    from ..core.recipe import CurrentScaling, DelayedScaling
    from ..core.tensor import role_quantizers
    recipe = fp8_recipe if fp8_recipe is not None else _DEFAULT_RECIPE
    if recast_in_backward and not isinstance(recipe, (CurrentScaling, DelayedScaling)):
        raise ValueError(f"prepare_fp8: recast_in_backward=True needs per-tensor scales (DelayedScaling or "
                         f"Float8CurrentScaling), got {type(recipe).__name__} (row-wise and block scales are not "
                         f"recast)")
    layers = [m for m in module.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.fp8_recast_in_backward = bool(recast_in_backward)
    if isinstance(recipe, DelayedScaling):
        for m in layers:
            m.init_fp8(recipe)
        # Registering may grow the manager's buffers, which makes the views the earlier layers took stale (a
        # compiled forward would re-register them: a graph break); a second pass takes them from the final buffers.
        for m in layers:
            m.quantizers(recipe)
    else:
        # The stateless recipes' quantizers are made once per recipe and cached: made now, not by the first compiled
        # step, whose guard on that cache would fail on the next step (a second compilation of the whole model).
        role_quantizers(recipe)
    return module
