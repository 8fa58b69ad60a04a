"""FP8 attention on a GPU (fp8ext/ops/attention_cudnn.py: cuDNN's FP8 fused attention) against its definition, the
CPU emulation (fp8ext/ops/attention_fp8.py), and against float64 attention.

The GPU sums in another order and rounds the softmax's unnormalised exponentials to E4M3 block by block (flash
attention) where the emulation rounds the normalised probabilities, so their FP8 roundings are independent: the two
are compared in norm, within one FP8 step, and the GPU's error against float64 attention must stay within the
emulation's bounds and within 1.5x the emulation's own error."""

import pytest
import torch
import torch.nn.functional as F

import fp8ext
from conftest import requires_cuda
from fp8ext.ops import attention_cudnn
from fp8ext.ops.attention_fp8 import fp8_scaled_dot_product_attention

pytestmark = [requires_cuda, pytest.mark.cuda]
cudnn = pytest.importorskip("cudnn", reason="FP8 attention on a GPU needs NVIDIA's cudnn frontend "
                                            "(pip install nvidia-cudnn-frontend)")


def inputs(b=2, h=4, hk=2, s=128, d=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((b, h, s, d), (b, hk, s, d), (b, hk, s, d), (b, h, s, d))]


LAYOUTS = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}  # memory order of [b, h, s, d] dims


def in_layout(t, layout):
    """t [b, h, s, d] as a view of a tensor laid out `layout` in memory."""
    p = LAYOUTS[layout]
    return t.permute(p).contiguous().permute([p.index(i) for i in range(4)])


def run(fn, tensors, device, dtype, layout="bshd", **kw):
    """(out, dq, dk, dv) of fn over [b, h, s, d] views of tensors laid out `layout` (DotProductAttention hands over
    "bshd" and "sbhd" views; a Hugging Face model [b, h, s, d] itself)."""
    q, k, v, do = (in_layout(t.to(device, dtype), layout) for t in tensors)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, **kw)
    return [out] + list(torch.autograd.grad(out, leaves, do))


def rel(a, b) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "no_mask"])
@pytest.mark.parametrize("h, hk", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
def test_gpu_engine_computes_what_the_emulation_defines(causal, h, hk, layout):
    x = inputs(h=h, hk=hk)
    kw = dict(is_causal=causal, enable_gqa=True)
    gpu = run(attention_cudnn.cudnn_fp8_attention, x, "cuda", torch.bfloat16, layout, **kw)
    cpu = run(fp8_scaled_dot_product_attention, x, "cpu", torch.bfloat16, **kw)
    exact = run(F.scaled_dot_product_attention, x, "cpu", torch.float64, **kw)
    report = {name: (round(rel(g, c), 4), round(rel(g, e), 4), round(rel(c, e), 4))
              for name, g, c, e in zip(("out", "dq", "dk", "dv"), gpu, cpu, exact)}
    for name, g, c, e, step in zip(("out", "dq", "dk", "dv"), gpu, cpu, exact, (2**-4, 2**-3, 2**-3, 2**-3)):
        assert g.dtype == torch.bfloat16 and g.shape == c.shape and g.is_cuda, name
        assert torch.isfinite(g).all(), name
        # cuDNN rounds the unnormalised exp(S - running max) to E4M3 block by block (flash attention), the emulation
        # the normalised P: the two roundings are independent, so the two differ by about their own FP8 errors
        assert rel(g, c) < step, f"{name}: GPU vs emulation (GPU vs emulation, GPU vs float64, emulation vs " \
                                 f"float64): {report}"
        assert rel(g, e) < step and rel(g, e) < 1.5 * rel(c, e) + 1e-3, f"{name}: {report}"


def test_module_on_a_gpu_runs_cudnn_in_both_layouts_and_reuses_its_graphs():
    attn = fp8ext.DotProductAttention(4, 128, num_gqa_groups=2, qkv_format="sbhd")
    q, k, v, do = inputs()
    sbhd = [t.permute(2, 0, 1, 3).contiguous().to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v)]
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling(fp8_dpa=True)):
        out = attn(*sbhd)
        built = len(attention_cudnn._graphs)
        out2 = attn(*sbhd)
    assert out.shape == (128, 2, 512) and torch.equal(out, out2)
    assert len(attention_cudnn._graphs) == built, "the second call builds no graph"
    out.backward(do.permute(2, 0, 1, 3).reshape(128, 2, 512).to("cuda", torch.bfloat16))
    want = fp8_scaled_dot_product_attention(*(t.to(torch.bfloat16) for t in (q, k, v)), is_causal=True,
                                            enable_gqa=True)
    assert rel(out, want.permute(2, 0, 1, 3).reshape(128, 2, 512)) < 2**-4
    bshd = fp8ext.DotProductAttention(4, 128, num_gqa_groups=2, qkv_format="bshd")
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.Float8CurrentScaling(fp8_dpa=True)):
        out_b = bshd(*(t.detach().transpose(0, 1) for t in sbhd))
    assert rel(out_b, out.transpose(0, 1)) < 2**-10, "bshd: the same numbers transposed"
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in sbhd)


def test_a_mask_cudnn_does_not_take_is_an_error_on_a_gpu():
    attn = fp8ext.DotProductAttention(4, 128, attn_mask_type="padding", qkv_format="bshd")
    q = torch.randn(2, 128, 4, 128, device="cuda", dtype=torch.bfloat16)
    pad = torch.zeros(2, 1, 1, 128, dtype=torch.bool, device="cuda")
    pad[1, ..., 100:] = True
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match="causal mask or none"):
            attn(q, q, q, attention_mask=pad)
    q.requires_grad_()
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling(fp8_dpa=True)):
        with pytest.raises(NotImplementedError, match="backward on Hopper takes head_dim 128 only, got 64"):
            fp8ext.DotProductAttention(4, 64, qkv_format="bshd")(*(q[..., :64],) * 3)


@pytest.mark.parametrize("fp8_backward", [True, False], ids=["fp8 backward", "high-precision backward"])
def test_torch_compile_calls_cudnn_as_a_torch_op_without_graph_breaks(fp8_backward):
    x = [t.to("cuda", torch.bfloat16) for t in inputs()]
    kw = dict(is_causal=True, enable_gqa=True, fp8_backward=fp8_backward)
    eager = run(attention_cudnn.cudnn_fp8_attention, x, "cuda", torch.bfloat16, **kw)
    torch._dynamo.reset()
    compiled = torch.compile(attention_cudnn.cudnn_fp8_attention, fullgraph=True)  # a graph break raises
    got = run(compiled, x, "cuda", torch.bfloat16, **kw)
    assert torch.equal(got[0], eager[0]), "the forward runs the same kernels"
    for name, g, e in zip(("dq", "dk", "dv"), got[1:], eager[1:]):
        assert g.shape == e.shape and g.stride() == e.stride() and g.dtype == e.dtype, name
        assert rel(g, e) < 1e-2, f"{name}: {rel(g, e)}"  # cuDNN's backward sums with atomics: not bitwise


def test_the_torch_ops_fake_implementations_match_the_real_ones():
    q, k, v, _ = (t.to("cuda", torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2) for t in inputs())
    for fp8_backward in (True, False):
        torch.library.opcheck(torch.ops.fp8ext.cudnn_fp8_attention,
                              (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), 128 ** -0.5, True,
                               fp8ext.E4M3.code, fp8ext.E5M2.code, 0.0, fp8_backward),
                              test_utils=("test_faketensor", "test_autograd_registration"))


def test_cuda_graph_replays_forward_and_backward():
    x = [t.to("cuda", torch.bfloat16) for t in inputs()]
    static = [t.clone().requires_grad_() for t in x[:3]]
    static_do = x[3].clone()
    kw = dict(is_causal=True, enable_gqa=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: builds and caches cuDNN's graphs outside the capture
        for _ in range(2):
            attention_cudnn.cudnn_fp8_attention(*static, **kw).backward(static_do)
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_cudnn.cudnn_fp8_attention(*static, **kw)
        grads = torch.autograd.grad(out, static, static_do)
    for seed in (1, 2):
        new = [t.to("cuda", torch.bfloat16) for t in inputs(seed=seed)]
        with torch.no_grad():
            for s, n in zip(static + [static_do], new):
                s.copy_(n)
        graph.replay()
        want = run(attention_cudnn.cudnn_fp8_attention, new, "cuda", torch.bfloat16, **kw)
        assert torch.equal(out, want[0]), f"replay {seed}: the forward"
        for name, g, w in zip(("dq", "dk", "dv"), grads, want[1:]):
            assert rel(g, w) < 1e-2, f"replay {seed}: {name}"


def test_the_output_puts_the_sequence_before_the_heads_and_fp8_output_is_its_bytes():
    x = [t.to("cuda", torch.bfloat16) for t in inputs()[:3]]
    outs = {}
    with torch.no_grad():
        for layout in LAYOUTS:
            outs[layout] = attention_cudnn.cudnn_fp8_attention(*(in_layout(t, layout) for t in x), is_causal=True,
                                                               enable_gqa=True)
        q, k, v = (in_layout(t, "bshd") for t in x)
        o8 = attention_cudnn.cudnn_fp8_attention(q, k, v, is_causal=True, enable_gqa=True, fp8_output=True)
    # the memory order the output projection (and DotProductAttention's "bshd" / "sbhd" views) reads as is
    assert outs["bshd"].permute(0, 2, 1, 3).is_contiguous() and outs["bhsd"].permute(0, 2, 1, 3).is_contiguous()
    assert outs["sbhd"].permute(2, 0, 1, 3).is_contiguous()
    assert torch.equal(outs["bhsd"], outs["bshd"]) and torch.equal(outs["sbhd"], outs["bshd"]), \
        "the inputs' layout changes nothing but the output's"
    out = outs["bshd"]
    assert isinstance(o8, fp8ext.FP8Tensor) and o8.data.dtype == torch.float8_e4m3fn and o8.data.shape == q.shape
    assert o8.data.permute(0, 2, 1, 3).is_contiguous()
    assert torch.equal(o8.dequantize(torch.bfloat16), out), "the output is O8 dequantized, bit for bit"
    with pytest.raises(RuntimeError, match="fp8_output=True .*no gradient"):
        attention_cudnn.cudnn_fp8_attention(q.requires_grad_(), k, v, is_causal=True, enable_gqa=True,
                                            fp8_output=True)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_mha_prefill_of_a_quantized_transformer_on_a_gpu(activations, monkeypatch):
    from fp8ext import inference
    from fp8ext.models.transformer import Transformer, preset
    torch.manual_seed(0)
    cfg = preset("tiny", d_model=256, n_heads=2, n_kv_heads=1, d_ff=512)  # head_dim 128
    model = Transformer(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (4, 128))
    if activations == "static":
        inference.calibrate(model, [ids[:2]], progress=False)
    inference.quantize_model(model, "channel", activations)
    gpu = model.to("cuda")
    logits, calls, seen = {}, [], []
    engine = fp8ext.modules.attention.FP8_ATTENTION_ENGINES["cuda"]
    monkeypatch.setitem(fp8ext.modules.attention.FP8_ATTENTION_ENGINES, "cuda",
                        lambda *a, **kw: calls.append(kw) or engine(*a, **kw))
    for block in gpu.blocks:
        block.attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(type(args[0]).__name__))
    with torch.no_grad():
        for name in ("fp8_dpa", "fp8_mha"):
            recipe = fp8ext.Float8CurrentScaling(**{name: True})
            calls.clear(), seen.clear()
            logits[name] = gpu(ids.cuda(), fp8=True, fp8_recipe=recipe).float().cpu()
            want = name == "fp8_mha"
            assert [kw.get("fp8_output", False) for kw in calls] == [want] * cfg.n_layers, name
            assert seen == ["FP8Activation" if want else "Tensor"] * cfg.n_layers, name
        cpu = model.to("cpu")(ids, fp8=True, fp8_recipe=fp8ext.Float8CurrentScaling(fp8_mha=True)).float()
    assert torch.isfinite(logits["fp8_mha"]).all()
    assert rel(logits["fp8_mha"], logits["fp8_dpa"]) < 0.05
    assert rel(logits["fp8_mha"], cpu) < 0.05, "cuDNN against the emulation, each through the FP8 o_proj"
