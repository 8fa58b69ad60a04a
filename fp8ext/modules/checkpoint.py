"""Activation checkpointing with FP8 layers: the recomputed forward computes exactly as the original one.

torch.utils.checkpoint (both modes), transformers' gradient_checkpointing_enable(), torch's checkpoint_wrapper and
apply_activation_checkpointing rerun a checkpointed forward during the backward pass, outside the fp8_autocast
that the original forward ran in. fp8ext's layers therefore remember the context of their last forward
(`forward_context`) and compute a rerun in it: the same recipe, the same casts and, with delayed scaling, the same
scales (no scale update runs between a step's forward and its backward: the update waits for the next step's
fp8_autocast, and fp8_autocast entered during a backward pass updates nothing). A rerun's casts record the amaxes
the original forward recorded (an amax entry is a running maximum), so a step's scaling state is what it is
without checkpointing, and after N steps the weights are bit for bit those of the same training without it.

A rerun is recognised as a forward call outside any fp8_autocast, with gradients enabled, while autograd's engine
runs a backward pass (where torch's checkpoint recomputes). The recomputation must come before the next step of
the same recipe: a layer whose delayed scales were updated between its forward and the rerun raises (pipeline
schedules that run a later micro-batch's forward first are not supported). A layer called several times in one
step reruns each call in the context of its last forward.

`checkpoint` is Transformer Engine's te.checkpoint by name (TE code ports by its imports); torch's own works as well.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..core.context import current_context, in_backward

__all__ = ["checkpoint", "forward_context"]


def forward_context(layer):
    """The fp8_autocast context (fp8ext.core.context._Context) that the FP8 layer `layer` computes this call in:
    the innermost one of this thread, recorded on the layer; outside any, the recorded one when this call reruns
    a checkpointed forward (see the module docstring), else None. `layer` (an FP8Linear) keeps the record in its
    `_fp8_forward` attribute: the context, and with delayed scaling the manager and its update count."""
    ctx = current_context()
    if torch.compiler.is_compiling():  # compiled checkpointing recomputes inside the compiled graph, not in Python
        return ctx
    if ctx is not None:
        mgr = layer.scaling_manager(ctx.recipe) if ctx.recipe.stateful else None
        # every FP8 forward passes here: a plain attribute written past nn.Module.__setattr__ (a few microseconds)
        layer.__dict__["_fp8_forward"] = (ctx, mgr, mgr.steps if mgr is not None else 0)
        return ctx
    record = layer._fp8_forward
    if record is None:
        return None
    if not (torch.is_grad_enabled() and in_backward()):
        layer.__dict__["_fp8_forward"] = None  # a forward outside fp8_autocast: a later rerun is of this one
        return None
    ctx, mgr, steps = record
    if mgr is not None and mgr.steps != steps:
        raise RuntimeError(
            f"{type(layer).__name__}: activation checkpointing is recomputing this layer's forward after its FP8 "
            f"scales were updated (update {mgr.steps}, the forward ran after update {steps}): an fp8_autocast step "
            "of the same recipe began between the forward and its backward. Run the backward of a checkpointed "
            "forward before the next fp8_autocast step")
    return ctx


def checkpoint(function, *args, distribute_saved_activations: bool = False, get_rng_state_tracker=None,
               tp_group=None, use_reentrant: bool = True, **kwargs):
    """function(*args, **kwargs) with its activations recomputed in the backward pass: Transformer Engine's
    te.checkpoint, which is torch.utils.checkpoint.checkpoint here (fp8ext's layers recompute exactly under torch's
    own; see the module docstring). use_reentrant defaults to True, as in TE; the other keyword arguments
    (preserve_rng_state, context_fn, determinism_check, ...) are torch's. TE's tensor-parallel arguments are
    accepted at their defaults only (fp8ext has no tensor parallelism)."""
    for name, value in (("distribute_saved_activations", distribute_saved_activations),
                        ("get_rng_state_tracker", get_rng_state_tracker), ("tp_group", tp_group)):
        if value not in (None, False):
            raise NotImplementedError(f"fp8ext.checkpoint: {name}={value!r} asks for tensor parallelism, which "
                                      f"fp8ext does not have; leave {name} at its default")
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
