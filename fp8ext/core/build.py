"""What this fp8ext is: its version and how fp8ext._C was built (fp8ext.__version__, fp8ext.build_info,
fp8ext.cuda_available are these)."""

from __future__ import annotations

from .. import _C

__all__ = ["VERSION", "build_info", "cuda_available"]

VERSION = "0.1.0"


def cuda_available() -> bool:
    """True when this build of fp8ext has its CUDA kernels and a CUDA device is visible."""
    return bool(_C.WITH_CUDA) and _C.cuda_device_count() > 0


def build_info() -> dict:
    """How fp8ext._C was built: {'cuda': bool, 'cuda_archs': '90a', versions, 'no_cuda_reason': ...}."""
    return dict(_C.build_info())
