"""The weight formats of fp8ext.adaptive (fp8ext/lowp/adaptive.py): their names, their bytes for a weight of a given
shape (the table in adaptive's docstring), where they apply, and a weight stored in one and read back
(fake_quantize_weight)."""

from __future__ import annotations

from typing import Dict, Iterable, Sequence, Tuple

import torch

from ..core.formats import E2M1, E3M2, E2M3, E4M3
from ..ops.mx import dequantize_mx, dequantize_nvfp4, quantize_mx, quantize_nvfp4
from ..ops import dequantize, quantize

__all__ = ["WEIGHT_FORMATS", "BITS_PER_WEIGHT", "DEFAULT_FORMATS", "fake_quantize_weight", "weight_bytes",
           "format_applies"]

# nominal bits per weight (the per-row and per-tensor float32 scales come on top, see weight_bytes)
BITS_PER_WEIGHT: Dict[str, float] = {
    "bf16": 16.0, "fp8": 8.0, "fp8_tensor": 8.0, "mxfp8": 8.25, "mxfp6": 6.25, "mxfp6_e2m3": 6.25,
    "fp6_tensor": 6.0, "mxfp4": 4.25, "nvfp4": 4.5, "fp4_tensor": 4.0,
}
WEIGHT_FORMATS: Tuple[str, ...] = tuple(BITS_PER_WEIGHT)
DEFAULT_FORMATS: Tuple[str, ...] = ("mxfp4", "mxfp6", "fp8", "bf16")
_BLOCK = {"mxfp8": 32, "mxfp6": 32, "mxfp6_e2m3": 32, "mxfp4": 32, "nvfp4": 16}
_MX_ELEM = {"mxfp8": E4M3, "mxfp6": E3M2, "mxfp6_e2m3": E2M3, "mxfp4": E2M1}
_TENSOR_ELEM = {"fp8_tensor": E4M3, "fp6_tensor": E3M2, "fp4_tensor": E2M1}


def _check_fmt(fmt, fn: str, arg: str = "fmt") -> str:
    if not isinstance(fmt, str) or fmt not in BITS_PER_WEIGHT:
        raise ValueError(f"{fn}(): {arg} must be one of {list(WEIGHT_FORMATS)}, got {fmt!r}")
    return fmt


def _check_shape(shape, fn: str) -> Tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{fn}(): a weight must be 2-D [out_features, in_features] and non-empty, got shape "
                         f"{list(shape)}")
    return shape


def format_applies(shape: Sequence[int], fmt: str) -> bool:
    """Whether `fmt` can store a weight of this shape: MX formats need in_features % 32 == 0, NVFP4 % 16."""
    n, k = _check_shape(shape, "format_applies")
    return k % _BLOCK.get(_check_fmt(fmt, "format_applies"), 1) == 0


def weight_bytes(shape: Sequence[int], fmt: str) -> int:
    """Bytes of an [N, K] weight stored in `fmt`, its scales included (the table in fp8ext.adaptive's docstring)."""
    fn = "weight_bytes"
    n, k = _check_shape(shape, fn)
    _check_fmt(fmt, fn)
    if not format_applies((n, k), fmt):
        raise ValueError(f"{fn}(): {fmt} needs in_features to be a multiple of {_BLOCK[fmt]}, got shape {[n, k]}")
    nk = n * k
    return {
        "bf16": 2 * nk,
        "fp8": nk + 4 * n,
        "fp8_tensor": nk + 4,
        "mxfp8": nk + nk // 32,
        "mxfp6": 3 * nk // 4 + nk // 32,
        "mxfp6_e2m3": 3 * nk // 4 + nk // 32,
        "fp6_tensor": -(-3 * nk // 4) + 4,
        "mxfp4": nk // 2 + nk // 32,
        "nvfp4": nk // 2 + nk // 16 + 4,
        "fp4_tensor": -(-nk // 2) + 4,
    }[fmt]


@torch.no_grad()
def fake_quantize_weight(w: torch.Tensor, fmt: str, *, scale_rule: str = "floor") -> torch.Tensor:
    """The weight `w` [N, K] stored in `fmt` and read back: quantized, then dequantized to float32 (w's shape
    and device). Formats (see fp8ext.adaptive's docstring): "bf16" (w rounded to bfloat16), "fp8" (E4M3, scale
    448 / amax per output row, as fp8ext.quantize_rowwise), "fp8_tensor" / "fp6_tensor" / "fp4_tensor"
    (E4M3 / E3M2 / E2M1 with one float32 scale max / amax), "mxfp8" / "mxfp6" / "mxfp6_e2m3" / "mxfp4"
    (fp8ext.quantize_mx with E4M3 / E3M2 / E2M3 / E2M1, blocks of 32 along K, `scale_rule` "floor" or
    "rceil") and "nvfp4" (fp8ext.quantize_nvfp4). Rounding is fp8ext's (round to nearest even, saturating).
    The block formats run on the CPU; a CUDA weight is copied there and the result copied back."""
    fn = "fake_quantize_weight"
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}(): w must be a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    _check_fmt(fmt, fn)
    _check_shape(w.shape, fn)
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"{fn}(): scale_rule must be 'floor' or 'rceil', got {scale_rule!r}")
    if not format_applies(w.shape, fmt):
        raise ValueError(f"{fn}(): {fmt} needs in_features (w.shape[1]) to be a multiple of {_BLOCK[fmt]}, got "
                         f"shape {list(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{fn}(): w holds NaN or Inf")
    device = w.device
    x = w.detach().float().cpu().contiguous()
    if fmt == "bf16":
        out = x.to(torch.bfloat16).float()
    elif fmt == "fp8":
        amax = x.abs().amax(dim=1)
        scale = torch.where(amax > 0, torch.tensor(E4M3.max, dtype=torch.float32) / amax, torch.ones_like(amax))
        q = quantize((x * scale[:, None]).contiguous(), E4M3, 1.0)  # the product in float32, then E4M3
        out = dequantize(q, 1.0, torch.float32) * (1.0 / scale)[:, None]
    elif fmt in _TENSOR_ELEM:
        f = _TENSOR_ELEM[fmt]
        amax = x.abs().amax()
        scale = (torch.tensor(f.max, dtype=torch.float32) / amax if amax > 0
                 else torch.ones((), dtype=torch.float32)).reshape(1)
        q = quantize(x, f, scale)
        out = dequantize(q, 1.0 / scale, torch.float32, fmt=None if f is E4M3 else f)
    elif fmt in _MX_ELEM:
        f = _MX_ELEM[fmt]
        out = dequantize_mx(*quantize_mx(x, f, 32, scale_rule), f, 32)
    else:  # nvfp4
        out = dequantize_nvfp4(*quantize_nvfp4(x))
    return out.to(device)


def _check_formats(formats, fn: str) -> Tuple[str, ...]:
    if isinstance(formats, str) or not isinstance(formats, Iterable):
        raise TypeError(f"{fn}(): formats must be a sequence of format names, got {formats!r}")
    formats = tuple(formats)
    if not formats:
        raise ValueError(f"{fn}(): formats is empty")
    for f in formats:
        _check_fmt(f, fn, "formats")
    if len(set(formats)) != len(formats):
        raise ValueError(f"{fn}(): formats has repeats: {list(formats)}")
    return formats
