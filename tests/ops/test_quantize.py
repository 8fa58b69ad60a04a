"""quantize() on the CPU, byte for byte against the independent numpy reference and against torch's own
float8 casts; the GPU's agreement with the CPU is in ops/test_cuda_kernels_vs_cpu.py."""

import numpy as np
import pytest
import torch

import fp8ext
import reference
from fp8ext.testing import assert_fp8_equal
from inputs import all_bf16, all_f16, float32_cases

FORMATS = [fp8ext.E4M3, fp8ext.E5M2]
SCALES = [1.0, 0.5, 3.0, 2.0**-7, 121.08108, 1e-3]


def scaled_f32(x: torch.Tensor, scale: float) -> np.ndarray:
    """x * scale rounded to float32: the value the definition rounds to FP8."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x.float().numpy() * np.float32(scale)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("source", ["bf16_all", "f16_all", "f32_cases"])
def test_quantize_matches_reference(fmt, saturate, scale, source):
    x = {"bf16_all": all_bf16, "f16_all": all_f16, "f32_cases": lambda: torch.from_numpy(float32_cases())}[source]()
    q = fp8ext.quantize(x, fmt, scale, saturate=saturate)
    assert q.dtype == fmt.torch_dtype and q.shape == x.shape
    want = reference.quantize(scaled_f32(x, scale), fmt.name, saturate, x=x.float().numpy())
    assert_fp8_equal(q, want, strict_nan=True, input=x,
                     msg=f"{fmt.name} saturate={saturate} scale={scale} {source}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_device_scale_equals_number_scale(fmt):
    x = torch.from_numpy(float32_cases(seed=1)[:200_000])
    for s in (0.37, 7.0):
        a = fp8ext.quantize(x, fmt, s)
        b = fp8ext.quantize(x, fmt, torch.tensor(s, dtype=torch.float32))
        c = fp8ext.quantize(x, fmt, torch.tensor([s], dtype=torch.float32))
        assert_fp8_equal(b, a, strict_nan=True, input=x, msg="0-d scale tensor")
        assert_fp8_equal(c, a, strict_nan=True, input=x, msg="1-element scale tensor")


def test_saturation_and_overflow_rules():
    e4, e5 = fp8ext.E4M3, fp8ext.E5M2
    x = torch.tensor([464.0, 464.001, 480.0, float("inf"), -1e9])
    assert fp8ext.quantize(x, e4).view(torch.uint8).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE]
    assert fp8ext.quantize(x, e4, saturate=False).view(torch.uint8).tolist() == [0x7E, 0x7F, 0x7F, 0x7F, 0xFF]
    y = torch.tensor([61439.0, 61440.0, float("inf"), -float("inf")])
    assert fp8ext.quantize(y, e5).view(torch.uint8).tolist() == [0x7B, 0x7B, 0x7B, 0xFB]
    assert fp8ext.quantize(y, e5, saturate=False).view(torch.uint8).tolist() == [0x7B, 0x7C, 0x7C, 0xFC]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_nan_keeps_its_sign_and_zeros_keep_theirs(fmt):
    x = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, -1e-30, 1e-30])
    for scale in (1.0, 3.0, torch.tensor(0.5)):
        got = fp8ext.quantize(x, fmt, scale).view(torch.uint8).tolist()
        assert got == [0x7F, 0xFF, 0x00, 0x80, 0x80, 0x00], f"scale {scale}"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_code_round_trips(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = [c for c in range(256) if np.isfinite(reference.decode_table(fmt.name)[c])]
    x = fp8ext.dequantize(codes.view(fmt.torch_dtype))
    q = fp8ext.quantize(x[finite], fmt)
    assert q.view(torch.uint8).tolist() == finite


def test_amax_out_is_fused_running_max():
    x = torch.tensor([1.0, -7.5, 3.0], dtype=torch.bfloat16)
    acc = torch.tensor(2.0)
    fp8ext.quantize(x, amax_out=acc)
    assert acc.item() == 7.5
    acc2 = torch.tensor(100.0)
    fp8ext.quantize(x, amax_out=acc2)
    assert acc2.item() == 100.0, "amax_out keeps a larger value it already holds"
    acc3 = torch.tensor(-1.0)
    fp8ext.quantize(torch.zeros(4), amax_out=acc3)
    assert acc3.item() == 0.0, "a negative starting value loses to |x|"
    acc4 = torch.tensor(0.0)
    fp8ext.quantize(torch.tensor([1.0, float("nan")]), amax_out=acc4)
    assert acc4.isnan().item(), "NaN in x shows in the amax"
    acc5 = torch.tensor(3.0)
    fp8ext.quantize(torch.empty(0), amax_out=acc5)
    assert acc5.item() == 3.0, "an empty x leaves amax_out unchanged"


def test_amax_uses_unscaled_values():
    acc = torch.zeros(())
    fp8ext.quantize(torch.tensor([2.0, -5.0]), fp8ext.E4M3, 100.0, amax_out=acc)
    assert acc.item() == 5.0


def test_shapes_are_kept():
    for shape in [(), (0,), (7,), (3, 5), (2, 3, 4, 5)]:
        x = torch.randn(shape)
        q = fp8ext.quantize(x)
        assert q.shape == x.shape


def test_numpy_input_on_cpu():
    a = np.array([[0.1, 1.0, -300.0], [1e6, np.nan, 2.0**-9]], dtype=np.float32)
    q = fp8ext.quantize(a, fp8ext.E4M3)
    assert isinstance(q, torch.Tensor) and q.shape == (2, 3)
    assert_fp8_equal(q, reference.quantize(a, "E4M3", True), strict_nan=True, input=a, msg="numpy float32")
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    assert_fp8_equal(fp8ext.quantize(h, "e5m2"), reference.quantize(h.astype(np.float32), "E5M2", True),
                     strict_nan=True, input=h, msg="numpy f16")


def test_format_spellings_agree():
    x = torch.randn(100)
    want = fp8ext.quantize(x, fp8ext.E5M2)
    for f in ("e5m2", "E5M2", fp8ext.Format.E5M2, torch.float8_e5m2):
        assert torch.equal(fp8ext.quantize(x, f).view(torch.uint8), want.view(torch.uint8))


# ---- torch's own casts -------------------------------------------------------------------------

def torch_saturates(dtype: torch.dtype) -> bool:
    """Whether the installed torch's CPU cast to `dtype` saturates (it changed between releases)."""
    fmt = fp8ext.E4M3 if dtype == torch.float8_e4m3fn else fp8ext.E5M2
    code = torch.tensor([1e6]).to(dtype).view(torch.uint8).item()
    assert code in (fmt.max_code, fmt.overflow_code), f"torch cast 1e6 to {dtype} as {code:#x}: neither rule"
    return code == fmt.max_code


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("source", ["bf16_all", "f16_all", "f32_cases"])
def test_equals_torch_cast_in_torchs_saturation_mode(dtype, source):
    """torch's x.to(float8) is fp8ext.quantize(x, scale=1) with the saturation torch uses. Which one
    that is depends on the release (2.11: E4M3 non-saturating; 2.13 on the CPU: E4M3 saturating, E5M2
    non-saturating), so it is read off torch first, then every byte is compared."""
    x = {"bf16_all": all_bf16, "f16_all": all_f16, "f32_cases": lambda: torch.from_numpy(float32_cases())}[source]()
    fmt = fp8ext.E4M3 if dtype == torch.float8_e4m3fn else fp8ext.E5M2
    ours = fp8ext.quantize(x, fmt, saturate=torch_saturates(dtype))
    assert_fp8_equal(ours, x.to(dtype), strict_nan=True, input=x,
                     msg=f"torch {torch.__version__} {dtype} from {source}")


def test_torch_saturation_behaviour_is_pinned():
    """Write down what this torch does, so a change in a new release shows up here first."""
    major_minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    e4 = torch_saturates(torch.float8_e4m3fn)
    e5 = torch_saturates(torch.float8_e5m2)
    assert not e5, "torch's E5M2 cast has always been non-saturating (overflow -> Inf)"
    if major_minor >= (2, 12):
        assert e4, "torch >= 2.12 saturates E4M3 on the CPU (pytorch#178817)"
    elif major_minor <= (2, 11):
        assert not e4, "torch <= 2.11 casts to E4M3 without saturating (overflow -> NaN)"
