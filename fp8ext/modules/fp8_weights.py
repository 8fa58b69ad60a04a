"""The weight tensors of FSDP2's FP8 all-gather (fp8ext/modules/fsdp.py says how it works): FP8ShardedWeight, the
shard FSDP2 holds, which casts itself to FP8 before the all-gather, and FP8GatheredWeight, the unsharded FP8 weight
FSDP2 hands FP8Linear (which reads it as its weight's cast). Apart from fsdp.py so that FP8Linear can know the
gathered weight without importing the functions that find FP8Linear layers in a model."""


from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.utils._pytree as pytree

from ..core.formats import FP8Format
from ..core.context import current_context
from ..core.tensor import TENSOR, FP8Tensor, Quantizer, role_quantizers
from ..ops import amax as _amax
from ..ops import quantize, scale_from_amax

__all__ = ["FP8ShardedWeight", "FP8GatheredWeight"]

# FSDP2 pads, slices, views and copies the local shard while it shards it (and copies it to a device): those ops keep
# the subclass (torchao's list); every other op (the optimizer's, say) runs on the plain shard.
_KEEP_SUBCLASS = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.alias.default,
}


def _wrapper(cls, t: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
    return torch.Tensor._make_wrapper_subclass(cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
                                               dtype=dtype, layout=t.layout, device=t.device,
                                               requires_grad=requires_grad)


class FP8ShardedWeight(torch.Tensor):
    """A weight's local high-precision shard (`hp`), which FSDP2 gathers in FP8 (see the module docstring) under
    `recipe` (CurrentScaling or DelayedScaling). It holds no scale: FSDP2 replaces a shard's tensor when it pads it
    again (at its lazy init, on the ranks with fewer rows), so what every rank must agree on lives elsewhere."""

    @staticmethod
    def __new__(cls, hp: torch.Tensor, recipe):
        return _wrapper(cls, hp, hp.dtype, hp.requires_grad)

    def __init__(self, hp: torch.Tensor, recipe):
        self.hp, self.recipe = hp, recipe

    def __repr__(self) -> str:
        return f"FP8ShardedWeight({type(self.recipe).__name__}, shard={list(self.hp.shape)}, dtype={self.hp.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        recipe = next(a.recipe for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, FP8ShardedWeight))
        if func is torch.ops.aten.detach.default:
            return FP8ShardedWeight(args[0].hp.detach(), recipe)
        args, kwargs = pytree.tree_map_only(FP8ShardedWeight, lambda t: t.hp, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_SUBCLASS:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: FP8ShardedWeight(t, recipe), out)

    def __tensor_flatten__(self):
        return ["hp"], self.recipe

    @staticmethod
    def __tensor_unflatten__(inner, recipe, outer_size, outer_stride):
        return FP8ShardedWeight(inner["hp"], recipe)

    # ---- FSDP2's extension points ---------------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """((the shard's FP8 bytes as uint8, rows padded to FSDP2's padded shard),), (scale_inv, format))."""
        fmt, scale = self._weight_scale(mesh, module)
        hp = self.hp if self.hp.is_contiguous() else self.hp.contiguous()
        scale_inv = torch.empty((), dtype=torch.float32, device=hp.device)  # 1 / scale, by the cast's own launch
        q = quantize(hp, fmt, scale, amax_out=self._amax_slot(module), scale_inv_out=scale_inv).view(torch.uint8)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 shards dim 0 in chunks of ceil(rows / world)
        if q.shape[0] != rows:  # the last ranks' shards of an uneven split: zero rows (zeros cast to zeros)
            q = torch.cat([q, q.new_zeros((rows - q.shape[0], *q.shape[1:]))])
        return (q,), (scale_inv, fmt)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype: torch.dtype, *,
                             out: Optional[torch.Tensor] = None):
        (data,) = all_gather_outputs
        scale_inv, fmt = metadata
        if out is not None:  # FSDP2 gathered into the storage `out` already views: only the scale is new
            if not isinstance(out, FP8GatheredWeight):
                raise RuntimeError(f"FP8ShardedWeight.fsdp_post_all_gather(): out must be an FP8GatheredWeight, got "
                                   f"{type(out).__name__}")
            out.scale_inv = scale_inv
            return None
        return FP8GatheredWeight(data.view(fmt.torch_dtype), scale_inv, fmt, param_dtype), (data,)

    # ---- scales -------------------------------------------------------------------------------------------
    def _weight_scale(self, mesh, module):
        """(format, scale) of the whole weight's cast, the same on every rank of the mesh."""
        if self.recipe.stateful:
            ctx = current_context()  # None in backward's gather, which casts with the forward's scale
            if ctx is not None and ctx.group is None and mesh.size() > 1:
                raise ValueError("FP8 all-gather with DelayedScaling: give fp8_autocast an fp8_group spanning the FSDP "
                                 "shard group (e.g. mesh.get_group()), so that the weights' amaxes are max-reduced "
                                 "and every rank casts its shard with the same scale")
            q = module.quantizers(self.recipe)[1]
            return q.fmt, q.slot_views()[0]
        fmt, margin = _weight_format(self.recipe)
        precomputed = _PRECOMPUTED.get(module)
        if precomputed is not None:
            scale, version = precomputed
            if module.weight._version != version:  # the same on every rank: all raise, none waits in a collective
                raise RuntimeError(f"FP8 all-gather: {type(module).__name__}({module.in_features}, "
                                   f"{module.out_features})'s weight changed since precompute_fp8_weight_scales(); "
                                   f"call it after every optimizer step (or never: each gather then all-reduces its "
                                   f"own amax)")
            return fmt, scale
        import torch.distributed as dist
        a = _amax(self.hp)
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=mesh.get_group())
        return fmt, scale_from_amax(a, fmt, margin)[0]

    def _amax_slot(self, module) -> Optional[torch.Tensor]:
        """The weight slot's amax (DelayedScaling: the shard's amax is recorded there), or None."""
        if not self.recipe.stateful:
            return None
        return module.quantizers(self.recipe)[1].slot_views()[1]


class FP8GatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 gives an FP8Linear: its FP8 values `data_fp8` [out, in] (a view of the all-gather's
    output) and `scale_inv` (float32, 0-d: weight ~ float(data_fp8) * scale_inv), reported as a `dtype` tensor (the
    parameter's dtype, which the layer's gradient takes). FP8Linear reads it through fp8_tensor(); any other op on it
    raises (its high-precision values were never gathered)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, fmt: FP8Format, dtype: torch.dtype):
        return _wrapper(cls, data, dtype)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, fmt: FP8Format, dtype: torch.dtype):
        self.data_fp8, self.scale_inv, self.fmt = data, scale_inv, fmt

    def __repr__(self) -> str:
        return f"FP8GatheredWeight({self.fmt.name}, shape={list(self.shape)}, dtype={self.dtype})"

    def fp8_tensor(self, quantizer: Quantizer) -> FP8Tensor:
        """The weight's per-tensor FP8 cast as FP8Linear's composed path takes it in place of `quantizer`'s cast
        (the layer's weight Quantizer under fp8_autocast's recipe), with the transposed copy the input gradient's
        GEMM reads (the bytes transposed: a per-tensor cast commutes with the transpose)."""
        if quantizer.granularity != TENSOR or quantizer.fmt != self.fmt:
            raise ValueError(f"FP8Linear: the weight was all-gathered in {self.fmt.name} with one scale per tensor; "
                             f"fp8_autocast's recipe casts weights to {quantizer.fmt.name} with "
                             f"{quantizer.granularity} scales: pass enable_fp8_all_gather the recipe fp8_autocast uses")
        data = self.data_fp8 if self.data_fp8.is_contiguous() else self.data_fp8.contiguous()
        return FP8Tensor(data, data.t().contiguous(), self.scale_inv, self.fmt)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        w = args[0]
        if func is torch.ops.aten.detach.default or func is torch.ops.aten.alias.default:
            return FP8GatheredWeight(w.data_fp8, w.scale_inv, w.fmt, w.dtype)
        if func is torch.ops.aten.as_strided.default:  # FSDP2 views the gathered rows as the parameter's shape
            return FP8GatheredWeight(func(w.data_fp8, *args[1:], **(kwargs or {})), w.scale_inv, w.fmt, w.dtype)
        raise NotImplementedError(f"FP8GatheredWeight: {func} is not defined on a weight all-gathered in FP8 (only "
                                  f"FP8Linear inside fp8_autocast reads it); run the layer inside fp8_autocast, or "
                                  f"shard the model without enable_fp8_all_gather")

    def __tensor_flatten__(self):
        return ["data_fp8", "scale_inv"], (self.fmt, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return FP8GatheredWeight(inner["data_fp8"], inner["scale_inv"], *spec)


# FP8Linear -> (its weight's CurrentScaling scale, float32 0-d; the version of its sharded weight Parameter then),
# set by precompute_fp8_weight_scales on every rank alike. Kept by layer, not on the shard's tensor (see
# FP8ShardedWeight); the Parameter's version moves with each in-place update (the optimizer's step) on every rank.
_PRECOMPUTED = weakref.WeakKeyDictionary()


def _weight_format(recipe):
    """(format, margin) of a weight's cast under `recipe` (the weight Quantizer's, so the two cannot differ)."""
    q = role_quantizers(recipe)[1]
    return q.fmt, q.margin
