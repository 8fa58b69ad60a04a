"""A worked example of fp8ext.testing: a hand-written E4M3 quantizer and GEMM, with planted bugs, each caught
by the helper meant for it (fp8ext.testing's docstring lists which catches which), with a readable message.

- ties rounded half up: assert_fp8_equal(..., input=x) against fp8ext.quantize, whose report says
  "input -400.0, a tie between -384.0 and -416.0";
- no saturation past 448: assert_close_fp8(..., saturate=True): "0xff (nan), -448.0, inf";
- subnormals flushed to zero: assert_close_fp8: "0x80 (-0.0), -0.013671875, 7" (7 ulps off);
- a GEMM summed in bfloat16: assert_gemm_close, which holds CPU tensors to fp32 accumulation.

assert_close_fp8(max_ulps=0.5) lets the tie bug through: a tie is half an ulp from both neighbours, so only a
byte-exact comparison with a correct cast (fp8ext.quantize) pins the rounding of ties.
"""

import pytest
import torch

import fp8ext
from fp8ext.testing import assert_close_fp8, assert_fp8_equal, assert_gemm_close, edge_values

E4M3 = fp8ext.E4M3
MIN_NORMAL = 2.0 ** -6  # E4M3's smallest normal; spacing 2**-9 below it


def my_e4m3(x: torch.Tensor, *, ties: str = "even", saturate: bool = True, subnormals: bool = True) -> torch.Tensor:
    """The quantizer under test (scale 1): round to the nearest E4M3 value, in float64 arithmetic.

    The flags plant the bugs: ties="up" rounds a tie to the larger magnitude; saturate=False gives NaN past
    448 (and for +-Inf) instead of +-448; subnormals=False flushes results below 2**-6 to zero."""
    v = x.double()
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp(min=MIN_NORMAL)))  # the binade; subnormals share the lowest's spacing
    step = torch.exp2(e - 3)  # 3 mantissa bits
    q = a / step
    m = (torch.round(q) if ties == "even" else torch.floor(q + 0.5)) * step  # torch.round: half to even
    m = torch.where(torch.isinf(a), float("inf"), m)  # inf / inf above is NaN
    if not subnormals:
        m = torch.where(m < MIN_NORMAL, 0.0, m)
    m = torch.where(m > E4M3.max, E4M3.max if saturate else float("nan"), m)
    m = torch.where(torch.isnan(a), float("nan"), m)
    return torch.copysign(m, v).to(torch.float8_e4m3fn)  # exact: m is an E4M3 value (or NaN)


X = edge_values(E4M3, torch.float32)  # every value, every tie and its neighbours, overflow, +-0, +-Inf, NaN


def test_the_correct_quantizer_passes_both_comparisons():
    assert_fp8_equal(my_e4m3(X), fp8ext.quantize(X, E4M3, saturate=True), input=X)
    assert_close_fp8(my_e4m3(X), X.double(), max_ulps=0.5, saturate=True)


def test_ties_rounded_half_up_pass_the_ulp_check_but_not_the_byte_check():
    got = my_e4m3(X, ties="up")
    assert_close_fp8(got, X.double(), max_ulps=0.5, saturate=True)  # the blind spot: every tie is 0.5 ulp away
    with pytest.raises(AssertionError, match=r"E4M3 codes differ .*; \d+ of them at ties \(inputs midway between two "
                                             r"E4M3 values\): check the rounding of ties") as info:
        assert_fp8_equal(got, fp8ext.quantize(X, E4M3, saturate=True), input=X)
    # 400 is midway between 384 (mantissa 12, even: the right answer) and 416 (the half-up one)
    assert "got 0xfd (-416.0), expected 0xfc (-384.0), input -400.0, a tie between -384.0 and -416.0" in str(info.value)


def test_a_missing_saturation_is_caught_by_the_saturating_ulp_check():
    got = my_e4m3(X, saturate=False)
    with pytest.raises(AssertionError, match=r"Greatest ulp distance: inf at index \(0,\) .*\n(.*\n)*"
                                             r"  \(0,\): 0xff \(nan\), -448.0, inf\n"):
        assert_close_fp8(got, X.double(), max_ulps=0.5, saturate=True)


def test_flushed_subnormals_are_caught_by_the_ulp_check():
    got = my_e4m3(X, subnormals=False)
    with pytest.raises(AssertionError, match=r"Greatest ulp distance: 7.5 at index .*\n(.*\n)*"
                                             r"  \(\d+,\): 0x80 \(-0.0\), -0.013671875, 7\n"):
        assert_close_fp8(got, X.double(), max_ulps=0.5, saturate=True)


def my_gemm(a8, b8, sa, sb, acc_dtype=torch.float32):
    """The GEMM under test: dequantize, then one matmul in acc_dtype (float32 is right, bfloat16 is the bug)."""
    a, b = (a8.float() * sa).to(acc_dtype), (b8.float() * sb).to(acc_dtype)
    return (a @ b.t()).float()


def test_a_gemm_is_held_to_fp32_accumulation_on_cpu_tensors():
    g = torch.Generator().manual_seed(0)
    a8 = fp8ext.quantize(torch.randn(32, 512, generator=g), E4M3)  # a8 [M, K], b8 [N, K]
    b8 = fp8ext.quantize(torch.randn(48, 512, generator=g), E4M3)
    sa, sb = torch.tensor(0.5), torch.tensor(0.25)
    assert_gemm_close(my_gemm(a8, b8, sa, sb), a8, b8, sa, sb)
    with pytest.raises(AssertionError, match=r"assert_gemm_close\(\): \d+ of 1536 outputs are outside the error bound "
                                             r"\(out_dtype=torch.float32, .*accum_bits=None \(fp32 accumulation, "
                                             r"chosen for cpu tensors\)"):
        assert_gemm_close(my_gemm(a8, b8, sa, sb, torch.bfloat16), a8, b8, sa, sb)
