"""FP8 all-gather under FSDP2 (torch.distributed.fsdp.fully_shard): each weight shard cast to FP8 before it is gathered.

Without this file FSDP2 all-gathers every FP8Linear weight in high precision (2 or 4 bytes an element) and the layer
casts the gathered weight. With enable_fp8_all_gather(model, recipe), called before fully_shard, each rank casts its
own shard and FSDP2 gathers the FP8 bytes (1 byte an element), through FSDP2's two extension points on the shard's
tensor type (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, torch 2.13):

    fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) -> (all-gather inputs, metadata)
    fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None)
        -> (the unsharded tensor, the tensors FSDP2 frees at reshard), or None with out= (later steps: FSDP2 keeps
           the first step's unsharded parameter and gathers into the same storage, so only the scale is refreshed)

FP8ShardedWeight wraps the local high-precision shard (what the optimizer updates); FP8GatheredWeight is the
unsharded parameter FSDP2 hands the layer: the gathered FP8 bytes with their scale_inv, which FP8Linear uses as its
weight's cast (FP8Linear._weight_fp8) on the composed path (the fast path casts W inside its C call). The weight's
gradient stays a plain high-precision tensor of the weight's shape, which FSDP2 reduce-scatters as before.

Scales, per tensor, the same on every rank, so that casting a shard before the gather gives the bytes that casting
the gathered weight would (tests compare the two bit for bit):
    CurrentScaling    scale = fmt.max / amax(whole weight) / 2**margin, the amax max-reduced across the shard group.
                      precompute_fp8_weight_scales(model) does it for every weight with one all-reduce (torchao's
                      precompute_float8_dynamic_scale_for_fsdp); call it after each optimizer step (a gather after
                      an update it missed raises). Never called, each gather all-reduces its own weight's amax.
    DelayedScaling    the weight slot's scale in the recipe's FP8ScalingManager, the shard's amax recorded in the
                      slot; give fp8_autocast an fp8_group so the manager max-reduces the amaxes (the same scale on
                      every rank, and the whole weight's amax in the history).
The gather is sent as uint8 (the FP8 bytes): gloo has no float8 dtypes, and NCCL moves bytes either way. The shard
is cast from the parameter itself (float32 master weights cast once, as torchao does), not from its copy in
MixedPrecisionPolicy's param_dtype: with a param_dtype the bytes differ from those of a high-precision gather.

    model = fp8ext.convert_to_fp8(model)
    fp8ext.enable_fp8_all_gather(model, recipe)               # before fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for x in batches:
        fp8ext.precompute_fp8_weight_scales(model)            # CurrentScaling: one all-reduce for every weight
        with fp8ext.fp8_autocast(fp8_recipe=recipe, fp8_group=group):   # group: the mesh's (DelayedScaling)
            loss = model(x).float().pow(2).mean()
        loss.backward(); optimizer.step(); optimizer.zero_grad()
This file holds no cast (fp8ext.ops) and no GEMM (fp8ext/modules/linear_autograd.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import amax as _amax
from ..ops import scale_from_amax
from .fp8_weights import _PRECOMPUTED, FP8GatheredWeight, FP8ShardedWeight, _weight_format
from .linear import FP8Linear

__all__ = ["FP8ShardedWeight", "FP8GatheredWeight", "enable_fp8_all_gather", "precompute_fp8_weight_scales"]


def enable_fp8_all_gather(model: nn.Module, recipe) -> nn.Module:
    """Makes FSDP2 gather every FP8Linear weight of `model` in FP8 under `recipe` (CurrentScaling or DelayedScaling:
    per-tensor scales; the recipe fp8_autocast will use). Call it before fully_shard: it swaps each weight Parameter
    for one holding an FP8ShardedWeight (same values, same requires_grad). Returns the model."""
    if not getattr(recipe, "per_tensor", False):
        raise TypeError(f"enable_fp8_all_gather(): recipe must be CurrentScaling or DelayedScaling (one scale per "
                        f"weight, the same on every rank), got {type(recipe).__name__}")
    for name, m in model.named_modules():
        if not isinstance(m, FP8Linear) or isinstance(m.weight, FP8ShardedWeight):
            continue
        if type(m.weight.data) is not torch.Tensor:
            raise TypeError(f"enable_fp8_all_gather(): {name}.weight is a {type(m.weight.data).__name__}; call it "
                            f"before fully_shard, on plain weights")
        m.weight = nn.Parameter(FP8ShardedWeight(m.weight.data, recipe), requires_grad=m.weight.requires_grad)
    return model


@torch.no_grad()
def precompute_fp8_weight_scales(model: nn.Module) -> None:
    """Every FP8-gathered weight's CurrentScaling scale from its whole-weight amax, with one all-reduce per device
    mesh for the model (each rank's shard amaxes, max-reduced), for the gathers until the weight changes: call it
    after fully_shard and after each optimizer step (torchao's precompute_float8_dynamic_scale_for_fsdp); a gather
    after an update that skipped it raises. Never called, each gather all-reduces its own weight's amax."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    by_mesh = {}
    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, FP8Linear) else None
        local = w.to_local() if isinstance(w, DTensor) else None
        if isinstance(local, FP8ShardedWeight) and not local.recipe.stateful:
            by_mesh.setdefault(w.device_mesh, []).append((m, local))
    for mesh, layers in by_mesh.items():
        amaxes = torch.stack([_amax(local.hp) for _, local in layers])
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=mesh.get_group())
        for (m, local), a in zip(layers, amaxes):
            fmt, margin = _weight_format(local.recipe)
            _PRECOMPUTED[m] = (scale_from_amax(a, fmt, margin)[0], m.weight._version)
