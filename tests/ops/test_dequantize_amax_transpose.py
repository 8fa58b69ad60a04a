"""dequantize, amax and cast_transpose on the CPU, against float64 math and torch."""

import numpy as np
import pytest
import torch

import fp8ext
import reference

FORMATS = [fp8ext.E4M3, fp8ext.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN, zeros compared with their sign."""
    a, b = a.float(), b.float()
    both_nan = a.isnan() & b.isnan()
    eq = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return bool((both_nan | eq).all())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale_inv", [1.0, 0.125, 3.3, 1e-4, 1000.0])
def test_dequantize_all_codes(fmt, dtype, scale_inv):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3)
    got = fp8ext.dequantize(codes.view(fmt.torch_dtype), scale_inv, dtype)
    assert got.dtype == dtype and got.shape == codes.shape
    # float64 product of the reference value and the float32 scale, rounded once to float32, then
    # to dtype by torch's own cast (exact for float32; round to nearest even for the 16-bit types).
    with np.errstate(invalid="ignore", over="ignore"):
        ref32 = (reference.decode_table(fmt.name)[codes.numpy()] * np.float64(np.float32(scale_inv))).astype(np.float32)
    want = torch.from_numpy(ref32).to(dtype)
    assert same_values(got, want)


def test_dequantize_uint8_needs_fmt_and_matches():
    b = torch.tensor([0x38, 0xB8, 0x7E], dtype=torch.uint8)
    assert fp8ext.dequantize(b, fmt=fp8ext.E4M3).tolist() == [1.0, -1.0, 448.0]
    r = fp8ext.dequantize(b, fmt="e5m2")
    assert r[:2].tolist() == [0.5, -0.5] and r[2].isnan().item()


def test_dequantize_device_scale():
    q = fp8ext.quantize(torch.randn(1000), fp8ext.E4M3)
    a = fp8ext.dequantize(q, 0.25)
    b = fp8ext.dequantize(q, torch.tensor(0.25))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_amax_matches_torch(dtype):
    for shape in [(1,), (17,), (1000, 33)]:
        x = (torch.randn(shape) * 37).to(dtype)
        got = fp8ext.amax(x)
        assert got.dtype == torch.float32 and got.shape == ()
        assert got.item() == x.abs().max().float().item()


def test_amax_special_values():
    assert fp8ext.amax(torch.empty(0)).item() == 0.0
    assert fp8ext.amax(torch.tensor([-3.0, float("-inf")])).item() == float("inf")
    assert fp8ext.amax(torch.tensor([1.0, float("nan"), 2.0])).isnan().item()
    assert fp8ext.amax(torch.tensor([-0.0])).item() == 0.0


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (130, 70), (256, 512)])
def test_cast_transpose_is_quantize_and_transpose(fmt, dtype, shape):
    x = (torch.randn(shape) * 100).to(dtype)
    acc = torch.zeros(())
    q, qt = fp8ext.cast_transpose(x, fmt, 0.7, amax_out=acc)
    want = fp8ext.quantize(x, fmt, 0.7)
    assert q.dtype == qt.dtype == fmt.torch_dtype
    assert q.shape == shape and qt.shape == (shape[1], shape[0])
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), want.view(torch.uint8).t())
    assert acc.item() == x.abs().max().float().item()


def test_cast_transpose_saturation_flag():
    x = torch.tensor([[1000.0, -1.0], [2.0, float("inf")]])
    q, _ = fp8ext.cast_transpose(x, fp8ext.E4M3, saturate=False)
    assert q.view(torch.uint8).tolist() == [[0x7F, 0xB8], [0x40, 0x7F]]
