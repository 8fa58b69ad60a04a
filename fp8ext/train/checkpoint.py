"""Training checkpoints: model (FP8 scaling state included, in each FP8 layer's extra state), optimizer, step,
RNG state and the run's arguments, in one file written atomically (a crash never leaves half a checkpoint).

FP8 and bf16 runs save the same model state dict (their linear layers are the same modules), so a bf16 run
resumes from an FP8 checkpoint and the other way round. With FSDP2 the full (unsharded) state is gathered to
rank 0 for saving and broadcast from it on loading, so a checkpoint does not depend on the number of GPUs.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

__all__ = ["save", "load", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"


def _state_dicts(model, optimizer):
    """Model and optimizer state in one layout for plain, DDP-unwrapped and FSDP2 models alike: full tensors on
    the CPU, optimizer state keyed by parameter name, so a checkpoint resumes under any of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save(out_dir: str, model, optimizer, step: int, args: Dict[str, Any], extra: Optional[dict] = None) -> str:
    """Writes out_dir/checkpoint.pt (every rank must call it under FSDP2; rank 0 writes)."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    path = pathlib.Path(out_dir) / CHECKPOINT_NAME
    if not dist.is_initialized() or dist.get_rank() == 0:
        state = {"model": model_sd, "optimizer": optim_sd, "step": step, "args": args,
                 "rng": {"torch": torch.get_rng_state(),
                         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                 **(extra or {})}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return str(path)


def load(path: str, model, optimizer) -> Dict[str, Any]:
    """Loads a checkpoint written by save() into model and optimizer; returns the rest (step, args, rng, ...)."""
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {p}")
    state = torch.load(p, map_location="cpu", weights_only=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"][:torch.cuda.device_count()])
    return state
