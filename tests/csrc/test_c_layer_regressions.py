"""Regression tests for the C layer's review findings: overlapping outputs, shape arithmetic, scales held in
host memory, empty inputs, the delayed-scaling rule for negative history entries, and (on a GPU) the
cast-transpose vector path, the GEMM plan cache's bound, autotune and the exit of a process that used cuBLASLt."""

import ctypes
import math
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import dlpack_craft
import fp8ext
from conftest import DEVICES, assert_same_bytes, requires_cuda
from fp8ext import _C

BAD_SCALES = [float("nan"), 0.0, -1.0, float("inf")]


def rel_err(got, want):
    """Norm-relative error. Hopper's FP8 tensor cores accumulate with fewer bits than float32 (about
    1e-4 relative here), so GEMM outputs are not compared element-wise to 1e-5 (as tests/ops/test_gemm.py)."""
    return ((got.double() - want).norm() / want.norm()).item()


# ---- outputs that overlap scale, each other or x: refused ----------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
@pytest.mark.parametrize("written, other", [("scale_inv_out", "scale"), ("amax_out", "scale"),
                                            ("scale_inv_out", "amax_out")])
def test_outputs_sharing_memory_with_scale_or_each_other_are_refused(device, op, written, other):
    buf = torch.ones(2, device=device)
    kwargs = {"scale": torch.ones((), device=device)}
    kwargs[written] = buf[0:1]
    kwargs[other] = buf[0] if other == "scale" else buf[0:1]  # a 0-d and a 1-element view of the same float
    x = torch.ones(4, 8, device=device)
    with pytest.raises(ValueError, match=rf"{op}\(\): {written} and {other} share memory"):
        getattr(fp8ext, op)(x, fp8ext.E4M3, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
def test_amax_out_inside_x_is_refused(device, op):
    x = torch.ones(4, 8, device=device)
    with pytest.raises(ValueError, match=rf"{op}\(\): amax_out and x share memory"):
        getattr(fp8ext, op)(x, fp8ext.E4M3, 1.0, amax_out=x[1, 2:3])


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_amax_out_sharing_memory_with_out_scale_is_refused(device):
    q = fp8ext.quantize(torch.randn(16, 32, device=device))
    one = torch.ones((), device=device)
    s = torch.ones((), device=device)
    with pytest.raises(ValueError, match=r"gemm\(\): amax_out and out_scale share memory"):
        fp8ext.gemm(q, q, a_scale_inv=one, b_scale_inv=one, out_dtype=torch.float8_e4m3fn, out_scale=s, amax_out=s)


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_out_sharing_memory_with_its_bias_is_refused(device):
    q = fp8ext.quantize(torch.randn(16, 32, device=device))
    one = torch.ones((), device=device)
    out = torch.zeros(16, 16, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gemm\(\): out and bias share memory"):
        fp8ext.gemm(q, q, a_scale_inv=one, b_scale_inv=one, out=out, bias=out[3])


@pytest.mark.parametrize("device", DEVICES)
def test_scale_update_buffers_sharing_memory_are_refused(device):
    from fp8ext.core.boundary import stream_of
    hist = torch.zeros(4, 2, device=device)
    both = torch.ones(4, device=device)
    fmt_max = torch.full((4,), 448.0, device=device)
    dl = torch.utils.dlpack.to_dlpack
    with pytest.raises(ValueError, match=r"scale_update\(\): scale and scale_inv share memory"):
        _C.scale_update(dl(hist), dl(both), dl(both), dl(fmt_max), 0, 0.0, True, 0.5,
                        stream=stream_of(torch.device(device)))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_blocks_scale_inv_inside_x_is_refused(device):
    x = torch.randn(4, 256, device=device)
    q = torch.empty(4, 256, dtype=torch.uint8, device=device)
    from fp8ext.core.boundary import stream_of
    dl = torch.utils.dlpack.to_dlpack
    with pytest.raises(ValueError, match=r"quantize_blocks\(\): scale_inv and x share memory"):
        _C.quantize_blocks(dl(x), dl(q), dl(x[0, :4]), fp8ext.E4M3.code, 1, 256, 1, 0,
                           stream=stream_of(torch.device(device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
def test_neighbouring_elements_of_one_buffer_are_accepted(device, op):
    buf = torch.tensor([0.0, 0.0, 4.0], device=device)  # amax, scale_inv, scale side by side
    getattr(fp8ext, op)(torch.full((4, 8), -3.0, device=device), fp8ext.E4M3, buf[2], amax_out=buf[0:1],
                        scale_inv_out=buf[1:2])
    assert buf.tolist() == [3.0, 0.25, 4.0], "amax_out, scale_inv_out written; scale untouched"


# ---- a shape's element count: no negative dimension, no overflow ---------------------------------

def crafted_capsule(shape):
    """A DLPack capsule of float32 on the CPU claiming `shape` over a 16-byte buffer (never read: refused)."""
    buf = np.zeros(4, dtype=np.float32)
    dims = (ctypes.c_int64 * len(shape))(*shape)
    t = dlpack_craft.DLTensor(buf.ctypes.data, dlpack_craft.DLDevice(1, 0), len(shape),
                              dlpack_craft.DLDataType(2, 32, 1), dims, None, 0)
    m = dlpack_craft.DLManagedTensor(t, None, None)
    dlpack_craft._KEEP.extend([buf, dims, m])
    return dlpack_craft._capsule_new(ctypes.addressof(m), b"dltensor", None)


@pytest.mark.parametrize("shape, match", [
    ((-4, 4), r"amax\(\): x has shape \[-4, 4\]; a dimension cannot be negative"),
    ((4, -1), r"a dimension cannot be negative"),
    ((2**62, 4), r"amax\(\): x has shape \[4611686018427387904, 4\]; its element count does not fit in int64"),
    ((3, 2**62), r"does not fit in int64"),
    ((2**31, 2**31, 2**31), r"does not fit in int64"),
    ((2**61, 2), r"does not fit in int64"),  # 2**62 elements fit, 2**64 bytes of float32 do not
    ((0, 2**62, 4), r"does not fit in int64"),  # empty, but its strides would have wrapped
], ids=lambda v: str(list(v)) if isinstance(v, tuple) else "")
def test_shapes_whose_element_count_is_negative_or_overflows_are_refused(shape, match):
    out = torch.zeros(())
    with pytest.raises(ValueError, match=match):
        _C.amax(crafted_capsule(shape), torch._C._to_dlpack(out))
    assert out.item() == 0.0


# ---- scales and scale_invs in host memory follow the rule of Python numbers ----------------------

@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
def test_cpu_scale_tensor_must_be_finite_and_positive(op, bad):
    with pytest.raises(ValueError, match=rf"{op}\(\): scale must be finite and positive, got {bad:g} \(a CPU tensor\)"):
        getattr(fp8ext, op)(torch.ones(4, 8), fp8ext.E4M3, torch.tensor(bad))


@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
def test_cpu_scale_inv_tensor_of_dequantize_must_be_finite_and_positive(bad):
    q = fp8ext.quantize(torch.ones(8))
    with pytest.raises(ValueError, match=rf"dequantize\(\): scale_inv must be finite and positive, got {bad:g}"):
        fp8ext.dequantize(q, torch.tensor(bad))


def gemm_operands(m=32, k=256, n=48):
    a = fp8ext.quantize(torch.randn(m, k, generator=torch.Generator().manual_seed(0)))
    b = fp8ext.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)))
    return a, b


@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
@pytest.mark.parametrize("kind", ["tensor", "row", "block"])
@pytest.mark.parametrize("which", ["a_scale_inv", "b_scale_inv"])
def test_cpu_gemm_scale_invs_are_checked_element_by_element(kind, which, bad):
    a, b = gemm_operands()
    if kind == "block":
        sa = fp8ext.quantize_blockwise(a.float(), block=(1, 128))[1]  # [32, 2], stored R-fastest
        sb = fp8ext.quantize_blockwise(b.float(), block=(128, 128))[1]  # [1, 2], rows padded to 4 floats
    else:
        sa, sb = (torch.ones(()), torch.ones(())) if kind == "tensor" else (torch.ones(32), torch.ones(48))
    scales = {"a_scale_inv": sa, "b_scale_inv": sb}
    index = {"tensor": (), "row": (5,), "block": (0, 1)}[kind]
    scales[which][index] = bad
    where = rf" at \[{', '.join(map(str, index))}\]" if index else ""
    with pytest.raises(ValueError, match=rf"gemm\(\): {which} must be finite and positive, got {bad:g}{where}"):
        fp8ext.gemm(a, b, **scales, out_dtype=torch.float32)


def test_cpu_gemm_out_scale_is_checked():
    a, b = gemm_operands()
    with pytest.raises(ValueError, match=r"gemm\(\): out_scale must be finite and positive, got 0"):
        fp8ext.gemm(a, b, a_scale_inv=torch.ones(()), b_scale_inv=torch.ones(()), out_dtype=torch.float8_e4m3fn,
                    out_scale=torch.zeros(()))


def test_padding_of_block_scales_is_not_read():
    """128x128 scale_inv rows are padded to 4 floats; the padding holds zeros and is not a scale."""
    a, b = gemm_operands(k=256, n=48)
    qa, sa = fp8ext.quantize_blockwise(a.float(), block=(1, 128))
    qb, sb = fp8ext.quantize_blockwise(b.float(), block=(128, 128))
    assert sb.shape == (1, 2) and sb.stride() == (4, 1)
    fp8ext.gemm(qa, qb, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)


# ---- empty inputs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0,), (0, 16), (5, 0)], ids=str)
def test_casts_of_empty_tensors(device, shape):
    x = torch.empty(shape, device=device)
    amax, sinv = torch.full((1,), 7.0, device=device), torch.zeros(1, device=device)
    q = fp8ext.quantize(x, fp8ext.E4M3, 2.0, amax_out=amax, scale_inv_out=sinv)
    assert q.shape == shape and q.dtype == torch.float8_e4m3fn
    assert fp8ext.dequantize(q, 0.5).shape == shape
    assert fp8ext.amax(x).item() == 0.0
    assert amax.item() == 7.0 and sinv.item() == 0.5, "an empty x leaves amax_out, still sets scale_inv_out"
    if len(shape) == 2:
        q, qt = fp8ext.cast_transpose(x, fp8ext.E5M2, 2.0, amax_out=amax)
        assert q.shape == shape and qt.shape == shape[::-1] and amax.item() == 7.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_gemm_with_no_rows(device, out_dtype):
    a = torch.empty(0, 64, dtype=torch.float8_e4m3fn, device=device)
    b = fp8ext.quantize(torch.randn(32, 64, device=device))
    one = torch.ones((), device=device)
    kwargs = {}
    if out_dtype == torch.float8_e4m3fn:
        kwargs = {"out_scale": one, "amax_out": torch.full((), 5.0, device=device)}
    out = fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one, out_dtype=out_dtype, **kwargs)
    assert out.shape == (0, 32) and out.dtype == out_dtype
    if kwargs:
        assert kwargs["amax_out"].item() == 0.0, "amax of an empty product"
    acc = torch.empty(0, 32, device=device)
    assert fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one, out=acc, accumulate=True) is acc
    rows = fp8ext.gemm(a, b, a_scale_inv=torch.ones(0, device=device), b_scale_inv=torch.ones(32, device=device))
    assert rows.shape == (0, 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k, n", [(0, 32), (64, 0)])
def test_gemm_still_refuses_empty_k_and_n(device, k, n):
    a = torch.empty(8, k, dtype=torch.float8_e4m3fn, device=device)
    b = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
    one = torch.ones((), device=device)
    with pytest.raises(ValueError, match=r"gemm\(\): cuBLASLt's FP8 GEMM needs K and N to be nonzero multiples of 16"):
        fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one)


# ---- delayed scaling with negative history entries --------------------------------------------------

def reference_scale_update(hist, scale, fmt_max, algo, margin, backoff):
    """csrc/scaling.h's rule in float64: the max of the finite, positive entries (0 if none); entry 0 non-finite ->
    backoff; negative entries count as 0. Returns float32 (scale, scale_inv) as the C code rounds them."""
    new = []
    for row, old, fmax in zip(hist.tolist(), scale.tolist(), fmt_max.tolist()):
        usable = [v for v in (row if algo == 0 else row[:1]) if math.isfinite(v) and v > 0]
        amax = max(usable, default=0.0)
        if not math.isfinite(row[0]):
            s = float(np.float32(old * backoff))
        elif amax > 0:
            s = min(float(np.float32(fmax / amax / 2.0**margin)), float(np.finfo(np.float32).max))
        else:
            s = old
        new.append(s)
    s = torch.tensor(new, dtype=torch.float32)
    return s, (1.0 / s.double()).float()


NEGATIVE_HISTORIES = torch.tensor([
    [-5.0, 2.0, 1.0, 0.0],          # a negative recent entry larger in magnitude than the rest
    [-1e30, -2.0, -0.0, -3.0],      # nothing positive: scale kept
    [4.0, -8.0, float("nan"), 1.0],  # a negative older entry beside a NaN one
    [-0.0, 0.0, 0.5, -0.25],
    [float("-inf"), -1.0, 2.0, 3.0],  # -Inf is an overflow (non-finite), a negative number is not
    [-7.0, float("inf"), 1.0, 2.0],
    [3.0, 2.0, 1.0, 0.5],
], dtype=torch.float32)


def run_scale_update(device, hist, algo, margin, backoff=0.5):
    n = hist.shape[0]
    h = hist.clone().to(device)
    scale = torch.linspace(1.0, 4.0, n).to(device)
    scale_inv = torch.zeros(n, device=device)
    fmt_max = torch.tensor([448.0, 57344.0] * (n // 2) + [448.0] * (n % 2), device=device)
    before = scale.clone()
    _C.scale_update(torch._C._to_dlpack(h), torch._C._to_dlpack(scale), torch._C._to_dlpack(scale_inv),
                    torch._C._to_dlpack(fmt_max), algo, float(margin), True, backoff,
                    stream=torch.cuda.current_stream().cuda_stream if device == "cuda" else 0)
    return h.cpu(), scale.cpu(), scale_inv.cpu(), before.cpu(), fmt_max.cpu()


@pytest.mark.parametrize("algo", [0, 1], ids=["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_cpu_scale_update_with_negative_entries_matches_float64_reference(algo, margin):
    h, scale, scale_inv, before, fmt_max = run_scale_update("cpu", NEGATIVE_HISTORIES, algo, margin)
    want, want_inv = reference_scale_update(NEGATIVE_HISTORIES, before, fmt_max, algo, margin, 0.5)
    assert torch.equal(scale, want), (scale, want)
    assert torch.equal(scale_inv, want_inv)
    moved = torch.equal(h[:, 1:].view(torch.int32), NEGATIVE_HISTORIES[:, :-1].view(torch.int32))
    assert moved and not h[:, 0].any(), "the history moved along by one, entry 0 zeroed"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("algo", [0, 1], ids=["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 2])
def test_gpu_scale_update_equals_cpu_on_negative_entries(algo, margin):
    g = torch.Generator().manual_seed(algo * 10 + margin)
    rand = torch.randn(64, 200, generator=g) * torch.exp2(torch.randint(-20, 20, (64, 200), generator=g).float())
    rand[::7, 0] = float("nan")
    rand[::11, 3] = float("-inf")
    hist = torch.cat([NEGATIVE_HISTORIES.repeat(1, 50), rand])
    cpu = run_scale_update("cpu", hist, algo, margin)
    gpu = run_scale_update("cuda", hist, algo, margin)
    for what, c, d in zip(["history", "scale", "scale_inv"], cpu[:3], gpu[:3]):
        assert torch.equal(c.view(torch.int32), d.view(torch.int32)), f"{what}: GPU differs from the CPU reference"


# ---- GPU: cast_transpose's vector path when rows % 8 != 0 -------------------------------------------

@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [65, 129, 131, 135, 263, 199], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("cols", [64, 128, 200, 72, 1032, 30], ids=lambda c: f"cols{c}")
def test_gpu_cast_transpose_with_odd_rows_is_bit_exact(dtype, rows, cols):
    assert rows % 8 in (1, 3, 7)
    g = torch.Generator().manual_seed(rows * 7 + cols)
    x = (torch.randn(rows, cols, generator=g) * 300).to(dtype)
    x[rows // 2, cols // 3] = float("nan") if cols == 200 else -1e6
    for fmt in (fp8ext.E4M3, fp8ext.E5M2):
        amax_c, amax_g = torch.zeros(1), torch.zeros(1, device="cuda")
        qc, qtc = fp8ext.cast_transpose(x, fmt, 0.75, amax_out=amax_c, saturate=fmt is fp8ext.E4M3)
        qg, qtg = fp8ext.cast_transpose(x.cuda(), fmt, 0.75, amax_out=amax_g, saturate=fmt is fp8ext.E4M3)
        assert_same_bytes(qg, qc, f"q {rows}x{cols} {fmt.name}")
        assert_same_bytes(qtg, qtc, f"q_t {rows}x{cols} {fmt.name}")
        assert torch.equal(amax_g.cpu().view(torch.int32), amax_c.view(torch.int32))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows, offset", [(131, 0), (136, 1), (136, 2), (136, 4), (132, 8)])
def test_gpu_cast_transpose_into_a_narrowly_aligned_out_t(rows, offset):
    """q_t whose rows are only 1-, 2- or 4-byte aligned (by its start or its row length) gets narrower stores:
    the same bytes."""
    x = torch.randn(rows, 128, device="cuda") * 100
    raw = torch.empty(rows * 128 + offset, dtype=torch.uint8, device="cuda")
    qt = raw[offset:].view(128, rows)
    q = torch.empty(rows, 128, dtype=torch.uint8, device="cuda")
    _C.cast_transpose(torch._C._to_dlpack(x), torch._C._to_dlpack(q), torch._C._to_dlpack(qt), fp8ext.E4M3.code,
                      2.0, stream=torch.cuda.current_stream().cuda_stream)
    qc, qtc = fp8ext.cast_transpose(x.cpu(), fp8ext.E4M3, 2.0)
    assert_same_bytes(q, qc, "q")
    assert_same_bytes(qt, qtc, "q_t")


# ---- GPU: the plan cache is bounded, autotune uses torch's memory and releases the GIL ---------------

@requires_cuda
@pytest.mark.cuda
def test_gpu_plan_cache_is_bounded_and_evicts_least_recently_used():
    _C.gemm_cache_clear()
    info = fp8ext.gemm_cache_info()
    bound = info["max_plans"]
    assert bound == 1024
    b = fp8ext.quantize(torch.randn(16, 32, device="cuda"))
    one = torch.ones((), device="cuda")
    a_all = fp8ext.quantize(torch.randn(bound + 40, 32, device="cuda"))
    first = a_all[:1].clone()  # M = 1
    for m in range(1, bound + 41):  # one plan per M
        if m > 1:
            fp8ext.gemm(first, b, a_scale_inv=one, b_scale_inv=one)  # keeps M = 1 the most recently used
        fp8ext.gemm(a_all[:m], b, a_scale_inv=one, b_scale_inv=one)
    after = fp8ext.gemm_cache_info()
    assert after["plans"] == bound and after["evictions"] - info["evictions"] == 40
    hits = after["hits"]
    fp8ext.gemm(first, b, a_scale_inv=one, b_scale_inv=one)
    assert fp8ext.gemm_cache_info()["hits"] == hits + 1, "the plan used most recently survived"
    misses = fp8ext.gemm_cache_info()["misses"]
    out = fp8ext.gemm(a_all[:2], b, a_scale_inv=one, b_scale_inv=one, out_dtype=torch.float32)
    assert fp8ext.gemm_cache_info()["misses"] == misses + 1, "M = 2 was evicted, and is made again"
    want = a_all[:2].double() @ b.double().t()
    assert rel_err(out, want) < 1e-3, "the rebuilt plan computes the product"


@requires_cuda
@pytest.mark.cuda
def test_gpu_autotune_times_into_torch_memory_once():
    m = k = n = 1024
    a = fp8ext.quantize(torch.randn(m, k, device="cuda"))
    b = fp8ext.quantize(torch.randn(n, k, device="cuda"))
    one = torch.ones((), device="cuda")
    _C.gemm_cache_clear()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    before = fp8ext.gemm_cache_info()
    out = fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one, out_dtype=torch.float32, autotune=True)
    info = fp8ext.gemm_cache_info()
    assert info["tuned"] - before["tuned"] == 1
    assert torch.cuda.max_memory_allocated() >= base + 2 * m * n * 4, "out and autotune's scratch, both from torch"
    fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one, out_dtype=torch.float32, autotune=True)
    assert fp8ext.gemm_cache_info()["tuned"] == info["tuned"], "tuned once per plan"
    want = a.double() @ b.double().t()
    assert rel_err(out, want) < 1e-3, "the tuned plan computes the product"


@requires_cuda
@pytest.mark.cuda
def test_gpu_autotune_waits_for_the_gpu_without_the_gil():
    a = fp8ext.quantize(torch.randn(8192, 8192, device="cuda"))
    b = fp8ext.quantize(torch.randn(8192, 8192, device="cuda"))
    one = torch.ones((), device="cuda")
    _C.gemm_cache_clear()
    fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one)  # warm: handle, heuristic plan, allocator
    torch.cuda.synchronize()
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=tick)
    t.start()
    time.sleep(0.02)
    start = time.perf_counter()
    fp8ext.gemm(a, b, a_scale_inv=one, b_scale_inv=one, autotune=True)
    took = time.perf_counter() - start
    stop.set()
    t.join()
    during = [y - x for x, y in zip(ticks, ticks[1:]) if y > start]
    assert took > 0.1, f"tuning 8192^3 should take a while, took {took:.3f} s"
    assert max(during) < 0.05, f"a Python thread waited {max(during):.3f} s of {took:.3f} s: the GIL was held"


@requires_cuda
@pytest.mark.cuda
def test_gpu_process_exits_cleanly_after_cublaslt_use():
    """The cuBLASLt handles are left to the process's exit (not destroyed after CUDA may be gone)."""
    code = textwrap.dedent("""
        import torch, fp8ext
        a = fp8ext.quantize(torch.randn(64, 64, device="cuda"))
        one = torch.ones((), device="cuda")
        fp8ext.gemm(a, a, a_scale_inv=one, b_scale_inv=one, autotune=True)
        torch.cuda.synchronize()
        print("done")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "done", r.stderr
    assert "error" not in r.stderr.lower(), r.stderr
