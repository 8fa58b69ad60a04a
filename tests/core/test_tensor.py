"""fp8ext.tensor: FP8Tensor bundles (data, transposed copy, scale_inv, format, scale layout); a Quantizer casts one
tensor role with its scaling slot; gemm takes FP8Tensors as it takes (float8 tensor, scale_inv) pairs."""
import pytest
import torch

import fp8ext
from fp8ext import _C
from fp8ext.tensor import TENSOR, FP8Tensor, Quantizer
from conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [fp8ext.E4M3, fp8ext.E5M2], ids=["e4m3", "e5m2"])
def test_quantizer_with_an_own_slot_is_cast_transpose_with_that_scale(device, fmt):
    x = torch.randn(48, 32, device=device, dtype=torch.bfloat16) * 3
    scale, amax = torch.tensor(5.0, device=device), torch.zeros((), device=device)
    want_q, want_qt = fp8ext.cast_transpose(x, fmt, scale)
    got = Quantizer(fmt, 0.0, scale=scale, amax=amax).quantize(x)
    assert isinstance(got, FP8Tensor) and got.fmt is fmt and got.layout == TENSOR
    assert torch.equal(got.data.view(torch.uint8), want_q.view(torch.uint8)), "data: cast_transpose's q"
    assert torch.equal(got.data_t.view(torch.uint8), want_qt.view(torch.uint8)), "data_t: cast_transpose's q^T"
    assert got.scale_inv.item() == pytest.approx(1 / 5.0), "scale_inv is 1 / scale"
    assert amax.item() == x.float().abs().max().item(), "the cast records max|x| in the slot's amax"


@pytest.mark.parametrize("device", DEVICES)
def test_quantizer_without_a_slot_scales_by_the_tensors_own_amax(device):
    x = torch.randn(32, 16, device=device) * 7
    got = Quantizer(fp8ext.E4M3, 1.0).quantize(x)
    scale, _ = fp8ext.scale_from_amax(fp8ext.amax(x), fp8ext.E4M3, 1.0)
    want_q, _ = fp8ext.cast_transpose(x, fp8ext.E4M3, scale)
    assert torch.equal(got.data.view(torch.uint8), want_q.view(torch.uint8)), "current scaling with the margin"


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_of_fp8_tensors_equals_gemm_of_their_data_and_scale_invs(device):
    q = Quantizer(fp8ext.E4M3, 0.0)
    a = q.quantize(torch.randn(32, 64, device=device))
    b = q.quantize(torch.randn(16, 64, device=device))
    want = fp8ext.gemm(a.data, b.data, a_scale_inv=a.scale_inv, b_scale_inv=b.scale_inv, out_dtype=torch.float32)
    assert torch.equal(fp8ext.gemm(a, b, out_dtype=torch.float32), want), "the same product"
    at = a.t()
    assert at.data is a.data_t and at.data_t is a.data and at.scale_inv is a.scale_inv, "t() swaps the copies"


def test_gemm_refuses_a_scale_inv_twice_or_none():
    q = Quantizer(fp8ext.E4M3, 0.0)
    a = q.quantize(torch.randn(16, 16))
    with pytest.raises(TypeError, match="a is an FP8Tensor, which carries its scale_inv"):
        fp8ext.gemm(a, a, a_scale_inv=a.scale_inv)
    with pytest.raises(TypeError, match="b_scale_inv is required"):
        fp8ext.gemm(a, a.data)


def test_the_saved_buffer_layout_is_the_extensions():
    """fp8ext.linear_autograd reads csrc/py_linear.c's layout from the module: three scale_invs, then x8^T."""
    assert _C.LINEAR_SINV_BYTES == 3 * _C.LINEAR_SINV_STRIDE
    assert _C.LINEAR_SINV_STRIDE % 16 == 0 and _C.LINEAR_ALIGN % 16 == 0, "cuBLASLt's 16-byte alignment"


def test_the_row_wise_weight_copy_is_not_kept_until_backward():
    # backward reads the weight's transposed FP8 copy only; a plan that kept the row-wise one too held a second
    # FP8 copy of every weight from forward to backward (+0.46 GiB at two Llama-3-8B-size layers)
    layer = fp8ext.Linear(64, 32)
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.DelayedScaling()):
        y = layer(torch.randn(16, 64))
    assert y.grad_fn.plan.w8 is None
    y.sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
