"""Training checkpoints: model (FP8 scaling state included, in each FP8 layer's extra state), optimizer, step,
RNG state and the run's arguments, in one file written atomically (a crash never leaves half a checkpoint).

FP8 and bf16 runs save the same model state dict (their linear layers are the same modules), so a bf16 run
resumes from an FP8 checkpoint and the other way round. With FSDP2 the full (unsharded) state is gathered to
rank 0 for saving and broadcast from it on loading, so a checkpoint does not depend on the number of GPUs.

A checkpoint holds only tensors, numbers, strings, None and lists, tuples and dicts of them, so read() loads
it with torch's weights-only unpickler: a file that holds anything else (which could run code while it is
unpickled) is refused, not loaded.
"""

from __future__ import annotations

import os
import pathlib
import pickle
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["save", "load", "read", "remove_stale_tmp", "CheckpointError", "CHECKPOINT_NAME"]

CHECKPOINT_NAME = "checkpoint.pt"
_TMP_NAME = "checkpoint.tmp"  # save() writes here first, then renames it to CHECKPOINT_NAME
_KEYS = ("model", "optimizer", "step", "args", "rng")  # what save() writes (and read() requires)


class CheckpointError(ValueError):
    """A file that is not a checkpoint fp8ext can load safely; the message names the file and what was wrong."""


def _state_dicts(model, optimizer):
    """Model and optimizer state in one layout for plain, DDP-unwrapped and FSDP2 models alike: full tensors on
    the CPU, optimizer state keyed by parameter name, so a checkpoint resumes under any of them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _fsync_dir(directory: pathlib.Path) -> None:
    """Makes a rename in `directory` durable. POSIX only: Windows cannot open a directory, and some file
    systems refuse fsync on one (EINVAL); the rename itself has happened either way."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(out_dir: str, model, optimizer, step: int, args: Dict[str, Any], extra: Optional[dict] = None) -> str:
    """Writes out_dir/checkpoint.pt (every rank must call it under FSDP2; rank 0 writes): into checkpoint.tmp,
    flushed to the disk, then renamed over checkpoint.pt, so that a crash or power loss at any point leaves the
    previous checkpoint or the new one, never a truncated file under the checkpoint's name."""
    model_sd, optim_sd = _state_dicts(model, optimizer)
    path = pathlib.Path(out_dir) / CHECKPOINT_NAME
    if not dist.is_initialized() or dist.get_rank() == 0:
        state = {"model": model_sd, "optimizer": optim_sd, "step": step, "args": args,
                 "rng": {"torch": torch.get_rng_state(),
                         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                 **(extra or {})}
        tmp = path.with_name(_TMP_NAME)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    if dist.is_initialized():
        dist.barrier()
    return str(path)


def remove_stale_tmp(out_dir: str) -> None:
    """Removes the checkpoint.tmp that a run killed while saving leaves in out_dir, with a note saying so."""
    tmp = pathlib.Path(out_dir) / _TMP_NAME
    if tmp.is_file():
        tmp.unlink()
        print(f"fp8ext.train: removed {tmp}, a checkpoint that an earlier run did not finish writing "
              f"({CHECKPOINT_NAME}, if there is one, is the last complete checkpoint)")


def _refusal(message: str) -> str:
    """What torch's weights-only unpickler refused, without its advice on loading the file unsafely."""
    said = message.split("WeightsUnpickler error:", 1)[-1]
    said = said.split("Please use `torch.serialization", 1)[0].split("Check the documentation of torch.load", 1)[0]
    return " ".join(said.split()).rstrip(".")


def read(path: str, option: str = "--resume") -> Tuple[pathlib.Path, Dict[str, Any]]:
    """(file, state) of the checkpoint that save() wrote at `path` (a run directory or the file itself), loaded
    on the CPU without running any code from the file. `option` names where the path came from, for errors.

    Raises FileNotFoundError when there is no checkpoint at `path`, and CheckpointError when the file holds
    anything but tensors and plain data, or is not a dict with the keys save() writes."""
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.is_file():
        raise FileNotFoundError(f"{option}: no checkpoint at {p}")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{option}: {p} is not a checkpoint fp8ext can load safely: torch's weights-only loader refused it "
            f"({_refusal(str(e))}). fp8ext.train writes only tensors, numbers, strings and containers of them; "
            "anything else could run code while the file is read, so it was not read") from e
    missing = [k for k in _KEYS if k not in state] if isinstance(state, dict) else list(_KEYS)
    if missing:
        what = f"a dict without {', '.join(missing)}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise CheckpointError(f"{option}: {p} is not an fp8ext.train checkpoint: it holds {what}, not the dict of "
                              f"{', '.join(_KEYS)} that fp8ext.train writes")
    return p, state


def load(path: str, model, optimizer) -> Dict[str, Any]:
    """Loads a checkpoint written by save() into model and optimizer; returns the rest (step, args, rng, ...)."""
    _, state = read(path, "--resume")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(full_state_dict=True))
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"][:torch.cuda.device_count()])
    return state
