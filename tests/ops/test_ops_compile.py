"""fp8ext's ops under torch.compile: fullgraph=True fails on any graph break, and the compiled results
must equal the eager ones byte for byte."""

import pytest
import torch

import fp8ext
from conftest import DEVICES


def pipeline(x, scale, acc):
    q = fp8ext.quantize(x, fp8ext.E4M3, scale, amax_out=acc)
    y = fp8ext.dequantize(q, scale.reciprocal(), torch.bfloat16)
    qe, qt = fp8ext.cast_transpose(x, fp8ext.E5M2, 2.0)
    return q, y * 2, qe, qt, fp8ext.amax(x), fp8ext.quantize(x, "e5m2", 0.25, saturate=False)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_pipeline_has_no_graph_breaks_and_matches_eager(device):
    torch._dynamo.reset()
    x = torch.randn(64, 32, device=device, dtype=torch.bfloat16) * 10
    scale = torch.tensor(3.0, device=device)
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(pipeline, fullgraph=True, backend=backend)
    acc_e, acc_c = torch.zeros((), device=device), torch.zeros((), device=device)
    eager = pipeline(x, scale, acc_e)
    got = compiled(x, scale, acc_c)
    for e, c in zip(eager, got):
        assert e.dtype == c.dtype and e.shape == c.shape
        assert torch.equal(e.view(torch.uint8) if e.element_size() == 1 else e, c.view(torch.uint8) if c.element_size() == 1 else c)
    assert acc_c.item() == acc_e.item() == x.abs().max().float().item(), "the amax_out mutation survives compilation"


def test_torch_ops_are_registered_with_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(8, 4, dtype=torch.bfloat16)
        q, a1 = torch.ops.fp8ext.quantize(x, fp8ext.E5M2.code, None, 1.0, True, False, 0, None)
        q2, qt, a2 = torch.ops.fp8ext.cast_transpose(x, fp8ext.E4M3.code, None, 1.0, True, torch.empty(1))
        y = torch.ops.fp8ext.dequantize(q, fp8ext.E5M2.code, None, 1.0, torch.float16)
        a = torch.ops.fp8ext.amax(x)
    assert q.dtype == torch.float8_e5m2 and q.shape == (8, 4)
    assert q2.dtype == torch.float8_e4m3fn and qt.shape == (4, 8)
    assert y.dtype == torch.float16 and a.shape == () and a1.shape == () and a2.shape == (1,)
