"""FP4 (E2M1), FP6 (E2M3, E3M2), E8M0 and the fnuz FP8 variants: quantize and dequantize on the CPU, bit for bit
against ml_dtypes on every bfloat16 pattern and a million float32 values; packing."""
import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ext
from conftest import requires_cuda

ML = {"E2M1": ml_dtypes.float4_e2m1fn, "E2M3": ml_dtypes.float6_e2m3fn, "E3M2": ml_dtypes.float6_e3m2fn,
      "E8M0": ml_dtypes.float8_e8m0fnu, "E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
      "E5M2FNUZ": ml_dtypes.float8_e5m2fnuz}
FORMATS = [getattr(fp8ext, n) for n in ML]
FNUZ = [fp8ext.E4M3FNUZ, fp8ext.E5M2FNUZ]


def all_bf16():
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def random_f32(n=1_000_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


def ml_codes(x: torch.Tensor, fmt, saturate=False) -> np.ndarray:
    v = x.float().numpy()
    if saturate:  # ml_dtypes' fnuz casts do not saturate: clamp first (NaN stays NaN)
        v = np.where(np.isnan(v), v, np.clip(v, -fmt.max, fmt.max))
    with np.errstate(all="ignore"):
        return v.astype(ML[fmt.name]).view(np.uint8)


def assert_codes(got: torch.Tensor, want: np.ndarray, x: torch.Tensor, what: str):
    bad = np.nonzero(got.numpy() != want)[0]
    assert not len(bad), (f"{what}: {len(bad)} codes differ, first inputs "
                          f"{[hex(int(x.float().view(torch.int32)[i]) & 0xFFFFFFFF) for i in bad[:4]]}: got "
                          f"{got.numpy()[bad[:4]]}, ml_dtypes {want[bad[:4]]}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("source", ["bf16_all", "f32_random", "f32_small"])
def test_encoding_equals_ml_dtypes_bit_for_bit(fmt, source):
    x = {"bf16_all": all_bf16, "f32_random": random_f32,
         "f32_small": lambda: random_f32(seed=1) * 1e-36}[source]()  # the latter: many float32 subnormals
    saturations = [False, True] if fmt in FNUZ else [True]  # the MX element formats always saturate
    for sat in saturations:
        got = fp8ext.quantize(x, fmt, 1.0, saturate=sat)
        assert got.dtype == torch.uint8 and got.shape == x.shape
        assert_codes(got, ml_codes(x, fmt, saturate=sat and fmt in FNUZ), x, f"{fmt.name} saturate={sat}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_multiplies_before_rounding(fmt):
    x = torch.randn(10_000) * 3
    scale = 0.37
    got = fp8ext.quantize(x, fmt, torch.tensor(scale), saturate=fmt not in FNUZ)
    assert_codes(got, ml_codes((x * scale), fmt), x, fmt.name)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_decoding_every_code_equals_ml_dtypes(fmt):
    codes = torch.arange(1 << min(fmt.bits, 8), dtype=torch.int32).to(torch.uint8)
    got = fp8ext.dequantize(codes, 1.0, torch.float32, fmt=fmt).numpy()
    want = codes.numpy().view(ML[fmt.name]).astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32)), "values and signed zeros"
    half = fp8ext.dequantize(codes, 0.5, torch.bfloat16, fmt=fmt).float().numpy()
    assert np.array_equal(half[ok], (want[ok] * 0.5).astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_format_constants_come_from_the_c_core_and_match_ml_dtypes(fmt):
    info = ml_dtypes.finfo(ML[fmt.name])
    assert fmt.max == float(info.max)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.min_normal == float(info.smallest_normal)
    assert (fmt.nan_code is None) == (fmt.name in ("E2M1", "E2M3", "E3M2"))
    assert not fmt.has_inf and fmt.torch_dtype == torch.uint8
    assert repr(fmt) == f"fp8ext.{fmt.name}"


def test_fp4_and_fp6_limits_named_in_the_specification():
    assert (fp8ext.E2M1.max, fp8ext.E2M3.max, fp8ext.E3M2.max) == (6.0, 7.5, 28.0)
    assert (fp8ext.E4M3FNUZ.max, fp8ext.E5M2FNUZ.max) == (240.0, 57344.0)
    x = torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 7.0, -100.0, float("inf")])
    q = fp8ext.quantize(x, fp8ext.E2M1)  # ties to even on one mantissa bit; saturation
    assert fp8ext.dequantize(q, fmt=fp8ext.E2M1).tolist() == [0.0, 1.0, 1.0, 2.0, 4.0, 6.0, -6.0, 6.0]


def test_amax_and_scale_inv_outputs_work_with_the_small_formats():
    x = torch.randn(1000) * 5
    amax, sinv = torch.zeros(1), torch.zeros(1)
    fp8ext.quantize(x, fp8ext.E2M1, 0.5, amax_out=amax, scale_inv_out=sinv)
    assert amax.item() == x.abs().max().item() and sinv.item() == 2.0


@pytest.mark.parametrize("bits, pack, unpack, group", [(4, fp8ext.pack_fp4, fp8ext.unpack_fp4, 2),
                                                       (6, fp8ext.pack_fp6, fp8ext.unpack_fp6, 4)])
def test_packing_round_trips_and_has_the_documented_layout(bits, pack, unpack, group):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 64), generator=g, dtype=torch.int32).to(torch.uint8)
    packed = pack(codes)
    assert packed.shape == (3, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack(packed), codes)
    # independently: the bit string, lowest index in the lowest bits, little-endian bytes
    row = codes[0].tolist()
    stream = sum(c << (bits * i) for i, c in enumerate(row))
    assert packed[0].tolist() == [(stream >> (8 * k)) & 0xFF for k in range(64 * bits // 8)]
    with pytest.raises(ValueError, match=f"multiple of {group}"):
        pack(codes[:, :group + 1])
    with pytest.raises(ValueError, match=f"below {1 << bits}"):
        pack(torch.full((group,), 1 << bits, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        pack(codes.float())


@pytest.mark.parametrize("bits, pack, unpack, group", [(4, fp8ext.pack_fp4, fp8ext.unpack_fp4, 2),
                                                       (6, fp8ext.pack_fp6, fp8ext.unpack_fp6, 4)])
@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0, 0), (2, 0, 8)])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_packing_empty_and_meta_tensors_gives_the_packed_shape(bits, pack, unpack, group, shape, device):
    codes = torch.zeros(shape, dtype=torch.uint8, device=device)
    packed = pack(codes)
    assert packed.shape == (*shape[:-1], shape[-1] * bits // 8) and packed.device.type == device
    assert unpack(packed).shape == codes.shape


def test_small_formats_refuse_what_they_do_not_support():
    x = torch.randn(64, 64)
    with pytest.raises(NotImplementedError, match="stochastic rounding is for E4M3 and E5M2 only"):
        fp8ext.quantize(x, fp8ext.E2M1, stochastic=True, seed=0)
    with pytest.raises(TypeError, match="must be fp8ext.E4M3 or fp8ext.E5M2"):
        fp8ext.cast_transpose(x, fp8ext.E2M1)
    with pytest.raises(TypeError, match="q must hold uint8 codes"):
        fp8ext.dequantize(fp8ext.quantize(x), fmt=fp8ext.E2M1)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_gpu_codes_equal_the_cpu_reference_and_ml_dtypes(fmt, dtype):
    if dtype == torch.bfloat16:
        x = all_bf16()
    elif dtype == torch.float32:
        x = random_f32()
    else:
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for saturate in (True, False):
        for scale in (1.0, 0.375):
            cpu = fp8ext.quantize(x, fmt, scale, saturate=saturate)
            amax = torch.zeros((), device="cuda")
            gpu = fp8ext.quantize(x.cuda(), fmt, scale, saturate=saturate, amax_out=amax)
            bad = (gpu.cpu() != cpu).nonzero().flatten()
            assert not len(bad), (f"{fmt.name} {dtype} saturate={saturate} scale={scale}: {len(bad)} codes differ, "
                                  f"first inputs {x[bad[:4]].tolist()}: gpu {gpu.cpu()[bad[:4]].tolist()}, "
                                  f"cpu {cpu[bad[:4]].tolist()}")
            want_amax = torch.zeros(())
            fp8ext.quantize(x, fmt, scale, saturate=saturate, amax_out=want_amax)
            assert amax.cpu().view(torch.int32) == want_amax.view(torch.int32)
    if dtype == torch.bfloat16:  # and the CPU reference is ml_dtypes' (tested above); check the GPU directly too
        assert_codes(fp8ext.quantize(x.cuda(), fmt, 1.0, saturate=False).cpu(), ml_codes(x, fmt), x, f"gpu {fmt.name}")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_gpu_decoding_equals_the_cpu_reference(fmt, dtype):
    codes = torch.arange(1 << fmt.bits, dtype=torch.uint8).repeat(37)  # odd length: the tail path too
    for scale_inv in (1.0, 3.0, 2.0 ** -100):
        cpu = fp8ext.dequantize(codes, scale_inv, dtype, fmt=fmt)
        gpu = fp8ext.dequantize(codes.cuda(), scale_inv, dtype, fmt=fmt).cpu()
        same = (gpu.view(torch.int16 if dtype != torch.float32 else torch.int32)
                == cpu.view(torch.int16 if dtype != torch.float32 else torch.int32))
        nan_both = gpu.isnan() & cpu.isnan()
        assert bool((same | nan_both).all()), f"{fmt.name} -> {dtype} scale_inv={scale_inv}"


@requires_cuda
@pytest.mark.cuda
def test_small_formats_refuse_stochastic_rounding_on_the_gpu_too():
    with pytest.raises(NotImplementedError, match="stochastic rounding is for E4M3 and E5M2 only"):
        fp8ext.quantize(torch.randn(16, device="cuda"), fp8ext.E2M1, stochastic=True)
