"""How fp8ext.train spreads and checkpoints the model: DDP or FSDP2 over several processes (FSDP2 with FP8
all-gather: --fp8_all_gather), and activation checkpointing of the transformer blocks (--activation_checkpointing).
The training loop that uses them is fp8ext/train/trainer.py."""

from __future__ import annotations

import functools
import gc
from argparse import Namespace

import torch

from ..models.transformer import Transformer, TransformerBlock
from ..modules.fsdp import precompute_fp8_weight_scales

__all__ = ["wrap", "release_meshes", "checkpoint_blocks", "checkpointed_blocks", "check_fp8_all_gather",
           "precompute_fp8_scales"]


# The device meshes this process built for FSDP2, released at teardown (see release_meshes)
_MESHES: list = []


def release_meshes(drop_groups: bool) -> None:
    """Drops the process groups held by the device meshes FSDP2 trained with, once destroy_process_group ran.
    DTensor's global sharding caches keep a mesh alive after training, and the mesh keeps its process group: a
    gloo group's worker threads then outlive destroy_process_group, and the group is destroyed during interpreter
    exit, which can abort the process ("terminate called without an active exception"). Releasing it here lets
    the group shut its threads down while the interpreter is alive."""
    while _MESHES:
        registry = getattr(_MESHES.pop(), "_pg_registry", None)
        if drop_groups and isinstance(registry, dict):
            registry.clear()
    if drop_groups:
        gc.collect()


def wrap(model, args, device, world):
    if world > 1 and args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (world,))  # the training device's, not the machine's default (--device cpu)
        _MESHES.append(mesh)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return torch.compile(model) if args.compile else model


# The ops whose outputs --activation_checkpointing selective keeps (the rest of a block is recomputed in the
# backward): the matrix products and attention, which cost O(d_model) or O(seq_len) FLOPs per output element to
# recompute, where the norms, RoPE and SwiGLU cost a few. Torch's dispatcher must see an op for it to be kept:
# fp8ext's torch ops (torch.compile) and the CPU's emulated FP8 products (aten::mm) are; the C calls of the eager
# fast path on a GPU (ONE_CALL, fp8ext/modules/linear_autograd.py) are not, so those layers are recomputed.
_SAVED_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "fp8ext::gemm", "fp8ext::linear_fwd",
              "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
              "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu")


def _saved_ops() -> list:
    """The default overloads of the _SAVED_OPS that this torch (and fp8ext, once its modules are imported) has."""
    packets = (getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1], None) for name in _SAVED_OPS)
    return [p.default for p in packets if p is not None and "default" in p.overloads()]


def checkpoint_blocks(model: Transformer, mode: str) -> None:
    """Wraps each of model.blocks, in place, in torch's checkpoint_wrapper (non-reentrant torch.utils.checkpoint;
    mode "selective" with a selective-checkpointing context that keeps _SAVED_OPS's outputs). Called before DDP,
    FSDP2 and torch.compile wrap the model, as torch's FSDP2 recipes do. The state dict keeps its keys (the
    wrapper's prefix is dropped on saving and restored on loading)."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)
    kw = {}
    if mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts  # torch >= 2.4
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _saved_ops())
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kw)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: isinstance(m, TransformerBlock))


def checkpointed_blocks(model: Transformer) -> int:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    return sum(isinstance(b, CheckpointWrapper) for b in model.blocks)


def check_fp8_all_gather(args: Namespace) -> None:
    if not (args.fsdp and args.use_fp8) or args.fp8_recipe not in ("delayed", "current"):
        raise SystemExit("fp8ext-train: --fp8_all_gather needs --fsdp and --use_fp8 with --fp8_recipe delayed or "
                         f"current (one scale per weight), got fsdp={args.fsdp}, use_fp8={args.use_fp8}, "
                         f"fp8_recipe={args.fp8_recipe}")


def precompute_fp8_scales(model, args: Namespace, world: int) -> None:
    """--fp8_all_gather with current scaling: every weight's scale for the next gathers, from one all-reduce (after
    each change of the weights: the optimizer's step, loading a checkpoint)."""
    if args.fp8_all_gather and world > 1 and args.fp8_recipe == "current":
        precompute_fp8_weight_scales(model)
