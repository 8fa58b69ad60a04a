"""FP8 attention with its backward in high precision (fp8_backward=False; Transformer Engine's NVTE_FP8_DPA_BWD=0):
the forward is FP8 attention's, unchanged; the gradients are those of torch's scaled_dot_product_attention at Q, K
and V cast to E4M3 and dequantized, with dO not cast. The reference here builds those casts with torch's own
float8_e4m3fn conversion, not fp8ext's."""

import pytest
import torch
import torch.nn.functional as F

import fp8ext
from conftest import requires_cuda
from fp8ext.ops.attention_fp8 import fp8_scaled_dot_product_attention

E4M3_MAX = 448.0


def tensors(b=2, h=4, hk=2, s=24, d=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(shape, generator=g) * 3 for shape in ((b, h, s, d), (b, hk, s, d), (b, hk, s, d),
                                                                     (b, h, s, d)))
    return [t.to(device, dtype) for t in (q, k, v, do)]


def torch_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x cast to E4M3 with its per-tensor current scale (448 / amax) by torch, dequantized, in x's dtype."""
    scale = torch.full((), E4M3_MAX, dtype=torch.float32, device=x.device) / x.abs().amax().float()
    q8 = (x.float() * scale).to(torch.float8_e4m3fn)
    return (q8.to(x.dtype) * scale.reciprocal().to(x.dtype))


def grads(fn, q, k, v, do, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    return [out.detach()] + list(torch.autograd.grad(out, leaves, do))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
def test_high_precision_backward_is_sdpa_backward_at_the_fp8_inputs(causal):
    q, k, v, do = tensors()
    kw = dict(is_causal=causal, enable_gqa=True)
    fp8_bwd = grads(fp8_scaled_dot_product_attention, q, k, v, do, fp8_backward=True, **kw)
    hp = grads(fp8_scaled_dot_product_attention, q, k, v, do, fp8_backward=False, **kw)
    ref = grads(F.scaled_dot_product_attention, *(torch_e4m3(t) for t in (q, k, v)), do, **kw)
    assert torch.equal(hp[0], fp8_bwd[0]), "the forward is FP8 attention's either way"
    for name, g, r, f in zip(("dq", "dk", "dv"), hp[1:], ref[1:], fp8_bwd[1:]):
        assert g.shape == r.shape and g.dtype == torch.float32
        # float32 sums in two orders: |values| about 1, so 1e-4 is far below the FP8 backward's difference (> 1e-2)
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-4), f"{name}: {(g - r).abs().max()}"
        assert not torch.allclose(g, f, rtol=1e-3, atol=1e-4), f"{name}: the FP8 backward differs (E5M2 dO, dS)"


def test_high_precision_backward_is_closer_to_float64_than_the_fp8_one():
    q, k, v, do = tensors(s=64, d=32, seed=1)
    kw = dict(is_causal=True, enable_gqa=True)
    exact = grads(F.scaled_dot_product_attention, *(t.double() for t in (q, k, v, do)), **kw)
    err = {}
    for fb in (True, False):
        g = grads(fp8_scaled_dot_product_attention, q, k, v, do, fp8_backward=fb, **kw)
        err[fb] = [((a.double() - e).norm() / e.norm()).item() for a, e in zip(g[1:], exact[1:])]
    assert all(hp < fp8 for hp, fp8 in zip(err[False], err[True])), err


def test_nvte_fp8_dpa_bwd_chooses_when_fp8_backward_is_none(monkeypatch):
    q, k, v, do = tensors()
    kw = dict(is_causal=True, enable_gqa=True)
    want = {fb: grads(fp8_scaled_dot_product_attention, q, k, v, do, fp8_backward=fb, **kw) for fb in (True, False)}
    for env, fb in (("0", False), ("1", True), (None, True)):
        if env is None:
            monkeypatch.delenv("NVTE_FP8_DPA_BWD", raising=False)
        else:
            monkeypatch.setenv("NVTE_FP8_DPA_BWD", env)
        got = grads(fp8_scaled_dot_product_attention, q, k, v, do, **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want[fb])), env
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "false")
    with pytest.raises(ValueError, match="NVTE_FP8_DPA_BWD must be 0 .* or 1"):
        fp8_scaled_dot_product_attention(q, k, v, **kw)
    with pytest.raises(TypeError, match="fp8_backward must be True, False or None"):
        fp8_scaled_dot_product_attention(q, k, v, fp8_backward="no", **kw)


def test_module_passes_fp8_backward_to_the_engine(fp8_attention_calls):
    with pytest.raises(TypeError, match="fp8_backward must be True, False or None"):
        fp8ext.DotProductAttention(4, 16, num_gqa_groups=2, fp8_backward=1)
    q, k, v, _ = tensors()
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # bshd
    for fb in (None, False, True):
        attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format="bshd", fp8_backward=fb)
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.DelayedScaling(fp8_dpa=True)):
            attn(q, k, v)
        assert fp8_attention_calls[-1].get("fp8_backward") is fb


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("d", [128, 64])
def test_gpu_high_precision_backward(d):
    pytest.importorskip("cudnn", reason="FP8 attention on a GPU needs NVIDIA's cudnn frontend")
    from fp8ext.ops.attention_cudnn import cudnn_fp8_attention
    q, k, v, do = tensors(s=256, d=d, dtype=torch.bfloat16, device="cuda")
    kw = dict(is_causal=True, enable_gqa=True)
    if d != 128:
        with pytest.raises(NotImplementedError, match="head_dim 128 only"):
            grads(cudnn_fp8_attention, q, k, v, do, fp8_backward=True, **kw)
    hp = grads(cudnn_fp8_attention, q, k, v, do, fp8_backward=False, **kw)
    # torch's SDPA backward at the same dequantized inputs, in float32: the bf16 kernels' own rounding apart
    ref = grads(F.scaled_dot_product_attention, *(torch_e4m3(t).float() for t in (q, k, v)), do.float(), **kw)
    for name, g, r in zip(("dq", "dk", "dv"), hp[1:], ref[1:]):
        assert g.dtype == torch.bfloat16 and g.is_cuda and torch.isfinite(g).all(), name
        err = ((g.float() - r).norm() / r.norm()).item()
        assert err < 2e-2, f"{name}: {err}"
