"""fuse_wgrad_accumulation: the weight gradient added into an fp32 weight.main_grad by the weight-gradient GEMM, in
FP8 and in high precision, checked against the gradients an unfused layer returns."""
import pytest
import torch

import fp8ext
from conftest import requires_cuda

RECIPE = fp8ext.DelayedScaling(fp8_format=fp8ext.Format.HYBRID, amax_history_len=4)


def pair(device="cpu", bias=True, seed=0):
    """Two layers with the same weights: one fused (main_grad), one plain."""
    torch.manual_seed(seed)
    fused = fp8ext.Linear(64, 32, bias=bias, fuse_wgrad_accumulation=True, device=device)
    plain = fp8ext.Linear(64, 32, bias=bias, device=device)
    plain.load_state_dict(fused.state_dict())
    fused.weight.main_grad = torch.zeros_like(fused.weight, dtype=torch.float32)
    return fused, plain


def micro_batches(n, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(48, 64, generator=g).to(device) for _ in range(n)]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "high_precision"])
def test_main_grad_holds_the_sum_of_the_micro_batches_weight_gradients(fp8):
    fused, plain = pair()
    xs = micro_batches(3)
    for i, x in enumerate(xs):
        first = i == 0
        with fp8ext.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
            fused(x, is_first_microbatch=first).square().sum().backward()
        with fp8ext.fp8_autocast(enabled=fp8, fp8_recipe=RECIPE):
            plain(x, is_first_microbatch=first).square().sum().backward()
    assert fused.weight.grad is None, "the weight's gradient went into main_grad, not .grad"
    want = plain.weight.grad.float()
    err = (fused.weight.main_grad - want).abs().max() / want.abs().max()
    assert err < (1e-6 if not fp8 else 1e-5), f"main_grad differs from the summed gradients by {err:.2e}"
    torch.testing.assert_close(fused.bias.grad, plain.bias.grad)  # the bias gradient is returned as usual


def test_main_grad_adds_to_what_it_held():
    fused, plain = pair()
    start = torch.randn_like(fused.weight.main_grad)
    fused.weight.main_grad.copy_(start)
    x = micro_batches(1)[0]
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        fused(x).sum().backward()
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        plain(x).sum().backward()
    torch.testing.assert_close(fused.weight.main_grad, start + plain.weight.grad.float(), rtol=1e-6, atol=1e-6)


def test_megatron_flag_gets_zeros_and_is_set():
    fused, _ = pair()
    fused.weight.grad_added_to_main_grad = False
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        fused(micro_batches(1)[0]).sum().backward()
    assert fused.weight.grad_added_to_main_grad is True
    assert fused.weight.grad is not None and not fused.weight.grad.any()
    assert fused.weight.main_grad.abs().sum() > 0


def test_missing_or_wrong_main_grad_is_a_clear_error():
    layer = fp8ext.Linear(64, 32, fuse_wgrad_accumulation=True)
    x = torch.randn(16, 64)
    with pytest.raises(RuntimeError, match="weight.main_grad is not set"):
        layer(x)
    layer.weight.main_grad = torch.zeros(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be a contiguous float32 tensor of shape \\[32, 64\\]"):
        layer(x)
    with torch.no_grad():  # no backward coming: main_grad is not needed
        assert layer(x).shape == (16, 32)


@requires_cuda
@pytest.mark.cuda
def test_on_the_gpu_the_wgrad_gemm_accumulates_into_main_grad():
    fused, plain = pair("cuda")
    xs = micro_batches(4, "cuda")
    for i, x in enumerate(xs):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            fused(x, is_first_microbatch=i == 0).square().sum().backward()
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
            plain(x, is_first_microbatch=i == 0).square().sum().backward()
    want = plain.weight.grad.float()
    # float32 accumulation in the GEMM against a sum of float32 GEMM outputs rounded to the weight's dtype
    err = (fused.weight.main_grad - want).norm() / want.norm()
    assert err < 1e-4, err
    assert fused.weight.grad is None
