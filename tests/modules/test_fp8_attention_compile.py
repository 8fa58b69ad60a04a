"""FP8 attention under torch.compile: the CPU engine (the emulation) traces into one graph, with fp8ext's casts as
torch ops, and computes what it computes eagerly (the GPU engine's torch ops are tested in test_attention_cudnn.py)."""

import pytest
import torch

from fp8ext.ops.attention_fp8 import fp8_scaled_dot_product_attention


@pytest.mark.skipif(tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13),
                    reason="torch.compile before torch 2.13 cannot trace the emulation's options (its FP8 formats)")
@pytest.mark.parametrize("fp8_backward", [True, False], ids=["fp8 backward", "high-precision backward"])
def test_emulation_compiles_into_one_graph_and_matches_eager(fp8_backward):
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(shape, generator=g) for shape in ((1, 4, 32, 16), (1, 2, 32, 16), (1, 2, 32, 16),
                                                                 (1, 4, 32, 16)))
    kw = dict(is_causal=True, enable_gqa=True, fp8_backward=fp8_backward)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, **kw)
        return [out] + list(torch.autograd.grad(out, leaves, do))

    torch._dynamo.reset()
    got = run(torch.compile(fp8_scaled_dot_product_attention, fullgraph=True))  # a graph break raises
    want = run(fp8_scaled_dot_product_attention)
    assert torch.equal(got[0], want[0]), "the forward's FP8 casts are fp8ext's torch ops"
    for name, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"{name}: {(a - b).abs().max()}"
