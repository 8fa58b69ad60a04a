"""fp8ext.testing's comparisons and edge cases, checked against the independent numpy reference
(tests/reference.py) and ml_dtypes where it is installed, and shown to fail when they should. The GEMM
bound is in testing/test_gemm_bound.py, the hypothesis strategies in testing/test_strategies.py."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fp8ext
import fp8ext.testing
import reference
from fp8ext.testing import assert_close_fp8, assert_fp8_equal, edge_groups, edge_values, ulp_distance

FORMATS = [fp8ext.E4M3, fp8ext.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
fmt_id = lambda f: f.name  # noqa: E731


def fp8(fmt, codes) -> torch.Tensor:
    return torch.tensor(codes, dtype=torch.uint8).view(fmt.torch_dtype)


def nan_codes(fmt):
    return [c for c in range(256) if np.isnan(reference.decode_table(fmt.name)[c])]


def ref_codes(x: torch.Tensor, fmt, saturate=True) -> torch.Tensor:
    """The independent reference's cast of x (at scale 1), as FP8."""
    v = x.float().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        return torch.from_numpy(reference.quantize(v, fmt.name, saturate, x=v)).view(fmt.torch_dtype)


# ---- assert_fp8_equal --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_fp8_equal_passes_on_the_same_bytes_in_any_spelling(fmt):
    q = fp8(fmt, list(range(256)))
    assert_fp8_equal(q, q.clone())
    assert_fp8_equal(q, q.view(torch.uint8))  # the format comes from the float8 side
    assert_fp8_equal(q.view(torch.uint8), np.arange(256, dtype=np.uint8), fmt=fmt.name.lower())
    assert_fp8_equal(q.reshape(16, 16), q.view(torch.uint8).reshape(16, 16).numpy(), strict_nan=True)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_any_nan_code_equals_another_unless_strict(fmt):
    nans = nan_codes(fmt)
    assert len(nans) == (2 if fmt is fp8ext.E4M3 else 6)
    a, b = fp8(fmt, nans), fp8(fmt, nans[::-1])
    assert_fp8_equal(a, b)
    with pytest.raises(AssertionError, match=rf"{len(nans)} of {len(nans)} {fmt.name} codes differ \(every byte"):
        assert_fp8_equal(a, b, strict_nan=True)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_fp8_equal_fails_on_signed_zeros_nan_against_numbers_and_neighbours(fmt):
    for got, want in [(0x00, 0x80), (0x7F, fmt.max_code), (0x01, 0x02), (0x38, 0xB8)]:
        with pytest.raises(AssertionError, match=r"1 of 1 .* codes differ"):
            assert_fp8_equal(fp8(fmt, [got]), fp8(fmt, [want]))


def test_fp8_equal_report_lists_codes_values_and_inputs():
    fmt = fp8ext.E4M3
    x = torch.linspace(-3, 3, 60).reshape(3, 4, 5)
    want = fp8ext.quantize(x, fmt)
    got = want.view(torch.uint8).clone()
    flat = got.view(-1)
    for i in range(3, 60, 5):  # 12 mismatches: one code up
        flat[i] += 1
    table = reference.decode_table("E4M3")
    with pytest.raises(AssertionError) as info:
        assert_fp8_equal(got.view(fmt.torch_dtype), want, input=x, msg="my cast")
    text = str(info.value)
    assert text.startswith("my cast: assert_fp8_equal(): 12 of 60 E4M3 codes differ"), text
    g, w = int(flat[3]), int(want.view(torch.uint8).view(-1)[3])
    line = (f"index (0, 0, 3): got {g:#04x} ({float(table[g])!r}), expected {w:#04x} ({float(table[w])!r}), "
            f"input {x.view(-1)[3].item()!r}")
    assert line in text, text
    assert text.count("\n  index") == 8 and "... and 4 more" in text


def round_half_up(x: torch.Tensor, fmt) -> torch.Tensor:
    """A cast with the classic tie bug: ties go to the larger magnitude instead of to even."""
    mag = x.abs().double()
    vals = torch.from_numpy(reference.finite_positive(fmt.name))
    lo = vals[(torch.searchsorted(vals, mag, right=True) - 1).clamp(0, vals.numel() - 2)]
    hi = vals[(torch.searchsorted(vals, mag, right=True)).clamp(max=vals.numel() - 1)]
    v = torch.where(mag - lo >= hi - mag, hi, lo).clamp(max=fmt.max) * torch.sign(x.double())
    return fp8ext.quantize(v.float(), fmt)  # exact: v is an FP8 value


def test_fp8_equal_report_marks_ties_that_close_fp8_lets_through():
    fmt = fp8ext.E4M3
    x = edge_groups(fmt, torch.float32)["midpoints"]  # the 126 ties inside the range; 63 have an even lower side
    got = round_half_up(x, fmt)
    assert_close_fp8(got, x.double(), max_ulps=0.5)  # a tie is 0.5 ulp from both neighbours: passes
    with pytest.raises(AssertionError) as info:
        assert_fp8_equal(got, fp8ext.quantize(x, fmt), input=x)
    text = str(info.value)
    assert text.startswith("assert_fp8_equal(): 63 of 126 E4M3 codes differ (NaN codes equal any NaN); 63 of them "
                           "at ties (inputs midway between two E4M3 values): check the rounding of ties"), text
    assert "input 0.0009765625, a tie between 0.0 and 0.001953125" in text, text
    assert text.count(", a tie between") == 8, "every reported row is marked"


def test_fp8_equal_report_marks_no_tie_where_the_input_is_none():
    x = torch.tensor([1.05])  # not a tie
    with pytest.raises(AssertionError) as info:
        assert_fp8_equal(fp8(fp8ext.E4M3, [0x39]), fp8ext.quantize(x, fp8ext.E4M3), input=x)
    assert "tie" not in str(info.value)


def test_fp8_equal_shapes_formats_and_wrong_calls():
    q = fp8(fp8ext.E4M3, [1, 2, 3, 4])
    with pytest.raises(AssertionError, match=r"shapes differ: actual has shape \[4\] but expected has shape \[2, 2\]"):
        assert_fp8_equal(q, q.reshape(2, 2))
    with pytest.raises(AssertionError, match="formats differ: actual is torch.float8_e4m3fn but expected is"):
        assert_fp8_equal(q, q.view(torch.uint8).view(torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"assert_fp8_equal\(\): actual is torch.float8_e4m3fn but fmt=fp8ext.E5M2"):
        assert_fp8_equal(q, q, fmt=fp8ext.E5M2)
    with pytest.raises(TypeError, match=r"assert_fp8_equal\(\): actual must be a torch.float8_e4m3fn "
                                        r".* got torch.float32"):
        assert_fp8_equal(q.float(), q)
    with pytest.raises(TypeError, match=r"give fmt="):
        assert_fp8_equal(q.view(torch.uint8), q.view(torch.uint8))
    with pytest.raises(TypeError, match=r"expected must be a torch.Tensor, a numpy array or a number, got list"):
        assert_fp8_equal(q, [1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"input has 3 elements but actual has 4"):
        assert_fp8_equal(q, q, input=torch.ones(3))


# ---- ulp_distance ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_neighbouring_values_are_one_ulp_apart(fmt):
    vals = torch.from_numpy(reference.finite_positive(fmt.name))
    for sign in (1, -1):
        d = ulp_distance(sign * vals[1:], sign * vals[:-1], fmt)
        assert torch.equal(d, torch.ones_like(d)), d
    assert ulp_distance(vals[2], vals[0], fmt).item() == 2.0, "two subnormal steps from zero"


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_spacing_is_the_gap_between_the_neighbours_of_the_reference(fmt):
    """The spacing at b is hi - lo for the FP8 neighbours lo <= |b| < hi (tests/reference.py)."""
    rng = np.random.default_rng(0)
    b = np.exp2(rng.uniform(np.log2(fmt.min_subnormal) - 2, np.log2(fmt.max), 20_000)) * rng.choice([-1, 1], 20_000)
    a = b + rng.normal(size=b.size) * np.abs(b)
    lo, hi = reference.neighbours(b, fmt.name)
    got = ulp_distance(torch.from_numpy(a), torch.from_numpy(b), fmt).numpy()
    np.testing.assert_allclose(got, np.abs(a - b) / (hi - lo), rtol=1e-15)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_spacing_agrees_with_ml_dtypes(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = ml_dtypes.float8_e4m3fn if fmt is fp8ext.E4M3 else ml_dtypes.float8_e5m2
    v = reference.finite_positive(fmt.name)[:-1].astype(t)  # np.spacing of the largest value is NaN
    step = np.spacing(v).astype(np.float64)
    d = ulp_distance(torch.from_numpy(v.astype(np.float64) + step), torch.from_numpy(v.astype(np.float64)), fmt)
    assert torch.equal(d, torch.ones_like(d))


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_correct_cast_is_within_half_an_ulp_and_ties_are_exactly_half(fmt, dtype):
    groups = edge_groups(fmt, dtype)
    x = torch.cat([edge_values(fmt, dtype), (torch.randn(10_000) * fmt.max / 4).to(dtype)])
    x = x[x.isfinite() & (x.abs() <= fmt.max)]
    d = ulp_distance(ref_codes(x, fmt), x.double())
    assert d.max().item() <= 0.5
    mids = groups["midpoints"].double()
    assert torch.equal(ulp_distance(ref_codes(groups["midpoints"], fmt), mids), torch.full_like(mids, 0.5))
    for near in ("above_midpoints", "below_midpoints"):
        assert ulp_distance(ref_codes(groups[near], fmt), groups[near].double()).max().item() < 0.5
    other = ref_codes(groups["above_midpoints"], fmt).view(torch.uint8) - 1  # the neighbour below: wrong
    assert ulp_distance(other.view(fmt.torch_dtype), groups["above_midpoints"].double()).min().item() > 0.5


def test_ulp_distance_of_special_values_and_broadcasting():
    inf, nan = float("inf"), float("nan")
    a = torch.tensor([nan, nan, inf, inf, 448.0, -inf, 0.0, -0.0])
    b = torch.tensor([nan, 1.0, inf, -inf, inf, 3.0, -0.0, 2.0 ** -10])
    assert ulp_distance(a, b, fp8ext.E4M3).tolist() == [0.0, inf, 0.0, inf, inf, inf, 0.0, 0.5]
    col = ulp_distance(torch.tensor([[1.0], [1.125]]), 1.0, "e4m3")
    assert col.shape == (2, 1) and col.tolist() == [[0.0], [1.0]]
    assert ulp_distance(fp8(fp8ext.E5M2, [0x3C]), 1.25).item() == 1.0, "the format from the float8 dtype"
    with pytest.raises(TypeError, match=r"ulp_distance\(\): give fmt="):
        ulp_distance(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match=r"ulp_distance\(\): fmt must be fp8ext.E4M3 or fp8ext.E5M2"):
        ulp_distance(torch.ones(2), torch.ones(2), "e3m4")


# ---- assert_close_fp8 --------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_close_fp8_accepts_a_correct_cast_of_every_edge_case(fmt, dtype):
    x = edge_values(fmt, dtype)
    assert_close_fp8(fp8ext.quantize(x, fmt), x.double(), saturate=True)  # NaN equals NaN, Inf clamps to max
    inside = x[x.abs() <= fmt.max]
    assert_close_fp8(fp8ext.quantize(inside, fmt, saturate=False), inside.double())


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_stochastic_rounding_is_within_one_ulp_but_not_half(fmt):
    x = (torch.rand(20_000, generator=torch.Generator().manual_seed(1)) * 2 - 1) * fmt.max / 3
    q = fp8ext.quantize(x, fmt, stochastic=True, seed=3)
    assert_close_fp8(q, x.double(), max_ulps=1.0)
    with pytest.raises(AssertionError, match=r"Mismatched elements: \d+ / 20000") as info:
        assert_close_fp8(q, x.double())
    assert f"not within 0.5 {fmt.name} ulps" in str(info.value)


def test_close_fp8_report_is_like_torch_testing():
    q = fp8(fp8ext.E4M3, [0x38, 0x3A, 0x40])  # 1.0, 1.25, 2.0
    ref = torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64)
    with pytest.raises(AssertionError) as info:
        assert_close_fp8(q, ref, msg="layer 3")
    text = str(info.value)
    assert text.startswith("layer 3: assert_close_fp8(): actual is not within 0.5 E4M3 ulps of reference"), text
    for part in ["Mismatched elements: 1 / 3 (33.3%)", "Greatest ulp distance: 2 at index (1,) (up to 0.5 allowed)",
                 "Greatest absolute difference: 0.25 at index (1,)", "  (1,): 0x3a (1.25), 1.0, 2"]:
        assert part in text, text
    assert_close_fp8(q, ref, max_ulps=2)


def test_close_fp8_greatest_absolute_difference_points_at_a_mismatch():
    """The element with the largest absolute difference may be inside the tolerance (a large value off by
    less than half an ulp); the report's greatest absolute difference is over the mismatches only."""
    q = fp8(fp8ext.E4M3, [0x7C, 0x38])  # 384.0 (0.3 ulp from 393.6, |diff| 9.6), 1.0 (1 ulp from 1.125)
    ref = torch.tensor([393.6, 1.125], dtype=torch.float64)
    with pytest.raises(AssertionError) as info:
        assert_close_fp8(q, ref)
    text = str(info.value)
    assert "Mismatched elements: 1 / 2" in text and "Greatest absolute difference: 0.125 at index (1,)" in text, text


def test_close_fp8_saturation_nan_and_wrong_calls():
    e4 = fp8ext.E4M3
    q = fp8ext.quantize(torch.tensor([1e6, -1e6, float("inf")]), e4)  # saturates to +-448
    with pytest.raises(AssertionError, match="Mismatched elements: 3 / 3"):
        assert_close_fp8(q, torch.tensor([1e6, -1e6, float("inf")]))
    assert_close_fp8(q, torch.tensor([1e6, -1e6, float("inf")]), saturate=True)
    nan = fp8(e4, [0x7F])
    assert_close_fp8(nan, torch.tensor([float("nan")]))
    with pytest.raises(AssertionError, match="Mismatched elements: 1 / 1"):
        assert_close_fp8(nan, torch.tensor([float("nan")]), equal_nan=False)
    assert_close_fp8(torch.tensor([1.125]), torch.tensor([1.1]), e4)  # real values, format given
    with pytest.raises(AssertionError, match=r"shapes differ"):
        assert_close_fp8(nan, torch.zeros(2))
    with pytest.raises(ValueError, match=r"max_ulps must be >= 0, got -1"):
        assert_close_fp8(nan, torch.zeros(1), max_ulps=-1)


# ---- edge_values -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_hold_every_value_tie_and_neighbour(fmt, dtype):
    x = edge_values(fmt, dtype)
    assert x.dtype == dtype and x.dim() == 1
    have = set(x.double().tolist())
    vals = reference.finite_positive(fmt.name)
    assert set(vals) | set(-vals) <= have, "every finite value, both signs"
    mids = (vals[:-1] + vals[1:]) / 2
    assert set(mids) | set(-mids) <= have, "every tie"
    g = edge_groups(fmt, dtype)
    assert np.array_equal(g["midpoints"].double().numpy(), mids)
    assert np.array_equal(g["subnormals"].double().numpy(), vals[1: 1 << fmt.mant_bits])
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    assert torch.all(g["above_midpoints"].view(bits) - g["midpoints"].view(bits) == 1), "the next input up"
    assert torch.all(g["midpoints"].view(bits) - g["below_midpoints"].view(bits) == 1), "the next input down"
    lo, hi = reference.neighbours(mids, fmt.name)
    assert np.array_equal(np.abs(ref_codes(g["above_midpoints"], fmt).double().numpy()), hi)
    assert np.array_equal(np.abs(ref_codes(g["below_midpoints"], fmt).double().numpy()), lo)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("dtype", DTYPES)
def test_edge_values_order_signs_and_specials(fmt, dtype):
    x = edge_values(fmt, dtype).double()
    n = (x.numel() - 5) // 2
    neg, zeros, pos, tail = x[:n], x[n:n + 2], x[n + 2:2 * n + 2], x[2 * n + 2:]
    assert torch.equal(neg, -pos.flip(0)) and bool((pos[1:] > pos[:-1]).all()) and bool((pos > 0).all())
    assert zeros.tolist() == [0.0, 0.0] and torch.signbit(zeros).tolist() == [True, False]
    assert tail[:2].tolist() == [float("inf"), float("-inf")] and tail[2].isnan()
    assert pos[-1].item() == torch.finfo(dtype).max and pos[0].item() < torch.finfo(dtype).smallest_normal


@pytest.mark.parametrize("fmt, dtype, present, absent", [
    (fp8ext.E4M3, torch.float32, [464.0, 464.00003, 463.99997, 480.0, 960.0], []),
    (fp8ext.E5M2, torch.float32, [61440.0, 61440.004, 61439.996, 65536.0, 131072.0], []),
    (fp8ext.E5M2, torch.float16, [61440.0, 61472.0, 61408.0, 65504.0], [65536.0]),
    (fp8ext.E4M3, torch.bfloat16, [464.0, 466.0, 462.0, 480.0], []),
], ids=["e4m3-f32", "e5m2-f32", "e5m2-f16", "e4m3-bf16"])
def test_edge_values_cover_overflow(fmt, dtype, present, absent):
    over = set(edge_groups(fmt, dtype)["overflow"].double().tolist())
    have = set(edge_values(fmt, dtype).double().tolist())
    for v in present:
        v = torch.tensor(v, dtype=dtype).double().item()
        assert v in over and -v in have, v
    assert not set(absent) & have


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
def test_fp8ext_casts_every_edge_value_as_the_reference_does(fmt, dtype, saturate):
    x = edge_values(fmt, dtype)
    assert_fp8_equal(fp8ext.quantize(x, fmt, saturate=saturate), ref_codes(x, fmt, saturate), strict_nan=True,
                     input=x)


def test_edge_values_refuse_what_they_cannot_make():
    with pytest.raises(TypeError, match=r"^edge_values\(\): dtype must be one of .* got torch.int32"):
        edge_values(fp8ext.E4M3, torch.int32)
    with pytest.raises(TypeError, match=r"^edge_values\(\): fmt must be fp8ext.E4M3 or fp8ext.E5M2"):
        edge_values("fp8", torch.float32)
    with pytest.raises(TypeError, match=r"^edge_groups\(\): dtype must be one of .* got torch.int32"):
        edge_groups(fp8ext.E4M3, torch.int32)
    with pytest.raises(ValueError, match="Format.HYBRID names a recipe"):
        edge_values(fp8ext.Format.HYBRID)
    assert edge_values(fp8ext.Format.E5M2, torch.float64, device="cpu").dtype == torch.float64


# ---- the module --------------------------------------------------------------------------------

def test_testing_needs_only_torch_and_numpy_and_is_not_imported_by_fp8ext():
    code = ("import sys, fp8ext; assert 'fp8ext.testing' not in sys.modules; import fp8ext.testing; "
            "bad = [m for m in ('hypothesis', 'ml_dtypes', 'pytest') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_importing_testing_is_light():
    """import fp8ext.testing loads fp8ext's ops, not its linear modules, torch._dynamo or tqdm (beyond what
    `import torch` loads itself: torch 2.13's torch.hub imports tqdm)."""
    show = "import sys; {}; print(' '.join(sorted(sys.modules)))"
    root = str(Path(fp8ext.__file__).parent.parent)  # this fp8ext, whatever the cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    torch_only = set(subprocess.run([sys.executable, "-c", show.format("import torch")], check=True, env=env,
                                    capture_output=True, text=True).stdout.split())
    loaded = set(subprocess.run([sys.executable, "-c", show.format("import fp8ext.testing")], check=True, env=env,
                                capture_output=True, text=True).stdout.split())
    heavy = {"torch._dynamo", "tqdm", "fp8ext.modules.linear"} & (loaded - torch_only)
    assert not heavy, f"import fp8ext.testing imported {sorted(heavy)}"
    assert "fp8ext.ops" in loaded and "fp8ext.testing._gemm" in loaded


def test_failure_tracebacks_end_in_the_test_not_in_fp8ext_testing(tmp_path):
    """The helpers set __tracebackhide__: pytest's report shows the caller's line and the message only."""
    (tmp_path / "test_user.py").write_text(
        "import torch, fp8ext\n"
        "from fp8ext.testing import assert_close_fp8, assert_fp8_equal, assert_gemm_close\n"
        "q = fp8ext.quantize(torch.tensor([1.0, 2.0]), fp8ext.E4M3)\n"
        "def test_equal():\n    assert_fp8_equal(q, q.view(torch.uint8).flip(0).view(q.dtype))\n"
        "def test_close():\n    assert_close_fp8(q, torch.tensor([1.0, 2.5]))\n"
        "def test_shapes():\n    assert_close_fp8(q, torch.zeros(3))\n"
        "def test_gemm():\n    a = fp8ext.quantize(torch.ones(2, 16), fp8ext.E4M3)\n"
        "    assert_gemm_close(torch.zeros(2, 2), a, a, 1.0, 1.0)\n")
    root = str(Path(fp8ext.__file__).parent.parent)  # this fp8ext, whatever the cwd
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=long",
                          str(tmp_path / "test_user.py")], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert "4 failed" in run.stdout, run.stdout
    assert "fp8ext/testing/" not in run.stdout and "def fail(" not in run.stdout, run.stdout
    assert ">       assert_close_fp8(q, torch.tensor([1.0, 2.5]))" in run.stdout, run.stdout


def test_the_testing_extra_names_what_it_needs():
    tomllib = pytest.importorskip("tomllib")
    with open(Path(__file__).parents[2] / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["testing"] == ["numpy", "hypothesis"]
    assert 'fp8ext[testing]' in fp8ext.testing.__doc__


def test_strategies_say_what_they_need_where_hypothesis_is_missing():
    code = ("import sys; sys.modules['hypothesis'] = None; import fp8ext.testing as t\n"
            "try:\n    t.strategies\nexcept ImportError as e:\n    assert 'needs hypothesis' in str(e), e\n"
            "else:\n    raise SystemExit('fp8ext.testing.strategies imported without hypothesis')")
    subprocess.run([sys.executable, "-c", code], check=True)
    import fp8ext.testing
    with pytest.raises(AttributeError, match="has no attribute 'assert_equal'"):
        fp8ext.testing.assert_equal


def test_quantize_refuses_float64_inputs_since_rounding_through_float32_can_change_the_result():
    # the documented reason (edge_values' docstring): float64 -> float32 -> FP8 is not float64 -> FP8
    with pytest.raises(TypeError, match="float64"):
        fp8ext.quantize(torch.tensor([1.0], dtype=torch.float64), fp8ext.E4M3)
    x = 1.0625 + 2.0 ** -40  # just above the tie between E4M3's 1.0 and 1.125: rounds to 1.125
    via_float32 = torch.tensor([x], dtype=torch.float64).float()  # lands on the tie itself
    assert fp8ext.dequantize(fp8ext.quantize(via_float32, fp8ext.E4M3)).item() == 1.0  # tie to even: 1.0


def test_a_distance_just_over_the_bound_is_printed_as_over_it():
    # 1.0 in E4M3 (ulp 0.125 there) against 1.0625 + 3.725e-9: 0.5000000298 ulps, just over the 0.5 allowed
    actual = torch.tensor([1.0]).to(torch.float8_e4m3fn)
    with pytest.raises(AssertionError) as info:
        fp8ext.testing.assert_close_fp8(actual, torch.tensor([1.0625 + 3.725e-9], dtype=torch.float64))
    text = str(info.value)
    assert "Greatest ulp distance: 0.50000003 at index" in text, text
    assert "(up to 0.5 allowed)" in text and "0.5 at index" not in text
