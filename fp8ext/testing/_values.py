"""What fp8ext.testing knows about FP8 values: the 256 codes of a format decoded by fp8ext's C core,
the format's spacing at a value, conversions of test arguments, and the failure report.

No FP8 rounding is defined here: values come from the C core's decoder (fp8ext.dequantize), and the
spacing is the format's arithmetic (exponent and mantissa widths), not a cast.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence, Tuple

import numpy as np
import torch

from ..core.formats import FP8Format, format_of_dtype, resolve_format
from ..ops import dequantize

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@lru_cache(maxsize=None)
def value_table(fmt: FP8Format) -> torch.Tensor:
    """float64 value of each of the 256 codes (NaN codes NaN, E5M2's Inf codes +-inf), decoded by the C
    core; exact, as every FP8 value is a float32 value. Shared and cached: never modify it."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return dequantize(codes, 1.0, torch.float32, fmt=fmt).double()


@lru_cache(maxsize=None)
def finite_magnitudes(fmt: FP8Format) -> torch.Tensor:
    """The representable values 0 <= v <= fmt.max in increasing order (index == code)."""
    return value_table(fmt)[: fmt.max_code + 1].clone()


def top_exponent(fmt: FP8Format) -> int:
    """e of the largest binade [2**e, 2**(e+1)) that holds finite values (8 for E4M3, 15 for E5M2)."""
    return math.frexp(fmt.max)[1] - 1


def step_above_max(fmt: FP8Format) -> float:
    """fmt.max plus the spacing of the top binade: the value the next code would have if the format went on
    (480 for E4M3, 65536 for E5M2). Halfway between it and fmt.max is where a cast starts to overflow."""
    return fmt.max + 2.0 ** (top_exponent(fmt) - fmt.mant_bits)


@lru_cache(maxsize=None)
def midpoints(fmt: FP8Format) -> torch.Tensor:
    """The positive ties of a cast at scale 1, float64, increasing: the midpoint of each pair of neighbouring
    values from (0, min_subnormal) to (fmt.max, step_above_max), the last one the overflow threshold."""
    grid = torch.cat([finite_magnitudes(fmt), torch.tensor([step_above_max(fmt)], dtype=torch.float64)])
    return (grid[:-1] + grid[1:]) / 2


def is_tie(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Whether each value of a CPU tensor is a tie of the format (see midpoints), elementwise."""
    return torch.isin(x.double().abs(), midpoints(fmt))


def tie_text(v: float, fmt: FP8Format) -> str:
    """', a tie between 1.0 and 1.125' when |v| is midway between two neighbouring FP8 values (or between
    fmt.max and the overflow), '' otherwise."""
    mids = midpoints(fmt)
    i = int(torch.searchsorted(mids, torch.tensor([abs(v)], dtype=torch.float64)))
    if not math.isfinite(v) or i >= mids.numel() or mids[i].item() != abs(v):
        return ""
    grid = finite_magnitudes(fmt)
    lo = grid[i].item()
    hi = grid[i + 1].item() if i + 1 < grid.numel() else step_above_max(fmt)
    sign = "-" if v < 0 else ""
    beyond = " (past fmt.max: the overflow threshold)" if i + 1 >= grid.numel() else ""
    return f", a tie between {sign}{lo!r} and {sign}{hi!r}{beyond}"


def spacing(x: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """The format's spacing (one ulp) at each value of a float64 tensor: 2**(e - mant_bits) for |x| in
    [2**e, 2**(e+1)); min_subnormal below min_normal (zero included); the top binade's spacing at and above
    fmt.max (Inf included). NaN gives NaN."""
    _, e = torch.frexp(x.abs())
    emin = 1 - fmt.bias
    e = torch.where(x.abs() < fmt.min_normal, emin, e - 1).clamp(max=top_exponent(fmt))
    e = torch.where(torch.isinf(x), top_exponent(fmt), e)
    out = torch.exp2((e - fmt.mant_bits).to(torch.float64))
    return torch.where(torch.isnan(x), float("nan"), out)


def as_tensor(x: Any, fn: str, arg: str) -> torch.Tensor:
    """A torch tensor from a tensor, a numpy array or a Python number (no copy where none is needed)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.tensor(float(x), dtype=torch.float64)
    raise TypeError(f"{fn}(): {arg} must be a torch.Tensor, a numpy array or a number, got {type(x).__name__}")


def tensor_format(t: torch.Tensor) -> Optional[FP8Format]:
    return format_of_dtype(t.dtype)


def pick_format(fn: str, fmt: Any, *tensors: Tuple[str, torch.Tensor]) -> FP8Format:
    """The format named by `fmt` or by the float8 dtype of the given tensors. A float8 dtype that disagrees
    with `fmt` is a ValueError (the call is wrong, not the values)."""
    named = resolve_format(fmt, fn) if fmt is not None else None
    for arg, t in tensors:
        f = tensor_format(t)
        if f is not None and named is not None and f is not named:
            raise ValueError(f"{fn}(): {arg} is {t.dtype} but fmt={named!r}; leave fmt out or make them agree")
        if f is not None and named is None:
            named = f
    if named is None:
        args = " or ".join(arg for arg, _ in tensors)
        raise TypeError(f"{fn}(): give fmt= (fp8ext.E4M3 or fp8ext.E5M2): {args} has no float8 dtype to take "
                        "the format from")
    return named


def codes_of(t: torch.Tensor, fn: str, arg: str) -> torch.Tensor:
    """The bytes of an FP8 tensor (a float8 dtype or uint8 codes) as a flat uint8 CPU tensor."""
    if t.dtype in FP8_DTYPES:
        t = t.view(torch.uint8)
    elif t.dtype != torch.uint8:
        raise TypeError(f"{fn}(): {arg} must be a torch.float8_e4m3fn / float8_e5m2 tensor or uint8 codes, "
                        f"got {t.dtype}")
    return t.detach().cpu().reshape(-1)


def values_of(t: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """float64 values on the CPU, flat: FP8 tensors and uint8 codes decoded in `fmt`, others converted."""
    if t.dtype in FP8_DTYPES or t.dtype == torch.uint8:
        return value_table(fmt)[t.detach().cpu().reshape(-1).view(torch.uint8).long()]
    return t.detach().cpu().reshape(-1).to(torch.float64)


def index_of(flat: int, shape: Sequence[int]) -> Tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, tuple(shape))) if len(shape) else ()


def code_text(code: int, fmt: FP8Format) -> str:
    return f"{code:#04x} ({value_table(fmt)[code].item()!r})"


def check_shapes(fn: str, shapes: Iterable[Tuple[str, Sequence[int]]]) -> None:
    """AssertionError when the named tensors' shapes differ (a test failure, as in torch.testing)."""
    __tracebackhide__ = True  # pytest shows the test's line, not this one
    shapes = list(shapes)
    if any(tuple(s) != tuple(shapes[0][1]) for _, s in shapes[1:]):
        described = " but ".join(f"{arg} has shape {list(s)}" for arg, s in shapes)
        raise AssertionError(f"{fn}(): shapes differ: {described}")


def fail(fn: str, msg: Optional[str], headline: str, lines: Sequence[str]) -> None:
    """Raise the AssertionError of a comparison: the caller's msg first, then the headline and details."""
    __tracebackhide__ = True
    head = f"{msg}: " if msg else ""
    raise AssertionError(f"{head}{fn}(): {headline}\n" + "\n".join(lines))
