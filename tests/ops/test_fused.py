"""fp8ext.fused (RMSNorm, SwiGLU and RoPE in one pass; the first two writing E4M3 directly) and their use in the
transformer's inference path: against float64 math, against the unfused composition (bit for bit where the
definition is), and the model's outputs with and without the fused kernels."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import fp8ext
from fp8ext import fused
from fp8ext.models.transformer import Transformer, apply_rope, preset

from conftest import requires_cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}


def close_to(got: torch.Tensor, want64: torch.Tensor, dtype, ulps: float = 1.0):
    """|got - want| within `ulps` units in the last place of dtype at want's magnitude (plus the smallest normal)."""
    tol = ulps * ULP[dtype] * want64.abs() + torch.finfo(dtype).tiny
    bad = (got.double() - want64).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} values off, e.g. got {got.double()[bad][:4]} want {want64[bad][:4]}"


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Same shape, dtype and bits (NaNs included)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
    a, b = got.contiguous().view(ints).cpu(), want.contiguous().view(ints).cpu()
    diff = a != b
    assert not diff.any(), f"{what}: {int(diff.sum())} of {a.numel()} differ, first at {diff.nonzero()[0].tolist()}"


def rms64(x, g, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + eps) * g.double()


def swiglu64(h):
    g, u = h.double().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


def devices():
    return ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])]


# ---- definitions against float64 -----------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1024, 9000])
def test_rms_norm_matches_float64(device, dtype, width):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, width, generator=gen) * 3).to(dtype).to(device)
    g = (1 + 0.1 * torch.randn(width, generator=gen)).to(device)
    got = fused.rms_norm(x, g, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape and got.device.type == device
    close_to(got.cpu(), rms64(x.cpu(), g.cpu(), 1e-5), dtype, ulps=1.0 if dtype != torch.float32 else 32.0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_float64(device, dtype):
    gen = torch.Generator().manual_seed(2)
    h = (torch.randn(3, 5, 2 * 704, generator=gen) * 4).to(dtype).to(device)
    got = fused.swiglu(h)
    assert got.shape == (3, 5, 704) and got.dtype == dtype
    close_to(got.cpu(), swiglu64(h.cpu()), dtype, ulps=1.0 if dtype != torch.float32 else 32.0)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 5])
def test_rope_qkv_equals_the_model_composition(device, dtype, start):
    """Bit for bit the transformer's apply_rope (each float32 product and sum rounded) on the same device."""
    b, s, h, kv, hd = 2, 7, 4, 2, 64
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(b, s, (h + 2 * kv) * hd, generator=gen).to(dtype).to(device)
    cfg = preset("tiny", d_model=h * hd, n_heads=h, n_kv_heads=kv, max_seq_len=32)
    from fp8ext.models.transformer import rope_tables
    cos, sin = rope_tables(cfg, device)
    q, k, v = fused.rope_qkv(qkv, cos[start:], sin[start:], h, kv)
    q0, k0, v0 = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
    wq = apply_rope(q0.view(b, s, h, hd).transpose(1, 2), cos[start:], sin[start:])
    wk = apply_rope(k0.view(b, s, kv, hd).transpose(1, 2), cos[start:], sin[start:])
    wv = v0.view(b, s, kv, hd).transpose(1, 2)
    for got, want, name in ((q, wq, "q"), (k, wk, "k"), (v, wv, "v")):
        assert got.is_contiguous() and got.shape == want.shape, name
        assert_same_bytes(got.contiguous(), want.contiguous(), name)


# ---- gradients (training) -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", [0, 5])
def test_rope_qkv_gradient_equals_autograd_of_the_composition(device, dtype, start):
    """The gradient of rope_qkv (one kernel on a GPU) is bit for bit autograd's through the transformer's
    apply_rope composition on the same device, for q, k and v."""
    b, s, h, kv, hd = 2, 7, 4, 2, 64
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(b, s, (h + 2 * kv) * hd, generator=gen).to(dtype).to(device)
    grads = [torch.randn(b, n, s, hd, generator=gen).to(dtype).to(device) for n in (h, kv, kv)]
    cfg = preset("tiny", d_model=h * hd, n_heads=h, n_kv_heads=kv, max_seq_len=32)
    from fp8ext.models.transformer import rope_tables
    cos, sin = rope_tables(cfg, device)
    a = qkv.clone().requires_grad_()
    out = fused.rope_qkv(a, cos[start:], sin[start:], h, kv)
    assert all(t.requires_grad for t in out)
    torch.autograd.backward(out, grads)
    w = qkv.clone().requires_grad_()
    q0, k0, v0 = w.split([h * hd, kv * hd, kv * hd], dim=-1)
    want = (apply_rope(q0.view(b, s, h, hd).transpose(1, 2), cos[start:], sin[start:]),
            apply_rope(k0.view(b, s, kv, hd).transpose(1, 2), cos[start:], sin[start:]),
            v0.view(b, s, kv, hd).transpose(1, 2))
    torch.autograd.backward(want, grads)
    assert_same_bytes(a.grad, w.grad, "dqkv")
    # a gradient that reaches only q (k and v unused) leaves zeros for them
    a.grad = None
    fused.rope_qkv(a, cos[start:], sin[start:], h, kv)[0].backward(grads[0])
    assert not a.grad[..., h * hd:].any()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("x_dtype, out_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("width", [2048, 520])
def test_rms_norm_train_matches_float64_forward_and_backward(device, x_dtype, out_dtype, width):
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(301, width, generator=gen) * 3).to(x_dtype).to(device).requires_grad_()
    g = (1 + 0.1 * torch.randn(width, generator=gen)).to(device).requires_grad_()
    dy = torch.randn(301, width, generator=gen).to(out_dtype).to(device)
    y = fused.rms_norm_train(x, g, 1e-5, out_dtype)
    assert y.dtype == out_dtype and y.shape == x.shape
    close_to(y.detach().cpu(), rms64(x.detach().cpu(), g.detach().cpu(), 1e-5), out_dtype,
             ulps=1.0 if out_dtype != torch.float32 else 32.0)
    y.backward(dy)
    x64, g64 = x.detach().cpu().double().requires_grad_(), g.detach().cpu().double().requires_grad_()
    rms64(x64, g64, 1e-5).backward(dy.cpu().double())
    assert x.grad.dtype == x_dtype and g.grad.dtype == torch.float32
    # dx = rstd * (gy - xh * mean(gy * xh)) cancels: float32 noise on the terms' scale, plus x's rounding
    xh = x64.detach() * torch.rsqrt(x64.detach().square().mean(-1, keepdim=True) + 1e-5)
    gy = dy.cpu().double() * g64.detach()
    terms = (gy.abs() + xh.abs() * (gy * xh).abs().mean(-1, keepdim=True)) * xh.abs().div(x64.detach().abs()
                                                                                             .clamp_min(1e-30))
    tol = ULP[x_dtype] * x64.grad.abs() + 2.0 ** -18 * terms + torch.finfo(x_dtype).tiny
    bad = (x.grad.cpu().double() - x64.grad).abs() > tol
    assert not bad.any(), f"dx: {int(bad.sum())} off"
    dg_tol = 2.0 ** -16 * (dy.cpu().double() * xh).abs().sum(0) + 1e-30
    assert ((g.grad.cpu().double() - g64.grad).abs() <= dg_tol).all(), "dgamma"


@requires_cuda
@pytest.mark.cuda
def test_rms_norm_train_kernels_agree_with_the_inference_kernel_and_are_deterministic():
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    g = 1 + 0.1 * torch.randn(4096, device="cuda")
    with torch.no_grad():
        assert_same_bytes(fused.rms_norm_train(x, g, 1e-6), fused.rms_norm(x, g, 1e-6), "same sum order")
    xg, gg = x.clone().requires_grad_(), g.clone().requires_grad_()
    dy = torch.randn_like(x)
    fused.rms_norm_train(xg, gg, 1e-6).backward(dy)
    first = (xg.grad.clone(), gg.grad.clone())
    xg.grad, gg.grad = None, None
    fused.rms_norm_train(xg, gg, 1e-6).backward(dy)
    assert_same_bytes(xg.grad, first[0], "dx")
    assert_same_bytes(gg.grad, first[1], "dgamma summed in a fixed order")


@requires_cuda
@pytest.mark.cuda
def test_rmsnorm_module_trains_through_the_kernels_under_autocast():
    norm = fp8ext.RMSNorm(2048, eps=1e-5, device="cuda")
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(2, 64, 2048, device="cuda", requires_grad=True)  # a float32 residual stream
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = norm(x)
    assert y.dtype == torch.bfloat16 and type(y.grad_fn).__name__ == "_RMSNormTrainBackward"
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):  # without gradients: as before
        assert_same_bytes(norm(x), F.rms_norm(x, (2048,), norm.weight, 1e-5).to(torch.bfloat16), "no_grad")
    y.float().square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    F.rms_norm(x2, (2048,), w2, 1e-5).to(torch.bfloat16).float().square().sum().backward()
    assert ((x.grad - x2.grad).norm() / x2.grad.norm()).item() < 1e-2
    assert ((norm.weight.grad - w2.grad).norm() / w2.grad.norm()).item() < 1e-2


@requires_cuda
@pytest.mark.cuda
def test_second_derivatives_raise_and_learned_rope_tables_get_gradients():
    """The kernels' backward passes are not differentiable again: asking for that raises (never a silently
    wrong higher-order gradient). A RoPE table that requires grad takes torch's differentiable ops."""
    h = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    gamma = torch.ones(64, device="cuda", requires_grad=True)
    for out, inp in ((fused.swiglu(h), h), (fused.rms_norm_train(x, gamma, 1e-6), x)):
        (g,) = torch.autograd.grad(out.float().square().sum(), inp, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.float().sum().backward()
    from fp8ext.models.transformer import rope_tables
    cos, sin = rope_tables(preset("tiny", d_model=128, n_heads=2, n_kv_heads=1, max_seq_len=16), "cuda")
    cos.requires_grad_()
    qkv = torch.randn(1, 4, 4 * 64, device="cuda", requires_grad=True)
    q, k, v = fused.rope_qkv(qkv, cos, sin, 2, 1)
    (q.sum() + k.sum()).backward()
    assert cos.grad is not None and cos.grad[:4].abs().sum() > 0 and qkv.grad is not None


def test_rms_norm_train_kernels_refuse_bad_arguments():
    from fp8ext import _C
    from fp8ext.core.boundary import dl
    x, g, r = torch.randn(4, 32), torch.ones(32), torch.empty(4)
    with pytest.raises(ValueError, match="x is in host memory"):
        _C.rms_norm_fwd(dl(x), dl(g), dl(torch.empty_like(x)), dl(r), 1e-6)
    with pytest.raises(TypeError, match="out_dtype"):
        fused.rms_norm_train(x, g, 1e-6, torch.int32)
    with pytest.raises(ValueError, match="gamma must be a tensor of 32"):
        fused.rms_norm_train(x, torch.ones(31), 1e-6)
    if fp8ext.cuda_available():
        xc, gc, rc = x.cuda(), g.cuda(), r.cuda()
        with pytest.raises(ValueError, match="multiple of 8 from 8 to 8192"):
            _C.rms_norm_fwd(dl(xc[:, :12].contiguous()), dl(gc[:12].contiguous()),
                            dl(torch.empty(4, 12, device="cuda")), dl(rc), 1e-6)
        with pytest.raises(ValueError, match="rstd"):
            _C.rms_norm_fwd(dl(xc), dl(gc), dl(torch.empty_like(xc)), dl(torch.empty(3, device="cuda")), 1e-6)
        with pytest.raises(ValueError, match="blocks <= min"):
            _C.rms_norm_bwd(dl(xc), dl(xc), dl(gc), dl(rc), dl(torch.empty_like(xc)),
                            dl(torch.empty(5, 32, device="cuda")), dl(torch.empty(32, device="cuda")))
        with pytest.raises(ValueError, match="dx"):
            _C.rms_norm_bwd(dl(xc), dl(xc.clone()), dl(gc), dl(rc), dl(xc),
                            dl(torch.empty(2, 32, device="cuda")), dl(torch.empty(32, device="cuda")))


def _swiglu_grad_close(got: torch.Tensor, h: torch.Tensor, dy: torch.Tensor, dtype) -> None:
    """got against float64 autograd: one unit in the last place of dtype, plus float32 arithmetic on the
    terms' scale (d_gate = dy * up * (sig + gate * sig * (1 - sig)) cancels near gate = -1.28)."""
    h64 = h.detach().cpu().double().requires_grad_()
    swiglu64(h64).backward(dy.cpu().double())
    g, u = h64.detach().chunk(2, dim=-1)
    scale = torch.cat([(dy.cpu().double() * u).abs() * (1 + g.abs()), (dy.cpu().double() * g).abs()], dim=-1)
    tol = ULP[dtype] * h64.grad.abs() + 2.0 ** -20 * scale + torch.finfo(dtype).tiny
    bad = (got.cpu().double() - h64.grad).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} off, e.g. got {got.cpu().double()[bad][:4]} want {h64.grad[bad][:4]}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_gradient_matches_float64(device, dtype):
    gen = torch.Generator().manual_seed(5)
    h = (torch.randn(3, 5, 2 * 704, generator=gen) * 4).to(dtype).to(device).requires_grad_()
    dy = torch.randn(3, 5, 704, generator=gen).to(dtype).to(device)
    y = fused.swiglu(h)
    close_to(y.detach().cpu(), swiglu64(h.detach().cpu()), dtype, ulps=1.0 if dtype != torch.float32 else 32.0)
    y.backward(dy)
    assert h.grad.dtype == dtype and h.grad.shape == h.shape
    _swiglu_grad_close(h.grad, h, dy, dtype)


@requires_cuda
@pytest.mark.cuda
def test_swiglu_gradient_of_a_non_contiguous_output_gradient():
    h = torch.randn(64, 2 * 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 64, device="cuda", dtype=torch.bfloat16).t()  # strided
    fused.swiglu(h).backward(dy)
    _swiglu_grad_close(h.grad, h, dy, torch.bfloat16)


def test_gradient_kernels_refuse_host_memory_and_bad_shapes():
    from fp8ext import _C
    from fp8ext.core.boundary import dl
    h, dy = torch.randn(4, 32), torch.randn(4, 16)
    with pytest.raises(ValueError, match="h is in host memory"):
        _C.swiglu_backward(dl(h), dl(dy), dl(torch.empty_like(h)))
    if fp8ext.cuda_available():
        hc, dyc = h.cuda(), dy.cuda()
        with pytest.raises(ValueError, match=r"dy \[rows, cols\]"):
            _C.swiglu_backward(dl(hc), dl(hc), dl(torch.empty_like(hc)))
        with pytest.raises(ValueError, match="multiple of 8"):
            _C.swiglu_backward(dl(hc[:, :12].contiguous()), dl(dyc[:, :6].contiguous()),
                               dl(torch.empty(4, 12, device="cuda")))
        with pytest.raises(ValueError, match="dh"):
            _C.swiglu_backward(dl(hc), dl(dyc), dl(hc))  # dh overlapping h


# ---- the FP8 outputs equal the composition -------------------------------------------------------------------

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [512, 3000, 6000, 9000])  # the GPU keeps rows of up to 8192 in registers
def test_fp8_outputs_equal_quantize_of_the_output(device, static, dtype, width):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(19, width, generator=gen) * 2).to(dtype).to(device)
    x[3] = 0  # a zero row: scale 1
    x[5, 7] = 3000.0  # saturates with the static scale
    g = (1 + 0.1 * torch.randn(width, generator=gen)).to(device)
    h = (torch.randn(19, 2 * width, generator=gen) * 3).to(dtype).to(device)
    scale = torch.tensor([37.0], device=device) if static else None
    for fp8_fn, hp in ((lambda: fused.rms_norm_fp8(x, g, 1e-6, scale), fused.rms_norm(x, g, 1e-6)),
                       (lambda: fused.swiglu_fp8(h, scale), fused.swiglu(h))):
        q, sinv = fp8_fn()
        assert q.dtype == torch.float8_e4m3fn and q.shape == hp.shape
        if static:
            assert sinv is None
            assert_same_bytes(q, fp8ext.quantize(hp.contiguous(), fp8ext.E4M3, scale.reshape(())), "static")
        else:
            wq, ws = fp8ext.quantize_rowwise(hp.contiguous(), fp8ext.E4M3)
            assert_same_bytes(q, wq, "rows")
            assert_same_bytes(sinv, ws, "scale_inv")


@pytest.mark.parametrize("device", devices())
def test_nan_and_inf_propagate_like_the_composition(device):
    x = torch.randn(4, 64).to(torch.bfloat16).to(device)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    g = torch.ones(64, device=device)
    hp = fused.rms_norm(x, g, 1e-6)
    assert torch.isnan(hp[1]).all() and torch.isnan(hp[2]).any() and torch.isfinite(hp[0]).all()
    q, sinv = fused.rms_norm_fp8(x, g, 1e-6)
    wq, ws = fp8ext.quantize_rowwise(hp.contiguous(), fp8ext.E4M3)
    assert_same_bytes(q, wq, "rows with NaN")
    assert_same_bytes(sinv, ws, "scale_inv with NaN")


# ---- errors ------------------------------------------------------------------------------------------------------

def test_errors_name_the_argument():
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        fused.rms_norm(x.to(torch.int32), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="gate then up"):
        fused.swiglu(torch.randn(4, 63))
    with pytest.raises(ValueError, match="scale must be a one-element float32"):
        fused.rms_norm_fp8(x, torch.ones(64), 1e-6, torch.ones(2))
    with pytest.raises(ValueError, match="qkv's last dimension"):
        fused.rope_qkv(torch.randn(1, 2, 100), torch.ones(8, 8), torch.ones(8, 8), 4, 2)
    with pytest.raises(ValueError, match="cos must be float32"):
        fused.rope_qkv(torch.randn(1, 2, 128), torch.ones(8, 4), torch.ones(8, 8), 4, 2)
    with pytest.raises(ValueError, match="exceed"):
        fused.rope_qkv(torch.randn(1, 9, 128), torch.ones(8, 8), torch.ones(8, 8), 4, 2)


@requires_cuda
@pytest.mark.cuda
def test_gpu_errors_name_the_argument():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gamma"):
        fused.rms_norm(x, torch.ones(32, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match="gamma is on"):
        fused.rms_norm(x, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="scale is on"):
        fused.swiglu_fp8(torch.randn(4, 64, device="cuda"), torch.ones(1))
    # non-contiguous and offset inputs are copied, not refused
    xt = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16).t()
    close_to(fused.rms_norm(xt, torch.ones(64, device="cuda"), 1e-6).cpu(),
             rms64(xt.cpu(), torch.ones(64), 1e-6), torch.bfloat16)
    off = torch.randn(4 * 64 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(4, 64)
    close_to(fused.rms_norm(off, torch.ones(64, device="cuda"), 1e-6).cpu(), rms64(off.cpu(), torch.ones(64), 1e-6),
             torch.bfloat16)


# ---- in the model -------------------------------------------------------------------------------------------------

@requires_cuda
@pytest.mark.cuda
def test_model_inference_path_matches_the_autograd_path(monkeypatch):
    """The transformer's forward without gradients (fused kernels, SDPA reading K/V heads in place) against the
    same model with gradients enabled (torch ops): logits within bf16 rounding noise."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", d_model=128, n_heads=4, n_kv_heads=2, d_ff=256), device="cuda")
    model = model.to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (3, 40), device="cuda")
    with torch.no_grad():
        fast = model(ids).float()
    monkeypatch.setattr(fused, "TRAINING", False)
    slow = model(ids).float().detach()
    rel = ((fast - slow).norm() / slow.norm()).item()
    assert rel < 2e-2, rel


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_model_training_with_fused_kernels_matches_the_composition(monkeypatch, fp8):
    """A training step on the GPU with the fused RoPE / SwiGLU kernels and in-place GQA against torch's
    composition (bf16 autocast): the loss and every gradient within bf16 rounding noise; with FP8 linear layers,
    within the noise FP8 itself adds (the composition in FP8 against the composition in bf16)."""
    cfg = preset("tiny", d_model=128, n_heads=4, n_kv_heads=2, d_ff=256)
    ids = torch.randint(0, 256, (3, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    out = {}
    for fused_on, fp8_on in ((True, fp8), (False, fp8), (False, False)):
        monkeypatch.setattr(fused, "TRAINING", fused_on)
        torch.manual_seed(0)
        model = Transformer(cfg, device="cuda")
        recipe = fp8ext.DelayedScaling()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], ids[:, 1:], fp8=fp8_on, fp8_recipe=recipe)[1]
        loss.backward()
        out[fused_on, fp8_on] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters()})
    (l1, g1), (l0, g0), (_, gb) = out[True, fp8], out[False, fp8], out[False, False]

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert abs(l1 - l0) < 2e-2 * abs(l0), (l1, l0)
    for n in g0:
        noise = rel(g0[n], gb[n])  # 0 without FP8
        assert rel(g1[n], g0[n]) < 3e-2 + 2 * noise, (n, rel(g1[n], g0[n]), noise)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_model_with_fused_norms_equals_unfused(activations):
    """quantize_model makes the norms before the QKV and w13 projections write E4M3 directly, and SwiGLU write
    w2's E4M3 input: the logits equal those of the same FP8 model run with the unfused ops, bit for bit."""
    from fp8ext import inference
    torch.manual_seed(0)
    cfg = preset("tiny", d_model=128, n_heads=4, n_kv_heads=2, d_ff=256)
    model = Transformer(cfg, device="cuda").to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 48), device="cuda")
    with torch.no_grad():
        if activations == "static":
            inference.calibrate(model, [ids], progress=False)
        inference.quantize_model(model, "channel", activations)
    norms = [m for m in model.modules() if isinstance(m, inference.FP8InputRMSNorm)]
    assert len(norms) == 2 * cfg.n_layers
    sd = model.state_dict()
    assert "blocks.0.attn_norm.weight" in sd and "blocks.0.ffn_norm.weight" in sd
    with torch.no_grad():
        got = model(ids)
        # unfused: the same layers, each norm's output quantized by the layer itself
        plain = copy.deepcopy(model)
        for block in plain.blocks:
            for name in ("attn_norm", "ffn_norm"):
                n = getattr(block, name)
                p = fp8ext.RMSNorm(cfg.d_model, eps=n.eps, device="cuda", params_dtype=torch.bfloat16)
                p.weight = n.weight
                setattr(block, name, p)
            block.ffn.w2.quantize_input = None  # instance attribute: SwiGLU then runs unfused
        want = plain(ids)
    assert_same_bytes(got, want, "logits")


@requires_cuda
@pytest.mark.cuda
def test_fp8_activation_for_another_layer_is_refused():
    from fp8ext.inference import FP8InferenceLinear
    a = FP8InferenceLinear.from_linear(torch.nn.Linear(64, 32, device="cuda"), "channel", "dynamic")
    b = FP8InferenceLinear.from_linear(torch.nn.Linear(64, 32, device="cuda"), "channel", "static", input_amax=3.0)
    h = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    act = a.quantize_input(h, "swiglu")
    assert act is not None and act.data.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(a(act).float(), a(fused.swiglu(h)).float(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="quantized for another layer"):
        b(act)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_cache_store_kernel_equals_the_torch_composition(dtype):
    """KVCache's FP8 store on a GPU (one kernel into the cache) writes the bytes of fp8(x / scale) computed
    with torch's float32 division and fp8ext.quantize, saturating, at the right positions."""
    from fp8ext.inference import KVCache
    cfg = preset("tiny", d_model=128, n_heads=4, n_kv_heads=2, max_seq_len=64)
    hd = cfg.head_dim
    ks = torch.tensor([0.01, 0.003], device="cuda")
    cache = KVCache(cfg, 3, 40, "fp8", device="cuda", k_scale=ks, v_scale=ks * 2)
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(3, 2, 7, hd, device="cuda", generator=gen).to(dtype)
    k[0, 1, 2, 3] = 100.0  # saturates
    k[1, 0, 4, 5] = float("nan")
    v = torch.randn(3, 2, 7, hd, device="cuda", generator=gen).to(dtype)
    cache.update(0, k, v, 0)
    step = torch.randn(3, 2, 1, hd, device="cuda", generator=gen).to(dtype)
    cache.append(0, step, step, 7)
    for x, stored, sc, at in ((k, cache.k[0, :, :, :7], ks, 0), (v, cache.v[0, :, :, :7], ks * 2, 0),
                              (step, cache.k[0, :, :, 7:8], ks, 7), (step, cache.v[0, :, :, 7:8], ks * 2, 7)):
        want = fp8ext.quantize((x.float() / sc[None, :, None, None]).contiguous(), fp8ext.E4M3, 1.0)
        assert_same_bytes(stored.contiguous(), want, f"positions from {at}")


def test_layers_made_under_inference_mode_work():
    """Tensors made under torch.inference_mode have no version counter: the caches keyed on it step aside."""
    from fp8ext.inference import FP8InferenceLinear
    with torch.inference_mode():
        lin = torch.nn.Linear(32, 16)
        layer = FP8InferenceLinear.from_linear(lin, "channel", "static", input_amax=3.0)
        norm = fp8ext.RMSNorm(32)
        x = torch.randn(4, 32)
        assert layer.weight.is_inference() and fused.version_key(layer.weight) is None
        y1, y2 = layer(x), layer(x)
        torch.testing.assert_close(y1, y2, rtol=0, atol=0)
        torch.testing.assert_close(norm.fused_gamma(), torch.ones(32), rtol=0, atol=0)
        torch.testing.assert_close(y1.float(), lin(x).float(), rtol=0.1, atol=0.1)
    w = torch.ones(3)
    assert fused.version_key(w) == (w.data_ptr(), 0)
    w.add_(1)
    assert fused.version_key(w) == (w.data_ptr(), 1)


def test_fused_norms_follow_the_layer_they_feed():
    """An FP8InputRMSNorm looks its layer up in the block at each call: replacing the projection later (or
    loading a checkpoint into an already quantized model) never feeds a stale or non-FP8 layer."""
    from fp8ext import inference
    torch.manual_seed(0)
    cfg = preset("tiny", d_model=64, n_heads=4, n_kv_heads=2, d_ff=128)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        inference.quantize_model(model, "channel", "dynamic")
    block = model.blocks[0]
    assert isinstance(block.attn_norm, inference.FP8InputRMSNorm)
    assert block.attn_norm.consumer() is block.attn.qkv_proj and block.ffn_norm.consumer() is block.ffn.w13
    new = inference.FP8InferenceLinear.from_linear(torch.nn.Linear(64, block.attn.qkv_proj.out_features, bias=False),
                                                   "tensor", "dynamic")
    block.attn.qkv_proj = new
    assert block.attn_norm.consumer() is new
    block.attn.qkv_proj = fp8ext.Linear(64, new.out_features, bias=False)
    assert block.attn_norm.consumer() is None
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.isfinite(model(ids)).all()  # the CPU path: plain norm into the plain linear
    assert inference.fuse_norms(model) == 2 * cfg.n_layers - 1  # all but the norm before the plain linear
    clone = copy.deepcopy(model)
    assert clone.blocks[1].attn_norm.consumer() is clone.blocks[1].attn.qkv_proj


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_training_kernels_are_registered_torch_ops(dtype):
    """torch.ops.fp8ext.swiglu / rms_norm_train and their backward ops (what torch.compile calls): schemas, fake
    tensors, autograd registration and dynamic shapes (torch.library.opcheck, on the CPU's definitions), and
    their gradients against autograd through the torch composition."""
    torch.manual_seed(0)
    h = torch.randn(6, 32, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.fp8ext.swiglu, (h,))
    torch.library.opcheck(torch.ops.fp8ext.swiglu_backward, (h.detach(), torch.randn(6, 16, dtype=dtype)))
    x = torch.randn(2, 3, 16, dtype=dtype, requires_grad=True)
    g = (torch.rand(16) + 0.5).requires_grad_()
    torch.library.opcheck(torch.ops.fp8ext.rms_norm_train, (x, g, 1e-6, torch.bfloat16))
    # non-contiguous inputs give contiguous outputs, as the fake kernels say
    torch.library.opcheck(torch.ops.fp8ext.swiglu, (torch.randn(32, 6, dtype=dtype).t(),))
    torch.library.opcheck(torch.ops.fp8ext.rms_norm_train, (torch.randn(16, 5, dtype=dtype).t(), g, 1e-6, dtype))
    y, rstd = torch.ops.fp8ext.rms_norm_train(x, g, 1e-6, torch.bfloat16)
    assert y.requires_grad and not rstd.requires_grad, "1/rms is a by-product, not differentiable"
    torch.library.opcheck(torch.ops.fp8ext.rms_norm_train_backward, (x.detach(), torch.randn_like(x), g.detach(),
                                                                       rstd.detach()))
    # gradients: the ops' formulas against autograd through the composition, in float64
    dy = torch.randn(6, 16, dtype=torch.float64)
    (dh,) = torch.autograd.grad(torch.ops.fp8ext.swiglu(h), h, dy.to(dtype))
    h64 = h.detach().double().requires_grad_()
    gate, up = h64.chunk(2, -1)
    (want,) = torch.autograd.grad(F.silu(gate) * up, h64, dy.to(dtype).double())
    # the gate's gradient cancels near gate = -1.28: within 4 units of dtype at the largest gradient
    assert torch.allclose(dh.double(), want, rtol=0, atol=4 * ULP[dtype] * float(want.abs().max()))
    dy = torch.randn(2, 3, 16, dtype=torch.float64)
    dx, dg = torch.autograd.grad(y, (x, g), dy.bfloat16())
    x64, g64 = x.detach().double().requires_grad_(), g.detach().double().requires_grad_()
    want_x, want_g = torch.autograd.grad(F.rms_norm(x64, (16,), g64, 1e-6), (x64, g64), dy.bfloat16().double())
    # dx cancels (dy * g - xh * dot): within 8 units of dtype at the gradient's largest magnitude
    assert torch.allclose(dx.double(), want_x, rtol=0, atol=8 * ULP[dtype] * float(want_x.abs().max()))
    assert torch.allclose(dg.double(), want_g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_qkv_is_a_registered_torch_op(dtype):
    """torch.ops.fp8ext.rope_qkv and its backward op (what torch.compile calls): schemas, fake tensors, autograd
    registration (torch.library.opcheck, on the CPU's definition), the outputs equal fused.rope_qkv's eager ones, and
    the gradient equals autograd's through the float32 composition, bit for bit (that is the kernel's definition)."""
    torch.manual_seed(0)
    b, s, h, kv, hd = 2, 5, 4, 2, 8
    qkv = torch.randn(b, s, (h + 2 * kv) * hd, dtype=dtype, requires_grad=True)
    cos, sin = torch.randn(9, hd // 2), torch.randn(9, hd // 2)
    torch.library.opcheck(torch.ops.fp8ext.rope_qkv, (qkv, cos, sin, h, kv, 3))
    # one token of one sequence: v is then a view of qkv in the reference, and the op copies it
    torch.library.opcheck(torch.ops.fp8ext.rope_qkv, (qkv[:1, :1].detach().clone().requires_grad_(), cos, sin, h, kv,
                                                      3))
    grads = [torch.randn(b, n, s, hd, dtype=dtype) for n in (h, kv, kv)]
    torch.library.opcheck(torch.ops.fp8ext.rope_qkv_backward, (*grads, cos, sin, h, kv, 3))
    out = torch.ops.fp8ext.rope_qkv(qkv, cos, sin, h, kv, 3)
    want = fused.rope_qkv(qkv, cos, sin, h, kv, 3)
    for name, a, w in zip("qkv", out, want):
        assert_same_bytes(a, w.contiguous(), name)
    (dqkv,) = torch.autograd.grad(out, qkv, grads)
    (want_dqkv,) = torch.autograd.grad(want, qkv, grads)
    assert_same_bytes(dqkv, want_dqkv, "dqkv")
    # a gradient that autograd leaves out (v unused) counts as zeros
    out = torch.ops.fp8ext.rope_qkv(qkv, cos, sin, h, kv, 3)
    want = fused.rope_qkv(qkv, cos, sin, h, kv, 3)
    (dqk,) = torch.autograd.grad(out[0].sum() + out[1].sum(), qkv)
    (want_dqk,) = torch.autograd.grad(want[0].sum() + want[1].sum(), qkv)
    assert_same_bytes(dqk, want_dqk, "dqkv without v's gradient")


@requires_cuda
@pytest.mark.cuda
def test_compiled_rope_qkv_runs_the_kernels_with_eager_bytes(monkeypatch):
    """Under torch.compile (fullgraph) fused.rope_qkv runs its forward and backward kernels as torch ops: outputs
    and the gradient equal the eager ones byte for byte."""
    calls = []
    fwd, bwd = fused.rope_qkv_gpu, fused.rope_qkv_backward_gpu
    monkeypatch.setattr(fused, "rope_qkv_gpu", lambda *a: calls.append("fwd") or fwd(*a))
    monkeypatch.setattr(fused, "rope_qkv_backward_gpu", lambda *a: calls.append("bwd") or bwd(*a))
    torch.manual_seed(0)
    b, s, h, kv, hd = 2, 64, 8, 2, 64
    cos, sin = torch.randn(128, hd // 2, device="cuda"), torch.randn(128, hd // 2, device="cuda")
    qkv0 = torch.randn(b, s, (h + 2 * kv) * hd, device="cuda", dtype=torch.bfloat16)
    grads = [torch.randn(b, n, s, hd, device="cuda", dtype=torch.bfloat16) for n in (h, kv, kv)]

    def rope(qkv):
        q, k, v = fused.rope_qkv(qkv, cos, sin, h, kv, 0)
        return q * 2, k, v

    results = []
    for fn in (rope, torch.compile(rope, fullgraph=True)):
        calls.clear()
        qkv = qkv0.clone().requires_grad_()
        out = fn(qkv)
        torch.autograd.backward(out, grads)
        results.append((*[t.detach() for t in out], qkv.grad))
        assert calls == ["fwd", "bwd"], f"{fn}: the kernels ran once each, got {calls}"
    for name, a, b_ in zip(("q", "k", "v", "dqkv"), *results):
        assert_same_bytes(b_, a, name)


@requires_cuda
@pytest.mark.cuda
def test_compiled_training_runs_the_fused_kernels_with_eager_bytes(monkeypatch):
    """Under torch.compile (fullgraph) fp8ext.RMSNorm and fused.swiglu run the same kernels as in eager mode, as
    torch ops: forward outputs and every gradient equal the eager ones byte for byte."""
    calls = []
    run_rows, bwd = fused.run_rows, fused.rms_norm_train_backward_gpu
    monkeypatch.setattr(fused, "run_rows", lambda *a: calls.append("swiglu") or run_rows(*a))
    monkeypatch.setattr(fused, "rms_norm_train_backward_gpu", lambda *a: calls.append("rms_bwd") or bwd(*a))
    torch.manual_seed(0)
    norm = fp8ext.RMSNorm(256, eps=1e-6, params_dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)

    def block(x, w):
        return fused.swiglu(norm(x) @ w)

    x0 = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    w0 = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * 0.05
    dy = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16)
    results = []
    for fn in (block, torch.compile(block, fullgraph=True)):
        calls.clear()
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        norm.weight.grad = None
        y = fn(x, w)
        y.backward(dy)
        results.append((y.detach(), x.grad, w.grad, norm.weight.grad))
        assert "swiglu" in calls and "rms_bwd" in calls, f"{fn}: the kernels ran"
    for name, a, b in zip(("y", "dx", "dw", "dgamma"), *results):
        assert_same_bytes(b, a, name)




@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fn, arg, call", [
    ("rms_norm", "x", lambda x, g: fused.rms_norm(x, g, 1e-5)),
    ("rms_norm_fp8", "x", lambda x, g: fused.rms_norm_fp8(x, g, 1e-5)),
    ("swiglu", "h", lambda x, g: fused.swiglu(x)),
    ("swiglu_fp8", "h", lambda x, g: fused.swiglu_fp8(x)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_broadcast_input_is_refused_before_the_kernels_copy_it(fn, arg, call):
    x = torch.zeros(1, device="cuda").expand(64, 1024)  # a view of one stored element
    g = torch.ones(1024, device="cuda")
    with pytest.raises(ValueError, match=rf"{fn}\(\): {arg} must be contiguous \(row-major, compact\), got a "
                                         r"broadcast view \(stride 0\)"):
        call(x, g)

