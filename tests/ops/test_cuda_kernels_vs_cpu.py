"""The CUDA kernels equal the CPU reference byte for byte (which ops/test_quantize.py ties to an independent
reference and to torch), on every input set, alignment, size and stream. Skipped without a GPU."""

import pytest
import torch

import fp8ext
from conftest import assert_same_bytes, requires_cuda
from fp8ext import _C
from inputs import all_bf16, all_f16, float32_cases

pytestmark = [requires_cuda, pytest.mark.cuda]
FORMATS = [fp8ext.E4M3, fp8ext.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def inputs(source):
    return {"bf16_all": all_bf16, "f16_all": all_f16, "f32_cases": lambda: torch.from_numpy(float32_cases())}[source]()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("scale", [1.0, 3.0, 2.0**-7, 121.08108])
@pytest.mark.parametrize("source", ["bf16_all", "f16_all", "f32_cases"])
def test_quantize_gpu_equals_cpu(fmt, saturate, scale, source):
    x = inputs(source)
    want = fp8ext.quantize(x, fmt, scale, saturate=saturate)
    xg = x.cuda()
    got = fp8ext.quantize(xg, fmt, scale, saturate=saturate)
    assert got.device == xg.device and got.dtype == fmt.torch_dtype
    assert_same_bytes(got, want, f"{fmt.name} sat={saturate} scale={scale} {source}")
    got_t = fp8ext.quantize(xg, fmt, torch.tensor(scale, device="cuda"), saturate=saturate)
    assert_same_bytes(got_t, want, "device scale")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, 1 << 20, (1 << 22) + 5])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_quantize_sizes_and_alignment(dtype, n, offset):
    """Unaligned views take the one-element path and the last n % 8 elements the tail path."""
    base = (torch.randn(n + offset, generator=torch.Generator().manual_seed(n)) * 50).to(dtype)
    x = base[offset:]
    acc_c, acc_g = torch.zeros(()), torch.zeros((), device="cuda")
    want = fp8ext.quantize(x, fp8ext.E4M3, 2.0, amax_out=acc_c)
    got = fp8ext.quantize(x.cuda() if offset == 0 else base.cuda()[offset:], fp8ext.E4M3, 2.0, amax_out=acc_g)
    assert_same_bytes(got, want, f"n={n} offset={offset}")
    assert acc_g.item() == acc_c.item()


def test_every_output_byte_is_written():
    x = torch.randn(1_000_003, device="cuda", dtype=torch.bfloat16)
    for poison in (0x00, 0xAA, 0xFF):
        out = torch.full((x.numel(),), poison, dtype=torch.uint8, device="cuda")
        _C.quantize(torch._C._to_dlpack(x), torch._C._to_dlpack(out), 0, 1.0,
                    stream=torch.cuda.current_stream().cuda_stream)
        assert_same_bytes(out, fp8ext.quantize(x.cpu()), f"poison {poison:#x}")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_gpu_equals_cpu_for_a_seed(fmt, dtype):
    x = (torch.randn(1 << 20) * 10).to(dtype)
    for seed in (0, 12345, 2**62 + 17):
        want = fp8ext.quantize(x, fmt, 0.5, stochastic=True, seed=seed)
        got = fp8ext.quantize(x.cuda(), fmt, 0.5, stochastic=True, seed=seed)
        assert_same_bytes(got, want, f"seed {seed}")
    got_tail = fp8ext.quantize(x.cuda()[3:], fmt, 0.5, stochastic=True, seed=9)
    assert_same_bytes(got_tail, fp8ext.quantize(x[3:], fmt, 0.5, stochastic=True, seed=9), "unaligned")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_dequantize_gpu_equals_cpu(fmt, dtype, offset):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4099)[: 256 * 4099 - 5]
    q = codes.view(fmt.torch_dtype)[offset:]
    for s in (1.0, 0.3, 1e-3):
        want = fp8ext.dequantize(q, s, dtype)
        got = fp8ext.dequantize(q.cuda(), torch.tensor(s, device="cuda"), dtype).cpu()
        nan = want.float().isnan()
        assert torch.equal(got.float().isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want[~nan].view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 9, 1 << 20, (1 << 22) + 3])
def test_amax_gpu_equals_cpu(dtype, n):
    x = (torch.randn(n) * 1000).to(dtype)
    assert fp8ext.amax(x.cuda()).item() == fp8ext.amax(x).item()
    x[n // 2] = float("nan")
    assert fp8ext.amax(x.cuda()).isnan().item()
    assert fp8ext.amax(x.cuda()[1:]).isnan().item() == (n > 1)


@pytest.mark.parametrize("nan_bits", [0x7E00, 0xFE00, 0x7C01, 0xFDFF, 0x7FFF], ids=hex)
@pytest.mark.parametrize("n", [9, 4099])
def test_float16_nan_amax_has_the_cpu_bits_on_the_gpu(nan_bits, n):
    """The GPU widens a float16 NaN as the CPU does (sign and payload kept), so amaxes agree bit for bit
    (the hardware conversion alone gives 0x7FFFFFFF for every NaN), in amax, quantize and cast_transpose."""
    x = (torch.randn(n, 64) * 10).half()
    x.view(torch.int16)[n // 2, 5] = nan_bits - (1 << 16 if nan_bits >= 0x8000 else 0)
    # |x| as float32 bits, the NaN widened exactly (payload kept, a signalling NaN not quietened: torch's
    # own x86 conversion quietens it); a NaN's bits beat every number's
    want = torch.tensor([0x7F800000 | ((nan_bits & 0x3FF) << 13)], dtype=torch.int32).view(torch.float32)
    for op in ("amax", "quantize", "cast_transpose"):
        acc_c, acc_g = torch.zeros(1), torch.zeros(1, device="cuda")
        if op == "amax":
            acc_c, acc_g = fp8ext.amax(x).reshape(1), fp8ext.amax(x.cuda()).reshape(1)
        elif op == "quantize":
            fp8ext.quantize(x, fp8ext.E4M3, 1.0, amax_out=acc_c)
            fp8ext.quantize(x.cuda(), fp8ext.E4M3, 1.0, amax_out=acc_g)
        else:
            fp8ext.cast_transpose(x, fp8ext.E4M3, 1.0, amax_out=acc_c)
            fp8ext.cast_transpose(x.cuda(), fp8ext.E4M3, 1.0, amax_out=acc_g)
        assert acc_c.view(torch.int32).item() == want.view(torch.int32).item(), f"{op}: CPU"
        assert acc_g.cpu().view(torch.int32).item() == want.view(torch.int32).item(), f"{op}: GPU"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (8, 8), (64, 64), (128, 256), (72, 200), (130, 70), (1000, 1024),
                                   (4096, 136), (3, 4096)])
def test_cast_transpose_gpu_equals_cpu(fmt, dtype, shape):
    x = (torch.randn(shape) * 300).to(dtype)
    acc_c, acc_g = torch.zeros(()), torch.zeros((), device="cuda")
    q, qt = fp8ext.cast_transpose(x, fmt, 0.5, amax_out=acc_c, saturate=False)
    qg, qtg = fp8ext.cast_transpose(x.cuda(), fmt, torch.tensor(0.5, device="cuda"), amax_out=acc_g, saturate=False)
    assert_same_bytes(qg, q, f"q {shape}")
    assert_same_bytes(qtg, qt, f"q_t {shape}")
    assert acc_g.item() == acc_c.item()


def test_cast_transpose_special_values_on_gpu():
    x = torch.from_numpy(float32_cases()[: 512 * 1024]).reshape(512, 1024)
    for fmt in FORMATS:
        for sat in (True, False):
            q, qt = fp8ext.cast_transpose(x, fmt, saturate=sat)
            qg, qtg = fp8ext.cast_transpose(x.cuda(), fmt, saturate=sat)
            assert_same_bytes(qg, q, "q")
            assert_same_bytes(qtg, qt, "q_t")


def test_runs_on_the_current_stream():
    x = torch.randn(1 << 22, device="cuda")
    want = fp8ext.quantize(x.cpu())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        q = fp8ext.quantize(x)
        done = torch.cuda.Event()
        done.record(s)
    done.synchronize()
    assert_same_bytes(q, want, "side stream")


def test_no_host_synchronisation():
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(2.0, device="cuda")
    acc = torch.zeros((), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        q = fp8ext.quantize(x, fp8ext.E4M3, scale, amax_out=acc)
        fp8ext.dequantize(q, scale, torch.bfloat16)
        fp8ext.cast_transpose(x, fp8ext.E5M2, scale, amax_out=acc)
        fp8ext.amax(x)
        fp8ext.quantize(x, stochastic=True, seed=3)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_cuda_graph_capture_and_replay():
    x = torch.randn(1 << 16, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(4.0, device="cuda")
    acc = torch.zeros((), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp8ext.quantize(x, fp8ext.E4M3, scale, amax_out=acc)  # warm up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q = fp8ext.quantize(x, fp8ext.E4M3, scale, amax_out=acc)
    for trial in range(3):
        x.copy_(torch.randn_like(x) * (trial + 1))
        scale.fill_(0.5 * (trial + 1))
        acc.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert_same_bytes(q, fp8ext.quantize(x.cpu(), fp8ext.E4M3, 0.5 * (trial + 1)), f"replay {trial}")
        assert acc.item() == x.abs().max().float().item()


def test_device_mismatch_is_an_error():
    x = torch.randn(16, device="cuda")
    with pytest.raises(ValueError, match=r"quantize\(\): scale is on cpu but x is on cuda:0"):
        fp8ext.quantize(x, fp8ext.E4M3, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"quantize\(\): amax_out is on cpu but x is on cuda:0"):
        fp8ext.quantize(x, amax_out=torch.zeros(()))
    with pytest.raises(ValueError, match=r"dequantize\(\): scale_inv is on cpu but q is on cuda:0"):
        fp8ext.dequantize(fp8ext.quantize(x), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"cast_transpose\(\): scale is on cpu but x is on cuda:0"):
        fp8ext.cast_transpose(x.view(4, 4), fp8ext.E4M3, torch.tensor(1.0))


def test_large_tensor_uses_64_bit_indexing():
    n = (1 << 31) + 64  # more elements than a 32-bit index can address
    try:
        x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    x.fill_(1.5)
    x[-3:] = torch.tensor([-7.0, 1e6, 2.0], dtype=torch.bfloat16)
    acc = torch.zeros((), device="cuda")
    q = fp8ext.quantize(x, fp8ext.E4M3, amax_out=acc)
    tail = q[-4:].view(torch.uint8).cpu().tolist()
    assert tail == [0x3C, 0xCE, 0x7E, 0x40]
    assert acc.item() == float(torch.tensor(1e6, dtype=torch.bfloat16))
    del x, q
    torch.cuda.empty_cache()
