"""Decode attention over an FP8 KV cache: the float32 reference against torch's SDPA on the dequantized cache, and
the CUDA kernel (which reads the FP8 bytes) against the reference."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import requires_cuda
from fp8ext.inference.attention import decode_attention, decode_attention_reference


def make(b, h, kv, max_len, hd, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, hd, generator=g).to(dtype)
    k = (torch.randn(b, kv, max_len, hd, generator=g) * 3).to(torch.float8_e4m3fn)
    v = (torch.randn(b, kv, max_len, hd, generator=g) * 3).to(torch.float8_e4m3fn)
    ks = torch.rand(kv, generator=g) * 0.05 + 0.01
    vs = torch.rand(kv, generator=g) * 0.5 + 0.1
    return [t.to(device) for t in (q, k, v, ks, vs)]


def sdpa_on_dequantized(q, k, v, ks, vs, length):
    """An independent computation: dequantize, repeat K/V for the query heads, SDPA in float64."""
    b, h, hd = q.shape
    kv = k.shape[1]
    kd = (k[:, :, :length].double() * ks.double().view(1, kv, 1, 1)).repeat_interleave(h // kv, dim=1)
    vd = (v[:, :, :length].double() * vs.double().view(1, kv, 1, 1)).repeat_interleave(h // kv, dim=1)
    return F.scaled_dot_product_attention(q.double()[:, :, None], kd, vd)[:, :, 0]


@pytest.mark.parametrize("b,h,kv,hd,length", [(1, 4, 2, 16, 1), (2, 4, 2, 16, 37), (3, 12, 4, 64, 200),
                                              (2, 8, 8, 32, 64)])
def test_reference_equals_sdpa_on_the_dequantized_cache(b, h, kv, hd, length):
    q, k, v, ks, vs = make(b, h, kv, 256, hd, torch.float32)
    got = decode_attention(q, k, v, length, ks, vs)  # on the CPU: the reference
    want = sdpa_on_dequantized(q, k, v, ks, vs, length)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_positions_past_length_are_not_read():
    q, k, v, ks, vs = make(1, 4, 2, 64, 16, torch.float32)
    a = decode_attention(q, k, v, 10, ks, vs)
    k[:, :, 10:] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    v[:, :, 10:] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)
    assert torch.equal(decode_attention(q, k, v, 10, ks, vs), a)


def test_bf16_cache_takes_no_scales_and_agrees_with_sdpa():
    q, k, v, _, _ = make(2, 4, 2, 32, 16, torch.float32)
    kb, vb = k.to(torch.bfloat16), v.to(torch.bfloat16)
    got = decode_attention(q, kb, vb, 20)
    want = sdpa_on_dequantized(q, kb, vb, torch.ones(2), torch.ones(2), 20)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to an FP8 cache only"):
        decode_attention(q, kb, vb, 20, torch.ones(2), torch.ones(2))


def test_bad_arguments_name_themselves():
    q, k, v, ks, vs = make(1, 4, 2, 32, 16)
    with pytest.raises(ValueError, match="length must be an int in"):
        decode_attention(q, k, v, 0, ks, vs)
    with pytest.raises(ValueError, match="length must be an int in"):
        decode_attention(q, k, v, 33, ks, vs)
    with pytest.raises(TypeError, match="k_scale must be a float32 tensor of 2 per-head scales"):
        decode_attention(q, k, v, 4, None, vs)
    with pytest.raises(ValueError, match="n_heads 3 must be a multiple of n_kv_heads 2"):
        decode_attention(q[:, :3], k, v, 4, ks, vs)
    with pytest.raises(ValueError, match=r"q must be \[batch, n_heads, head_dim\]"):
        decode_attention(q[:, :, None], k, v, 4, ks, vs)
    with pytest.raises(TypeError, match="one dtype"):
        decode_attention(q, k, v.to(torch.bfloat16), 4, ks, vs)


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_reference], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan, math.inf, 1e39, 1e-50, 10**400],
                         ids=["0", "-0.5", "nan", "inf", "1e39", "1e-50", "int-1e400"])
def test_softmax_scale_the_kernel_refuses_is_refused_on_the_cpu_too(fn, bad):
    """The CUDA kernel's binding takes a softmax_scale that is finite and positive in float32; so does the CPU
    reference (1e39 is Inf and 1e-50 is 0 in float32)."""
    q, k, v, ks, vs = make(1, 4, 2, 32, 16)
    with pytest.raises(ValueError, match=rf"{fn.__name__}\(\): softmax_scale must be finite and positive in float32"):
        fn(q, k, v, 4, ks, vs, softmax_scale=bad)


CASES = [  # b, h, kv, hd, max_len, length
    (1, 4, 2, 16, 256, 1), (2, 4, 2, 16, 256, 255), (3, 12, 4, 64, 1024, 700), (2, 16, 4, 128, 2048, 2048),
    (1, 32, 8, 128, 32768, 32768), (4, 8, 8, 64, 512, 333), (2, 16, 2, 128, 4096, 4000), (1, 6, 1, 256, 128, 100),
    (8, 32, 8, 128, 8192, 5003), (1, 4, 4, 32, 64, 64),
    (96, 16, 4, 128, 1100, 1025),  # 384 (batch x K/V head) pairs: not split, output written by one kernel
    # head_dim 128: the tensor-core path for 16-bit queries, every group size, lengths not a multiple of 16
    (2, 3, 3, 128, 300, 37), (1, 6, 3, 128, 100, 17), (2, 12, 4, 128, 600, 521), (1, 12, 2, 128, 1000, 999),
    (3, 8, 1, 128, 20000, 19999),
    # head_dim 64 and 256 on the tensor-core path (16-bit queries)
    (2, 16, 2, 256, 3000, 2999), (2, 6, 6, 64, 5000, 4097), (1, 24, 8, 64, 900, 31), (2, 4, 2, 256, 64, 1),
]


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("b,h,kv,hd,max_len,length", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernel_equals_the_reference(b, h, kv, hd, max_len, length, dtype):
    q, k, v, ks, vs = make(b, h, kv, max_len, hd, dtype, "cuda", seed=length)
    got = decode_attention(q, k, v, length, ks, vs)
    assert got.dtype == dtype and got.shape == q.shape
    want = decode_attention_reference(q.cpu().float(), k.cpu(), v.cpu(), length, ks.cpu(), vs.cpu())
    # float32 accumulation in another order, then one rounding to dtype
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.cpu().float(), want, rtol=tol, atol=tol * float(want.abs().max()))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [1, 2, 7, 64])
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_any_split_of_the_positions_gives_the_same_attention(dtype, splits, hd):
    from fp8ext import _C
    from fp8ext.core.boundary import dl, dl_fp8
    b, h, kv, length = 2, 16, 4, 1500
    q, k, v, ks, vs = make(b, h, kv, 1600, hd, dtype, "cuda", seed=splits + hd)
    out = torch.empty_like(q)
    ws = torch.empty(b * h * splits * (hd + 2), dtype=torch.float32, device="cuda")
    _C.decode_attention(dl(q), dl_fp8(k), dl_fp8(v), dl(ks), dl(vs), dl(out), dl(ws), length, hd ** -0.5, splits,
                        torch.cuda.current_stream().cuda_stream)
    want = decode_attention_reference(q.cpu().float(), k.cpu(), v.cpu(), length, ks.cpu(), vs.cpu())
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.cpu().float(), want, rtol=tol, atol=tol * float(want.abs().max()))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("magnitude", [1e6, 1e-6])
def test_queries_far_outside_float16s_range(magnitude):
    # the tensor-core path rounds the query to f16 after scaling each head by a power of two: a bf16 query of
    # 1e6 (f16 overflows at 65504) or 1e-6 (f16 subnormal) keeps its precision
    q, k, v, ks, vs = make(2, 8, 2, 512, 128, torch.float32, "cuda")
    q = (q * magnitude).to(torch.bfloat16)
    got = decode_attention(q, k, v, 500, ks, vs)
    want = decode_attention_reference(q.cpu().float(), k.cpu(), v.cpu(), 500, ks.cpu(), vs.cpu())
    assert got.isfinite().all()
    torch.testing.assert_close(got.cpu().float(), want, rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))


@requires_cuda
@pytest.mark.cuda
def test_kernel_reads_only_positions_below_length_and_is_deterministic():
    q, k, v, ks, vs = make(2, 8, 2, 4096, 128, torch.bfloat16, "cuda")
    a = decode_attention(q, k, v, 1500, ks, vs)
    k[:, :, 1500:] = torch.tensor(float("nan")).to(torch.float8_e4m3fn).cuda()
    v[:, :, 1500:] = torch.tensor(float("nan")).to(torch.float8_e4m3fn).cuda()
    b = decode_attention(q, k, v, 1500, ks, vs)
    assert torch.equal(a, b)
    assert not b.isnan().any()


@requires_cuda
@pytest.mark.cuda
def test_kernel_refuses_what_it_cannot_do():
    q, k, v, ks, vs = make(1, 5, 1, 128, 128, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="1, 2, 3, 4, 6 or 8 query heads per K/V head"):
        decode_attention(q, k, v, 10, ks, vs)
    q, k, v, ks, vs = make(1, 4, 2, 128, 48, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="head_dim must be 16, 32, 64, 128 or 256"):
        decode_attention(q, k, v, 10, ks, vs)
    q, k, v, ks, vs = make(1, 4, 2, 128, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="k_cache is on cpu"):
        decode_attention(q, k.cpu(), v, 10, ks, vs)
    from fp8ext import _C
    from fp8ext.core.boundary import dl, dl_fp8
    q, k, v, ks, vs = make(1, 4, 2, 128, 128, torch.bfloat16, "cuda")
    shifted = torch.empty(k.numel() + 8, dtype=torch.uint8, device="cuda")[8:].view(torch.float8_e4m3fn).view(k.shape)
    out, ws = torch.empty_like(q), torch.empty(4 * 130, device="cuda")
    with pytest.raises(ValueError, match="16-byte boundary"):
        _C.decode_attention(dl(q), dl_fp8(shifted), dl_fp8(v), dl(ks), dl(vs), dl(out), dl(ws), 10, 0.1, 1,
                            torch.cuda.current_stream().cuda_stream)
