"""edge_values: the inputs that FP8 casts get wrong, for one format and one input dtype.

The cases, by name (edge_groups gives them as positive magnitudes; edge_values adds the signs and the
special values): every positive finite FP8 value ("values", the FP8 "subnormals" among them); the
"midpoints" between neighbouring values (ties: 0 and min_subnormal, ..., fmt.max and the overflow
threshold), and the dtype's next representable input above and below each midpoint
("above_midpoints", "below_midpoints"); "overflow": the threshold halfway between fmt.max and the next
would-be value (464 for E4M3, 61440 for E5M2), the inputs just below and above it, that next value (480,
65536), twice it and the dtype's largest finite value; "tiny": the dtype's smallest normal and smallest
subnormal (both far below FP8's smallest subnormal). Values the dtype cannot hold exactly (E5M2's 65536 in
float16) are left out.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..core.formats import resolve_format
from ._values import finite_magnitudes, step_above_max

__all__ = ["edge_values", "edge_groups", "EDGE_DTYPES"]

EDGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_dtype(dtype: Any, fn: str) -> torch.dtype:
    if dtype not in EDGE_DTYPES:
        raise TypeError(f"{fn}(): dtype must be one of {[str(d) for d in EDGE_DTYPES]}, got {dtype!r}")
    return dtype


def _exact(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 values x that dtype holds exactly (and finitely), as dtype."""
    y = x.to(dtype)
    return y[torch.isfinite(y) & (y.double() == x)]


def edge_groups(fmt: Any, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """The edge cases of edge_values as positive magnitudes, by name (see this module's docstring): a dict
    of 1-D CPU tensors of `dtype`, each sorted."""
    return _groups(fmt, dtype, "edge_groups")


def _groups(fmt: Any, dtype: torch.dtype, fn: str) -> Dict[str, torch.Tensor]:
    """edge_groups, with errors naming `fn` (the public function the user called)."""
    f = resolve_format(fmt, fn)
    dtype = _check_dtype(dtype, fn)
    vals = finite_magnitudes(f)
    above = step_above_max(f)
    grid = torch.cat([vals, torch.tensor([above], dtype=torch.float64)])
    mids = _exact((grid[:-1] + grid[1:]) / 2, dtype)  # the last one is the overflow threshold
    inf, zero = torch.tensor(float("inf"), dtype=dtype), torch.tensor(0.0, dtype=dtype)
    up, down = torch.nextafter(mids, inf), torch.nextafter(mids, zero)
    fin = torch.finfo(dtype)
    threshold = mids[-1:]
    overflow = torch.cat([threshold.double(), down[-1:].double(), up[-1:].double(),
                          torch.tensor([above, 2 * above, fin.max], dtype=torch.float64)])
    smallest_subnormal = torch.nextafter(zero, inf).reshape(1).double()
    tiny = torch.cat([smallest_subnormal, torch.tensor([fin.smallest_normal], dtype=torch.float64)])
    return {
        "values": _exact(vals[1:], dtype),
        "subnormals": _exact(vals[1: 1 << f.mant_bits], dtype),
        "midpoints": mids[:-1],
        "above_midpoints": up[:-1],
        "below_midpoints": down[:-1],
        "overflow": _exact(overflow, dtype).sort().values,
        "tiny": _exact(tiny, dtype),
    }


def edge_values(fmt: Any, dtype: torch.dtype = torch.float32, *, device: Optional[Any] = None) -> torch.Tensor:
    """A 1-D tensor of `dtype` holding every edge case of an FP8 cast to `fmt` (at scale 1), both signs.

    Order: the negative cases from -largest to the smallest magnitude, -0.0, 0.0, the positive cases in
    increasing order, then inf, -inf and NaN. The cases (see fp8ext.testing's docs): every finite FP8
    value; the midpoints between neighbours (ties) and the next input `dtype` can hold above and below
    each; FP8's subnormals; the overflow threshold, the inputs just around it and values past it; the
    dtype's tiniest values. dtype: float32, bfloat16, float16 or float64. For a scaled cast, divide by the
    scale in float64 and keep the values the dtype holds exactly.

    float64 edge values are for casts that take float64; fp8ext.quantize does not: it takes its kernels' input
    dtypes (float32, bfloat16, float16), as Transformer Engine's casts do, and refuses float64 rather than
    convert it, because rounding a float64 value to float32 first can move it onto an FP8 tie (double
    rounding) and change the FP8 result. To compare your float64 cast with fp8ext.quantize, test on
    edge_values(fmt, torch.float32) (or any float64 tensor whose values float32 holds: x.float() is then exact).
    """
    groups = _groups(fmt, dtype, "edge_values")
    pos = torch.unique(torch.cat(list(groups.values())).double())  # sorted
    specials = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    signed_zeros = torch.tensor([-0.0, 0.0], dtype=torch.float64)
    out = torch.cat([-pos.flip(0), signed_zeros, pos, specials]).to(dtype)
    return out if device is None else out.to(device)
