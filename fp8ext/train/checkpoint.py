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

import errno
import pathlib
import pickle
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .._io import atomic_write

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
        try:
            with atomic_write(path, "wb", tmp_name=_TMP_NAME) as f:
                torch.save(state, f)
        except (OSError, RuntimeError) as e:  # a full disk: torch.save says "unexpected pos", the OS ENOSPC
            kept = (f"{path} is the last complete checkpoint, unchanged" if path.is_file()
                    else "no checkpoint was written")
            raise OSError(f"could not write the checkpoint {path} (is the disk full?): writing "
                          f"{path.with_name(_TMP_NAME)} failed: {' '.join(str(e).split()) or type(e).__name__}; "
                          f"{kept}") from e
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


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _arg_problem(action, value) -> Optional[str]:
    """What is wrong with `value` as the checkpoint's record of the command-line option `action`, or None."""
    import argparse
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return None if isinstance(value, bool) else "expected true or false"
    if action.choices is not None:
        if value is None and action.default is None:  # an option with choices that was not given
            return None
        return None if isinstance(value, str) and value in action.choices else \
            f"expected one of {', '.join(map(str, action.choices))}"
    if action.type is None:  # a path or a device name, or none
        return None if value is None or isinstance(value, str) else "expected a string or None"
    numbers = (int, float) if isinstance(action.default, float) else int  # --lr, --weight_decay: numbers
    if isinstance(value, bool) or not isinstance(value, numbers):
        return f"expected {'an integer' if numbers is int else 'a number'}, got a {type(value).__name__}"
    try:
        action.type(repr(value))  # the option's own range (>= 1, finite, ...)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        return str(e)
    return None


def _check_state(p: pathlib.Path, state: Dict[str, Any], option: str) -> None:
    """The step and the arguments a checkpoint records, of the types and in the ranges fp8ext.train writes."""
    step = state["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{option}: {p} is not a usable fp8ext.train checkpoint: its step is {_short(step)}, "
                              "not an integer >= 0")
    args = state["args"]
    if not isinstance(args, dict):
        raise CheckpointError(f"{option}: {p} is not a usable fp8ext.train checkpoint: its args are a "
                              f"{type(args).__name__}, not the dict of the training run's options")
    from .options import parser
    for action in parser()._actions:
        if action.dest in args and action.dest not in ("help", "debug"):
            problem = _arg_problem(action, args[action.dest])
            if problem:
                raise CheckpointError(f"{option}: {p} is not a usable fp8ext.train checkpoint: its "
                                      f"args[{action.dest!r}] is {_short(args[action.dest])} ({problem})")


def read(path: str, option: str = "--resume") -> Tuple[pathlib.Path, Dict[str, Any]]:
    """(file, state) of the checkpoint that save() wrote at `path` (a run directory or the file itself), loaded
    on the CPU without running any code from the file. `option` names where the path came from, for errors.

    Raises FileNotFoundError when there is no checkpoint at `path`, and CheckpointError when the file is empty,
    truncated or not a torch file, holds anything but tensors and plain data, is not a dict with the keys save()
    writes, or records a step or an option of the wrong type or out of range."""
    p = pathlib.Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.is_file():
        raise FileNotFoundError(f"{option}: no checkpoint at {p}")
    if p.stat().st_size == 0:
        raise CheckpointError(f"{option}: {p} is empty, not a checkpoint (a copy or a save that did not finish?)")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{option}: {p} is not a checkpoint fp8ext can load safely: torch's weights-only loader refused it "
            f"({_refusal(str(e))}). fp8ext.train writes only tensors, numbers, strings and containers of them; "
            "anything else could run code while the file is read, so it was not read") from e
    except OSError as e:
        if e.errno != errno.EINVAL:  # the file could not be read (permissions, I/O): said as it is
            raise
        raise CheckpointError(f"{option}: {p} cannot be read as a checkpoint: it is truncated or damaged (torch's zip "
                              f"reader: {e.strerror or e})") from e
    except Exception as e:  # noqa: BLE001 - torch.load on a damaged file raises EOFError, RuntimeError, KeyError...
        said = " ".join(str(e).split()).split(". ")[0]
        raise CheckpointError(f"{option}: {p} cannot be read as a checkpoint: it is truncated, damaged or not a file "
                              f"torch.save wrote ({type(e).__name__}{': ' + said if said else ''})") from e
    missing = [k for k in _KEYS if k not in state] if isinstance(state, dict) else list(_KEYS)
    if missing:
        what = f"a dict without {', '.join(missing)}" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise CheckpointError(f"{option}: {p} is not an fp8ext.train checkpoint: it holds {what}, not the dict of "
                              f"{', '.join(_KEYS)} that fp8ext.train writes")
    _check_state(p, state, option)
    return p, state


def load(path: str, model, optimizer, max_steps: Optional[int] = None,
         run_args: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Loads a checkpoint written by save() into model and optimizer; returns the rest (step, args, rng, ...).
    With max_steps, a checkpoint past it is refused (its run has more steps than this one); with run_args (the
    resuming run's options), one of another model (--preset, --separate_qkv) is refused by name."""
    p, state = read(path, "--resume")
    if max_steps is not None and state["step"] > max_steps:
        raise CheckpointError(f"--resume: {p} is at step {state['step']}, past --max_steps {max_steps}; continue it "
                              f"with --max_steps {state['step']} or more")
    def given(key, v):
        return (f"--{key}" if v else f"no --{key}") if isinstance(v, bool) else f"--{key} {v}"
    for key in ("preset", "separate_qkv"):
        if run_args is not None and key in state["args"] and key in run_args and state["args"][key] != run_args[key]:
            raise CheckpointError(f"--resume: {p} holds a model trained with {given(key, state['args'][key])}; this "
                                  f"run has {given(key, run_args[key])}: another model")
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    try:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(full_state_dict=True))
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"][:torch.cuda.device_count()])
    except (RuntimeError, KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        said = " ".join(str(e).split())
        raise CheckpointError(f"--resume: {p} does not fit this run's model and optimizer (another --preset or "
                              f"--separate_qkv?): {type(e).__name__}: {said[:300]}") from e
    return state
