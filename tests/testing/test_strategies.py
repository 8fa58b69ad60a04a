"""fp8ext.testing.strategies: hypothesis strategies drawing the cases of fp8ext.testing.edge_values, FP8
codes and input values, used for a property test of fp8ext.quantize against the independent numpy
reference. Skipped where hypothesis is not installed (that the module then says so is in
testing/test_comparisons_and_edges.py)."""

import math

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fp8ext  # noqa: E402
import reference  # noqa: E402
from fp8ext.testing import assert_close_fp8, assert_fp8_equal, edge_values  # noqa: E402
from fp8ext.testing import strategies as fst  # noqa: E402

FORMATS = [fp8ext.E4M3, fp8ext.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
quick = settings(max_examples=50, deadline=None, database=None)  # no example database in the tree


KEYS = [(f, d) for f in FORMATS for d in DTYPES]
EDGES = {key: fst.edge_value(*key) for key in KEYS}
CASES = {key: set(edge_values(*key).double().tolist()) for key in KEYS}
VALUES = {key: fst.values(*key) for key in KEYS}
FINITE = {key: fst.values(*key, allow_nan=False, allow_infinity=False) for key in KEYS}
TENSORS = {key: fst.tensors(*key, max_size=32) for key in KEYS}


def holds(v: float, dtype: torch.dtype) -> bool:
    """Whether dtype holds v exactly (NaN counts)."""
    return math.isnan(v) or torch.tensor(v, dtype=torch.float64).to(dtype).item() == v


@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"{k[0].name}-{k[1]}")
@quick
@given(data=st.data())
def test_drawn_values_are_edge_cases_or_held_by_the_dtype(key, data):
    v = data.draw(EDGES[key])
    assert math.isnan(v) or v in CASES[key]
    v = data.draw(VALUES[key])
    assert isinstance(v, float) and holds(v, key[1])
    w = data.draw(FINITE[key])
    assert math.isfinite(w) and holds(w, key[1])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@quick
@given(data=st.data())
def test_codes_and_fp8_tensors(fmt, data):
    nan = np.isnan(reference.decode_table(fmt.name))
    c = data.draw(fst.codes(fmt, allow_nan=False))
    assert 0 <= c <= 255 and not nan[c]
    q = data.draw(fst.fp8_tensors(fmt, min_size=2, max_size=5))
    assert q.dtype == fmt.torch_dtype and 2 <= q.numel() <= 5


@quick
@given(x=fst.tensors(fp8ext.E4M3, torch.bfloat16, min_size=3, max_size=7, allow_nan=False))
def test_tensors_have_the_dtype_size_and_flags(x):
    assert x.dtype == torch.bfloat16 and 3 <= x.numel() <= 7 and not x.isnan().any()


@quick
@given(data=st.data())
def test_edge_values_draws_tensors_of_edge_cases_like_the_function(data):
    """fst.edge_values draws tensors (as fp8ext.testing.edge_values returns one); fst.edge_value one float."""
    key = (fp8ext.E4M3, torch.bfloat16)
    x = data.draw(fst.edge_values(*key, shape=(2, 3)))
    assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and x.shape == (2, 3)
    assert all(math.isnan(v) or v in CASES[key] for v in x.double().reshape(-1).tolist())
    y = data.draw(fst.edge_values(*key, min_size=1, max_size=4))
    assert y.dim() == 1 and 1 <= y.numel() <= 4


@quick
@given(x=fst.tensors(fp8ext.E5M2, torch.float16, shape=(3, 4)), q=fst.fp8_tensors(fp8ext.E4M3, shape=5),
       e=fst.tensors(fp8ext.E4M3, shape=(0, 2)))
def test_tensors_take_a_shape(x, q, e):
    assert x.shape == (3, 4) and x.dtype == torch.float16
    assert q.shape == (5,) and q.dtype == torch.float8_e4m3fn
    assert e.shape == (0, 2)


def test_a_bad_shape_names_the_strategy():
    with pytest.raises(ValueError, match=r"tensors\(\): shape must be an int or a tuple of ints >= 0, got \(2, -1\)"):
        fst.tensors(fp8ext.E4M3, shape=(2, -1))


def test_the_cases_appear():
    """Hypothesis finds each kind of case in the mix: a tie, an input past the overflow threshold, NaN, -0."""
    vals = reference.finite_positive("E4M3")
    ties = set(((vals[:-1] + vals[1:]) / 2).tolist())
    found = settings(database=None, max_examples=2000, derandomize=True)
    for cond in (lambda v: v in ties, lambda v: 464 < v < 1e6, math.isnan,
                 lambda v: v == 0 and math.copysign(1, v) < 0):
        hypothesis.find(VALUES[fp8ext.E4M3, torch.float32], cond, settings=found)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@quick
@given(data=st.data())
def test_quantize_matches_the_reference_on_drawn_tensors(fmt, dtype, saturate, data):
    x = data.draw(TENSORS[fmt, dtype])
    v = x.float().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        want = reference.quantize(v, fmt.name, saturate, x=v)
    q = fp8ext.quantize(x, fmt, saturate=saturate)
    assert_fp8_equal(q, want, strict_nan=True, input=x)
    if saturate:
        assert_close_fp8(q, x.double(), saturate=True)
