"""How tensors cross into fp8ext._C: DLPack capsules, the caller's CUDA stream, shapes and devices.

torch tensors are exported with torch's C-level DLPack export (a fraction of a microsecond, where
`Tensor.__dlpack__` costs about 2 us of Python); other arrays (numpy, ...) are handed to C as they
are and C calls their `__dlpack__`. FP8 tensors cross as uint8, the format passed beside them.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import torch

_to_dlpack = torch._C._to_dlpack
raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (device index) -> the current stream as an int
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FLOAT_MAX = sys.float_info.max


def _exports_float8() -> bool:
    """Whether this torch exports float8 tensors over DLPack (newer releases do; C accepts those codes as FP8
    bytes and checks them against the format). Older ones raise, and FP8 crosses as a uint8 view."""
    try:
        _to_dlpack(torch.empty(1, dtype=torch.float8_e4m3fn))
        return True
    except Exception:  # noqa: BLE001 - any refusal means "view as uint8"
        return False


FP8_DLPACK = _exports_float8()


def _device_error(t: torch.Tensor, fn: str, arg: str) -> Exception:
    """The error for a tensor that cannot cross into C: a meta tensor, a sparse one, ..."""
    if t.device.type == "meta":
        return ValueError(f"{fn}(): {arg} is on meta; fp8ext runs on cpu and cuda (a meta tensor has no data)")
    if t.layout != torch.strided:
        return TypeError(f"{fn}(): {arg} must be a dense (strided) tensor, got {t.layout}")
    return ValueError(f"{fn}(): {arg} is on {t.device.type}; fp8ext runs on cpu and cuda")


def check_device(t: torch.Tensor, fn: str, arg: str) -> None:
    """A torch tensor argument that fp8ext reads itself or with torch ops: on cpu or cuda and dense. A meta
    tensor, which has no data, is refused here, naming `arg`, before anything reads its values."""
    if t.device.type not in ("cpu", "cuda") or t.layout != torch.strided:
        raise _device_error(t, fn, arg)


def _export(t: torch.Tensor, fn: Optional[str], arg: Optional[str]) -> Any:
    """torch's DLPack export; what it refuses is named (only on that path: the export itself is the check, at no
    cost to the calls that succeed): a device or layout fp8ext cannot read as _device_error says, anything else
    (a dtype DLPack has no code for, ...) as a TypeError with torch's reason."""
    try:
        return _to_dlpack(t)
    except (BufferError, RuntimeError) as e:
        if fn is None:
            raise
        if t.device.type not in ("cpu", "cuda") or t.layout != torch.strided:
            raise _device_error(t, fn, arg or "x") from None
        raise TypeError(f"{fn}(): {arg or 'x'} could not be exported through DLPack (pass a dense tensor of a "
                        f"dtype fp8ext takes): {e}") from e


def dl_fp8(t: torch.Tensor, fn: Optional[str] = None, arg: Optional[str] = None) -> Any:
    """A DLPack capsule for an FP8 torch tensor: its own float8 type where torch exports it, else uint8.
    With fn and arg, a tensor that cannot cross (a meta tensor has no data) raises naming them."""
    return _export(t if FP8_DLPACK else t.view(torch.uint8), fn, arg)


def dl(t: Any, fn: Optional[str] = None, arg: Optional[str] = None) -> Any:
    """A DLPack capsule for a torch tensor (FP8 as dl_fp8 does); anything else unchanged. With fn and arg, a
    tensor that cannot cross (a meta tensor has no data) raises a ValueError or TypeError naming them."""
    if isinstance(t, torch.Tensor):
        if t.dtype in _FP8_DTYPES:
            return dl_fp8(t, fn, arg)
        return _export(t, fn, arg)
    return t


def dl_opt(t: Any, fn: Optional[str] = None, arg: Optional[str] = None) -> Any:
    return None if t is None else dl(t, fn, arg)


def scale_arg(scale: Any, fn: Optional[str] = None, arg: str = "scale") -> Any:
    """A Python number stays a number (passed by value; C checks it); a tensor becomes a capsule (read on
    device)."""
    if isinstance(scale, torch.Tensor):
        return _export(scale, fn, arg)
    return scale


def number(value: Any, fn: str, arg: str, rule: str = "must be finite") -> float:
    """float(value) for a Python number argument (a scale, a margin), refusing what float() cannot convert with
    an error that names the argument: an int past the float range is a ValueError (`rule`), not an
    OverflowError. The int is compared before the conversion, so torch.compile traces the refusal too."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _FLOAT_MAX:
        raise ValueError(f"{fn}(): {arg} {rule}, got an int too large for a float")
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{fn}(): {arg} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}(): {arg} must be a number, got {type(value).__name__}") from None


def _is_broadcast(x: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape))


def _layout_error(fn: str, arg: str, x: Any = None) -> ValueError:
    if isinstance(x, torch.Tensor) and _is_broadcast(x):
        return ValueError(f"{fn}(): {arg} must be contiguous (row-major, compact), got a broadcast view (stride 0) "
                          f"of shape {list(x.shape)} and strides {list(x.stride())}; fp8ext neither reads one in place "
                          f"nor copies it (it can describe far more elements than it stores)")
    return ValueError(f"{fn}(): {arg} must be contiguous (row-major, compact); call .contiguous() first")


def refuse_broadcast(x: torch.Tensor, fn: str, arg: str = "x") -> None:
    """For the functions that copy a non-contiguous input before their kernel (a strided or transposed view is
    fine there): a broadcast view (stride 0 over a dimension longer than one) is refused as describe() refuses it,
    before a copy materialises every element it describes. Free for a contiguous x (one is_contiguous call)."""
    if not x.is_contiguous() and _is_broadcast(x):
        raise _layout_error(fn, arg, x)


def describe(x: Any, fn: str, arg: str = "x") -> Tuple[Tuple[int, ...], torch.device]:
    """Shape and device of a torch tensor or of any array that supports DLPack, which must be contiguous (the C
    layer reads it in place). The layout is checked here, before the caller allocates x-sized outputs: a
    broadcast view (torch's expand, numpy's broadcast_to) can describe far more elements than it stores."""
    if isinstance(x, torch.Tensor):
        check_device(x, fn, arg)
        if not x.is_contiguous():
            raise _layout_error(fn, arg, x)
        return x.shape, x.device
    dev = getattr(x, "__dlpack_device__", None)
    if dev is None or not hasattr(x, "__dlpack__"):
        raise TypeError(f"{fn}(): {arg} must be a torch.Tensor or an array that supports DLPack, "
                        f"got {type(x).__name__}")
    try:
        kind, index = dev()
    except (BufferError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise TypeError(f"{fn}(): {arg}.__dlpack_device__() failed: {e}") from e
    flags = getattr(x, "flags", None)  # numpy and the arrays that copy its interface
    if getattr(flags, "c_contiguous", True) is False:
        raise _layout_error(fn, arg)
    if int(kind) == 1:
        return tuple(x.shape), torch.device("cpu")
    if int(kind) == 2:
        return tuple(x.shape), torch.device("cuda", int(index))
    raise ValueError(f"{fn}(): {arg} is on DLPack device type {int(kind)}; fp8ext runs on cpu and cuda")


def stream_of(device: torch.device) -> int:
    """The caller's current CUDA stream on `device` as an integer (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    if raw_stream is None:
        raise RuntimeError("this torch build has no CUDA support, but a CUDA tensor was given")
    return raw_stream(device.index if device.index is not None else torch.cuda.current_device())
