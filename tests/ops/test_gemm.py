"""fp8ext.gemm against a float64 product of the dequantized inputs, on the CPU (emulated) and the GPU
(cuBLASLt), over format pairs, scale kinds, output types, bias, accumulation and FP8 output."""

import threading

import pytest
import torch

import fp8ext
from conftest import DEVICES, requires_cuda
from fp8ext.testing import assert_gemm_close, gemm_reference
from inputs import gemm_operands

PAIRS = [(fp8ext.E4M3, fp8ext.E4M3), (fp8ext.E4M3, fp8ext.E5M2), (fp8ext.E5M2, fp8ext.E4M3)]
SHAPES = [(16, 32, 16), (48, 256, 80), (200, 384, 112), (1, 128, 64), (130, 2048, 272)]


def make(m, k, n, fa, fb, kind, device, seed=0):
    """Random FP8 operands and scale_inv tensors of the given kind, and their float64 product."""
    a, b, sa, sb = gemm_operands(m, k, n, fa, fb, kind, device, seed)
    return a, b, sa, sb, gemm_reference(a, b, sa, sb)


def close(out, a, b, sa, sb, device, **kw):
    """Every element inside fp8ext.testing's error bound: the fp32-accumulation model for the CPU's
    emulation, the H100 model (reduced-precision accumulator) for cuBLASLt."""
    assert_gemm_close(out, a, b, sa, sb, **kw, **({"accum_bits": None} if device == "cpu" else {}))


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fa, fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("kind", ["tensor", "row", "block", "block1x128"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp32_output_matches_fp64_product(device, fa, fb, kind, shape):
    m, k, n = shape
    if kind.startswith("block"):
        m += -m % 4  # 1x128 blocks need M % 4 == 0 (cuBLASLt); the refusal is tested in test_errors_name_the_rule
    a, b, sa, sb, ref = make(m, k, n, fa, fb, kind, device)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32 and out.device.type == device
    err = rel_err(out, ref)
    assert err < 1e-3, f"relative Frobenius error {err:.2e}"
    close(out, a, b, sa, sb, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype, tol", [(torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
def test_half_outputs_and_bias(device, out_dtype, tol):
    a, b, sa, sb, ref = make(96, 512, 144, fp8ext.E4M3, fp8ext.E4M3, "tensor", device)
    bias = (torch.randn(144, device=device) * 3).to(out_dtype if out_dtype == torch.float16 else torch.bfloat16)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=out_dtype, bias=bias)
    assert out.dtype == out_dtype
    assert rel_err(out, ref + bias.double()) < tol
    close(out, a, b, sa, sb, device, bias=bias)


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_output_with_bf16_bias(device):
    a, b, sa, sb, ref = make(64, 256, 96, fp8ext.E4M3, fp8ext.E5M2, "tensor", device)
    bias = torch.randn(96, device=device).to(torch.bfloat16)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32, bias=bias)
    assert rel_err(out, ref + bias.double()) < 1e-3
    close(out, a, b, sa, sb, device, bias=bias)


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_adds_into_fp32_out(device):
    a, b, sa, sb, ref = make(64, 256, 96, fp8ext.E5M2, fp8ext.E4M3, "tensor", device)
    acc = torch.randn(64, 96, device=device)
    start = acc.clone()
    res = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out=acc, accumulate=True)
    assert res is acc
    assert rel_err(acc, start.double() + ref) < 1e-3
    fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out=acc, accumulate=True)
    assert rel_err(acc, start.double() + 2 * ref) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fa, fb, fo", [(fp8ext.E4M3, fp8ext.E4M3, fp8ext.E4M3), (fp8ext.E4M3, fp8ext.E5M2, fp8ext.E5M2)],
                         ids=["e4m3_out", "e5m2_out"])
def test_fp8_output_with_scale_and_amax(device, fa, fb, fo):
    a, b, sa, sb, ref = make(64, 256, 96, fa, fb, "tensor", device)
    out_scale = torch.tensor(fo.max / 2 / ref.abs().max().item(), device=device)
    amax = torch.full((), -1.0, device=device)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=fo.torch_dtype, out_scale=out_scale,
                      amax_out=amax)
    assert out.dtype == fo.torch_dtype
    assert abs(amax.item() - ref.abs().max().item()) <= 1e-4 * ref.abs().max().item(), "amax of d, before out_scale"
    err = rel_err(out.double() / out_scale.double(), ref)
    assert err < (0.04 if fo is fp8ext.E4M3 else 0.08), f"FP8 output error {err}"


@pytest.mark.parametrize("device", DEVICES)
def test_fast_accumulation_stays_close(device):
    a, b, sa, sb, ref = make(128, 4096, 128, fp8ext.E4M3, fp8ext.E4M3, "tensor", device)
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32, use_fast_accum=True)
    assert rel_err(out, ref) < 1e-2
    close(out, a, b, sa, sb, device, use_fast_accum=True)


@pytest.mark.parametrize("device", DEVICES)
def test_errors_name_the_rule(device):
    def q(shape, f=fp8ext.E4M3):
        return fp8ext.quantize(torch.randn(shape, device=device), f)

    one = torch.ones((), device=device)
    a, b = q((32, 64)), q((48, 64))
    cases = [
        (dict(a=q((32, 40)), b=q((48, 40))), ValueError, r"K and N to be nonzero multiples of 16.*K=40"),
        (dict(b=q((40, 64))), ValueError, r"multiples of 16.*N=40"),
        (dict(b=q((48, 32))), ValueError, r"a is \[32, 64\] but b is \[48, 32\]"),
        (dict(a=q((32, 64), fp8ext.E5M2), b=q((48, 64), fp8ext.E5M2)), ValueError, r"no E5M2 x E5M2"),
        (dict(a=torch.randn(32, 64, device=device)), TypeError, r"a must be a torch.float8_e4m3fn or torch.float8_e5m2"),
        (dict(a=q((2, 32, 64))), ValueError, r"a and b must be 2-D"),
        (dict(a_scale_inv=torch.ones(5, device=device)), ValueError, r"a_scale_inv has shape \[5\]"),
        (dict(a_scale_inv=torch.ones((), dtype=torch.float64, device=device)), TypeError, r"a_scale_inv must be float32"),
        (dict(a_scale_inv=torch.ones(32, device=device)), ValueError, r"per-row but b_scale_inv is per-tensor"),
        (dict(bias=torch.ones(48, device=device)), TypeError, r"bias must be bfloat16 for a bfloat16 output"),
        (dict(bias=torch.ones(47, device=device, dtype=torch.bfloat16)), ValueError, r"bias must have shape \[48\]"),
        (dict(out_dtype=torch.float8_e5m2), ValueError, r"E5M2 output needs an E5M2 input"),
        (dict(out_dtype=torch.int32), TypeError, r"out_dtype must be one of"),
        (dict(accumulate=True), ValueError, r"accumulate=True adds into out: pass out="),
        (dict(out=torch.empty(32, 48, device=device, dtype=torch.float8_e4m3fn), accumulate=True), ValueError,
         r"accumulate=True needs a float32, bfloat16 or float16 out"),
        (dict(out=torch.empty(32, 40, device=device)), ValueError, r"out must have shape \[32, 48\]"),
        (dict(out_scale=one), ValueError, r"out_scale and amax_out go with an FP8 output"),
        (dict(out=torch.empty(32, 48, device=device), out_dtype=torch.bfloat16), ValueError, r"out is torch.float32"),
    ]
    for kw, exc, match in cases:
        args = dict(a=a, b=b, a_scale_inv=one, b_scale_inv=one) | kw
        with pytest.raises(exc, match=match):
            fp8ext.gemm(args.pop("a"), args.pop("b"), **args)
    xa, sxa = fp8ext.quantize_blockwise(torch.randn(32, 256, device=device), fp8ext.E4M3)
    xb, sxb = fp8ext.quantize_blockwise(torch.randn(64, 256, device=device), fp8ext.E4M3, (128, 128))
    with pytest.raises(ValueError, match="use_fast_accum=True is not supported with block scales"):
        fp8ext.gemm(xa, xb, a_scale_inv=sxa, b_scale_inv=sxb, use_fast_accum=True)
    with pytest.raises(ValueError, match=r"must be stored M-fastest, strides \(1, 32\)"):
        fp8ext.gemm(xa, xb, a_scale_inv=sxa.contiguous(), b_scale_inv=sxb)
    with pytest.raises(ValueError, match=r"a_scale_inv has shape \[1, 2\]; for a \[64, 256\] expected"):
        fp8ext.gemm(xb, xb, a_scale_inv=sxb, b_scale_inv=sxb)  # 128x128 blocks are for b (weights) only
    with pytest.raises(ValueError, match=r"1x128-block scales need M \(6\) to be a multiple of 4"):
        fp8ext.gemm(fp8ext.quantize(torch.randn(6, 256, device=device)), xb,
                    a_scale_inv=torch.ones(6, 2, device=device).t().contiguous().t(), b_scale_inv=sxb)
    with pytest.raises(ValueError, match=r"FP8 output needs per-tensor input scales"):
        fp8ext.gemm(xa, xb, a_scale_inv=sxa, b_scale_inv=sxb, out_dtype=torch.float8_e4m3fn)


def test_quantize_blocks_need_rows_multiple_of_4_and_cols_multiple_of_8():
    with pytest.raises(ValueError, match="multiple of 4"):
        fp8ext.quantize_blockwise(torch.randn(6, 128))
    with pytest.raises(ValueError, match="multiple of 8"):
        fp8ext.quantize_rowwise(torch.randn(6, 12))
    with pytest.raises(ValueError, match=r"block must be \(1, 128\) or \(128, 128\)"):
        fp8ext.quantize_blockwise(torch.randn(8, 128), block=(2, 64))


# ---- GPU-only behaviour ----------------------------------------------------------------------------

@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["tensor", "row"])
@pytest.mark.parametrize("fast", [False, True])
def test_matches_torch_scaled_mm(kind, fast):
    a, b, sa, sb, _ = make(256, 1024, 512, fp8ext.E4M3, fp8ext.E4M3, kind, "cuda")
    ours = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    if kind == "tensor":
        theirs = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    else:
        theirs = torch._scaled_mm(a, b.t(), scale_a=sa[:, None].contiguous(), scale_b=sb[None, :].contiguous(),
                                  out_dtype=torch.bfloat16, use_fast_accum=fast)
    diff = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
    assert diff < 4e-3, f"fp8ext vs torch._scaled_mm relative difference {diff:.2e}"


@requires_cuda
@pytest.mark.cuda
def test_cuda_graph_capture_replays_with_new_inputs():
    m, k, n = 128, 512, 256
    a, b, sa, sb, _ = make(m, k, n, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda")
    out = torch.empty(m, n, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out=out)  # plan and workspace made outside the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out=out)
    for seed in (1, 2):
        a2, b2, sa2, sb2, ref = make(m, k, n, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda", seed=seed)
        a.copy_(a2), b.copy_(b2), sa.copy_(sa2), sb.copy_(sb2)
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 1e-3


@requires_cuda
@pytest.mark.cuda
def test_plan_cache_and_autotune():
    fp8ext._C.gemm_cache_clear()
    before = fp8ext.gemm_cache_info()
    a, b, sa, sb, ref = make(512, 1024, 768, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda")
    for _ in range(3):
        plain = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    info = fp8ext.gemm_cache_info()
    assert info["plans"] == 1 and info["misses"] - before["misses"] == 1 and info["hits"] - before["hits"] == 2
    tuned = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32, autotune=True)
    assert fp8ext.gemm_cache_info()["tuned"] >= before["tuned"]
    assert rel_err(tuned, ref) < 1e-3 and rel_err(plain, ref) < 1e-3


@requires_cuda
@pytest.mark.cuda
def test_threads_with_their_own_streams():
    """Several Python threads, each on its own stream with its own shapes, get their own right answers."""
    errors, results = [], {}

    def work(i):
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                a, b, sa, sb, ref = make(64 * (i + 1), 256, 128 + 16 * i, fp8ext.E4M3, fp8ext.E5M2, "tensor", "cuda", i)
                outs = [fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32) for _ in range(20)]
            s.synchronize()
            results[i] = max(rel_err(o, ref) for o in outs)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert max(results.values()) < 1e-3, results


@requires_cuda
@pytest.mark.cuda
def test_mixed_devices_are_refused():
    a, b, sa, sb, _ = make(32, 64, 48, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda")
    with pytest.raises(ValueError, match=r"gemm\(\): b is on cpu but a is on cuda:0"):
        fp8ext.gemm(a, b.cpu(), a_scale_inv=sa, b_scale_inv=sb)
    with pytest.raises(ValueError, match=r"gemm\(\): b_scale_inv is on cpu but a is on cuda:0"):
        fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb.cpu())
    with pytest.raises(ValueError, match=r"gemm\(\): bias is on cpu but a is on cuda:0"):
        fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, bias=torch.zeros(48, dtype=torch.bfloat16))


@requires_cuda
@pytest.mark.cuda
def test_no_host_sync_in_gemm():
    a, b, sa, sb, _ = make(128, 256, 128, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda")
    fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb)  # plan made
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_one_element_scales_are_not_stretched_over_larger_operands():
    """A one-element scale reads as per-row only when M == 1, as a 128x128 grid only when N, K <= 128:
    otherwise cuBLASLt would read past its end."""
    a = fp8ext.quantize(torch.randn(64, 256))
    b = fp8ext.quantize(torch.randn(256, 256))
    with pytest.raises(ValueError, match="per-tensor but b_scale_inv is per-row"):
        fp8ext.gemm(a, b, a_scale_inv=torch.ones(1), b_scale_inv=torch.ones(256))
    xa, sxa = fp8ext.quantize_blockwise(torch.randn(64, 256), block=(1, 128))
    with pytest.raises(ValueError, match="1x128-block but b_scale_inv is per-tensor"):
        fp8ext.gemm(xa, b, a_scale_inv=sxa, b_scale_inv=torch.ones(1, 1))


@pytest.mark.parametrize("out", ["e4m3", 1.5, torch.utils.dlpack.to_dlpack(torch.zeros(16, 16))],
                         ids=["str", "float", "capsule"])
def test_out_that_is_not_a_tensor_is_a_type_error_naming_it(out):
    a = fp8ext.quantize(torch.ones(16, 16))
    one = torch.ones(())
    with pytest.raises(TypeError, match=r"gemm\(\): out must be a torch.Tensor or None, got "):
        fp8ext.gemm(a, a, a_scale_inv=one, b_scale_inv=one, out=out)



@pytest.mark.parametrize("value,expected", [(None, 32 << 20), ("4", 4 << 20), ("1", 1 << 20)])
def test_workspace_size_comes_from_fp8ext_gemm_workspace_mib(monkeypatch, value, expected):
    from fp8ext.ops import matmul as _gemm
    if value is None:
        monkeypatch.delenv("FP8EXT_GEMM_WORKSPACE_MIB", raising=False)
    else:
        monkeypatch.setenv("FP8EXT_GEMM_WORKSPACE_MIB", value)
    assert _gemm._workspace_bytes() == expected


@pytest.mark.parametrize("value", ["0", "-3", "2.5", "lots", "2048"])
def test_a_bad_fp8ext_gemm_workspace_mib_is_refused_by_name(monkeypatch, value):
    from fp8ext.ops import matmul as _gemm
    monkeypatch.setenv("FP8EXT_GEMM_WORKSPACE_MIB", value)
    with pytest.raises(ValueError, match="FP8EXT_GEMM_WORKSPACE_MIB"):
        _gemm._workspace_bytes()


class _FakeC:
    """fp8ext._C's bind_torch_workspace, as it answers when torch's functions are found, or not."""

    def __init__(self, error=None):
        self.error, self.calls = error, []

    def bind_torch_workspace(self, path):
        self.calls.append(path)
        if self.error:
            raise RuntimeError(self.error)


def test_gemms_borrow_torchs_workspace_when_it_is_found(monkeypatch):
    from fp8ext.ops import matmul as _gemm
    fake = _FakeC()
    monkeypatch.setattr(_gemm, "_C", fake)
    monkeypatch.setattr(_gemm, "_OWN_WORKSPACE", False)
    assert _gemm._borrow_torch_workspace() is True
    assert fake.calls and fake.calls[0].endswith("libtorch_cuda.so")


def test_fp8ext_gemm_workspace_mib_keeps_a_workspace_of_fp8exts_own(monkeypatch):
    from fp8ext.ops import matmul as _gemm
    fake = _FakeC()
    monkeypatch.setattr(_gemm, "_C", fake)
    monkeypatch.setattr(_gemm, "_OWN_WORKSPACE", True)
    assert _gemm._borrow_torch_workspace() is False and fake.calls == []


def test_a_workspace_torch_cannot_lend_is_a_warning_not_a_silent_fallback(monkeypatch):
    from fp8ext.ops import matmul as _gemm
    monkeypatch.setattr(_gemm, "_C", _FakeC("libtorch_cuda.so has no _ZN2at4cuda22getCUDABlasLtWorkspaceEv"))
    monkeypatch.setattr(_gemm, "_OWN_WORKSPACE", False)
    with pytest.warns(RuntimeWarning, match=r"workspace of their own \(\d+ MiB .*could not be borrowed: "
                                            r"libtorch_cuda.so has no"):
        assert _gemm._borrow_torch_workspace() is False


def test_torchs_library_is_also_looked_for_by_name(monkeypatch):
    from fp8ext.ops import matmul as _gemm

    class Fake(_FakeC):
        def bind_torch_workspace(self, path):
            self.calls.append(path)
            if path != "libtorch_cuda.so":
                raise RuntimeError(f"{path} is not a library this process has loaded")
    fake = Fake()
    monkeypatch.setattr(_gemm, "_C", fake)
    monkeypatch.setattr(_gemm, "_OWN_WORKSPACE", False)
    assert _gemm._borrow_torch_workspace() is True
    assert len(fake.calls) == 2 and fake.calls[0].endswith("/lib/libtorch_cuda.so") and fake.calls[1] == "libtorch_cuda.so"


@pytest.mark.parametrize("torch_device, borrowed", [(0, True), (1, False)])
def test_a_gemm_off_torchs_current_device_takes_a_workspace_of_its_own(monkeypatch, torch_device, borrowed):
    # torch makes its workspace on its own current device: a call on another device must not borrow it
    from fp8ext.ops import matmul as _gemm
    own = (object(), "own capsule")
    monkeypatch.setattr(_gemm, "_workspaces", {})
    monkeypatch.setattr(_gemm, "_borrow", True)
    monkeypatch.setattr(_gemm, "_torch_device", lambda: torch_device)
    monkeypatch.setattr(_gemm, "_own_workspace", lambda device: own)
    got = _gemm.workspace(torch.device("cuda", 0), 1234)
    assert got is (None if borrowed else "own capsule")
    monkeypatch.setattr(_gemm, "_torch_device", lambda: 0)
    assert _gemm.workspace(torch.device("cuda", 0), 1234) is got, "a (device, stream) keeps what it got first"


def test_torch_workspace_names_its_device_argument():
    with pytest.raises(TypeError, match=r"torch_workspace\(\): device must be an int"):
        fp8ext._C.torch_workspace("cuda:0")


@pytest.mark.skipif(fp8ext.build_info()["cuda"], reason="the binding's CPU-build answer")
def test_a_cpu_build_has_no_torch_workspace_to_borrow():
    with pytest.raises(RuntimeError, match="built without CUDA"):
        fp8ext._C.bind_torch_workspace("libtorch_cuda.so")
    with pytest.raises(TypeError, match="lib_path must be a str"):
        fp8ext._C.bind_torch_workspace(3)


def test_gemm_workspace_info_names_a_device_that_is_not_cuda():
    with pytest.raises(ValueError, match=r"gemm_workspace_info\(\): device must be a CUDA device, got cpu"):
        fp8ext.gemm_workspace_info("cpu")


needs_borrowing = pytest.mark.skipif("FP8EXT_GEMM_WORKSPACE_MIB" in __import__("os").environ,
                                     reason="FP8EXT_GEMM_WORKSPACE_MIB asks for a workspace of fp8ext's own")


@requires_cuda
@pytest.mark.cuda
@needs_borrowing
def test_gemm_and_torch_scaled_mm_share_one_workspace_per_stream():
    a, b, sa, sb, ref = make(256, 512, 256, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda")
    out = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()  # a new stream: neither torch nor fp8ext has a workspace for it yet
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out=out)
        before = torch.cuda.memory_allocated()
        theirs = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        grown = torch.cuda.memory_allocated() - before
        info = fp8ext.gemm_workspace_info()  # after: asking makes torch's workspace of the stream, were it not there
    torch.cuda.current_stream().wait_stream(s)
    assert info["owner"] == "torch" and info["bytes"] > 0
    assert grown == theirs.numel() * theirs.element_size(), "torch._scaled_mm made a workspace fp8ext had not used"
    assert rel_err(out, ref) < 1e-2


@requires_cuda
@pytest.mark.cuda
@needs_borrowing
def test_borrowed_workspace_gives_the_bytes_of_an_own_one_of_its_size(monkeypatch):
    from fp8ext.ops import matmul as _gemm
    a, b, sa, sb, _ = make(512, 1024, 768, fp8ext.E4M3, fp8ext.E5M2, "tensor", "cuda", seed=3)
    borrowed = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.bfloat16)
    nbytes = fp8ext.gemm_workspace_info()["bytes"]
    monkeypatch.setattr(_gemm, "_workspaces", {})
    monkeypatch.setattr(_gemm, "_borrow", False)
    monkeypatch.setattr(_gemm, "WORKSPACE_BYTES", nbytes)
    own = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.bfloat16)
    assert fp8ext.gemm_workspace_info()["owner"] == "fp8ext"
    assert torch.equal(own.view(torch.int16), borrowed.view(torch.int16))


@requires_cuda
@pytest.mark.cuda
@needs_borrowing
def test_binding_torchs_workspace_from_a_wrong_library_is_refused_and_changes_nothing():
    import os
    with pytest.raises(RuntimeError, match=r"/no/such/libtorch_cuda.so is not a library this process has loaded"):
        fp8ext._C.bind_torch_workspace("/no/such/libtorch_cuda.so")
    c10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")  # loaded by torch; not the right one
    with pytest.raises(RuntimeError, match=r"libc10.so has no _ZN2at4cuda22getCUDABlasLtWorkspaceEv"):
        fp8ext._C.bind_torch_workspace(c10)
    a, b, sa, sb, ref = make(128, 256, 128, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda")
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    assert fp8ext.gemm_workspace_info()["owner"] == "torch" and rel_err(out, ref) < 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
@needs_borrowing
def test_a_gemm_on_a_device_torch_has_not_made_current_is_right_and_changes_no_device():
    torch.cuda.set_device(0)
    a, b, sa, sb, ref = make(256, 512, 256, fp8ext.E4M3, fp8ext.E4M3, "tensor", "cuda:1")
    out = fp8ext.gemm(a, b, a_scale_inv=sa, b_scale_inv=sb, out_dtype=torch.float32)
    assert out.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
    assert fp8ext.gemm_workspace_info("cuda:1")["owner"] == "fp8ext"
    assert rel_err(out, ref) < 1e-3
