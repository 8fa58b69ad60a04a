"""fp8ext.testing's GEMM helpers: gemm_reference against an independent float64 product, the bound's
formula as fp8ext.testing._gemm derives it, the CPU emulation inside the bound, an emulated Hopper
accumulator (13 fraction bits, truncating) inside the H100 model but outside the fp32 one, perturbed and
wrong outputs outside; on a GPU, cuBLASLt's outputs inside the H100 model in both accumulation modes."""

import math
import re

import numpy as np
import pytest
import torch

import fp8ext
import reference
from conftest import requires_cuda
from fp8ext.testing import (FAST_ACCUM_FACTOR, H100_ACCUM_BITS, accum_bits_for, assert_gemm_close, gemm_error_bound,
                            gemm_reference)
from fp8ext.testing import _gemm
from inputs import gemm_operands

E4, E5 = fp8ext.E4M3, fp8ext.E5M2
PAIRS = [(E4, E4), (E4, E5), (E5, E4)]
KINDS = ["tensor", "row", "block", "block1x128"]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
U32 = 2.0 ** -24
H100 = dict(accum_bits=H100_ACCUM_BITS)  # Hopper's model, named: CPU tensors default to fp32 accumulation


def operands(m, k, n, fa=E4, fb=E4, kind="tensor", device="cpu", seed=0):
    m += -m % 4 if kind.startswith("block") else 0  # 1x128 blocks need M % 4 == 0
    return gemm_operands(m, k, n, fa, fb, kind, device, seed)


def gamma(n, u):
    return n * u / (1 - n * u)


def outside(out, a, b, sa, sb, **kw):
    """The AssertionError's text, failing the test if assert_gemm_close passes."""
    with pytest.raises(AssertionError) as info:
        assert_gemm_close(out, a, b, sa, sb, **kw)
    return str(info.value)


def perturbed(out, a, b, sa, sb, i, j, **kw):
    """out with element (i, j) moved to 3 bounds away from the reference (past the bound after rounding)."""
    bound = gemm_error_bound(a, b, sa, sb, out_dtype=out.dtype, **kw)
    bad = out.clone()
    bad[i, j] = (gemm_reference(a, b, sa, sb)[i, j] + 3 * bound[i, j]).to(out.dtype)
    return bad


def truncate(x: np.ndarray, bits: int) -> np.ndarray:
    """x truncated (toward zero) to `bits` fraction bits: what Hopper's FP8 accumulator keeps."""
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(np.ldexp(m, bits + 1)), e - bits - 1)


def hopper_emulation(a8, b8, fast, bits=13, mma_k=32, interval=128):
    """A GEMM of per-tensor scale 1 the way the model says Hopper runs it: exact products, 32 at a time
    added to an accumulator truncated to 13 fraction bits, promoted into fp32 every 128 of K (never with
    fast accumulation)."""
    a, b = a8.double().numpy(), b8.double().numpy()
    k = a.shape[1]
    p = k if fast else interval
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for c0 in range(0, k, p):
        c = np.zeros(acc.shape)
        for s0 in range(c0, min(c0 + p, k), mma_k):
            c = truncate(c + a[:, s0:s0 + mma_k] @ b[:, s0:s0 + mma_k].T, bits)
        acc = acc + c.astype(np.float32)
    return torch.from_numpy(acc)


# ---- the reference and the formula ------------------------------------------------------------

@pytest.mark.parametrize("fa, fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_the_float64_product_of_the_dequantized_operands(fa, fb, kind):
    m, k, n = 36, 384, 160
    a, b, sa, sb = operands(m, k, n, fa, fb, kind)
    da = reference.decode_table(fa.name)[a.view(torch.uint8).numpy()]
    db = reference.decode_table(fb.name)[b.view(torch.uint8).numpy()]
    sa64, sb64 = sa.double().numpy(), sb.double().numpy()
    if kind == "row":
        da, db = da * sa64[:, None], db * sb64[:, None]
    elif kind == "tensor":
        da, db = da * sa64, db * sb64
    else:
        da = da * np.repeat(sa64, 128, axis=1)[:, :k]
        db = db * (np.repeat(sb64, 128, axis=1)[:, :k] if kind == "block1x128"
                   else np.repeat(np.repeat(sb64, 128, axis=0)[:n], 128, axis=1)[:, :k])
    bias = torch.randn(n).to(torch.bfloat16)
    got = gemm_reference(a, b, sa, sb, bias=bias)
    assert got.dtype == torch.float64 and got.shape == (m, n)
    np.testing.assert_allclose(got.numpy(), da @ db.T + bias.double().numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("out_dtype, u_out, eta", [(torch.float32, U32, 2.0 ** -150),
                                                   (torch.bfloat16, 2.0 ** -8, 2.0 ** -134),
                                                   (torch.float16, 2.0 ** -11, 2.0 ** -25)])
@pytest.mark.parametrize("model, g_acc, g_32", [
    (H100, gamma(4, 2.0 ** -12), gamma(2 + 4, U32)),                        # 128 of K per promotion: J 4, C 2
    (dict(H100, use_fast_accum=True), gamma(8, 2.0 ** -10), gamma(1 + 4, U32)),  # all 256 in the tensor core; u x 4
    (dict(accum_bits=10, mma_k=16, promote_interval=64), gamma(4, 2.0 ** -9), gamma(4 + 4, U32)),
    (dict(accum_bits=None), gamma(256, U32), gamma(4, U32)),               # fp32 accumulation
    (dict(), gamma(256, U32), gamma(4, U32)),                              # CPU tensors: fp32 by default
], ids=["split", "fast", "custom", "fp32", "cpu-default"])
def test_bound_is_the_documented_formula(out_dtype, u_out, eta, model, g_acc, g_32):
    """a8 = 1.0 and b8 = -1.0 everywhere, K = 256, scales 0.5 and 0.25: r = -32 + bias, S = 32."""
    a = fp8ext.quantize(torch.ones(2, 256), E4)
    b = fp8ext.quantize(-torch.ones(16, 256), E5)
    bias = torch.full((16,), 3.0)
    got = gemm_error_bound(a, b, torch.tensor(0.5), 0.25, out_dtype=out_dtype, bias=bias, **model)
    s, r = 32.0, -32.0 + 3.0
    e_acc = g_acc * s + g_32 * (1 + g_acc) * (s + 3.0)
    want = e_acc + u_out * (abs(r) + e_acc) + eta
    assert got.shape == (2, 16) and torch.allclose(got, torch.full_like(got, want), rtol=1e-14, atol=0)


def test_bound_grows_with_k_fewer_bits_fast_accumulation_and_coarser_outputs():
    a, b, sa, sb = operands(8, 4096, 16)

    def bound(**kw):
        return gemm_error_bound(a, b, sa, sb, **{**H100, **kw}).max().item()

    assert bound(use_fast_accum=True) > 10 * bound() > 10 * bound(accum_bits=None)
    assert bound(accum_bits=10) > bound() > bound(accum_bits=16)
    assert bound(out_dtype=torch.bfloat16) > bound(out_dtype=torch.float16) > bound()
    a2, b2, sa2, sb2 = operands(8, 128, 16)
    assert gemm_error_bound(a2, b2, sa2, sb2, use_fast_accum=True, **H100).gt(
        gemm_error_bound(a2, b2, sa2, sb2, **H100)).all(), \
        "K <= promote_interval: the same steps, fast accumulation's measured factor on top"
    with pytest.raises(ValueError, match=r"accum_bits=3: 128 steps with unit error 1 give no bound"):
        bound(accum_bits=3, use_fast_accum=True)


# ---- outputs inside and outside --------------------------------------------------------------

@pytest.mark.parametrize("fa, fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(16, 32, 16), (48, 256, 80), (1, 128, 64), (130, 2048, 272)], ids=str)
def test_cpu_emulation_is_inside_the_fp32_and_the_h100_bounds(fa, fb, kind, shape):
    a, b, sa, sb = operands(*shape, fa, fb, kind)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    assert_gemm_close(out, a, b, sa, sb, accum_bits=None)
    assert_gemm_close(out, a, b, sa, sb, **H100)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
def test_cpu_emulation_with_bias_and_half_outputs_is_inside(out_dtype):
    a, b, sa, sb = operands(64, 1024, 96)
    bias = (torch.randn(96) * 4).to(torch.float16 if out_dtype == torch.float16 else torch.bfloat16)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=out_dtype, bias=bias)
    assert_gemm_close(out, a, b, sa, sb, bias=bias, accum_bits=None)
    text = outside(out, a, b, sa, sb, accum_bits=None)  # the bias left out of the reference
    assert "outside the error bound" in text


@pytest.mark.parametrize("fast", [False, True], ids=["split_accum", "fast_accum"])
@pytest.mark.parametrize("data", ["signed", "positive"])
def test_an_emulated_hopper_accumulator_needs_the_h100_model(fast, data):
    """The truncating 13-bit accumulator of the model is inside the H100 bound in both modes; with fast
    accumulation over K = 4096 of same-sign terms it is outside the fp32-accumulation bound, which is why
    the default models a reduced-precision accumulator."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 4096, generator=g), torch.randn(24, 4096, generator=g)
    if data == "positive":
        x, w = x.abs(), w.abs()
    a, b = fp8ext.quantize(x, E4), fp8ext.quantize(w, E4)
    out = hopper_emulation(a, b, fast)
    assert_gemm_close(out, a, b, 1.0, 1.0, use_fast_accum=fast, **H100)
    if fast and data == "positive":
        assert "outside the error bound" in outside(out, a, b, 1.0, 1.0, accum_bits=None)
    if fast:
        emulated_split = hopper_emulation(a, b, fast=False)
        err = lambda o: (o.double() - gemm_reference(a, b, 1.0, 1.0)).abs().max().item()  # noqa: E731
        assert err(out) > 4 * err(emulated_split), "promotion every 128 is what keeps the error small"


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("model", [H100, dict(H100, use_fast_accum=True), dict(accum_bits=None), dict()], ids=str)
def test_a_perturbed_output_is_outside_and_the_report_says_where(out_dtype, model):
    a, b, sa, sb = operands(40, 512, 48)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=out_dtype)
    assert_gemm_close(out, a, b, sa, sb, **model)
    text = outside(perturbed(out, a, b, sa, sb, 7, 11, **model), a, b, sa, sb, msg="step 3", **model)
    assert text.startswith("step 3: assert_gemm_close(): 1 of 1920 outputs are outside the error bound"), text
    assert "at index (7, 11)" in text and "\n  (7, 11): " in text


def test_real_mistakes_are_outside():
    a, b, sa, sb = operands(64, 2048, 80)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    short = fp8ext.gemm(a[:, :-16].contiguous(), b[:, :-16].contiguous(), a_scale_inv=sa, b_scale_inv=sb,
                        out_dtype=torch.float32)  # the last 16 of K skipped
    outside(short, a, b, sa, sb)
    outside(out * (1 + 2e-3), a, b, sa, sb, accum_bits=None)  # a scale off by 0.2 %: outside the fp32 model
    outside(out * (1 + 2e-2), a, b, sa, sb, **H100)  # by 2 %: outside the H100 model too
    outside(out.roll(1, dims=1), a, b, sa, sb)  # columns in the wrong place
    text = outside(torch.zeros_like(out), a, b, sa, sb)  # nothing computed: all but the smallest are outside
    n = int(re.search(r"(\d+) of 5120 outputs are outside", text).group(1))
    assert n > 4500 and f"... and {n - 8} more" in text and text.count("\n  (") == 8


def test_a_bfloat16_matmul_is_outside_the_default_bound_on_cpu_tensors():
    """The default model follows the device: CPU tensors are held to fp32 accumulation, so a GEMM that
    accumulates in bfloat16 fails without naming accum_bits (it passed Hopper's wider bound before)."""
    a, b, sa, sb = operands(32, 1024, 48)
    good = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    wrong = ((a.float() * sa) .bfloat16() @ (b.float() * sb).bfloat16().t()).float()
    assert_gemm_close(good, a, b, sa, sb)
    text = outside(wrong, a, b, sa, sb)
    assert "outside the error bound (out_dtype=torch.float32, use_fast_accum=False, accum_bits=None (fp32 " \
           "accumulation, chosen for cpu tensors)" in text, text


def test_the_accumulator_model_follows_the_device():
    cpu = torch.zeros(1)
    assert accum_bits_for(cpu, None, cpu) is None
    with pytest.raises(ValueError, match=r"accum_bits_for\(\): cannot choose the accumulator model from tensors on "
                                         r"\['meta'\]: pass accum_bits=None"):
        accum_bits_for(torch.zeros(1, device="meta"))
    a, b, sa, sb = operands(8, 256, 16)
    with pytest.raises(ValueError, match=r'accum_bits must be an int, None or "device", got \'cuda\''):
        gemm_error_bound(a, b, sa, sb, accum_bits="cuda")
    assert torch.equal(gemm_error_bound(a, b, sa, sb), gemm_error_bound(a, b, sa, sb, accum_bits=None))


@requires_cuda
@pytest.mark.cuda
def test_cuda_tensors_get_the_hopper_model_and_mixed_devices_must_name_it():
    a, b, sa, sb = operands(8, 256, 16, device="cuda")
    assert accum_bits_for(a, b) == H100_ACCUM_BITS
    assert torch.equal(gemm_error_bound(a, b, sa, sb), gemm_error_bound(a, b, sa, sb, **H100))
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"assert_gemm_close\(\): cannot choose the accumulator model from tensors "
                                         r"on \['cpu', 'cuda'\]"):
        assert_gemm_close(out.cpu(), a, b, sa, sb)


@pytest.mark.parametrize("figure, digits, k, model", [
    ("9.8e-4", 2, 4096, H100), ("0.143 at K = 4096", 3, 4096, dict(H100, use_fast_accum=True)),
    ("0.0323 at\nK = 1024", 3, 1024, dict(H100, use_fast_accum=True)),
    ("2.4e-4 at K = 4096", 2, 4096, dict(accum_bits=None)),
], ids=["split", "fast-4096", "fast-1024", "fp32"])
def test_the_docstring_figures_are_what_the_code_computes(figure, digits, k, model):
    """The factor on S (gamma_J(u)) that fp8ext.testing._gemm's docstring quotes, rounded as it is quoted."""
    assert figure in _gemm.__doc__, f"{figure!r} is not in fp8ext.testing._gemm's docstring"
    g_acc, _ = _gemm._model(k, model.get("use_fast_accum", False), model["accum_bits"], 32, 128)
    assert float(f"{g_acc:.{digits}g}") == float(figure.split()[0]), (figure, g_acc)
    assert "FAST_ACCUM_FACTOR * 2**-12" in _gemm.__doc__ and FAST_ACCUM_FACTOR == 4.0


def test_scaled_mm_row_wise_scale_shapes_are_accepted():
    """torch._scaled_mm takes row-wise scales as scale_a [M, 1] and scale_b [1, N]: the same as [M] and [N]."""
    a, b, sa, sb = operands(16, 256, 32, kind="row")
    want = gemm_reference(a, b, sa, sb)
    assert torch.equal(gemm_reference(a, b, sa.reshape(16, 1), sb.reshape(1, 32)), want)
    assert torch.equal(gemm_error_bound(a, b, sa.reshape(16, 1), sb.reshape(1, 32)),
                       gemm_error_bound(a, b, sa, sb))
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    assert_gemm_close(out, a, b, sa.reshape(16, 1), sb.reshape(1, 32))


def test_non_finite_references_must_be_matched():
    a = fp8ext.quantize(torch.ones(4, 32), E4)
    a.view(torch.uint8)[1, 3] = 0x7F  # NaN
    b = fp8ext.quantize(torch.ones(16, 32), E4)
    out = fp8ext.gemm(a, b, a_scale_inv=torch.tensor(1.0), b_scale_inv=torch.tensor(1.0),
                      out_dtype=torch.float32)
    assert out[1].isnan().all() and not out[0].isnan().any()
    assert_gemm_close(out, a, b, 1.0, 1.0)
    out[1, 5] = 32.0
    assert "1 of 64 outputs" in outside(out, a, b, 1.0, 1.0)


def test_wrong_calls_name_the_argument():
    a, b, sa, sb = operands(8, 256, 16)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    with pytest.raises(TypeError, match=r"gemm_error_bound\(\): a8 must be a 2-D torch.float8_e4m3fn "
                                        r".* got torch.float32"):
        gemm_error_bound(a.float(), b, sa, sb)
    with pytest.raises(ValueError, match=r"gemm_reference\(\): a8 is \[M, K\] = \[8, 256\] "
                                         r"and b8 is \[N, K\] = \[16, 128\]"):
        gemm_reference(a, b[:, :128], sa, sb)
    with pytest.raises(ValueError, match=r"a_scale_inv has shape \[3\]; for a \[8, 256\] operand expected one element, "
                                         r".* or torch._scaled_mm's row-wise \[8, 1\] \(scale_a\) or \[1, 8\]"):
        gemm_reference(a, b, torch.ones(3), sb)
    with pytest.raises(TypeError, match=r"b_scale_inv must be a float tensor or a number, got torch.int64"):
        gemm_reference(a, b, sa, torch.ones((), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"bias must have shape \[16\] \(N\), got \[8\]"):
        gemm_reference(a, b, sa, sb, bias=torch.ones(8))
    with pytest.raises(TypeError, match=r"assert_gemm_close\(\): out must be a float32, bfloat16 or float16"):
        assert_gemm_close(out.to(torch.float8_e4m3fn), a, b, sa, sb)
    with pytest.raises(TypeError, match=r"gemm_error_bound\(\): out_dtype must be"):
        gemm_error_bound(a, b, sa, sb, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(AssertionError, match=r"shapes differ: out has shape \[16, 8\] but the product \[M, N\]"):
        assert_gemm_close(out.t(), a, b, sa, sb)
    with pytest.raises(ValueError, match=r"must be positive"):
        gemm_error_bound(a, b, sa, sb, mma_k=0)


# ---- cuBLASLt on a GPU -------------------------------------------------------------------------

GPU_SHAPES = [(16, 32, 16), (128, 1024, 256), (130, 2048, 272), (64, 4096, 128), (256, 4096, 512)]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fast", [False, True], ids=["split_accum", "fast_accum"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_cublaslt_output_is_inside_the_h100_bound(fast, out_dtype, shape):
    a, b, sa, sb = operands(*shape, device="cuda")
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=out_dtype, use_fast_accum=fast)
    assert_gemm_close(out, a, b, sa, sb, use_fast_accum=fast)
    i, j = shape[0] // 2, shape[2] - 1
    outside(perturbed(out, a, b, sa, sb, i, j, use_fast_accum=fast), a, b, sa, sb, use_fast_accum=fast)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fa, fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fast", [False, True], ids=["split_accum", "fast_accum"])
def test_cublaslt_scale_kinds_and_pairs_are_inside(fa, fb, kind, fast):
    if fast and kind.startswith("block"):
        pytest.skip("cuBLASLt has no fast accumulation with block scales (fp8ext.gemm refuses it)")
    a, b, sa, sb = operands(256, 4096, 384, fa, fb, kind, "cuda", seed=2)
    bias = torch.randn(384, device="cuda").to(torch.bfloat16)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.bfloat16, bias=bias, use_fast_accum=fast)
    assert_gemm_close(out, a, b, sa, sb, bias=bias, use_fast_accum=fast)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fast", [False, True], ids=["split_accum", "fast_accum"])
@pytest.mark.parametrize("k", [1024, 4096, 8192])
def test_cublaslt_with_same_sign_terms_is_inside(fast, k):
    """Same-sign products make every truncation of the accumulator err the same way: the hardest case
    for the H100 model (the errors add up instead of cancelling)."""
    g = torch.Generator().manual_seed(k)
    x, w = torch.rand(128, k, generator=g), torch.rand(256, k, generator=g)
    a, b = fp8ext.quantize(x.cuda(), E4, 448.0), fp8ext.quantize(w.cuda(), E4, 448.0)
    one = torch.tensor(1 / 448.0, device="cuda")
    out = fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one, out_dtype=torch.float32, use_fast_accum=fast)
    assert_gemm_close(out, a, b, one, one, use_fast_accum=fast)
    assert math.isfinite(out.sum().item())
