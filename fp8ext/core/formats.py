"""FP8 formats.

`E4M3` and `E5M2` describe the two OCP FP8 tensor formats; every number in them is read from the
C core (`fp8ext._C.formats()`), which is the one place fp8ext defines FP8. `Format` is Transformer
Engine's recipe enum: which tensor format the forward pass (weights, activations) and the backward
pass (gradients) use.
"""

from __future__ import annotations

import enum
from collections import namedtuple
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import _C

__all__ = ["FP8Format", "E4M3", "E5M2", "Format", "resolve_format", "SmallFormat", "E2M1", "E2M3", "E3M2", "E8M0",
           "E4M3FNUZ", "E5M2FNUZ", "SMALL_FORMATS"]


@dataclass(frozen=True)
class _Format:
    """The constants every format has, as the C core defines them."""

    name: str
    code: int
    exp_bits: int
    mant_bits: int
    bias: int
    max: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    nan_code: Optional[int]
    inf_code: Optional[int]
    max_code: int
    overflow_code: int

    def __repr__(self) -> str:
        return f"fp8ext.{self.name}"


@dataclass(frozen=True, repr=False)
class FP8Format(_Format):
    """One FP8 tensor format.

    Attributes: exp_bits, mant_bits, bias; max (largest finite value), min_normal, min_subnormal;
    has_inf; the byte encodings nan_code (positive NaN; the sign bit is added for negative NaN),
    inf_code (None for E4M3, which has no Inf), max_code (the largest finite value) and
    overflow_code (what a non-saturating cast produces on overflow: NaN for E4M3, Inf for E5M2);
    code (the C core's format number) and torch_dtype (torch.float8_e4m3fn / torch.float8_e5m2).
    """

    torch_dtype: torch.dtype


_TABLE = _C.formats()
E4M3 = FP8Format(**_TABLE["E4M3"], torch_dtype=torch.float8_e4m3fn)
E5M2 = FP8Format(**_TABLE["E5M2"], torch_dtype=torch.float8_e5m2)
_BY_CODE = {E4M3.code: E4M3, E5M2.code: E5M2}

_FormatHelper = namedtuple("_FormatHelper", ["max_fwd", "max_bwd"])
_E4M3, _E5M2 = E4M3, E5M2  # the enum's body below shadows the names


class Format(enum.Enum):
    """Transformer Engine's FP8 recipe format: E4M3 everywhere, E5M2 everywhere, or HYBRID
    (E4M3 for weights and activations in the forward pass, E5M2 for gradients in the backward
    pass). `Format.HYBRID.value.max_fwd` is 448.0 as in TE; `.fwd` and `.bwd` give the formats."""

    E4M3 = _FormatHelper(max_fwd=_E4M3.max, max_bwd=_E4M3.max)
    E5M2 = _FormatHelper(max_fwd=_E5M2.max, max_bwd=_E5M2.max)
    HYBRID = _FormatHelper(max_fwd=_E4M3.max, max_bwd=_E5M2.max)

    @property
    def fwd(self) -> FP8Format:
        """The format of forward-pass tensors (weights, activations)."""
        return _E5M2 if self is Format.E5M2 else _E4M3

    @property
    def bwd(self) -> FP8Format:
        """The format of backward-pass tensors (gradients)."""
        return _E4M3 if self is Format.E4M3 else _E5M2


@dataclass(frozen=True, repr=False)
class SmallFormat(_Format):
    """A format that fp8ext.quantize / dequantize take (CPU and GPU), one code per uint8 byte: the OCP MX element
    formats E2M1 (FP4, max 6), E2M3 and E3M2 (FP6, max 7.5 and 28), which have no Inf or NaN and saturate;
    E8M0 (the MX block scale: powers of two 2^-127 .. 2^127, 0xFF NaN); and AMD MI300's FP8 variants
    E4M3FNUZ (max 240) and E5M2FNUZ (max 57344), with 0x80 their only NaN and no negative zero.

    Attributes as FP8Format's, plus `bits` (the code's width); nan_code is None for formats without NaN.
    Constants are read from the C core, as E4M3's and E5M2's are.
    """

    bits: int
    torch_dtype: torch.dtype = torch.uint8


E2M1, E2M3, E3M2, E8M0, E4M3FNUZ, E5M2FNUZ = (SmallFormat(name=n, **_TABLE[n]) for n in
                                              ("E2M1", "E2M3", "E3M2", "E8M0", "E4M3FNUZ", "E5M2FNUZ"))
SMALL_FORMATS = (E2M1, E2M3, E3M2, E8M0, E4M3FNUZ, E5M2FNUZ)

_BY_NAME = {"e4m3": E4M3, "e4m3fn": E4M3, "e5m2": E5M2}
_BY_DTYPE = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}


def resolve_format(fmt: Any, fn: str = "fp8ext", arg: str = "fmt") -> FP8Format:
    """fp8ext.E4M3/E5M2, Format.E4M3/E5M2, "e4m3"/"e5m2", or the torch float8 dtype -> FP8Format."""
    if isinstance(fmt, FP8Format):
        return fmt
    if isinstance(fmt, Format):
        if fmt is Format.HYBRID:
            raise ValueError(f"{fn}(): {arg}=Format.HYBRID names a recipe (E4M3 forward, E5M2 backward), "
                             "not a tensor format; pass fp8ext.E4M3 or fp8ext.E5M2")
        return fmt.fwd
    if isinstance(fmt, str) and fmt.lower() in _BY_NAME:
        return _BY_NAME[fmt.lower()]
    if isinstance(fmt, torch.dtype) and fmt in _BY_DTYPE:
        return _BY_DTYPE[fmt]
    raise TypeError(f"{fn}(): {arg} must be fp8ext.E4M3 or fp8ext.E5M2 (or 'e4m3'/'e5m2', a Format member, "
                    f"torch.float8_e4m3fn/float8_e5m2), got {fmt!r}")


def format_of_dtype(dtype: torch.dtype) -> Optional[FP8Format]:
    return _BY_DTYPE.get(dtype)


def format_of_code(code: int) -> FP8Format:
    return _BY_CODE[code]
