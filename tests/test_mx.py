"""MX (OCP Microscaling) and NVFP4 block scaling, against an independent numpy / ml_dtypes reference on the CPU, and
on a GPU against the CPU bit for bit."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ext
from conftest import requires_cuda

ML = {"E4M3": ml_dtypes.float8_e4m3fn, "E5M2": ml_dtypes.float8_e5m2, "E3M2": ml_dtypes.float6_e3m2fn,
      "E2M3": ml_dtypes.float6_e2m3fn, "E2M1": ml_dtypes.float4_e2m1fn}
EMAX = {"E4M3": 8, "E5M2": 15, "E3M2": 4, "E2M3": 2, "E2M1": 2}  # OCP MX v1.0, table 1
ELEMS = [fp8ext.E4M3, fp8ext.E5M2, fp8ext.E3M2, fp8ext.E2M3, fp8ext.E2M1]


def reference_mx(x: np.ndarray, f, rule: str, block=32):
    """float64 math and ml_dtypes casts, block by block."""
    xb = x.astype(np.float64).reshape(-1, block)
    scales, elems = [], []
    for row in xb:
        amax = np.abs(row).max()
        if np.isnan(amax):
            scales.append(255)
            e = 0
        else:
            if amax == 0:
                e = -127
            elif rule == "floor":
                e = math.floor(math.log2(amax)) - EMAX[f.name]
            else:
                e = math.ceil(math.log2(amax / f.max))
            e = max(-127, min(127, e))
            scales.append(e + 127)
        v = np.clip(row / 2.0 ** e, -f.max, f.max)  # the element formats saturate
        elems.append(v.astype(np.float32).astype(ML[f.name]).view(np.uint8))
    return np.concatenate(elems), np.array(scales, dtype=np.uint8)


def sample(seed=0, rows=8, cols=256):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, cols // 32, 1), generator=g)
                                                          .float()).repeat_interleave(32, 2).reshape(rows, cols)
    x[0, :32] = 0.0  # a block of zeros
    x[1, 5] = 1e6  # an outlier
    x[2, 40] = 2.0 ** 120  # a scale near the top of E8M0
    return x


@pytest.mark.parametrize("f", ELEMS, ids=lambda f: f.name)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_quantization_equals_the_reference(f, rule):
    x = sample()
    elems, scales = fp8ext.quantize_mx(x, f, scale_rule=rule)
    want_e, want_s = reference_mx(x.numpy(), f, rule)
    assert scales.shape == (8, 8) and scales.dtype == torch.uint8
    assert np.array_equal(scales.reshape(-1).numpy(), want_s)
    got = elems.view(torch.uint8) if elems.dtype != torch.uint8 else elems
    assert np.array_equal(got.reshape(-1).numpy(), want_e)
    back = fp8ext.dequantize_mx(elems, scales, f)
    rel = ((back - x).norm() / x.norm()).item()
    assert rel < {"E4M3": 0.04, "E5M2": 0.08, "E3M2": 0.08, "E2M3": 0.04, "E2M1": 0.2}[f.name]


def test_rceil_never_saturates_and_floor_uses_the_top_binade():
    x = sample(seed=3)
    for f in ELEMS:
        _, s_r = fp8ext.quantize_mx(x, f, scale_rule="rceil")
        _, s_f = fp8ext.quantize_mx(x, f, scale_rule="floor")
        assert (s_r.int() >= s_f.int()).all(), f"{f.name}: the RCEIL scale is never below FLOOR's"
        scale = torch.exp2(s_r.float() - 127).repeat_interleave(32, -1)
        assert (x.abs() <= f.max * scale).all(), "RCEIL: every block fits without saturating"


def test_nan_block_gets_the_nan_scale():
    x = torch.randn(64)
    x[3] = float("nan")
    _, scales = fp8ext.quantize_mx(x, fp8ext.E2M1)
    assert scales.tolist()[0] == 0xFF and scales.tolist()[1] != 0xFF
    assert fp8ext.dequantize_mx(*fp8ext.quantize_mx(x, fp8ext.E2M1), fp8ext.E2M1)[:32].isnan().all()


def test_nvfp4_equals_the_reference():
    x = sample(seed=5, cols=128)
    elems, bs, ts = fp8ext.quantize_nvfp4(x)
    xd = x.numpy().astype(np.float64)
    ts_want = np.float32(np.abs(x.numpy()).max() / np.float32(448 * 6))
    assert ts.item() == ts_want
    blocks = x.numpy().reshape(8, 8, 16)
    bamax = np.abs(blocks).max(-1).astype(np.float32)
    bs_want = (bamax / np.float32(6) / ts_want).astype(np.float32)
    bs_want = np.clip(bs_want, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(bs.view(torch.uint8).numpy(), bs_want.view(np.uint8))
    s = bs_want.astype(np.float32) * ts_want
    s = np.where(s > 0, s, np.float32(1))
    v = np.clip((blocks / s[..., None]).astype(np.float32), -6, 6)
    assert np.array_equal(elems.reshape(8, 8, 16).numpy(), v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    back = fp8ext.dequantize_nvfp4(elems, bs, ts)
    assert ((back - x).norm() / x.norm()).item() < 0.2 and torch.isfinite(back).all() and xd.size == back.numel()


def test_block_scaling_refuses_bad_arguments():
    with pytest.raises(ValueError, match="multiple of block=32"):
        fp8ext.quantize_mx(torch.randn(4, 40))
    with pytest.raises(ValueError, match="elem must be one of"):
        fp8ext.quantize_mx(torch.randn(32), fp8ext.E8M0)
    with pytest.raises(ValueError, match="scale_rule must be"):
        fp8ext.quantize_mx(torch.randn(32), scale_rule="round")
    with pytest.raises(TypeError, match="x must be a float32"):
        fp8ext.quantize_nvfp4(torch.zeros(16, dtype=torch.int32))


def _u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("f", ELEMS, ids=lambda f: f.name)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_on_the_gpu_gives_the_cpu_bytes(f, rule):
    x = sample(seed=3, rows=64, cols=1024)
    x[3, 7] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        e_cpu, s_cpu = fp8ext.quantize_mx(x.to(dtype), f, scale_rule=rule)
        e_gpu, s_gpu = fp8ext.quantize_mx(x.to(dtype).cuda(), f, scale_rule=rule)
        bad_s = (s_gpu.cpu() != s_cpu).nonzero().tolist()
        assert not bad_s, f"{dtype}: scales differ at blocks {bad_s[:4]}: gpu {[int(s_gpu[r, c]) for r, c in bad_s[:4]]}, " \
                          f"cpu {[int(s_cpu[r, c]) for r, c in bad_s[:4]]}"
        bad = (_u8(e_gpu).cpu() != _u8(e_cpu)).nonzero().tolist()
        assert not bad, f"{dtype}: {len(bad)} elements differ, first at {bad[:4]}: x {[x[r, c].item() for r, c in bad[:4]]}, " \
                        f"gpu {[int(_u8(e_gpu)[r, c]) for r, c in bad[:4]]}, cpu {[int(_u8(e_cpu)[r, c]) for r, c in bad[:4]]}"
        back = fp8ext.dequantize_mx(e_gpu, s_gpu, f).cpu()
        want = fp8ext.dequantize_mx(e_cpu, s_cpu, f)
        assert torch.equal(back.nan_to_num(7.0), want.nan_to_num(7.0))


@requires_cuda
@pytest.mark.cuda
def test_nvfp4_on_the_gpu_gives_the_cpu_bytes():
    x = sample(seed=4, rows=32, cols=512) * 1e-3
    e_cpu, b_cpu, t_cpu = fp8ext.quantize_nvfp4(x)
    e_gpu, b_gpu, t_gpu = fp8ext.quantize_nvfp4(x.cuda())
    assert torch.equal(e_gpu.cpu(), e_cpu) and torch.equal(_u8(b_gpu).cpu(), _u8(b_cpu))
    assert t_gpu.cpu().view(torch.int32) == t_cpu.view(torch.int32)
