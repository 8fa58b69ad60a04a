"""Debug checks: values that fp8ext cannot check without synchronising with the GPU.

A scale given as a Python number or a CPU tensor is always checked (NaN, 0, negative and Inf raise). A
scale or scale_inv that lives on a CUDA device is read by the kernels where it lives, without a host
synchronisation, so a bad one (say, the NaN scale of a step that overflowed) silently gives NaN or
saturated output. With debug checks on (`fp8ext.set_debug_checks(True)`, or FP8EXT_DEBUG=1 in the
environment), quantize, cast_transpose, gemm and FP8Linear read their device scales and scale_invs and
their inputs back to the host before they run and raise ValueError naming the function and the argument
for a non-finite or non-positive scale and for NaN or Inf in the input. This synchronises on every call:
use it to find where a bad value enters, not in production runs.
"""

from __future__ import annotations

import os

import torch

__all__ = ["set_debug_checks", "debug_checks_enabled"]

checks_on = os.environ.get("FP8EXT_DEBUG", "0") not in ("", "0")


def set_debug_checks(enabled: bool) -> None:
    """Turns the debug checks (see this module's docstring) on or off for the whole process."""
    global checks_on
    checks_on = bool(enabled)


def debug_checks_enabled() -> bool:
    return checks_on


def enabled() -> bool:
    """True when the checks are on and can run (not while torch.compile traces or a CUDA graph captures)."""
    if not checks_on or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_finite(x, fn: str, arg: str) -> None:
    """Raises ValueError when the tensor x holds NaN or Inf."""
    if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.is_meta:
        return
    bad = ~torch.isfinite(x.detach())
    if bool(bad.any()):
        nan = int(torch.isnan(x.detach()).sum())
        raise ValueError(f"{fn}(): {arg} holds {nan} NaN and {int(bad.sum()) - nan} Inf values (debug checks are on)")


def check_scale(s, fn: str, arg: str) -> None:
    """Raises ValueError when a scale or scale_inv tensor holds a value that is not finite and positive."""
    if not isinstance(s, torch.Tensor) or s.numel() == 0 or s.is_meta:
        return
    v = s.detach().float()
    bad = ~(torch.isfinite(v) & (v > 0))
    if bool(bad.any()):
        first = v.reshape(-1)[bad.reshape(-1)][0].item()
        raise ValueError(f"{fn}(): {arg} must be finite and positive, got {first} (in {int(bad.sum())} of "
                         f"{v.numel()} values; debug checks are on)")
