"""The checks every binding of fp8ext._C makes, and the public ops in front of them: outputs share no memory with
inputs or with each other, scales in host memory are finite and positive, and every refusal names the argument
(a Python number past the float range, a meta tensor, a broadcast view far larger than its storage)."""

import ctypes
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import dlpack_craft
import fp8ext
from conftest import DEVICES
from fp8ext import _C
from fp8ext.core.boundary import stream_of

BAD_SCALES = [float("nan"), 0.0, -1.0, float("inf")]
dl = torch.utils.dlpack.to_dlpack


# ---- outputs sharing memory with inputs or with each other ---------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_out_overlapping_q_is_refused(device):
    buf = torch.zeros(256, dtype=torch.uint8, device=device)
    q, out = buf[:64], buf.view(torch.float32)  # 64 FP8 bytes inside the 64 floats written
    with pytest.raises(ValueError, match=r"dequantize\(\): out and q share memory"):
        _C.dequantize(dl(q), dl(out), fp8ext.E4M3.code, 1.0, stream=stream_of(torch.device(device)))
    assert not buf.any(), "nothing was written"


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_out_overlapping_its_scale_inv_is_refused(device):
    q = torch.zeros(8, dtype=torch.uint8, device=device)
    out = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"dequantize\(\): out and scale_inv share memory"):
        _C.dequantize(dl(q), dl(out), fp8ext.E4M3.code, dl(out[3]), stream=stream_of(torch.device(device)))


@pytest.mark.parametrize("device", DEVICES)
def test_amax_out_inside_x_is_refused_by_the_binding(device):
    x = torch.ones(8, device=device)
    with pytest.raises(ValueError, match=r"amax\(\): out and x share memory"):
        _C.amax(dl(x), dl(x[3]), stream=stream_of(torch.device(device)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("same", [("scale", "amax"), ("scale", "scale_inv"), ("scale_inv", "amax")], ids=str)
def test_scale_from_amax_arguments_sharing_memory_are_refused(device, same):
    t = {name: torch.full((), 4.0, device=device) for name in ("amax", "scale", "scale_inv")}
    t[same[1]] = t[same[0]]
    with pytest.raises(ValueError, match=rf"scale_from_amax\(\): {same[0]} and {same[1]} share memory"):
        _C.scale_from_amax(dl(t["amax"]), dl(t["scale"]), dl(t["scale_inv"]), fp8ext.E4M3.code,
                           stream=stream_of(torch.device(device)))


# ---- scales in host memory: finite and positive --------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
def test_cpu_fmt_max_of_scale_update_must_be_finite_and_positive(bad):
    hist, scale, scale_inv = torch.ones(2, 4), torch.ones(2), torch.ones(2)
    fmt_max = torch.tensor([448.0, bad])
    with pytest.raises(ValueError, match=rf"scale_update\(\): fmt_max must be finite and positive, got {bad:g} at \[1\]"):
        _C.scale_update(dl(hist), dl(scale), dl(scale_inv), dl(fmt_max), 0, 0.0, True, 0.5)
    assert scale.tolist() == [1.0, 1.0], "nothing was updated"


def linear_fwd_args(**changes):
    """_C.linear_fwd's arguments, as keywords, for M = K = N = 16 on the CPU (py_linear.c's buffer layout)."""
    a = dict(x=torch.ones(16, 16), w=torch.ones(16, 16), saved=torch.zeros(768 + 512, dtype=torch.uint8),
             scratch=torch.zeros(512, dtype=torch.uint8), y=torch.zeros(16, 16), x_scale=torch.ones(()),
             x_amax=torch.zeros(()), w_scale=torch.ones(()), w_amax=torch.zeros(()), fmt=0, bias=None,
             workspace=None, stream=0)
    a.update(changes)
    return {k: dl(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


def linear_bwd_args(**changes):
    """_C.linear_bwd's arguments, as keywords, for M = K = N = 16 on the CPU, no dx, dw or db."""
    a = dict(dy=torch.ones(16, 16), saved=torch.zeros(768 + 512, dtype=torch.uint8),
             scratch=torch.zeros(512, dtype=torch.uint8), m=16, k=16, n=16, fwd_fmt=0, g_scale=torch.ones(()),
             g_amax=torch.zeros(()), bwd_fmt=1, dx=None, dw=None, accumulate=False, workspace=None, stream=0, db=None)
    a.update(changes)
    return {k: dl(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
@pytest.mark.parametrize("arg", ["x_scale", "w_scale"])
def test_cpu_scales_of_linear_fwd_must_be_finite_and_positive(arg, bad):
    assert _C.linear_fwd(**linear_fwd_args()) is False, "with a scale of 1 the casts run (the GEMM is the caller's)"
    with pytest.raises(ValueError, match=rf"linear_fwd\(\): {arg} must be finite and positive, got {bad:g}"):
        _C.linear_fwd(**linear_fwd_args(**{arg: torch.tensor(bad)}))


@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
def test_cpu_scale_of_linear_bwd_must_be_finite_and_positive(bad):
    assert _C.linear_bwd(**linear_bwd_args()) is False, "with a scale of 1 the cast runs (the GEMMs are the caller's)"
    with pytest.raises(ValueError, match=rf"linear_bwd\(\): g_scale must be finite and positive, got {bad:g}"):
        _C.linear_bwd(**linear_bwd_args(g_scale=torch.tensor(bad)))


def test_linear_fwd_format_past_int_range_is_refused():
    with pytest.raises(ValueError, match=r"linear_fwd\(\): fmt must be 0 \(E4M3\) or 1 \(E5M2\), got 4294967296"):
        _C.linear_fwd(**linear_fwd_args(fmt=2**32))


def test_linear_bwd_sizes_whose_buffers_overflow_are_refused():
    with pytest.raises(ValueError, match=r"linear_bwd\(\): M=16, K=1152921504606846976, N=16 give buffers too large"):
        _C.linear_bwd(**linear_bwd_args(k=2**60))


# ---- GPU-only buffers, checked before anything runs (hand-made CUDA capsules: never dereferenced) -------------

_KEEP = []


def cuda_view(buf: np.ndarray, shape, dtype: str = "float32", offset: int = 0):
    """A capsule claiming a contiguous CUDA tensor of `shape` at byte `offset` of buf (host memory no kernel
    ever reads: the binding refuses the call first). dtype: float32, bfloat16, uint8, int32 or int64."""
    code, bits = {"float32": (2, 32), "bfloat16": (4, 16), "uint8": (1, 8), "int32": (0, 32), "int64": (0, 64)}[dtype]
    dims = (ctypes.c_int64 * len(shape))(*shape)
    t = dlpack_craft.DLTensor(buf.ctypes.data + offset, dlpack_craft.DLDevice(2, 0), len(shape),
                              dlpack_craft.DLDataType(code, bits, 1), dims, None, 0)
    m = dlpack_craft.DLManagedTensor(t, None, None)
    _KEEP.extend([buf, dims, m])
    return dlpack_craft._capsule_new(ctypes.addressof(m), b"dltensor", None)


def aligned_buffer(nbytes: int) -> tuple:
    """(buffer, offset of its first 256-byte aligned byte)."""
    buf = np.zeros(nbytes + 256, dtype=np.uint8)
    return buf, -buf.ctypes.data % 256


def test_gemm_workspace_overlapping_an_operand_is_refused():
    buf, o = aligned_buffer(1 << 16)
    a, b = cuda_view(buf, (16, 32), "uint8", o), cuda_view(buf, (16, 32), "uint8", o + 1024)
    one, one_b = cuda_view(buf, (1,), offset=o + 2048), cuda_view(buf, (1,), offset=o + 2052)
    out = cuda_view(buf, (16, 16), offset=o + 4096)
    with pytest.raises(ValueError, match=r"gemm\(\): workspace and a share memory"):
        _C.gemm(a, b, 0, 0, one, one_b, out, workspace=cuda_view(buf, (1024,), "uint8", o))
    with pytest.raises(ValueError, match=r"gemm\(\): out and tune_scratch share memory"):
        _C.gemm(a, b, 0, 0, one, one_b, out, workspace=cuda_view(buf, (1024,), "uint8", o + 8192),
                tune_scratch=cuda_view(buf, (1024,), "uint8", o + 4096), autotune=True)


def test_linear_fwd_workspace_overlapping_x_is_refused():
    buf, o = aligned_buffer(1 << 16)
    v = lambda shape, dtype, at: cuda_view(buf, shape, dtype, o + at)  # noqa: E731
    args = [v((16, 16), "float32", 0), v((16, 16), "float32", 1024), v((1280,), "uint8", 2048),
            v((512,), "uint8", 4096), v((16, 16), "float32", 5120), 0]
    kw = dict(x_scale=v((1,), "float32", 6144), x_amax=v((1,), "float32", 6148), w_scale=v((1,), "float32", 6152),
              w_amax=v((1,), "float32", 6156), workspace=v((1024,), "uint8", 0))
    with pytest.raises(ValueError, match=r"linear_fwd\(\): workspace and x share memory"):
        _C.linear_fwd(*args, **kw)


def decode_attention_args(buf, o, **at):
    """decode_attention's arguments for batch 1, 2 heads, 1 K/V head, head_dim 16, max_len 8, over buf."""
    where = dict(DECODE_AT, **at)
    v = lambda name, shape, dtype: cuda_view(buf, shape, dtype, o + where[name])  # noqa: E731
    return dict(q=v("q", (1, 2, 16), "float32"), k=v("k", (1, 1, 8, 16), "uint8"), v=v("v", (1, 1, 8, 16), "uint8"),
                k_scale=v("k_scale", (1,), "float32"), v_scale=v("v_scale", (1,), "float32"),
                out=v("out", (1, 2, 16), "float32"), workspace=v("workspace", (64,), "float32"), length=8,
                softmax_scale=0.25, splits=1, length_dev=v("length_dev", (1,), "int64"))


DECODE_AT = dict(q=0, k=256, v=512, k_scale=768, v_scale=772, out=1024, workspace=2048, length_dev=4096)
DECODE_ORDER = ["out", "workspace", "q", "k", "v", "k_scale", "v_scale", "length_dev"]  # outputs first


@pytest.mark.parametrize("written, read", [("out", "q"), ("out", "k_scale"), ("workspace", "v"),
                                           ("workspace", "out"), ("workspace", "length_dev")])
def test_decode_attention_outputs_sharing_memory_are_refused(written, read):
    buf, o = aligned_buffer(1 << 13)
    first, second = sorted([written, read], key=DECODE_ORDER.index)
    with pytest.raises(ValueError, match=rf"decode_attention\(\): {first} and {second} share memory"):
        _C.decode_attention(**decode_attention_args(buf, o, **{written: DECODE_AT[read]}))


@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
def test_decode_attention_softmax_scale_must_be_finite_and_positive(bad):
    buf, o = aligned_buffer(1 << 13)
    args = decode_attention_args(buf, o)
    args["softmax_scale"] = bad
    with pytest.raises(ValueError, match=r"decode_attention\(\): softmax_scale must be finite and positive"):
        _C.decode_attention(**args)


def weight_only_args(buf, o, **at):
    """weight_only's arguments for FP8 weights, M = 1, K = 256, N = 64, over buf."""
    where = dict(WO_AT, **at)
    v = lambda name, shape, dtype: cuda_view(buf, shape, dtype, o + where[name])  # noqa: E731
    return dict(x=v("x", (1, 256), "bfloat16"), w=v("w", (64, 256), "uint8"), block_scales=None,
                channel_scale=v("channel_scale", (64,), "float32"), tensor_scale=None,
                workspace=v("workspace", (64,), "float32"), counters=v("counters", (1,), "int32"),
                out=v("out", (1, 64), "bfloat16"), fmt=0, splits=1)


WO_AT = dict(x=0, w=1024, channel_scale=17408, workspace=17664, counters=18176, out=18432)
WO_ORDER = ["out", "workspace", "counters", "x", "w", "block_scales", "channel_scale", "tensor_scale"]


@pytest.mark.parametrize("written, read", [("out", "x"), ("workspace", "w"), ("counters", "channel_scale"),
                                           ("counters", "out")])
def test_weight_only_outputs_sharing_memory_are_refused(written, read):
    buf, o = aligned_buffer(1 << 16)
    first, second = sorted([written, read], key=WO_ORDER.index)
    with pytest.raises(ValueError, match=rf"weight_only\(\): {first} and {second} share memory"):
        _C.weight_only(**weight_only_args(buf, o, **{written: WO_AT[read]}))


def test_weight_only_read_only_counters_are_refused():
    buf, o = aligned_buffer(1 << 16)
    args = weight_only_args(buf, o)
    args["counters"] = dlpack_craft.capsule(np.zeros(1, dtype=np.int32), device_type=2, versioned=True,
                                            read_only=True)
    with pytest.raises(ValueError, match=r"weight_only\(\): counters is read-only"):
        _C.weight_only(**args)


def test_kv_store_cache_overlapping_pos_dev_is_refused():
    buf, o = aligned_buffer(1 << 12)
    x = cuda_view(buf, (1, 1, 1, 16), "float32", o)
    scale = cuda_view(buf, (1,), "float32", o + 64)
    cache = cuda_view(buf, (1, 1, 8, 16), "uint8", o + 256)
    with pytest.raises(ValueError, match=r"kv_store\(\): cache and pos_dev share memory"):
        _C.kv_store(x, scale, cache, 0, pos_dev=cuda_view(buf, (1,), "int64", o + 256))


# ---- every refusal names the argument --------------------------------------------------------------------------

Q = fp8ext.quantize(torch.ones(4, 8))

NUMBER_SCALES = [
    ("quantize", "scale", lambda s: fp8ext.quantize(torch.ones(4), scale=s)),
    ("quantize", "scale", lambda s: fp8ext.quantize(torch.ones(4), fp8ext.E2M1, scale=s)),
    ("dequantize", "scale_inv", lambda s: fp8ext.dequantize(Q, scale_inv=s)),
    ("cast_transpose", "scale", lambda s: fp8ext.cast_transpose(torch.ones(4, 8), scale=s)),
    ("cast_transpose_dbias", "scale", lambda s: fp8ext.cast_transpose_dbias(torch.ones(4, 8), scale=s)),
]


@pytest.mark.parametrize("value", [10**400, -10**400], ids=["1e400", "-1e400"])
@pytest.mark.parametrize("fn, arg, call", NUMBER_SCALES, ids=lambda v: v if isinstance(v, str) else "")
def test_int_scale_past_the_float_range_is_a_value_error_naming_it(fn, arg, call, value):
    with pytest.raises(ValueError, match=rf"{fn}\(\): {arg} must be finite and positive in float32, got an int too "
                                         r"large for a float"):
        call(value)


def test_int_margin_past_the_float_range_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"scale_from_amax\(\): margin must be finite, got an int too large"):
        fp8ext.scale_from_amax(torch.ones(()), margin=10**400)


def test_int_scale_past_the_float_range_is_refused_under_torch_compile():
    torch._dynamo.reset()
    f = torch.compile(lambda x: fp8ext.quantize(x, scale=10**400), backend="eager")
    with pytest.raises(ValueError, match=r"quantize\(\): scale must be finite and positive in float32"):
        f(torch.ones(4))


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


E4 = torch.float8_e4m3fn
Q16 = fp8ext.quantize(torch.ones(16, 16))
META_CALLS = [
    ("quantize", "x", lambda: fp8ext.quantize(meta(4))),
    ("quantize", "scale", lambda: fp8ext.quantize(torch.ones(4), scale=meta())),
    ("quantize", "amax_out", lambda: fp8ext.quantize(torch.ones(4), amax_out=meta(1))),
    ("quantize", "scale_inv_out", lambda: fp8ext.quantize(torch.ones(4), scale_inv_out=meta(1))),
    ("quantize", "out", lambda: fp8ext.quantize(torch.ones(4), out=meta(4, dtype=E4))),
    ("quantize", "scale", lambda: fp8ext.quantize(torch.ones(4), fp8ext.E2M1, scale=meta())),
    ("quantize", "amax_out", lambda: fp8ext.quantize(torch.ones(4), fp8ext.E2M1, amax_out=meta(1))),
    ("dequantize", "q", lambda: fp8ext.dequantize(meta(4, dtype=E4))),
    ("dequantize", "scale_inv", lambda: fp8ext.dequantize(Q, scale_inv=meta())),
    ("amax", "x", lambda: fp8ext.amax(meta(4))),
    ("cast_transpose", "x", lambda: fp8ext.cast_transpose(meta(4, 8))),
    ("cast_transpose", "scale", lambda: fp8ext.cast_transpose(torch.ones(4, 8), scale=meta())),
    ("cast_transpose", "amax_out", lambda: fp8ext.cast_transpose(torch.ones(4, 8), amax_out=meta(1))),
    ("cast_transpose", "scale_inv_out", lambda: fp8ext.cast_transpose(torch.ones(4, 8), scale_inv_out=meta(1))),
    ("cast_transpose", r"out\[1\]",
     lambda: fp8ext.cast_transpose(torch.ones(4, 8), out=(torch.empty(4, 8, dtype=E4), meta(8, 4, dtype=E4)))),
    ("cast_transpose_dbias", "x", lambda: fp8ext.cast_transpose_dbias(meta(4, 8))),
    ("cast_transpose_dbias", "scale", lambda: fp8ext.cast_transpose_dbias(torch.ones(4, 8), scale=meta())),
    ("cast_transpose_dbias", "amax_out", lambda: fp8ext.cast_transpose_dbias(torch.ones(4, 8), amax_out=meta(1))),
    ("cast_transpose_dbias", "scale_inv_out",
     lambda: fp8ext.cast_transpose_dbias(torch.ones(4, 8), scale_inv_out=meta(1))),
    ("cast_transpose_dbias", r"out\[2\]", lambda: fp8ext.cast_transpose_dbias(
        torch.ones(4, 8), out=(torch.empty(4, 8, dtype=E4), torch.empty(8, 4, dtype=E4), meta(8)))),
    ("quantize_rowwise", "x", lambda: fp8ext.quantize_rowwise(meta(4, 8))),
    ("quantize_blockwise", "x", lambda: fp8ext.quantize_blockwise(meta(4, 128))),
    ("scale_from_amax", "amax", lambda: fp8ext.scale_from_amax(meta())),
    ("gemm", "a_scale_inv", lambda: fp8ext.gemm(Q16, Q16, a_scale_inv=meta(1), b_scale_inv=torch.ones(()))),
    ("gemm", "b_scale_inv", lambda: fp8ext.gemm(Q16, Q16, a_scale_inv=torch.ones(()), b_scale_inv=meta())),
    ("gemm", "bias", lambda: fp8ext.gemm(Q16, Q16, a_scale_inv=torch.ones(()), b_scale_inv=torch.ones(()),
                                         bias=meta(16, dtype=torch.bfloat16))),
    ("gemm", "out", lambda: fp8ext.gemm(Q16, Q16, a_scale_inv=torch.ones(()), b_scale_inv=torch.ones(()),
                                        out=meta(16, 16))),
    ("dequantize_nvfp4", "elements",
     lambda: fp8ext.dequantize_nvfp4(meta(4, 32, dtype=torch.uint8), torch.ones(4, 2).to(E4), torch.ones(()))),
    ("dequantize_nvfp4", "block_scales",
     lambda: fp8ext.dequantize_nvfp4(torch.zeros(4, 32, dtype=torch.uint8), meta(4, 2, dtype=E4), torch.ones(()))),
    ("dequantize_nvfp4", "tensor_scale",
     lambda: fp8ext.dequantize_nvfp4(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(4, 2).to(E4), meta())),
    ("dequantize_mx", "elements",
     lambda: fp8ext.dequantize_mx(meta(4, 32, dtype=torch.uint8), torch.full((4, 1), 127, dtype=torch.uint8),
                                  fp8ext.E2M1)),
    ("dequantize", "q", lambda: fp8ext.dequantize(meta(4, dtype=torch.uint8), fmt=fp8ext.E2M1)),
]


@pytest.mark.parametrize("fn, arg, call", META_CALLS, ids=lambda v: v.replace("\\", "") if isinstance(v, str) else "")
def test_meta_tensor_argument_is_refused_naming_it(fn, arg, call):
    with pytest.raises(ValueError, match=rf"{fn}\(\): {arg} is on meta; .*a meta tensor has no data"):
        call()


def test_sparse_tensor_argument_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"quantize\(\): scale must be a dense \(strided\) tensor, got torch.sparse_coo"):
        fp8ext.quantize(torch.ones(4), scale=torch.ones(1).to_sparse())


# A broadcast view of 2**32 elements stored in one: refused before anything x-sized is allocated or copied. Run in
# a child whose address space is capped just above what it holds after import, so a regression fails the test with
# an allocation error instead of taking the machine's memory.
BROADCAST_CASES = {
    "quantize": "fp8ext.quantize(torch.zeros(1).expand(2**32))",
    "quantize_small": "fp8ext.quantize(torch.zeros(1).expand(2**32), fp8ext.E2M1)",
    "dequantize": "fp8ext.dequantize(torch.zeros(1, dtype=torch.float8_e4m3fn).expand(2**32))",
    "cast_transpose": "fp8ext.cast_transpose(torch.zeros(1).expand(65536, 65536))",
    "cast_transpose_dbias": "fp8ext.cast_transpose_dbias(torch.zeros(1).expand(65536, 65536))",
    "quantize_rowwise": "fp8ext.quantize_rowwise(torch.zeros(1).expand(65536, 65536))",
    "quantize_blockwise": "fp8ext.quantize_blockwise(torch.zeros(1).expand(65536, 65536))",
    "quantize_numpy": "fp8ext.quantize(np.broadcast_to(np.zeros(1, np.float32), (2**32,)))",
    "quantize_mx": "fp8ext.quantize_mx(torch.zeros(1).expand(65536, 65536))",
    "quantize_mx_small": "fp8ext.quantize_mx(torch.zeros(1).expand(65536, 65536), fp8ext.E2M1, 16)",
    "quantize_nvfp4": "fp8ext.quantize_nvfp4(torch.zeros(1).expand(65536, 65536))",
}

_CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import torch
    import fp8ext
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    results = {}
    for name, call in json.loads(sys.argv[1]).items():
        try:
            eval(call)
            results[name] = ["accepted", ""]
        except BaseException as e:  # noqa: BLE001 - the test reads which
            results[name] = [type(e).__name__, str(e)]
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def broadcast_results():
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(BROADCAST_CASES)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", BROADCAST_CASES)
def test_broadcast_view_of_2_32_elements_is_refused_before_any_allocation(broadcast_results, case):
    kind, message = broadcast_results[case]
    fn = case.replace("_small", "").replace("_numpy", "")
    arg = "q" if fn == "dequantize" else "x"
    assert kind == "ValueError", f"{case}: expected a ValueError naming {arg}, got {kind}: {message}"
    assert message.startswith(f"{fn}(): {arg} must be contiguous (row-major, compact)"), message


def test_broadcast_view_message_says_what_it_is():
    with pytest.raises(ValueError, match=r"quantize\(\): x must be contiguous \(row-major, compact\), got a broadcast "
                                         r"view \(stride 0\) of shape \[4, 8\] and strides \[0, 1\]"):
        fp8ext.quantize(torch.zeros(8).expand(4, 8))
    x = torch.randn(8, 1, 16).transpose(0, 1)  # [1, 8, 16], strides (16, 16, 1): contiguous in torch and in C
    assert torch.equal(fp8ext.quantize(x).float(), fp8ext.quantize(x.clone()).float()), "size-one dimensions' " \
        "strides do not matter"


def test_fp8linear_refuses_a_broadcast_input_before_copying_it():
    """The composed path copies a strided input; a broadcast view, which may describe far more elements than it
    stores, is refused first (a small one here: the old behaviour, a copy, must not run out of memory)."""
    layer = fp8ext.FP8Linear(32, 16)
    with fp8ext.fp8_autocast(), torch.no_grad(), \
            pytest.raises(ValueError, match=r"FP8Linear\(\): input must be contiguous \(row-major, compact\), got a "
                                            r"broadcast view \(stride 0\)"):
        layer(torch.zeros(1).expand(64, 32))


def test_fp8linear_still_takes_a_strided_input():
    layer = fp8ext.FP8Linear(32, 16)
    x = torch.randn(32, 16).t()  # [16, 32], not contiguous
    with fp8ext.fp8_autocast(), torch.no_grad():
        assert torch.equal(layer(x), layer(x.contiguous())), "a transposed input gives what its copy gives"


# ---- arguments that cannot cross the boundary at all ------------------------------------------------------------

def read_only(*shape):
    a = np.zeros(shape, dtype=np.float32)
    a.flags.writeable = False  # numpy refuses to export it through DLPack (BufferError)
    return a


READ_ONLY_CALLS = [
    ("quantize", "x", lambda: fp8ext.quantize(read_only(4, 16))),
    ("quantize", "amax_out", lambda: fp8ext.quantize(torch.ones(4), amax_out=read_only(1))),
    ("dequantize", "scale_inv", lambda: fp8ext.dequantize(Q, scale_inv=read_only(1))),
    ("amax", "x", lambda: fp8ext.amax(read_only(4))),
    ("cast_transpose", "x", lambda: fp8ext.cast_transpose(read_only(4, 16))),
    ("scale_from_amax", "amax", lambda: fp8ext.scale_from_amax(read_only(1))),
    ("gemm", "b_scale_inv", lambda: _C.gemm(dl(Q16), dl(Q16), 0, 0, dl(torch.ones(1)), read_only(1),
                                            dl(torch.zeros(16, 16)))),
    ("amax", "x", lambda: _C.amax(read_only(4), dl(torch.zeros(1)))),
    ("rms_norm_fwd", "x", lambda: _C.rms_norm_fwd(read_only(4, 16), dl(torch.ones(16)), dl(torch.zeros(4, 16)),
                                                  dl(torch.zeros(4)), 1e-5)),
]


@pytest.mark.parametrize("fn, arg, call", READ_ONLY_CALLS, ids=lambda v: v if isinstance(v, str) else "")
def test_array_that_refuses_dlpack_export_is_a_type_error_naming_it(fn, arg, call):
    with pytest.raises(TypeError, match=rf"{fn}\(\): {arg} \(numpy.ndarray\) could not be exported through DLPack "
                                        r"\(pass a torch tensor or a writable array\): Cannot export readonly"):
        call()


def qint8(*shape):
    return torch.quantize_per_tensor(torch.ones(shape), 1.0, 0, torch.qint8)  # torch has no DLPack code for it


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("fn, arg, call", [
    ("quantize", "scale", lambda: fp8ext.quantize(torch.ones(4), scale=qint8(1))),
    ("quantize", "amax_out", lambda: fp8ext.quantize(torch.ones(4), amax_out=qint8(1))),
    ("gemm", "a_scale_inv", lambda: fp8ext.gemm(Q16, Q16, a_scale_inv=qint8(1), b_scale_inv=torch.ones(()))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_tensor_torch_cannot_export_is_a_type_error_naming_it(fn, arg, call):
    with pytest.raises(TypeError, match=rf"{fn}\(\): {arg} could not be exported through DLPack"):
        call()


# A Python int past the C type of a number argument: ValueError naming the argument, never an OverflowError.
HUGE_NUMBER_CALLS = [
    ("quantize", "fmt", lambda n: _C.quantize(dl(torch.ones(4)), dl(torch.zeros(4, dtype=torch.uint8)), n, 1.0)),
    ("amax", "stream", lambda n: _C.amax(dl(torch.ones(4)), dl(torch.zeros(1)), stream=n)),
    ("scale_from_amax", "margin", lambda n: _C.scale_from_amax(dl(torch.ones(1)), dl(torch.ones(1)),
                                                               dl(torch.ones(1)), 0, margin=n)),
    ("rms_norm_fwd", "eps", lambda n: _C.rms_norm_fwd(dl(torch.ones(4, 16)), dl(torch.ones(16)),
                                                      dl(torch.zeros(4, 16)), dl(torch.zeros(4)), n)),
    ("kv_store", "pos", lambda n: _C.kv_store(dl(torch.ones(1, 16)), dl(torch.ones(1)),
                                              dl(torch.zeros(4, 16, dtype=torch.uint8)), n)),
    ("cast_transpose_dbias_workspace", "cols", lambda n: _C.cast_transpose_dbias_workspace(16, n)),
    ("weight_only_blocks_per_sm", "m", lambda n: _C.weight_only_blocks_per_sm(0, n, 0)),
]


@pytest.mark.parametrize("value", [10**400, -10**400], ids=["1e400", "-1e400"])
@pytest.mark.parametrize("fn, arg, call", HUGE_NUMBER_CALLS, ids=lambda v: v if isinstance(v, str) else "")
def test_int_past_a_number_arguments_c_type_is_a_value_error_naming_it(fn, arg, call, value):
    with pytest.raises(ValueError, match=rf"^{fn}\(\): {arg} is out of range \("):
        call(value)
