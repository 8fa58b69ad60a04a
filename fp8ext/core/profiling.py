"""Profiler ranges for fp8ext's ops and layers, off by default.

With `fp8ext.set_profiling(True)` (or FP8EXT_PROFILE=1 in the environment) every call of quantize,
dequantize, amax, cast_transpose, quantize_rowwise, quantize_blockwise, gemm and FP8Linear.forward runs inside
a range named after it ("fp8ext.quantize", "fp8ext.gemm", "FP8Linear.forward", ...): a
torch.profiler.record_function, so it appears in torch.profiler traces (Chrome trace JSON included), and on a
CUDA device also an NVTX range, so `nsys profile --trace=cuda,nvtx` shows it. Off, a call pays one check of a
module flag. Under torch.compile no ranges are added (the compiled graph has its own).
"""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

__all__ = ["set_profiling", "profiling_enabled", "profiled"]

ranges_on = os.environ.get("FP8EXT_PROFILE", "0") not in ("", "0")
F = TypeVar("F", bound=Callable)


def set_profiling(enabled: bool) -> None:
    """Turns fp8ext's profiler and NVTX ranges on or off for the whole process."""
    global ranges_on
    ranges_on = bool(enabled)


def profiling_enabled() -> bool:
    return ranges_on


def profiled(name: str) -> Callable[[F], F]:
    """Decorator: runs the function inside a range called `name` while profiling is on."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if not ranges_on or torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            nvtx = torch.cuda.is_available()
            with torch.profiler.record_function(name):
                if nvtx:
                    torch.cuda.nvtx.range_push(name)
                try:
                    return fn(*args, **kwargs)
                finally:
                    if nvtx:
                        torch.cuda.nvtx.range_pop()
        return inner  # type: ignore[return-value]
    return wrap
