"""Weight-only layers: packing against fp8ext.mx and fp8ext.quantize, the stored bytes, the CPU path, and the
few-token CUDA kernel against a float64 product with the dequantized weight."""
import pytest
import torch
import torch.nn as nn

import fp8ext
from conftest import requires_cuda
from fp8ext.weight_only import WEIGHT_ONLY_FORMATS, WeightOnlyLinear, bits_per_weight


def linear(k, n, bias=False, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(3.0)
        lin.weight[0, :7] = torch.tensor([0.0, -0.0, 1e-30, 5.0, -7.0, 1e-3, 2.0 ** -20])
    return lin


@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
def test_dequantized_weight_is_the_formats_own_rounding(fmt):
    lin = linear(256, 64)
    w = lin.weight.detach()
    layer = WeightOnlyLinear.from_linear(lin, fmt)
    got = layer.dequantized_weight()
    if fmt == "fp8":  # per row: x * (448 / amax) rounded to E4M3, times amax / 448
        amax = w.abs().amax(dim=1)
        scale = torch.full_like(amax, 448.0) / amax
        want = fp8ext.quantize((w * scale[:, None]).contiguous()).float() * (1.0 / scale)[:, None]
    elif fmt == "nvfp4":
        want = fp8ext.dequantize_nvfp4(*fp8ext.quantize_nvfp4(w))
    else:
        elem = {"mxfp8": fp8ext.E4M3, "mxfp6": fp8ext.E3M2, "mxfp6_e2m3": fp8ext.E2M3, "mxfp4": fp8ext.E2M1}[fmt]
        want = fp8ext.dequantize_mx(*fp8ext.quantize_mx(w, elem), elem=elem)
    assert torch.equal(got, want)


def test_error_and_bytes_order_the_formats():
    lin = linear(1024, 256)
    w = lin.weight.detach()
    err, size = {}, {}
    for fmt in WEIGHT_ONLY_FORMATS:
        layer = WeightOnlyLinear.from_linear(lin, fmt)
        err[fmt] = float((layer.dequantized_weight() - w).norm() / w.norm())
        size[fmt] = layer.nbytes
        assert abs(layer.nbytes * 8 / w.numel() - bits_per_weight(fmt, 1024)) < 0.01, fmt
    assert err["mxfp4"] > err["mxfp6_e2m3"] > err["mxfp8"]
    assert err["nvfp4"] < err["mxfp4"]  # smaller blocks, finer scales
    assert 0.05 < err["mxfp4"] < 0.2 and err["fp8"] < 0.04
    assert size["mxfp4"] < size["nvfp4"] < size["mxfp6"] < size["fp8"] < w.numel() * 2


def test_cpu_forward_is_f_linear_with_the_dequantized_weight_and_bias():
    lin = linear(256, 64, bias=True)
    layer = WeightOnlyLinear.from_linear(lin, "mxfp4")
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16), lin.bias.detach().bfloat16())
    assert torch.equal(layer(x), want)
    assert layer(x).shape == (3, 5, 64)


def test_gradients_flow_to_the_input_through_the_dequantized_weight():
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "mxfp4")
    x = torch.randn(2, 256, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.dequantized_weight().sum(0).expand(2, 256))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="fmt must be one of"):
        WeightOnlyLinear(256, 64, "int4")
    with pytest.raises(ValueError, match="multiple of mxfp4's block size 32"):
        WeightOnlyLinear(100, 64, "mxfp4")
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "fp8")
    with pytest.raises(ValueError, match="last dimension must be 256"):
        layer(torch.randn(2, 128))
    with pytest.raises(ValueError, match="weight holds NaN or Inf"):
        layer.pack_(torch.full((64, 256), float("nan")))
    with pytest.raises(TypeError, match="must have a 2-D weight"):
        WeightOnlyLinear.from_linear(nn.ReLU(), "fp8")


def test_state_dict_round_trips_the_packed_bytes():
    a = WeightOnlyLinear.from_linear(linear(256, 64), "nvfp4")
    b = WeightOnlyLinear(256, 64, "nvfp4")
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.dequantized_weight(), b.dequantized_weight())


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 256, 64), (3, 2304, 192), (16, 4096, 1024), (8, 1024, 4096), (16, 512, 64)])
def test_kernel_equals_the_float64_product(fmt, m, k, n):
    lin = linear(k, n, bias=(m == 3), seed=k + n)
    layer = WeightOnlyLinear.from_linear(lin, fmt).cuda()
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    assert layer.uses_kernel(x)
    got = layer(x)
    w = layer.dequantized_weight(torch.float64)
    want = x.double() @ w.T
    if lin.bias is not None:
        want = (want.bfloat16() + lin.bias.detach().cuda().bfloat16()).double()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-2, f"{fmt} {m}x{k}x{n}: max error {err:.2e} of the largest output"
    assert torch.equal(layer(x), got), "a second call (the counters reset themselves) gives the same bytes"


@requires_cuda
@pytest.mark.cuda
def test_many_tokens_and_other_dtypes_take_the_dequantized_gemm():
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "mxfp6").cuda()
    for x in (torch.randn(17, 256, dtype=torch.bfloat16, device="cuda"), torch.randn(2, 256, device="cuda"),
              torch.randn(2, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)):
        assert not layer.uses_kernel(x)
        want = torch.nn.functional.linear(x, layer.dequantized_weight(x.dtype))
        assert torch.equal(layer(x), want)
