"""fp8ext's numeric results against references computed independently of it (docs/numerics.md's conventions):

- quantize(x, fmt, scale, saturate) == torch's own float32 -> float8 cast of fl32(x * scale), byte for byte, NaN
  codes included, with the saturation convention applied to torch's answer: saturate=True clamps to +-max (Inf too),
  saturate=False overflows to Inf (E5M2) or NaN (E4M3; past max + half an ulp, the tie going to max), NaN stays NaN
  (0x7F with x's sign). torch's own overflow behaviour is read off the installed release, not assumed.
- dequantize(q, scale_inv, dtype) == fl_dtype(fl32(float(q) * scale_inv)) (torch's float8 -> float32 conversion),
  for every one of the 256 codes; dequantize then quantize with the inverse power-of-two scale is the identity.
- amax(x) == max|x| in float64 (0 when empty, NaN with a NaN); quantize's amax_out accumulates it; cast_transpose
  gives quantize's bytes and their transpose; scale_from_amax is float32's fmt.max / amax / 2**margin.
- gemm(a8, b8) within the bound fp8ext.testing._gemm documents for the CPU (fp32 accumulation) of the float64
  product of torch's dequantization of the same inputs; the bound is recomputed here from the formula.
Inputs: every FP8 value and the midpoints between neighbours (ties) with their float neighbours, zeros of both signs,
subnormals, max, just past max, the overflow threshold, huge values, +-Inf, NaN of both signs, and seeded random
values over 40 binades, in float32, bfloat16 and float16.
"""

import math

import pytest
import torch

import fp8ext
from fp8ext.testing import gemm_error_bound
from prop_support import one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (prop_support)

U8 = torch.uint8
# format -> (fp8ext's, torch's dtype, max, mantissa bits, Inf code or None): from the OCP table in docs/numerics.md
FORMATS = {"e4m3": (fp8ext.E4M3, torch.float8_e4m3fn, 448.0, 3, None),
           "e5m2": (fp8ext.E5M2, torch.float8_e5m2, 57344.0, 2, 0x7C)}
SOURCES = [torch.float32, torch.bfloat16, torch.float16]


def torch_saturates(dtype) -> bool:
    """Whether the installed torch's own cast clamps an overflow to max (it did not up to 2.11 for E4M3; E5M2 never)."""
    code = int(torch.tensor([1e6]).to(dtype).view(U8))
    return code in (0x7E, 0x7B)


def fp8_values(dtype) -> torch.Tensor:
    """Every FP8 value of `dtype` as float64 (torch's decoding), NaN codes left out."""
    v = torch.arange(256, dtype=U8).view(dtype).to(torch.float64)
    return v[~v.isnan()]


def inputs(name, source, seed=0) -> torch.Tensor:
    _, dtype, fmax, mant, _ = FORMATS[name]
    vals = fp8_values(dtype).unique()
    finite = vals[vals.isfinite()]
    mids = (finite[1:] + finite[:-1]) / 2
    ulp_at_max = 2.0 ** (math.floor(math.log2(fmax)) - mant)
    specials = torch.tensor([0.0, -0.0, fmax, fmax + ulp_at_max / 2, fmax + ulp_at_max / 4, fmax + ulp_at_max * 0.75,
                             2 * fmax, 1e30, torch.finfo(source).max, math.inf, -math.inf, math.nan, -math.nan],
                            dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    rnd = torch.randn(4096, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-24, 17, (4096,), generator=g)
    edge = torch.cat([vals, mids, specials])
    edge = torch.cat([edge, -edge]).to(source)
    up, down = (torch.nextafter(edge, torch.tensor(s, dtype=source)) for s in (math.inf, -math.inf))
    return torch.cat([edge, up, down, rnd.to(source)])


def reference_codes(x, name, scale, saturate) -> torch.Tensor:
    """The FP8 codes docs/numerics.md prescribes, from torch's own cast of v = fl32(x * scale)."""
    _, dtype, fmax, mant, inf_code = FORMATS[name]
    v = x.float() * torch.tensor(scale, dtype=torch.float32)
    sign = (v.view(torch.int32) < 0).to(U8) << 7  # the sign bit, NaN's too
    if saturate:
        codes = v.clamp(-fmax, fmax).to(dtype).view(U8).clone()  # clamp keeps NaN
    else:
        codes = v.to(dtype).view(U8).clone()
        if torch_saturates(dtype):  # torch clamped: put back the format's own overflow
            threshold = fmax + 2.0 ** (math.floor(math.log2(fmax)) - mant) / 2  # ties go to max (its mantissa is even)
            over = v.abs() > threshold
            codes[over] = sign[over] | (inf_code if inf_code is not None else 0x7F)
    nan = v.isnan()
    codes[nan] = sign[nan] | 0x7F
    return codes


def assert_codes_equal(got, want, x, what):
    bad = (got.view(U8) != want).nonzero().reshape(-1)
    if bad.numel():
        rows = [f"x={x[i].item()!r}: got 0x{int(got.view(U8)[i]):02X}, want 0x{int(want[i]):02X}" for i in bad[:8]]
        pytest.fail(f"{what}: {bad.numel()} of {got.numel()} codes differ\n  " + "\n  ".join(rows))


@pytest.mark.parametrize("saturate", [True, False], ids=["saturate", "overflow"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 0.3, 1234.5])
@pytest.mark.parametrize("source", SOURCES, ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_quantize_equals_torchs_cast_with_fp8exts_saturation(name, source, scale, saturate):
    x = inputs(name, source)
    want = reference_codes(x, name, scale, saturate)
    for s in (scale, torch.tensor([scale])):  # a number and a one-element tensor
        got = fp8ext.quantize(x, FORMATS[name][0], s, saturate=saturate)
        assert got.dtype == FORMATS[name][1]
        assert_codes_equal(got, want, x, f"quantize({name}, {source}, scale={s}, saturate={saturate})")


@pytest.mark.parametrize("name", FORMATS)
def test_cast_transpose_gives_quantizes_bytes_and_their_transpose(name):
    x = inputs(name, torch.bfloat16)[:4096].reshape(64, 64)
    q, qt = fp8ext.cast_transpose(x, FORMATS[name][0], 0.75)
    want = reference_codes(x.reshape(-1), name, 0.75, True).reshape(64, 64)
    assert torch.equal(q.view(U8), want) and torch.equal(qt.view(U8), want.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale_inv", [1.0, 0.5, 2.0**-20, 3.0, 0.1, 1e-30, 1e30])
@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_equals_torchs_conversion_for_every_code(name, scale_inv, dtype):
    q = torch.arange(256, dtype=U8).view(FORMATS[name][1])
    want = (q.to(torch.float32) * torch.tensor(scale_inv, dtype=torch.float32)).to(dtype)
    for s in (scale_inv, torch.tensor([scale_inv])):
        got = fp8ext.dequantize(q, s, dtype)
        assert got.dtype == dtype
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), f"NaN where torch has none, or none where it has one (scale_inv {s})"
        bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
        diff = (got[~nan].view(bits) != want[~nan].view(bits)).nonzero().reshape(-1)
        assert not diff.numel(), f"codes {q.view(U8)[~nan][diff][:8].tolist()}: got {got[~nan][diff][:8].tolist()}, " \
                                 f"want {want[~nan][diff][:8].tolist()}"


@pytest.mark.parametrize("scale", [1.0, 2.0**-6, 2.0**9])
@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_then_quantize_with_the_inverse_scale_is_the_identity(name, scale):
    fmt, dtype = FORMATS[name][:2]
    q = torch.arange(256, dtype=U8).view(dtype)
    back = fp8ext.quantize(fp8ext.dequantize(q, 1.0 / scale), fmt, scale, saturate=False)
    nan = q.to(torch.float32).isnan()
    assert torch.equal(back.view(U8)[~nan], q.view(U8)[~nan])
    assert back.to(torch.float32)[nan].isnan().all()


AMAX_CASES = {
    "random": lambda g, n, dt: (torch.randn(n, generator=g) * 100).to(dt),
    "all-negative": lambda g, n, dt: -(torch.rand(n, generator=g) + 0.1).to(dt),
    "negative-zeros": lambda g, n, dt: torch.full((n,), -0.0, dtype=dt),
    "subnormal": lambda g, n, dt: (torch.rand(n, generator=g) * torch.finfo(dt).smallest_normal).to(dt),
    "with-inf": lambda g, n, dt: torch.cat([torch.randn(n, generator=g).to(dt), torch.tensor([-math.inf], dtype=dt)]),
    "with-nan": lambda g, n, dt: torch.cat([torch.randn(n, generator=g).to(dt), torch.tensor([math.nan], dtype=dt),
                                           torch.tensor([math.inf], dtype=dt)]),
    "max": lambda g, n, dt: torch.cat([torch.zeros(n, dtype=dt), torch.tensor([-torch.finfo(dt).max], dtype=dt)]),
}


@pytest.mark.parametrize("n", [0, 1, 7, 4097])
@pytest.mark.parametrize("case", AMAX_CASES)
@pytest.mark.parametrize("dtype", SOURCES, ids=str)
def test_amax_is_the_float64_max_abs(dtype, case, n):
    if n == 0 and case in ("with-inf", "with-nan", "max"):
        n = 1
    x = AMAX_CASES[case](torch.Generator().manual_seed(n), n, dtype)
    got = fp8ext.amax(x)
    assert got.dtype == torch.float32 and got.dim() == 0
    want = x.double().abs().max() if x.numel() else torch.tensor(0.0, dtype=torch.float64)
    if want.isnan():
        assert got.isnan()
    else:
        assert got.double() == want, f"amax {got.item()!r}, float64 max|x| {want.item()!r}"
    for start in (0.0, 1.0, 1e30):  # quantize's amax_out becomes max(amax_out, max|x|)
        acc = torch.full((1,), start)
        if x.numel():
            fp8ext.quantize(x, fp8ext.E4M3, 1.0, amax_out=acc)
        expect = max(torch.tensor(start, dtype=torch.float32).item(), want.item()) if not want.isnan() else math.nan
        assert (acc.isnan().item() and math.isnan(expect)) or acc.item() == expect, (start, acc.item(), expect)


@pytest.mark.parametrize("margin", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("name", FORMATS)
def test_scale_from_amax_is_max_over_amax_in_float32(name, margin):
    fmt, _, fmax = FORMATS[name][:3]
    for a in (1e-45, 1e-30, 0.37, 1.0, fmax, 3e38, 0.0, math.inf, math.nan):
        scale, scale_inv = fp8ext.scale_from_amax(torch.tensor([a]), fmt, margin)
        f32 = torch.tensor(fmax, dtype=torch.float32)
        want = f32 / torch.tensor(a, dtype=torch.float32) / 2.0 ** margin if 0 < a < math.inf else torch.tensor(1.0)
        want = want.clamp(max=torch.finfo(torch.float32).max)
        assert scale.item() == want.item(), f"amax {a}: scale {scale.item()!r}, want {want.item()!r}"
        assert scale_inv.item() == (1 / want).item()


# ---- gemm --------------------------------------------------------------------------------------------------------

U32 = 2.0**-24
OUT = {torch.float32: (2.0**-24, 2.0**-150), torch.bfloat16: (2.0**-8, 2.0**-134), torch.float16: (2.0**-11, 2.0**-25)}


def gamma(n, u):
    return n * u / (1 - n * u)


def dequantized(q8, scale_inv, k_blocks=None):
    """float64 (q8 as torch decodes it) * scale_inv expanded by its shape: one element, per row, or 128-wide blocks."""
    x = q8.to(torch.float64)
    s = scale_inv.to(torch.float64) if isinstance(scale_inv, torch.Tensor) else torch.tensor(float(scale_inv))
    rows, k = x.shape
    if s.numel() == 1:
        return x * s.reshape(())
    if s.dim() == 1:
        return x * s.reshape(rows, 1)
    if s.shape[0] == rows:  # 1 x 128 blocks
        return x * s.repeat_interleave(128, 1)[:, :k]
    return x * s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :k]  # 128 x 128


GEMMS = [  # (a format, b format, M, K, N, scaling)
    ("e4m3", "e4m3", 1, 16, 16, "tensor"),
    ("e4m3", "e5m2", 17, 48, 32, "tensor"),
    ("e5m2", "e4m3", 33, 272, 48, "row"),
    ("e4m3", "e4m3", 64, 272, 48, "block"),
    ("e4m3", "e4m3", 16, 4096, 16, "tensor"),  # a long sum: the bound grows with K
]


@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fa, fb, m, k, n, scaling", GEMMS,
                         ids=[f"{a}x{b}-{m}x{k}x{n}-{s}" for a, b, m, k, n, s in GEMMS])
def test_gemm_is_within_the_documented_bound_of_the_float64_product(fa, fb, m, k, n, scaling, out_dtype, with_bias):
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.5
    if scaling == "block":
        a8, sa = fp8ext.quantize_blockwise(x, FORMATS[fa][0], (1, 128))
        b8, sb = fp8ext.quantize_blockwise(w, FORMATS[fb][0], (128, 128))
    else:
        a8, b8 = (x * 8).to(FORMATS[fa][1]), (w * 4).to(FORMATS[fb][1])  # torch's casts: independent inputs
        if scaling == "tensor":
            sa, sb = torch.tensor([0.37]), torch.tensor([1.9])
        else:
            sa, sb = torch.rand(m, generator=g) + 0.05, torch.rand(n, generator=g) + 0.05
    bias = (torch.randn(n, generator=g) * 3).to(torch.float16 if out_dtype == torch.float16 else torch.bfloat16) \
        if with_bias else None
    out = fp8ext.gemm(a8, b8, a_scale_inv=sa, b_scale_inv=sb, out_dtype=out_dtype, bias=bias)
    assert out.dtype == out_dtype and out.shape == (m, n)
    a, b = dequantized(a8, sa), dequantized(b8, sb)
    beta = bias.double() if bias is not None else torch.zeros(n, dtype=torch.float64)
    r, s = a @ b.t() + beta, a.abs() @ b.abs().t()
    g_acc, g32 = gamma(k, U32), gamma(4, U32)  # CPU: fp32 accumulation, J = K steps, C = 0 promotions
    e_acc = g_acc * s + g32 * (1 + g_acc) * (s + beta.abs())
    u_out, eta = OUT[out_dtype]
    bound = e_acc + u_out * (r.abs() + e_acc) + eta
    err = (out.double() - r).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"|out - float64 product| reaches {worst:.3g} x the bound"
    lib = gemm_error_bound(a8, b8, sa, sb, out_dtype=out_dtype, bias=bias)
    assert torch.allclose(lib, bound, rtol=1e-12, atol=0), "fp8ext.testing.gemm_error_bound is the documented formula"


@pytest.mark.parametrize("where", ["a", "b"])
def test_gemm_carries_nan_and_inf_of_its_inputs_as_the_float64_product_does(where):
    g = torch.Generator().manual_seed(3)
    a8 = torch.randn(16, 32, generator=g).to(torch.float8_e4m3fn)
    b8 = torch.randn(16, 32, generator=g).to(torch.float8_e5m2 if where == "a" else torch.float8_e4m3fn)
    target = a8 if where == "a" else b8
    target.view(U8)[0, 0] = 0x7F  # NaN
    if where == "a":
        b8.view(U8)[3, 5] = 0x7C  # E5M2 +Inf
    out = fp8ext.gemm(a8, b8, a_scale_inv=torch.ones(1), b_scale_inv=torch.ones(1), out_dtype=torch.float32)
    r = a8.to(torch.float64) @ b8.to(torch.float64).t()
    nonfinite = ~r.isfinite()
    assert nonfinite.any()
    assert torch.equal(out.isnan(), r.isnan()) and torch.equal(out[r.isinf()], r[r.isinf()].float())
