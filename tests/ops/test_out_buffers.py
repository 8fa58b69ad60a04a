"""quantize(..., out=) and cast_transpose(..., out=): casts into caller-provided buffers give the same bytes as the
allocating calls, reuse the memory, and refuse buffers of the wrong kind by name."""
import pytest
import torch

import fp8ext
from conftest import requires_cuda


def data(device="cpu", shape=(48, 80), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 30).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def test_quantize_into_a_buffer_gives_the_allocating_calls_bytes_in_the_same_memory(device):
    x = data(device)
    buf = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device)
    ptr = buf.data_ptr()
    for step in range(3):
        xs = x * (step + 1)
        amax_a, amax_b = torch.zeros((), device=device), torch.zeros((), device=device)
        got = fp8ext.quantize(xs, fp8ext.E4M3, 0.5, amax_out=amax_a, out=buf)
        want = fp8ext.quantize(xs, fp8ext.E4M3, 0.5, amax_out=amax_b)
        assert got is buf and buf.data_ptr() == ptr
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(amax_a, amax_b)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
def test_cast_transpose_into_a_pair_of_buffers(device):
    x = data(device)
    q_buf = torch.empty(x.shape, dtype=torch.float8_e5m2, device=device)
    qt_buf = torch.empty(x.shape[::-1], dtype=torch.float8_e5m2, device=device)
    q, qt = fp8ext.cast_transpose(x, fp8ext.E5M2, 2.0, out=(q_buf, qt_buf))
    wq, wqt = fp8ext.cast_transpose(x, fp8ext.E5M2, 2.0)
    assert q is q_buf and qt is qt_buf
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(qt.view(torch.uint8), wqt.view(torch.uint8))


def test_small_formats_write_codes_into_a_uint8_buffer():
    x = data()
    buf = torch.empty(x.shape, dtype=torch.uint8)
    assert torch.equal(fp8ext.quantize(x, fp8ext.E2M1, 0.1, out=buf), fp8ext.quantize(x, fp8ext.E2M1, 0.1))


def test_wrong_buffers_are_refused_by_name():
    x = data()
    with pytest.raises(TypeError, match=r"quantize\(\): out must be torch.float8_e4m3fn, got torch.float8_e5m2"):
        fp8ext.quantize(x, out=torch.empty(x.shape, dtype=torch.float8_e5m2))
    with pytest.raises(ValueError, match=r"quantize\(\): out must have shape \[48, 80\], got \[80, 48\]"):
        fp8ext.quantize(x, out=torch.empty(80, 48, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        fp8ext.quantize(x, out=[1, 2])
    with pytest.raises(ValueError, match="out must be contiguous"):
        fp8ext.quantize(x, out=torch.empty(80, 48, dtype=torch.float8_e4m3fn).t())
    with pytest.raises(TypeError, match=r"cast_transpose\(\): out must be a pair"):
        fp8ext.cast_transpose(x, out=torch.empty(x.shape, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=r"cast_transpose\(\): out\[1\] must have shape \[80, 48\]"):
        fp8ext.cast_transpose(x, out=(torch.empty(x.shape, dtype=torch.float8_e4m3fn),
                                      torch.empty(x.shape, dtype=torch.float8_e4m3fn)))
    with pytest.raises(TypeError, match=r"quantize\(\): out must be torch.uint8"):
        fp8ext.quantize(x, fp8ext.E2M1, out=torch.empty(x.shape, dtype=torch.float8_e4m3fn))
