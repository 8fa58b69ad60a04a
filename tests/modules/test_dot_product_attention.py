"""fp8ext.DotProductAttention (Transformer Engine's te.DotProductAttention) and the FP8 attention it runs with a
recipe's fp8_dpa=True (fp8ext/ops/attention_fp8.py, the CPU emulation of cuDNN's FP8 fused attention).

The emulation is checked stage by stage against float64 computed here from torch's own FP8 casts of the same
operands: every cast byte for byte, every GEMM and the softmax to float32's precision. The module is checked
against torch's scaled_dot_product_attention (bit for bit where it computes in high precision) with masks built
here, position by position, from Transformer Engine's mask conventions."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F

import fp8ext
from conftest import assert_same_bytes, requires_cuda
from fp8ext.modules import attention as attention_module
from fp8ext.ops.attention_fp8 import (FP8AttentionOptions, attention_backward, attention_forward, attention_probs,
                                      fp8_scaled_dot_product_attention)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_DPA = fp8ext.DelayedScaling(fp8_dpa=True)


# ---- the reference: torch's own casts, float64 arithmetic -----------------------------------------------------------

def torch_scale(x: torch.Tensor, dtype) -> torch.Tensor:
    """Current scaling: fmt.max / amax in float32."""
    return torch.tensor(torch.finfo(dtype).max, dtype=torch.float32) / x.float().abs().max()


def torch_cast(x: torch.Tensor, dtype, scale) -> torch.Tensor:
    """torch's cast of x * scale (rounded to float32), saturated to the format's maximum as fp8ext's casts are."""
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-top, top).to(dtype)


def f64(data: torch.Tensor, scale) -> torch.Tensor:
    """FP8 bytes dequantized in float64 by the exact scale (not its float32 reciprocal)."""
    return data.double() / torch.as_tensor(scale, dtype=torch.float64)


def bound_scales(q, k, v, do, softmax_scale) -> dict:
    """The scales of O, dS, dQ, dK and dV (fmt.max / bound, float64), from the amaxes of the inputs: the bounds of
    fp8ext/ops/attention_fp8.py's docstring, written out again here."""
    _, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    a_q, a_k, a_v = (x.double().abs().max() for x in (q, k, v))
    c = 1.0625 + sk / (1024 * 448)
    bounds = {"o": c * a_v}
    if do is not None:
        a_do, g = do.double().abs().max(), h // hk
        ds = (1 + c) * d * a_do * a_v
        bounds.update(ds=ds, dq=1.25 * softmax_scale * ds * a_k, dk=1.25 * softmax_scale * g * sq * ds * a_q,
                      dv=1.25 * g * sq * c * a_do)
    return {n: (448.0 if n == "o" else 57344.0) / b for n, b in bounds.items()}


def assert_rounds(t8, exact64: torch.Tensor, scale, msg: str) -> None:
    """The FP8 tensor t8 (scale `scale`) holds exact64 rounded to its format: within half a step (relative 2^-4
    for E4M3, 2^-3 for E5M2; half the smallest subnormal step near 0), with float32's slack for exact64 having been
    summed in float32 before the cast."""
    e4 = t8.data.dtype == E4M3
    scale = torch.as_tensor(scale, dtype=torch.float64)
    torch.testing.assert_close(t8.scale.double(), scale, rtol=1e-6, atol=0, msg=f"{msg}: its scale")
    err = (f64(t8.data, scale) - exact64).abs()
    tol = exact64.abs() * (2**-4 if e4 else 2**-3) + (2**-10 if e4 else 2**-17) / scale + 1e-5 * exact64.abs().max()
    assert (err <= tol).all(), f"{msg}: worst error {err.max().item():.3g}"


def expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def group_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def inputs(b=2, h=4, hk=2, sq=8, sk=8, d=16, dtype=torch.float32, magnitude=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, h, sq, d), (b, hk, sk, d), (b, hk, sk, d), (b, h, sq, d))
    return [(torch.randn(s, generator=g) * magnitude).to(dtype) for s in shapes]


def softmax64(s64: torch.Tensor, allowed) -> torch.Tensor:
    if allowed is not None:
        s64 = s64.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s64, -1).nan_to_num(0.0)


MASKS = {"none": lambda sq, sk: None,
         "causal": lambda sq, sk: torch.ones(sq, sk, dtype=torch.bool).tril(),
         "mask": lambda sq, sk: torch.rand(2, 1, sq, sk, generator=torch.Generator().manual_seed(1)) < 0.7}


# ---- the emulation, stage by stage -----------------------------------------------------------------------------------

@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)], ids=["MHA", "GQA"])
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_matches_float64_from_torch_casts(heads, kv_heads, mask, dtype):
    q, k, v, _ = inputs(h=heads, hk=kv_heads, sq=8, sk=12, dtype=dtype)
    allowed = MASKS[mask](8, 12)
    opts = FP8AttentionOptions(softmax_scale=0.3, is_causal=mask == "causal")
    state = attention_forward(q, k, v, None if mask == "causal" else allowed, opts)
    scales = [torch_scale(x, E4M3) for x in (q, k, v)]
    for name, x, t, s in zip("QKV", (q, k, v), (state.q8, state.k8, state.v8), scales):
        assert_same_bytes(t.data, torch_cast(x, E4M3, s), f"{name}8: torch's cast with scale 448 / amax")
        assert t.scale_inv == 1 / s, f"{name}8's scale_inv is 1 / scale"
    s64 = f64(state.q8.data, scales[0]) @ expand(f64(state.k8.data, scales[1]), heads).transpose(-2, -1) * 0.3
    p64 = softmax64(s64, allowed)
    p, p8 = attention_probs(state)
    torch.testing.assert_close(p.double(), p64, rtol=1e-5, atol=1e-7, msg="P: float32 softmax")
    assert_same_bytes(p8.data, torch_cast(p, E4M3, 448.0), "P8: torch's cast of P with the fixed scale 448")
    o64 = f64(p8.data, 448.0) @ expand(f64(state.v8.data, scales[2]), heads)
    assert_rounds(state.o8, o64, bound_scales(q, k, v, None, 0.3)["o"], "O8: P8 V8 cast to E4M3")
    out = fp8_scaled_dot_product_attention(q, k, v, None if mask == "causal" else allowed, is_causal=mask == "causal",
                                           scale=0.3, enable_gqa=True)
    o = state.o8.data.float() * state.o8.scale_inv
    assert out.dtype == dtype and torch.equal(out, o.to(dtype)), "the autograd function returns O8 dequantized"


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)], ids=["MHA", "GQA"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_backward_matches_float64_from_torch_casts(heads, kv_heads, mask):
    q, k, v, do = inputs(h=heads, hk=kv_heads, sq=8, sk=12)
    allowed = MASKS[mask](8, 12)
    state = attention_forward(q, k, v, None if mask == "causal" else allowed,
                              FP8AttentionOptions(softmax_scale=0.3, is_causal=mask == "causal"))
    g = attention_backward(state, do)
    s_do = torch_scale(do, E5M2)
    assert_same_bytes(g.do8.data, torch_cast(do, E5M2, s_do), "dO8: torch's cast with scale 57344 / amax")
    q64, k64, v64 = (f64(t.data, torch_scale(x, E4M3)) for t, x in zip((state.q8, state.k8, state.v8), (q, k, v)))
    p, p8 = attention_probs(state)
    do64 = f64(g.do8.data, s_do)
    want = bound_scales(q, k, v, do, 0.3)
    assert_rounds(g.dv8, group_sum(f64(p8.data, 448.0).transpose(-2, -1) @ do64, kv_heads), want["dv"],
                  "dV8: P8^T dO8, summed over each group")
    dp64 = do64 @ expand(v64, heads).transpose(-2, -1)
    o64 = f64(state.o8.data, 1 / state.o8.scale_inv.double())
    ds64 = p.double() * (dp64 - (do64 * o64).sum(-1, keepdim=True))
    assert_rounds(g.ds8, ds64, want["ds"], "dS8: P (dP - rowsum(dO8 O8))")
    ds = f64(g.ds8.data, want["ds"])
    assert_rounds(g.dq8, ds @ expand(k64, heads) * 0.3, want["dq"], "dQ8: dS8 K8 * softmax_scale")
    assert_rounds(g.dk8, group_sum(ds.transpose(-2, -1) @ q64, kv_heads) * 0.3, want["dk"],
                  "dK8: dS8^T Q8 * softmax_scale, summed over each group")
    for name, t8, grad in (("dq", g.dq8, g.dq), ("dk", g.dk8, g.dk), ("dv", g.dv8, g.dv)):
        assert torch.equal(grad, t8.data.float() * t8.scale_inv), f"{name}: its FP8 cast dequantized"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_autograd_gives_the_backward_pass(dtype):
    q, k, v, do = inputs(dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fp8_scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(do)
    state = attention_forward(q, k, v, None, FP8AttentionOptions(1 / math.sqrt(16), is_causal=True))
    want = attention_backward(state, do)
    for name, leaf, g in zip("qkv", leaves, want[:3]):
        assert leaf.grad.dtype == dtype and torch.equal(leaf.grad, g.to(dtype)), f"d{name} from autograd"


def test_fp8_format_e4m3_casts_the_gradients_to_e4m3():
    q, k, v, do = inputs(h=2, hk=2)
    opts = FP8AttentionOptions(0.25, fwd=fp8ext.E4M3, bwd=fp8ext.E4M3)
    g = attention_backward(attention_forward(q, k, v, None, opts), do)
    assert g.do8.data.dtype == g.ds8.data.dtype == E4M3
    assert_same_bytes(g.do8.data, torch_cast(do, E4M3, torch_scale(do, E4M3)))


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])
def test_fp8_error_is_bounded_and_above_float32_attention(magnitude):
    """Scores kept of order 1 (softmax_scale 1 / (magnitude^2 sqrt(d))) while the tensors span magnitudes that
    E4M3 could not hold unscaled: the per-tensor scales make the error independent of the magnitude. Bounds (norm of
    the error over norm of the exact value): forward within E4M3's unit roundoff 2^-4, gradients within E5M2's
    2^-3; float32 attention (torch's SDPA) stays within 1e-6, so the FP8 error is really quantization."""
    x = inputs(b=2, h=4, hk=4, sq=32, sk=32, d=32, magnitude=magnitude)
    scale = 1 / (magnitude ** 2 * math.sqrt(32))

    def run(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in x[:3]]
        out = fn(*leaves, is_causal=True, scale=scale)
        return [out] + list(torch.autograd.grad(out, leaves, x[3].to(dtype)))

    exact = run(F.scaled_dot_product_attention, torch.float64)
    fp8 = run(fp8_scaled_dot_product_attention, torch.float32)
    f32 = run(F.scaled_dot_product_attention, torch.float32)
    for name, e, a, b, bound in zip(["out", "dq", "dk", "dv"], exact, fp8, f32, [2**-4] + [2**-3] * 3):
        err_fp8 = ((a.double() - e).norm() / e.norm()).item()
        err_f32 = ((b.double() - e).norm() / e.norm()).item()
        assert err_fp8 < bound, f"{name}: FP8 relative error {err_fp8:.4f} over {bound}"
        assert err_f32 < 1e-6 and err_fp8 > 1000 * err_f32, f"{name}: FP8 {err_fp8:.2e} vs float32 {err_f32:.2e}"


def test_a_query_with_every_key_masked_gives_zero_and_zero_gradients():
    q, k, v, do = inputs(h=2, hk=2)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    mask[1, :, 3] = False
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fp8_scaled_dot_product_attention(*leaves, mask)
    out.backward(do)
    assert (out[1, :, 3] == 0).all() and out.isfinite().all() and (leaves[0].grad[1, :, 3] == 0).all()
    assert all(t.grad.isfinite().all() for t in leaves)


# ---- the module: masks as Transformer Engine defines them -----------------------------------------------------------

def te_allowed(b, sq, sk, *, causal=False, window=(-1, -1), bottom_right=False, q_lens=None, kv_lens=None):
    """[b, 1, sq, sk], True where query i attends to key j, position by position from TE's rules: keys in
    [i + off - left, i + off + right] (-1 unbounded), off = len_kv - len_q when aligned bottom right, else 0; causal
    is right = 0; with padding only the first len tokens of each sequence take part."""
    out = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    left, right = window[0], 0 if causal else window[1]
    for n in range(b):
        lq = sq if q_lens is None else q_lens[n]
        lk = sk if kv_lens is None else kv_lens[n]
        off = lk - lq if bottom_right else 0
        for i in range(lq):
            for j in range(lk):
                out[n, 0, i, j] = (right < 0 or j <= i + off + right) and (left < 0 or j >= i + off - left)
    return out


def padding_mask(lens, s):
    """TE's padding mask [b, 1, 1, s]: True at the padding."""
    return torch.stack([torch.arange(s) >= n for n in lens]).view(len(lens), 1, 1, s)


LENS_Q, LENS_KV = [6, 4], [6, 3]
CASES = {  # name: (module kwargs, forward kwargs of TE's conventions, sq, sk, the allowed mask or "causal")
    "no_mask": (dict(attn_mask_type="no_mask"), {}, 6, 6, None),
    "causal": ({}, {}, 6, 6, "causal"),
    "causal cross": ({}, {}, 4, 6, "causal"),
    "causal_bottom_right": (dict(attn_mask_type="causal_bottom_right"), {}, 4, 6,
                            te_allowed(2, 4, 6, causal=True, bottom_right=True)),
    "padding": (dict(attn_mask_type="padding"), dict(attention_mask=padding_mask(LENS_Q, 6)), 6, 6,
                te_allowed(2, 6, 6, q_lens=LENS_Q, kv_lens=LENS_Q)),
    "padding pair": (dict(attn_mask_type="padding", attention_type="cross"),
                     dict(attention_mask=(padding_mask(LENS_Q, 6), padding_mask(LENS_KV, 6))), 6, 6,
                     te_allowed(2, 6, 6, q_lens=LENS_Q, kv_lens=LENS_KV)),
    "padding cu_seqlens": (dict(attn_mask_type="padding"),
                           dict(cu_seqlens_q=torch.tensor([0, 6, 10], dtype=torch.int32),
                                cu_seqlens_kv=torch.tensor([0, 6, 9], dtype=torch.int32)), 6, 6,
                           te_allowed(2, 6, 6, q_lens=LENS_Q, kv_lens=LENS_KV)),
    "padding_causal": (dict(attn_mask_type="padding,causal"), dict(attention_mask=padding_mask(LENS_Q, 6)), 6, 6,
                       te_allowed(2, 6, 6, causal=True, q_lens=LENS_Q, kv_lens=LENS_Q)),
    "window (2, 1)": (dict(attn_mask_type="no_mask", window_size=(2, 1)), {}, 6, 6,
                      te_allowed(2, 6, 6, window=(2, 1))),
    "window (2, 1) bottom right": (dict(attn_mask_type="no_mask", window_size=(2, 1)), {}, 4, 6,
                                   te_allowed(2, 4, 6, window=(2, 1), bottom_right=True)),
    "causal window (2, 0)": (dict(window_size=(2, 0)), {}, 6, 6, te_allowed(2, 6, 6, causal=True, window=(2, 0))),
    "arbitrary": (dict(attn_mask_type="arbitrary"), dict(attention_mask=~MASKS["mask"](6, 6)), 6, 6,
                  MASKS["mask"](6, 6)),
}


def module_inputs(sq, sk, fmt="sbhd", dtype=torch.float32, heads=4, kv_heads=2):
    q, k, v, do = inputs(b=2, h=heads, hk=kv_heads, sq=sq, sk=sk, d=16, dtype=dtype)
    layout = (lambda t: t.permute(2, 0, 1, 3)) if fmt == "sbhd" else (lambda t: t.permute(0, 2, 1, 3))
    return [layout(t).contiguous() for t in (q, k, v)], (q, k, v, do)


def run_module(attn, layers, fwd_kwargs, recipe=None, grad=None):
    leaves = [t.clone().requires_grad_() for t in layers]
    with fp8ext.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        out = attn(*leaves, **fwd_kwargs)
    if grad is not None:
        out.backward(grad)
    return out, [t.grad for t in leaves]


def sbhd_out(out_bhsd):
    b, h, s, d = out_bhsd.shape
    return out_bhsd.permute(2, 0, 1, 3).reshape(s, b, h * d)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("recipe", [None, fp8ext.DelayedScaling(), FP8_DPA], ids=["no autocast", "fp8_dpa False",
                                                                                  "fp8_dpa True"])
def test_module_is_sdpa_or_the_fp8_emulation_with_te_masks(case, recipe):
    mod_kwargs, fwd_kwargs, sq, sk, allowed = CASES[case]
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2, **mod_kwargs)
    layers, (q, k, v, do) = module_inputs(sq, sk)
    out, grads = run_module(attn, layers, fwd_kwargs, recipe, sbhd_out(do))
    causal = isinstance(allowed, str)
    mask = None if causal else allowed
    if recipe is None or not recipe.fp8_dpa:
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.25,
                                              enable_gqa=True)
    else:
        want = fp8_scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=0.25, enable_gqa=True)
    assert out.shape == (sq, 2, 64), "TE's output: [seq, batch, heads * head_dim]"
    assert torch.equal(out, sbhd_out(want)), f"{case}: the same call, bit for bit"
    if mask is not None:
        padded = ~mask.any(-1)[:, 0]  # [b, sq]: queries that see no key
        assert (out.view(sq, 2, 4, 16)[padded.t()] == 0).all(), "a padded query gives zeros"
    assert all(g is not None and g.isfinite().all() for g in grads)


@pytest.mark.parametrize("case", ["causal", "padding_causal", "window (2, 1)"])
def test_fp8_path_is_close_to_high_precision(case):
    """Within E4M3's unit roundoff forward and twice E5M2's backward (six positions average few rounding errors),
    and not equal: the FP8 path quantizes."""
    mod_kwargs, fwd_kwargs, sq, sk, _ = CASES[case]
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2, **mod_kwargs)
    layers, (*_, do) = module_inputs(sq, sk)
    high, high_grads = run_module(attn, layers, fwd_kwargs, None, sbhd_out(do))
    low, low_grads = run_module(attn, layers, fwd_kwargs, FP8_DPA, sbhd_out(do))
    for name, a, b, bound in zip(["out", "dq", "dk", "dv"], [low] + low_grads, [high] + high_grads,
                                 [2**-4] + [2**-2] * 3):
        err = ((a - b).norm() / b.norm()).item()
        assert 1e-4 < err < bound, f"{case}: {name} FP8 relative error {err:.4f} (bound {bound})"


@pytest.mark.parametrize("recipe", [None, FP8_DPA], ids=["high precision", "fp8_dpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sbhd_and_bshd_give_the_same_numbers_transposed(recipe, dtype):
    out = {}
    for fmt in ("sbhd", "bshd"):
        attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format=fmt)
        layers, (*_, do) = module_inputs(6, 6, fmt, dtype)
        out[fmt] = run_module(attn, layers, {}, recipe)[0]
    assert out["sbhd"].shape == (6, 2, 64) and out["bshd"].shape == (2, 6, 64)
    assert out["sbhd"].dtype == dtype and torch.equal(out["sbhd"].transpose(0, 1), out["bshd"])


def test_forward_arguments_override_the_module_and_qkv_format_per_call():
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2)
    layers, (q, k, v, _) = module_inputs(6, 6, "bshd")
    out = attn(*layers, qkv_format="bshd", attn_mask_type="no_mask", window_size=(1, 1))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=te_allowed(2, 6, 6, window=(1, 1)), scale=0.25,
                                          enable_gqa=True)
    assert torch.equal(out, want.permute(0, 2, 1, 3).reshape(2, 6, 64))
    assert attn.attn_mask_type == "causal" and attn.window_size == (-1, 0), "the module's own stay as they were"


def test_gpu_engine_missing_is_an_error_not_a_high_precision_run():
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2)
    layers = [t.to("meta") for t in module_inputs(6, 6)[0]]
    assert attn(*layers).shape == (6, 2, 64), "high precision runs on any device"
    with fp8ext.fp8_autocast(fp8_recipe=FP8_DPA):
        with pytest.raises(NotImplementedError, match="fp8_dpa=True.*no engine for meta tensors.*CPU.*CUDA GPUs"):
            attn(*layers)


def test_a_gpu_engine_slots_into_the_dispatch(monkeypatch):
    seen = []
    monkeypatch.setitem(attention_module.FP8_ATTENTION_ENGINES, "meta",
                        lambda q, k, v, mask, **kw: seen.append(kw) or torch.zeros_like(q))
    layers = [t.to("meta") for t in module_inputs(6, 6)[0]]
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.CurrentScaling(fp8_dpa=True, margin=1)):
        fp8ext.DotProductAttention(4, 16, num_gqa_groups=2)(*layers)
    assert seen == [dict(is_causal=True, scale=0.25, enable_gqa=True, fp8_format=fp8ext.Format.HYBRID, margin=1)]


def test_without_the_cudnn_frontend_a_gpu_run_says_how_to_get_it(monkeypatch):
    from fp8ext.ops import attention_cudnn
    monkeypatch.setitem(sys.modules, "cudnn", None)  # as if not installed
    assert not attention_cudnn.cudnn_available()
    with pytest.raises(ImportError, match="pip install nvidia-cudnn-frontend"):
        attention_cudnn._cudnn()


def test_the_gpu_engine_refuses_masks_and_cpu_tensors_clearly():
    from fp8ext.ops.attention_cudnn import cudnn_fp8_attention
    q, k, v, _ = inputs()
    with pytest.raises(NotImplementedError, match="causal mask or none"):
        cudnn_fp8_attention(q, k, v, torch.ones(8, 8, dtype=torch.bool), enable_gqa=True)
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        cudnn_fp8_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_calibration_and_disabled_autocast_compute_in_high_precision():
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2)
    layers, _ = module_inputs(6, 6)
    want = attn(*layers)
    for ctx in (dict(enabled=False), dict(enabled=True, calibrating=True)):
        with fp8ext.fp8_autocast(fp8_recipe=FP8_DPA, **ctx):
            assert torch.equal(attn(*layers), want), ctx


# ---- errors ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(attention_dropout=0.1), NotImplementedError, "attention_dropout=0.1 is not supported"),
    (dict(attn_mask_type="sliding"), ValueError, "attn_mask_type must be one of"),
    (dict(qkv_format="thd"), NotImplementedError, "qkv_format='thd'"),
    (dict(qkv_format="hbsd"), ValueError, "qkv_format must be 'sbhd' or 'bshd'"),
    (dict(num_gqa_groups=3), ValueError, r"num_attention_heads \(4\) must be a multiple of num_gqa_groups \(3\)"),
    (dict(kv_channels=(16, 8)), NotImplementedError, "different head dimensions"),
    (dict(kv_channels=0), ValueError, "kv_channels must be a positive int"),
    (dict(tp_size=2), NotImplementedError, "tp_size=2 asks for tensor parallelism"),
    (dict(softmax_type="learnable"), NotImplementedError, "attention sinks"),
    (dict(no_such_thing=1), TypeError, "unexpected keyword argument 'no_such_thing'"),
    (dict(window_size=(-2, 0)), ValueError, "window_size must be None or a pair"),
    (dict(attn_mask_type="no_mask", window_size=(-1, 3)), ValueError, r"should be \(-1, -1\) or \(>=0, >=0\)"),
    (dict(attention_type="encoder"), ValueError, "attention_type must be 'self' or 'cross'"),
])
def test_constructor_refuses(kwargs, error, match):
    args = {"num_attention_heads": 4, "kv_channels": 16, **kwargs}
    with pytest.raises(error, match=match):
        fp8ext.DotProductAttention(**args)


def test_constructor_follows_te_window_rules_with_a_warning():
    with pytest.warns(UserWarning, match=r"using \(3, 0\), as Transformer Engine does"):
        assert fp8ext.DotProductAttention(4, 16, window_size=(3, 3)).window_size == (3, 0)
    attn = fp8ext.DotProductAttention(4, (16, 16), layer_number=3, name="attn")
    assert attn.softmax_scale == 0.25 and attn.num_gqa_groups == 4 and not list(attn.parameters())


def _bad(q, k, v):
    """Forward arguments with one fault each, on sbhd tensors [6, 2, heads, 16]."""
    pad = padding_mask([6, 4], 6)
    return {
        "rank": ((q[0], k, v), {}, ValueError, "query_layer must be a 4-D tensor in 'sbhd' layout"),
        "heads": ((q[:, :, :3], k, v), {}, ValueError, "query_layer must have 4 heads"),
        "kv heads": ((q, k[:, :, :1], v[:, :, :1]), {}, ValueError, "2 heads \\(num_gqa_groups\\)"),
        "head dim": ((q[..., :8], k, v), {}, ValueError, "of 16 \\(kv_channels\\)"),
        "k and v": ((q, k, v[:5]), {}, ValueError, "one shape"),
        "dtype": ((q, k.double(), v), {}, TypeError, "must share one dtype"),
        "not a tensor": ((q, k, None), {}, ValueError, "value_layer must be a 4-D tensor"),
        "mask with causal": ((q, k, v), dict(attention_mask=pad), ValueError, "attn_mask_type='causal' takes none"),
        "padding without mask": ((q, k, v), dict(attn_mask_type="padding"), ValueError, "needs attention_mask"),
        "padding mask shape": ((q, k, v), dict(attn_mask_type="padding", attention_mask=pad[:, :, :, :5]),
                               ValueError, r"attention_mask must be a bool tensor \[2, 1, 1, 6\]"),
        "padding mask dtype": ((q, k, v), dict(attn_mask_type="padding", attention_mask=pad.int()), ValueError,
                               "True = padding"),
        "cu_seqlens shape": ((q, k, v), dict(attn_mask_type="padding", cu_seqlens_q=torch.tensor([0, 6])),
                             ValueError, r"cu_seqlens_q must be an int32 tensor of shape \[3\]"),
        "cu_seqlens without padding": ((q, k, v), dict(cu_seqlens_q=torch.tensor([0, 6, 12])), ValueError,
                                       "need a padding mask type"),
        "arbitrary shape": ((q, k, v), dict(attn_mask_type="arbitrary", attention_mask=pad[:, :, :, :5]),
                            ValueError, "broadcastable to"),
        "max_seqlen": ((q, k, v), dict(max_seqlen_q=8), ValueError, "max_seqlen_q=8, but"),
        "bias": ((q, k, v), dict(core_attention_bias_type="post_scale_bias"), NotImplementedError, "attention bias"),
        "unknown": ((q, k, v), dict(no_such_thing=1), TypeError, "unexpected keyword argument 'no_such_thing'"),
        "mask type": ((q, k, v), dict(attn_mask_type="causal,sliding"), ValueError, "attn_mask_type must be one of"),
    }


@pytest.mark.parametrize("fault", list(_bad(*[torch.zeros(1, 1, 1, 1)] * 3)))
def test_forward_refuses(fault):
    layers, _ = module_inputs(6, 6)
    args, kwargs, error, match = _bad(*layers)[fault]
    with pytest.raises(error, match=match):
        fp8ext.DotProductAttention(4, 16, num_gqa_groups=2)(*args, **kwargs)


@pytest.mark.parametrize("call, error, match", [
    (lambda q, k, v: fp8_scaled_dot_product_attention(q[0], k, v), ValueError, "query must be a 4-D tensor"),
    (lambda q, k, v: fp8_scaled_dot_product_attention(q, k, v), ValueError, "enable_gqa=True"),
    (lambda q, k, v: fp8_scaled_dot_product_attention(q, k[:, :, :3], v, enable_gqa=True), ValueError,
     "key and value must be"),
    (lambda q, k, v: fp8_scaled_dot_product_attention(q, k.half(), v.half(), enable_gqa=True), TypeError,
     "share one dtype"),
    (lambda q, k, v: fp8_scaled_dot_product_attention(q, k, v, torch.ones(8, 8, dtype=torch.bool), is_causal=True,
                                                      enable_gqa=True), ValueError, "not both"),
    (lambda q, k, v: fp8_scaled_dot_product_attention(q, k, v, torch.ones(3, 8), enable_gqa=True), ValueError,
     "attn_mask must be a bool tensor"),
    (lambda q, k, v: fp8_scaled_dot_product_attention(q, k, v, enable_gqa=True, fp8_format="e4m3"), TypeError,
     "fp8_format must be a fp8ext.Format"),
    (lambda q, k, v: fp8_scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=float("nan")), TypeError,
     "scale must be a finite number"),
])
def test_emulation_refuses(call, error, match):
    q, k, v, _ = inputs()
    with pytest.raises(error, match=match):
        call(q, k, v)


# ---- the recipe fields ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [fp8ext.DelayedScaling, fp8ext.Float8CurrentScaling, fp8ext.Float8BlockScaling,
                                    fp8ext.Float8RowwiseScaling], ids=lambda r: r.__name__)
def test_fp8_dpa_and_fp8_mha_need_a_per_tensor_recipe(recipe):
    if recipe in (fp8ext.DelayedScaling, fp8ext.Float8CurrentScaling):
        assert recipe(fp8_dpa=True).fp8_dpa
        assert recipe(fp8_mha=True).fp8_dpa, "fp8_mha=True sets fp8_dpa=True"
    else:
        for field in ("fp8_dpa", "fp8_mha"):
            with pytest.raises(NotImplementedError, match=f"{field}=True .*DelayedScaling or Float8CurrentScaling"):
                recipe(**{field: True})


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fp8_output_is_the_outputs_fp8_bytes_and_scale(fmt, dtype):
    # Transformer Engine's fp8_output (what fp8_mha uses): the FP8 bytes the output is the dequantization of
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2, qkv_format=fmt)
    layers, _ = module_inputs(12, 12, fmt, dtype)
    with torch.no_grad(), fp8ext.fp8_autocast(fp8_recipe=fp8ext.Float8CurrentScaling(fp8_mha=True)):
        out = attn(*layers)
        o8 = attn(*layers, fp8_output=True)
    assert isinstance(o8, fp8ext.FP8Tensor) and o8.data.dtype == E4M3 and o8.scale_inv.numel() == 1
    assert o8.data.shape == out.shape == ((12, 2, 64) if fmt == "sbhd" else (2, 12, 64))
    assert torch.equal(o8.dequantize(dtype), out), "the output is O8 dequantized, bit for bit"
    # independently: O8's scale is fmt.max over the bound c * amax(V), and every byte is the cast of the output
    v = layers[2]
    c = 1.0625 + 12 / (1024 * 448)
    assert o8.scale_inv.item() == pytest.approx(c * v.double().abs().max().item() / 448, rel=1e-6)


def test_fp8_output_needs_fp8_attention_and_no_gradient():
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2)
    layers, _ = module_inputs(8, 8)
    with pytest.raises(ValueError, match="fp8_output=True .*needs FP8 attention"):
        attn(*layers, fp8_output=True)
    leaves = [t.clone().requires_grad_() for t in layers]
    with fp8ext.fp8_autocast(fp8_recipe=FP8_DPA):
        with pytest.raises(RuntimeError, match="fp8_output=True .*no gradient.*torch.no_grad"):
            attn(*leaves, fp8_output=True)
    with pytest.raises(TypeError, match="fp8_output must be True or False"):
        fp8_scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in layers), enable_gqa=True, fp8_output=1)
    with torch.no_grad(), fp8ext.fp8_autocast(fp8_recipe=FP8_DPA):
        with pytest.raises(TypeError, match="fp8_output must be True or False"):
            attn(*layers, fp8_output="no")


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_checkpointed_forward_reruns_in_fp8(use_reentrant):
    attn = fp8ext.DotProductAttention(4, 16, num_gqa_groups=2)
    layers, (*_, do) = module_inputs(6, 6)
    want, want_grads = run_module(attn, layers, {}, FP8_DPA, sbhd_out(do))
    leaves = [t.clone().requires_grad_() for t in layers]
    with fp8ext.fp8_autocast(fp8_recipe=FP8_DPA):
        out = fp8ext.checkpoint(attn, *leaves, use_reentrant=use_reentrant)
    out.backward(sbhd_out(do))  # the rerun happens here, outside fp8_autocast
    assert torch.equal(out, want) and all(torch.equal(t.grad, g) for t, g in zip(leaves, want_grads))
