"""MX (OCP Microscaling) and NVFP4 block scaling, against an independent numpy / ml_dtypes reference on the CPU, and
on a GPU (fp8ext's one-pass kernel, csrc/kernels/quantize_mx.cu) against the CPU bit for bit."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import fp8ext
from conftest import requires_cuda
from fp8ext.core.boundary import FP8_DLPACK

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


def test_mx_inf_block_gets_the_nan_scale():
    """amax = Inf: the NaN scale 0xFF under both rules, as for a NaN (OCP MX v1.0); the block dequantizes to NaN
    (tests/ops/test_mx_nonfinite.py covers the rule in full)."""
    x = torch.zeros(32)
    x[3] = float("inf")
    for f in ELEMS:
        e_f, s_f = fp8ext.quantize_mx(x, f, scale_rule="floor")
        _, s_r = fp8ext.quantize_mx(x, f, scale_rule="rceil")
        assert s_f.tolist() == [0xFF] and s_r.tolist() == [0xFF], f"{f.name}: {s_f}, {s_r}"
        assert fp8ext.dequantize_mx(e_f, s_f, f).isnan().all()


def test_nvfp4_block_scale_of_a_nan_quotient_is_the_positive_nan_code():
    """0x7F for a block holding NaN or Inf (left out of the tensor's amax: tensor_scale stays finite) and wherever
    block_amax / 6 / tensor_scale is 0 / 0 (an all-zero block where the tensor scale underflows to 0); x86 alone would
    make 0 / 0 negative (0xFF)."""
    x = torch.randn(3, 16)
    x[1, 4] = float("nan")
    assert fp8ext.quantize_nvfp4(x)[1].view(torch.uint8)[1, 0].item() == 0x7F
    x = torch.randn(3, 16)
    x[2, 9] = float("-inf")
    _, bs, ts = fp8ext.quantize_nvfp4(x)
    assert ts.item() == fp8ext.quantize_nvfp4(x[:2])[2].item() and bs.view(torch.uint8)[:, 0].tolist()[2] == 0x7F
    x = torch.zeros(2, 16)
    x[0, 0] = 2.0 ** -140  # amax / 2688 rounds to 0
    _, bs, ts = fp8ext.quantize_nvfp4(x)
    assert ts.item() == 0.0 and bs.view(torch.uint8).flatten().tolist() == [0x7E, 0x7F]


def test_nvfp4_refuses_an_empty_tensor():
    with pytest.raises(ValueError, match="x must not be empty"):
        fp8ext.quantize_nvfp4(torch.zeros(0, 16))


def test_the_kernel_bindings_refuse_bad_arguments():
    """fp8ext._C.quantize_mx / quantize_nvfp4 run on a GPU only and name the argument they refuse."""
    dl = torch._C._to_dlpack
    x, out, sc = torch.randn(4, 64), torch.empty(4, 64, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"quantize_mx\(\): x is in host memory"):
        fp8ext._C.quantize_mx(dl(x), dl(out), dl(sc), fp8ext.E2M1.code)
    with pytest.raises(ValueError, match=r"fmt must be an MX element format"):
        fp8ext._C.quantize_mx(dl(x), dl(out), dl(sc), fp8ext.E8M0.code)
    with pytest.raises(ValueError, match=r"quantize_nvfp4\(\): x must be contiguous"):
        fp8ext._C.quantize_nvfp4(dl(x[:, :32].t()), dl(out), dl(sc), dl(torch.zeros(())), dl(torch.zeros(())))


def _u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _assert_bytes(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, what: str) -> None:
    """got (GPU) has want's (CPU) dtype, shape and bytes; x (the input, for the message) has got's shape or None."""
    assert got.is_cuda and got.dtype == want.dtype and got.shape == want.shape, \
        f"{what}: gpu {got.dtype} {list(got.shape)} on {got.device}, cpu {want.dtype} {list(want.shape)}"
    g, w = _u8(got).cpu().reshape(-1), _u8(want).reshape(-1)
    bad = (g != w).nonzero().flatten()[:4].tolist()
    xs = [x.reshape(-1)[i].item() for i in bad] if x is not None and x.shape == got.shape else "-"
    assert not bad, f"{what}: {int((g != w).sum())} bytes differ, first at flat index {bad}: x {xs}, " \
                    f"gpu {g[bad].tolist()}, cpu {w[bad].tolist()}"


def _mx_gpu_equals_cpu(x: torch.Tensor, f, rule: str, what: str, block: int = 32) -> None:
    e_cpu, s_cpu = fp8ext.quantize_mx(x, f, block, scale_rule=rule)
    e_gpu, s_gpu = fp8ext.quantize_mx(x.cuda(), f, block, scale_rule=rule)
    _assert_bytes(s_gpu, s_cpu, None, f"{what} {f.name} {rule} scales")
    _assert_bytes(e_gpu, e_cpu, x, f"{what} {f.name} {rule} elements")


def _nvfp4_gpu_equals_cpu(x: torch.Tensor, what: str) -> None:
    e_cpu, b_cpu, t_cpu = fp8ext.quantize_nvfp4(x)
    e_gpu, b_gpu, t_gpu = fp8ext.quantize_nvfp4(x.cuda())
    assert t_gpu.shape == t_cpu.shape and t_gpu.cpu().view(torch.int32) == t_cpu.view(torch.int32), \
        f"{what}: tensor_scale gpu {t_gpu.item()}, cpu {t_cpu.item()}"
    _assert_bytes(b_gpu, b_cpu, None, f"{what} block scales")
    _assert_bytes(e_gpu, e_cpu, x, f"{what} elements")


def _every_pattern(dtype: torch.dtype, order: str) -> torch.Tensor:
    """All 65,536 16-bit patterns of dtype (NaN, Inf, subnormals, zeros) as [n, 32]: sorted (whole blocks of NaN, of
    zeros, of subnormals), shuffled (NaN and Inf scattered), or shuffled without NaN, or without NaN and Inf."""
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    if order != "sorted":
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(7))]
        if order != "shuffled":
            x = x[~x.isnan() if order == "no_nan" else torch.isfinite(x)]
        x = x[: x.numel() // 32 * 32]
    return x.reshape(-1, 32)


PATTERN_ORDERS = ["sorted", "shuffled", "no_nan", "finite"]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("f", ELEMS, ids=lambda f: f.name)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mx_on_the_gpu_gives_the_cpu_bytes(f, rule, dtype):
    x = sample(seed=3, rows=64, cols=1024)
    x[3, 7] = float("nan")
    x[4, 100] = float("-inf")
    x[5, 64:96] = torch.randn(32) * 2.0 ** -135  # subnormal float32 (zero in bfloat16 and float16)
    _mx_gpu_equals_cpu(x.to(dtype), f, rule, str(dtype))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("f", ELEMS, ids=lambda f: f.name)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
@pytest.mark.parametrize("order", PATTERN_ORDERS)
def test_mx_on_the_gpu_every_16_bit_pattern(f, rule, order):
    """Every bfloat16 pattern (read as bfloat16, and widened to float32) and every float16 pattern."""
    xb = _every_pattern(torch.bfloat16, order)
    _mx_gpu_equals_cpu(xb, f, rule, f"bf16 {order}")
    _mx_gpu_equals_cpu(xb.float(), f, rule, f"bf16 as fp32 {order}")
    _mx_gpu_equals_cpu(_every_pattern(torch.float16, order), f, rule, f"fp16 {order}")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1, 32), (3, 5, 64), (7, 96), (2, 1, 1, 32), (4099, 32), (0, 32), (3, 0), (32,)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_block_scaling_on_the_gpu_odd_shapes(shape, dtype):
    """Leading dimensions of any count and size (blocks run across rows), a grid's partial last CUDA block, empty x."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(11)) * 100).to(dtype)
    for f in (fp8ext.E4M3, fp8ext.E2M1):
        _mx_gpu_equals_cpu(x, f, "floor", f"{shape} {dtype}")
    if x.numel():
        _nvfp4_gpu_equals_cpu(x, f"{shape} {dtype}")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_block_scaling_on_the_gpu_non_contiguous_and_unaligned_x(dtype):
    """A non-contiguous x is copied first; an x that is contiguous but not 16-byte aligned is read element by element:
    both give the CPU's bytes."""
    base = (torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 10).to(dtype)
    strided = base[:, ::2]  # [64, 128], row stride 256
    assert not strided.is_contiguous()
    flat = base.reshape(-1)
    shifted_cpu = flat[2: 2 + 63 * 256].reshape(63, 256)  # starts 4 or 8 bytes in
    shifted_gpu = flat.cuda()[2: 2 + 63 * 256].reshape(63, 256)
    assert shifted_gpu.is_contiguous() and shifted_gpu.data_ptr() % 16 != 0
    for f in (fp8ext.E4M3, fp8ext.E3M2):
        _mx_gpu_equals_cpu(strided, f, "rceil", f"strided {dtype}")
        e_cpu, s_cpu = fp8ext.quantize_mx(shifted_cpu, f)
        e_gpu, s_gpu = fp8ext.quantize_mx(shifted_gpu, f)
        _assert_bytes(s_gpu, s_cpu, None, f"unaligned {dtype} {f.name} scales")
        _assert_bytes(e_gpu, e_cpu, shifted_cpu, f"unaligned {dtype} {f.name} elements")
    _nvfp4_gpu_equals_cpu(strided, f"strided {dtype}")
    e_cpu, b_cpu, _ = fp8ext.quantize_nvfp4(shifted_cpu)
    e_gpu, b_gpu, _ = fp8ext.quantize_nvfp4(shifted_gpu)
    _assert_bytes(b_gpu, b_cpu, None, f"unaligned {dtype} block scales")
    _assert_bytes(e_gpu, e_cpu, shifted_cpu, f"unaligned {dtype} elements")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("block", [16, 64])
def test_mx_on_the_gpu_other_block_sizes_take_the_torch_path(block):
    x = sample(seed=9, rows=16, cols=256)
    _mx_gpu_equals_cpu(x, fp8ext.E2M3, "floor", f"block {block}", block=block)


@requires_cuda
@pytest.mark.cuda
def test_the_gpu_path_runs_the_kernel_not_the_torch_code(monkeypatch):
    """On a GPU, quantize_mx (block 32) and quantize_nvfp4 call fp8ext._C's one-pass kernels once each and never the
    torch code's casts (fp8ext.mx.quantize)."""
    import fp8ext.mx as mx

    calls = []

    def spy(name):
        real = getattr(fp8ext._C, name)

        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapped

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch code's quantize ran on the GPU")

    monkeypatch.setattr(fp8ext._C, "quantize_mx", spy("quantize_mx"))
    monkeypatch.setattr(fp8ext._C, "quantize_nvfp4", spy("quantize_nvfp4"))
    monkeypatch.setattr(mx, "quantize", torch_path)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    fp8ext.quantize_mx(x, fp8ext.E4M3)
    fp8ext.quantize_mx(x, fp8ext.E2M1, scale_rule="rceil")
    fp8ext.quantize_nvfp4(x)
    assert calls == ["quantize_mx", "quantize_mx", "quantize_nvfp4"], calls


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("order", PATTERN_ORDERS)
def test_nvfp4_on_the_gpu_every_16_bit_pattern(order):
    """Blocks holding NaN or Inf get the NaN block scale and are left out of the tensor's amax; the finite patterns
    give a tensor scale near the float32 maximum."""
    xb = _every_pattern(torch.bfloat16, order)
    _nvfp4_gpu_equals_cpu(xb, f"bf16 {order}")
    _nvfp4_gpu_equals_cpu(xb.float(), f"bf16 as fp32 {order}")
    _nvfp4_gpu_equals_cpu(_every_pattern(torch.float16, order), f"fp16 {order}")


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0])
def test_nvfp4_on_the_gpu_gives_the_cpu_bytes(dtype, scale):
    x = sample(seed=4, rows=32, cols=512) * scale
    _nvfp4_gpu_equals_cpu(x.to(dtype), f"{dtype} x{scale}")


@requires_cuda
@pytest.mark.cuda
def test_nvfp4_on_the_gpu_tiny_tensors():
    """float32 subnormal amax: a tensor scale that underflows to 0 (0 / 0 in zero blocks) or is itself subnormal."""
    g = torch.Generator().manual_seed(2)
    for k, zero_row in ((5, 0), (5000, 1)):
        x = torch.randint(-k, k + 1, (64, 32), generator=g).float() * 2.0 ** -149
        x[zero_row] = 0.0
        _nvfp4_gpu_equals_cpu(x, f"tiny k={k}")


@requires_cuda
@pytest.mark.cuda
def test_block_scaling_on_the_gpu_uses_the_current_stream():
    x = sample(seed=6, rows=256, cols=1024).cuda()
    want = fp8ext.quantize_mx(x, fp8ext.E4M3), fp8ext.quantize_nvfp4(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = fp8ext.quantize_mx(x, fp8ext.E4M3), fp8ext.quantize_nvfp4(x)
    torch.cuda.current_stream().wait_stream(s)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(_u8(g), _u8(w)) if g.dim() else torch.equal(g, w)


@requires_cuda
@pytest.mark.cuda
def test_the_kernel_bindings_refuse_bad_arguments_on_the_gpu():
    dl = torch._C._to_dlpack
    x = torch.randn(4, 64, device="cuda")
    out = torch.empty(4, 64, dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"scales has shape \[4, 4\]"):
        fp8ext._C.quantize_mx(dl(x), dl(out), dl(torch.empty(4, 4, dtype=torch.uint8, device="cuda")),
                              fp8ext.E2M1.code)
    with pytest.raises(ValueError, match=r"scales is on cpu"):
        fp8ext._C.quantize_mx(dl(x), dl(out), dl(torch.empty(4, 2, dtype=torch.uint8)), fp8ext.E2M1.code)
    with pytest.raises(ValueError, match=r"x must be contiguous"):
        fp8ext._C.quantize_mx(dl(x[:, ::2]), dl(out[:, :32]), dl(torch.empty(4, 1, dtype=torch.uint8, device="cuda")),
                              fp8ext.E2M1.code)
    with pytest.raises(ValueError, match=r"tensor_scale must hold exactly one float32"):
        fp8ext._C.quantize_nvfp4(dl(x), dl(out), dl(torch.empty(4, 4, dtype=torch.uint8, device="cuda")),
                                 dl(torch.empty(2, device="cuda")), dl(torch.empty((), device="cuda")))
    with pytest.raises(ValueError, match=r"out and x share memory"):
        fp8ext._C.quantize_mx(dl(x), dl(x.view(torch.uint8).reshape(-1)[:256].view(4, 64)),
                              dl(torch.empty(4, 2, dtype=torch.uint8, device="cuda")), fp8ext.E2M1.code)
    with pytest.raises(ValueError, match=r"multiple of 32"):
        fp8ext._C.quantize_mx(dl(torch.randn(4, 48, device="cuda")), dl(out), dl(out), fp8ext.E2M1.code)
    if FP8_DLPACK:  # this torch hands float8 tensors to C as float8, which C checks against fmt
        with pytest.raises(TypeError, match=r"out must hold uint8 codes"):
            fp8ext._C.quantize_mx(dl(x), dl(torch.empty(4, 64, dtype=torch.float8_e4m3fn, device="cuda")),
                                  dl(torch.empty(4, 2, dtype=torch.uint8, device="cuda")), fp8ext.E2M1.code)


def test_dequantize_nvfp4_takes_one_tensor_scale_per_row_of_blocks():
    """Rows quantized separately (each its own tensor scale) dequantize together, bit for bit, given their scales
    as [rows, 1] (the KV cache's NVFP4 part reads its chunks so); scales that do not broadcast are refused."""
    rows = [torch.randn(3, 32) * 10.0 ** e for e in (-2, 0, 3)]
    parts = [fp8ext.quantize_nvfp4(r) for r in rows]
    elements = torch.stack([e for e, _, _ in parts], 1)  # [3, rows, 32]
    block_scales = torch.stack([b for _, b, _ in parts], 1)
    tensor_scales = torch.stack([t for _, _, t in parts])[:, None]  # [rows, 1]
    got = fp8ext.dequantize_nvfp4(elements, block_scales, tensor_scales)
    want = torch.stack([fp8ext.dequantize_nvfp4(*p) for p in parts], 1)
    assert torch.equal(got, want)
    with pytest.raises(TypeError, match=r"tensor_scale must be a one-element float tensor \(or scales that broadcast"):
        fp8ext.dequantize_nvfp4(elements, block_scales, torch.ones(4, 1))
