"""Hypothesis strategies for FP8 tests: the edge cases of fp8ext.testing.edge_values, FP8 codes, and
inputs mixing the edge cases with arbitrary values of an input dtype. Needs `hypothesis`
(`pip install "fp8ext[testing]"` or `pip install hypothesis`); fp8ext.testing imports this module only when
it is asked for.

    from hypothesis import given
    from fp8ext.testing import strategies as fst

    @given(fst.tensors(fp8ext.E4M3, torch.bfloat16, shape=(4, 8)))
    def test_cast(x): ...

Names follow what they draw: the plural ones (edge_values, tensors, fp8_tensors) draw CPU tensors, as
fp8ext.testing.edge_values returns one; the singular ones draw one Python number (edge_value, a float;
values, a float; codes, an int). A shape= (an int or a tuple) gives tensors of exactly that shape; without
it they are 1-D with min_size to max_size elements.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised by a test that hides hypothesis
    raise ImportError("fp8ext.testing.strategies needs hypothesis: pip install hypothesis") from e

from ..core.formats import resolve_format
from ._edges import EDGE_DTYPES, edge_values as _edge_values
from ._values import value_table

__all__ = ["edge_value", "edge_values", "values", "codes", "tensors", "fp8_tensors"]

Shape = Union[int, Sequence[int]]


def _lists_as_tensors(elements: st.SearchStrategy, to_tensor, shape: Optional[Shape], min_size: int,
                      max_size: int, fn: str) -> st.SearchStrategy[torch.Tensor]:
    """Tensors of `shape` (exactly) or 1-D of min_size..max_size elements, each drawn from `elements`."""
    if shape is None:
        return st.lists(elements, min_size=min_size, max_size=max_size).map(to_tensor)
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise ValueError(f"{fn}(): shape must be an int or a tuple of ints >= 0, got {shape!r}")
    n = math.prod(dims)
    return st.lists(elements, min_size=n, max_size=n).map(lambda v: to_tensor(v).reshape(dims))


def edge_value(fmt: Any, dtype: torch.dtype = torch.float32) -> st.SearchStrategy[float]:
    """One of fp8ext.testing.edge_values(fmt, dtype), as a Python float (NaN included)."""
    return st.sampled_from(_edge_values(fmt, dtype).tolist())


def edge_values(fmt: Any, dtype: torch.dtype = torch.float32, *, shape: Optional[Shape] = None, min_size: int = 1,
                max_size: int = 64) -> st.SearchStrategy[torch.Tensor]:
    """A CPU tensor of `dtype` whose elements are all edge cases, drawn from edge_value(fmt, dtype): like
    fp8ext.testing.edge_values (which returns every case once, 1-D) but in any number, order and shape.
    (Before, this strategy drew a single float: that is edge_value now.)"""
    return _lists_as_tensors(edge_value(fmt, dtype), lambda v: torch.tensor(v, dtype=dtype), shape, min_size,
                             max_size, "edge_values")


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


def tensors(fmt: Any, dtype: torch.dtype = torch.float32, *, shape: Optional[Shape] = None, min_size: int = 1,
            max_size: int = 64, allow_nan: bool = True, allow_infinity: bool = True) -> st.SearchStrategy[torch.Tensor]:
    """A CPU tensor of `dtype` whose elements are drawn from values(fmt, dtype, ...): of `shape` where given,
    else 1-D with min_size to max_size elements."""
    elements = values(fmt, dtype, allow_nan=allow_nan, allow_infinity=allow_infinity)
    return _lists_as_tensors(elements, lambda v: torch.tensor(v, dtype=dtype), shape, min_size, max_size, "tensors")


def fp8_tensors(fmt: Any, *, shape: Optional[Shape] = None, min_size: int = 1, max_size: int = 64,
                allow_nan: bool = True) -> st.SearchStrategy[torch.Tensor]:
    """A CPU tensor of the format's float8 dtype holding codes drawn from codes(fmt, ...): of `shape` where
    given, else 1-D with min_size to max_size elements."""
    f = resolve_format(fmt, "fp8_tensors")
    return _lists_as_tensors(codes(f, allow_nan=allow_nan), lambda c: torch.tensor(c, dtype=torch.uint8).view(
        f.torch_dtype), shape, min_size, max_size, "fp8_tensors")
