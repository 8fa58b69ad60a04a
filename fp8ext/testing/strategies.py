"""Hypothesis strategies for FP8 tests: the edge cases of fp8ext.testing.edge_values, FP8 codes, and
inputs mixing the edge cases with arbitrary values of an input dtype. Needs `hypothesis`
(`pip install hypothesis`); fp8ext.testing imports this module only when it is asked for.

    from hypothesis import given
    from fp8ext.testing import strategies as fst

    @given(fst.tensors(fp8ext.E4M3, torch.bfloat16))
    def test_cast(x): ...
"""

from __future__ import annotations

import math
from typing import Any

import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised by a test that hides hypothesis
    raise ImportError("fp8ext.testing.strategies needs hypothesis: pip install hypothesis") from e

from ..formats import resolve_format
from ._edges import EDGE_DTYPES, edge_values as _edge_values
from ._values import value_table

__all__ = ["edge_values", "values", "codes", "tensors", "fp8_tensors"]


def edge_values(fmt: Any, dtype: torch.dtype = torch.float32) -> st.SearchStrategy[float]:
    """One of fp8ext.testing.edge_values(fmt, dtype), as a Python float (NaN included)."""
    return st.sampled_from(_edge_values(fmt, dtype).tolist())


def values(fmt: Any, dtype: torch.dtype = torch.float32, *, allow_nan: bool = True,
           allow_infinity: bool = True) -> st.SearchStrategy[float]:
    """A value `dtype` holds exactly, as a Python float, from one of four equally likely sources: the
    special values (+-0, and +-Inf and NaN unless excluded), the finite edge cases of edge_values, a value
    within twice FP8's range, or any finite value of the dtype (the last two rounded to the dtype by torch)."""
    f = resolve_format(fmt, "values")
    if dtype not in EDGE_DTYPES:
        raise TypeError(f"values(): dtype must be one of {[str(d) for d in EDGE_DTYPES]}, got {dtype!r}")
    cases = _edge_values(f, dtype).tolist()
    specials = [0.0, -0.0] + [v for v in cases if (allow_nan and v != v) or (allow_infinity and abs(v) == math.inf)]
    finite = [v for v in cases if v == v and abs(v) != math.inf and v != 0]
    fin = torch.finfo(dtype)
    width = 16 if dtype == torch.float16 else 64 if dtype == torch.float64 else 32
    near = min(2 * f.max, fin.max)  # within twice FP8's range, as far as the dtype goes
    to_dtype = lambda v: torch.tensor(v, dtype=torch.float64).to(dtype).item()  # noqa: E731
    return st.one_of(st.sampled_from(specials), st.sampled_from(finite),
                     st.floats(-near, near, width=width).map(to_dtype),
                     st.floats(-fin.max, fin.max, width=width).map(to_dtype))


def codes(fmt: Any, *, allow_nan: bool = True) -> st.SearchStrategy[int]:
    """An FP8 code (0..255) of the format; allow_nan=False leaves out its NaN codes."""
    f = resolve_format(fmt, "codes")
    nan = torch.isnan(value_table(f))
    return st.sampled_from([c for c in range(256) if allow_nan or not bool(nan[c])])


def tensors(fmt: Any, dtype: torch.dtype = torch.float32, *, min_size: int = 1, max_size: int = 64,
            allow_nan: bool = True, allow_infinity: bool = True) -> st.SearchStrategy[torch.Tensor]:
    """A 1-D CPU tensor of `dtype` whose elements are drawn from values(fmt, dtype, ...)."""
    elements = values(fmt, dtype, allow_nan=allow_nan, allow_infinity=allow_infinity)
    return st.lists(elements, min_size=min_size, max_size=max_size).map(lambda v: torch.tensor(v, dtype=dtype))


def fp8_tensors(fmt: Any, *, min_size: int = 1, max_size: int = 64, allow_nan: bool = True
                ) -> st.SearchStrategy[torch.Tensor]:
    """A 1-D CPU tensor of the format's float8 dtype holding codes drawn from codes(fmt, ...)."""
    f = resolve_format(fmt, "fp8_tensors")
    return st.lists(codes(f, allow_nan=allow_nan), min_size=min_size, max_size=max_size).map(
        lambda c: torch.tensor(c, dtype=torch.uint8).view(f.torch_dtype))
