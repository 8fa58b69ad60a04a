"""How tensors cross into fp8ext._C: DLPack capsules, the caller's CUDA stream, shapes and devices.

torch tensors are exported with torch's C-level DLPack export (a fraction of a microsecond, where
`Tensor.__dlpack__` costs about 2 us of Python); other arrays (numpy, ...) are handed to C as they
are and C calls their `__dlpack__`. FP8 tensors cross as uint8, the format passed beside them.
"""

from __future__ import annotations

from typing import Any, Tuple

import torch

_to_dlpack = torch._C._to_dlpack
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _exports_float8() -> bool:
    """Whether this torch exports float8 tensors over DLPack (newer releases do; C accepts those codes as FP8
    bytes and checks them against the format). Older ones raise, and FP8 crosses as a uint8 view."""
    try:
        _to_dlpack(torch.empty(1, dtype=torch.float8_e4m3fn))
        return True
    except Exception:  # noqa: BLE001 - any refusal means "view as uint8"
        return False


FP8_DLPACK = _exports_float8()


def dl_fp8(t: torch.Tensor) -> Any:
    """A DLPack capsule for an FP8 torch tensor: its own float8 type where torch exports it, else uint8."""
    return _to_dlpack(t if FP8_DLPACK else t.view(torch.uint8))


def dl(t: Any) -> Any:
    """A DLPack capsule for a torch tensor (FP8 as dl_fp8 does); anything else unchanged."""
    if isinstance(t, torch.Tensor):
        if t.dtype in _FP8_DTYPES:
            return dl_fp8(t)
        return _to_dlpack(t)
    return t


def dl_opt(t: Any) -> Any:
    return None if t is None else dl(t)


def scale_arg(scale: Any) -> Any:
    """A Python number stays a number (passed by value); a tensor becomes a capsule (read on device)."""
    if isinstance(scale, torch.Tensor):
        return _to_dlpack(scale)
    return scale


def describe(x: Any, fn: str, arg: str = "x") -> Tuple[Tuple[int, ...], torch.device]:
    """Shape and device of a torch tensor or of any array that supports DLPack."""
    if isinstance(x, torch.Tensor):
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{fn}(): {arg} is on {x.device.type}; fp8ext runs on cpu and cuda")
        return x.shape, x.device
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None or not hasattr(x, "__dlpack__"):
        raise TypeError(f"{fn}(): {arg} must be a torch.Tensor or an array that supports DLPack, "
                        f"got {type(x).__name__}")
    kind, index = dev()
    if int(kind) == 1:
        return tuple(x.shape), torch.device("cpu")
    if int(kind) == 2:
        return tuple(x.shape), torch.device("cuda", int(index))
    raise ValueError(f"{fn}(): {arg} is on DLPack device type {int(kind)}; fp8ext runs on cpu and cuda")


def stream_of(device: torch.device) -> int:
    """The caller's current CUDA stream on `device` as an integer (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    if _raw_stream is None:
        raise RuntimeError("this torch build has no CUDA support, but a CUDA tensor was given")
    return _raw_stream(device.index if device.index is not None else torch.cuda.current_device())
