"""An example of fp8ext.testing in a test suite: torch's own float8 casts, checked with it.

torch's x.to(torch.float8_e4m3fn / torch.float8_e5m2) rounds to nearest, ties to even, as fp8ext.quantize
does. Past the largest value it depends on the release: on the CPU torch 2.12 and later saturate E4M3
to +-448, torch 2.11 and earlier give NaN; E5M2 has always overflowed to Inf (as tests/ops/test_quantize.py
records too). The tests pin that, then check every edge case byte for byte and in ulps.
"""

import pytest
import torch

import fp8ext
from fp8ext.testing import assert_close_fp8, assert_fp8_equal, edge_values

TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
E4M3_SATURATES = TORCH >= (2, 12)
CASTS = [(fp8ext.E4M3, torch.float8_e4m3fn, E4M3_SATURATES), (fp8ext.E5M2, torch.float8_e5m2, False)]
SOURCES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("fmt, dtype, saturates, last_in, first_past", [
    (*CASTS[0], 464.0, 464.00003),   # the tie 464 goes to 448 (even); anything above overflows
    (*CASTS[1], 61439.996, 61440.0),  # the tie 61440 goes to the would-be 65536 (even): overflow
], ids=["e4m3", "e5m2"])
def test_torch_overflow_is_pinned(fmt, dtype, saturates, last_in, first_past):
    past = torch.tensor([first_past, 2 * fmt.max, 1e6, float("inf")])
    code = fmt.max_code if saturates else fmt.overflow_code
    want = torch.full(past.shape, code, dtype=torch.uint8)
    msg = f"torch {torch.__version__} {dtype}"
    assert_fp8_equal(past.to(dtype), want, strict_nan=True, input=past, msg=msg)
    assert_fp8_equal((-past).to(dtype), want | 0x80, strict_nan=True, input=-past, msg=msg)
    assert_fp8_equal(torch.tensor([last_in]).to(dtype), torch.tensor([fmt.max_code], dtype=torch.uint8), msg=msg)


@pytest.mark.parametrize("fmt, dtype, saturates", CASTS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_torch_cast_equals_fp8ext_on_every_edge_case(fmt, dtype, saturates, source):
    x = edge_values(fmt, source)
    assert_fp8_equal(x.to(dtype), fp8ext.quantize(x, fmt, saturate=saturates), input=x)


@pytest.mark.parametrize("fmt, dtype, saturates", CASTS, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("source", SOURCES, ids=str)
def test_torch_cast_is_correctly_rounded(fmt, dtype, saturates, source):
    x = edge_values(fmt, source)
    inside = x[x.abs() <= fmt.max]  # past the range the rule is saturation or overflow, pinned above
    assert_close_fp8(inside.to(dtype), inside.double(), max_ulps=0.5)


def test_torch_cast_on_drawn_inputs():
    """The same with hypothesis, where it is installed: random tensors mixed with the edge cases."""
    hypothesis = pytest.importorskip("hypothesis")
    from fp8ext.testing import strategies as fst

    @hypothesis.settings(max_examples=100, deadline=None, database=None)
    @hypothesis.given(x=fst.tensors(fp8ext.E5M2, torch.bfloat16))
    def check(x):
        assert_fp8_equal(x.to(torch.float8_e5m2), fp8ext.quantize(x, fp8ext.E5M2, saturate=False), input=x)

    check()
