"""RMSNorm and SwiGLU computed inside the FP8 cast of the next GEMM's input (fp8ext.modules.fused_linear, used by
LayerNormLinear and LayerNormMLP): the same bytes as the separate steps (the step's output rounded to the input's
dtype, then FP8Linear), forward, backward and the scaling state, on the CPU reference and on a GPU's kernels."""
import pytest
import torch

import fp8ext
import fp8ext as te
from fp8ext import _C, fused
from fp8ext.modules import fused_linear as FL
from fp8ext.core.boundary import dl, dl_fp8, stream_of
from conftest import requires_cuda

EPS = 1e-5


def _step_pair(op, dtype, bias, device="cpu"):
    """Two identical FP8 layers and inputs for the fused path and the separate steps."""
    torch.manual_seed(0)
    k, n = 64, 48
    a = fp8ext.Linear(k, n, bias=bias, params_dtype=dtype, device=device)
    b = fp8ext.Linear(k, n, bias=bias, params_dtype=dtype, device=device)
    b.load_state_dict(a.state_dict())
    width = 2 * k if op == FL.SWIGLU else k
    x = torch.randn(2, 16, width, dtype=dtype, device=device) * 3
    gamma = torch.rand(k, device=device) + 0.5
    return a, b, x, gamma


def _count_prologue_casts(monkeypatch):
    """The list of the prologues (FL.RMSNORM, ...) computed inside casts from now on: by the composed fused path or
    by FP8Linear's one-call forward (SwiGLU's layer once its slots are registered)."""
    calls = []
    real, real_fwd = FL._cast_with_prologue, _C.linear_fwd
    monkeypatch.setattr(FL, "_cast_with_prologue", lambda op, *a, **kw: calls.append(op) or real(op, *a, **kw))
    monkeypatch.setattr(_C, "linear_fwd", lambda *a, **kw: (kw.get("prologue") and calls.append(kw["prologue"])) or
                        real_fwd(*a, **kw))
    return calls


class _ReferenceRMSNorm(torch.autograd.Function):
    """RMSNorm by fp8ext.fused's reference definitions both ways (the definitions the GPU kernels compute)."""

    @staticmethod
    def forward(ctx, x, gamma):
        x2 = x.reshape(-1, x.shape[-1])
        y, rstd = fused.rms_norm_train_reference(x2, gamma, EPS, x.dtype)
        ctx.save_for_backward(x2, gamma, rstd)
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, gamma, rstd = ctx.saved_tensors
        dx, dgamma = fused.rms_norm_train_backward_reference(x2, dy, gamma, rstd)
        return dx.reshape(dy.shape), dgamma


class _ReferenceSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return fused.swiglu_reference(h)

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        return fused.swiglu_backward_reference(h, dy)


def _separate(op, x, gamma, lin):
    if op == FL.RMSNORM:
        return lin(_ReferenceRMSNorm.apply(x, gamma))
    return lin(_ReferenceSwiGLU.apply(x))


@pytest.mark.parametrize("op", [FL.RMSNORM, FL.SWIGLU], ids=["rmsnorm", "swiglu"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_path_is_the_separate_steps_bit_for_bit(op, bias, dtype):
    """On the CPU the fused path computes the step with fp8ext.fused's reference definitions: over three steps of
    delayed scaling its outputs, gradients and scaling state equal those of the step followed by FP8Linear."""
    fused_lin, sep_lin, x, gamma = _step_pair(op, dtype, bias)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ga, gb = gamma.clone().requires_grad_(), gamma.clone().requires_grad_()
    recipe = fp8ext.DelayedScaling(amax_history_len=4)
    for step in range(3):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            ya = FL.fused_input_linear(fused_lin, op, xa, ga if op == FL.RMSNORM else None, EPS, reference=True)
            yb = _separate(op, xb, gb, sep_lin)
        assert ya is not None
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb), step
        assert torch.equal(xa.grad, xb.grad), step
        assert torch.equal(fused_lin.weight.grad, sep_lin.weight.grad), step
        if bias:
            assert torch.equal(fused_lin.bias.grad, sep_lin.bias.grad), step
        if op == FL.RMSNORM:
            assert torch.equal(ga.grad, gb.grad), step
        for t in (xa, xb, ga, gb, *fused_lin.parameters(), *sep_lin.parameters()):
            t.grad = None
    sa, sb = fused_lin.fp8_state(), sep_lin.fp8_state()
    for key in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(sa[key], sb[key]), key
    assert sa["amax_history"].abs().sum() > 0  # the input's amax was recorded


@pytest.mark.parametrize("fc2_bias", [False, True])
@pytest.mark.parametrize("main_grad", [False, True])
def test_reference_mlp_is_the_separate_steps_bit_for_bit(fc2_bias, main_grad):
    """The whole MLP as one node (SwiGLU's gradient inside fc1's gradient cast), on the CPU reference: outputs,
    gradients (into main_grad with fuse_wgrad_accumulation) and scaling state equal the separate steps'."""
    torch.manual_seed(0)
    k, f = 64, 96
    dt = torch.bfloat16

    def layers():
        torch.manual_seed(1)
        kw = dict(params_dtype=dt, fuse_wgrad_accumulation=main_grad)
        fc1, fc2 = fp8ext.Linear(k, 2 * f, bias=False, **kw), fp8ext.Linear(f, k, bias=fc2_bias, **kw)
        for lin in (fc1, fc2):
            if main_grad:
                lin.weight.main_grad = torch.zeros_like(lin.weight, dtype=torch.float32)
        return fc1, fc2

    (a1, a2), (b1, b2) = layers(), layers()
    x = torch.randn(2, 16, k, dtype=dt) * 2
    gamma = torch.rand(k) + 0.5
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ga, gb = gamma.clone().requires_grad_(), gamma.clone().requires_grad_()
    recipe = fp8ext.DelayedScaling(amax_history_len=4)
    for step in range(3):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            ya = FL.fused_mlp(a1, a2, xa, ga, EPS, reference=True)
            yb = b2(_ReferenceSwiGLU.apply(b1(_ReferenceRMSNorm.apply(xb, gb))))
        assert ya is not None
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb), step
        assert torch.equal(xa.grad, xb.grad), step
        assert torch.equal(ga.grad, gb.grad), step
        for la, lb in ((a1, b1), (a2, b2)):
            wa = la.weight.main_grad if main_grad else la.weight.grad
            wb = lb.weight.main_grad if main_grad else lb.weight.grad
            assert torch.equal(wa, wb), step
            if la.bias is not None:
                assert torch.equal(la.bias.grad, lb.bias.grad), step
        for t in (xa, xb, ga, gb, *a1.parameters(), *a2.parameters(), *b1.parameters(), *b2.parameters()):
            t.grad = None
    for la, lb in ((a1, b1), (a2, b2)):
        sa, sb = la.fp8_state(), lb.fp8_state()
        for key in ("amax_history", "scale", "scale_inv"):
            assert torch.equal(sa[key], sb[key]), key
        assert sa["amax_history"][:, 2].abs().sum() > 0  # the output gradient's amax was recorded


def test_a_second_backward_through_the_fused_mlp_is_refused_with_the_way_out():
    """The fused MLP releases h and fc2's FP8 operands during its backward (its peak memory is below the separate
    layers'), so a second backward through the same forward raises, naming the switch that runs the steps separately;
    the first backward's gradients are complete."""
    torch.manual_seed(0)
    fc1, fc2 = fp8ext.Linear(64, 192, bias=False), fp8ext.Linear(96, 64, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    with fp8ext.fp8_autocast(enabled=True):
        y = FL.fused_mlp(fc1, fc2, x, torch.ones(64), EPS, reference=True)
    y.sum().backward(retain_graph=True)
    assert x.grad is not None and fc1.weight.grad is not None and fc2.weight.grad is not None
    with pytest.raises(RuntimeError, match="fp8ext.fused.TRAINING = False"):
        y.sum().backward()


def test_layers_it_cannot_see_through_take_the_separate_steps():
    """Layers that are not FP8Linear (fp8ext.inference's quantized layers, nn.Linear) and layers or norms with hooks
    (observers, FSDP on a single layer): the fused paths use parameters without calling the modules, so they return
    None and the modules run as modules."""
    fc1, fc2 = fp8ext.Linear(64, 192, bias=False), fp8ext.Linear(96, 64, bias=False)
    x = torch.randn(16, 64)
    with fp8ext.fp8_autocast(enabled=True):
        assert FL.fused_mlp(fc1, fc2, x, torch.ones(64), EPS, reference=True) is not None
        assert FL.fused_mlp(torch.nn.Linear(64, 192, bias=False), fc2, x, torch.ones(64), EPS, reference=True) is None
        assert FL.fused_input_linear(torch.nn.Linear(64, 64), FL.RMSNORM, x, torch.ones(64), EPS,
                                     reference=True) is None
        handle = fc2.register_forward_hook(lambda *a: None)
        assert FL.fused_mlp(fc1, fc2, x, torch.ones(64), EPS, reference=True) is None
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None)
        try:
            assert FL.fused_input_linear(fc1, FL.RMSNORM, x, torch.ones(64), EPS, reference=True) is None
        finally:
            handle.remove()
        handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *a: None)
        try:  # a global backward hook would not fire for layers the fused paths do not call
            assert FL.fused_input_linear(fc1, FL.RMSNORM, x, torch.ones(64), EPS, reference=True) is None
        finally:
            handle.remove()
        assert FL.fused_input_linear(fc1, FL.RMSNORM, x, torch.ones(64), EPS, reference=True) is not None
    mlp = te.LayerNormMLP(64, 96, normalization="RMSNorm", activation="swiglu", bias=False)
    mlp.layer_norm.register_forward_hook(lambda *a: None)
    assert mlp._fusable_gamma(x) is None


def test_mlp_with_a_bias_on_fc1_takes_the_separate_steps():
    fc1, fc2 = fp8ext.Linear(64, 192, bias=True), fp8ext.Linear(96, 64)
    with fp8ext.fp8_autocast(enabled=True):
        assert FL.fused_mlp(fc1, fc2, torch.randn(16, 64), torch.ones(64), EPS, reference=True) is None


def test_paths_it_does_not_take_return_none():
    lin, _, x, gamma = _step_pair(FL.RMSNORM, torch.bfloat16, False)

    def call(xx=x, **kw):
        return FL.fused_input_linear(lin, FL.RMSNORM, xx, gamma, EPS, reference=True, **kw)

    assert call() is None  # outside fp8_autocast
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.CurrentScaling()):
        assert call() is None  # current scaling needs the output's amax before its cast
    with fp8ext.fp8_autocast(enabled=True):
        assert call(x[:, :15]) is None  # 30 tokens: not a multiple of 16
        assert call(x.double()) is None
        assert FL.fused_input_linear(lin, FL.RMSNORM, x, gamma, EPS) is None  # a CPU tensor without reference=True
        assert call() is not None
        try:
            FL.ENABLED = False
            assert call() is None
        finally:
            FL.ENABLED = True
        try:
            fused.TRAINING = False
            assert call() is None
        finally:
            fused.TRAINING = True


def test_the_fused_cast_refuses_host_memory_and_names_its_arguments():
    x = torch.randn(64, 64)
    q = torch.empty(64, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="host memory"):
        _C.cast_transpose_fused(dl(x), dl_fp8(q), dl_fp8(q.clone()), fp8ext.E4M3.code, 1.0, FL.RMSNORM)


# ---- on a GPU: the kernels ------------------------------------------------------------------------------------


def _fused_cast(op, x2, g, scale, dy=None, fmt=fp8ext.E4M3):
    m, k = x2.shape[0], x2.shape[1] // (2 if op == FL.SWIGLU else 1)
    dev = x2.device
    rstd = None
    if op == FL.RMSNORM:
        rstd = torch.empty(m, dtype=torch.float32, device=dev)
        _C.rms_norm_fwd(dl(x2), dl(g), None, dl(rstd), EPS, stream_of(dev))
    q = torch.empty(m, k, dtype=fmt.torch_dtype, device=dev)
    qt = torch.empty(k, m, dtype=fmt.torch_dtype, device=dev)
    amax = torch.zeros(1, device=dev)
    sinv = torch.empty((), device=dev)
    _C.cast_transpose_fused(dl(x2), dl_fp8(q), dl_fp8(qt), fmt.code, dl(scale), op,
                            rstd=None if rstd is None else dl(rstd), gamma=None if g is None else dl(g),
                            amax_out=dl(amax), stream=stream_of(dev), scale_inv_out=dl(sinv),
                            dy=None if dy is None else dl(dy))
    return q, qt, amax, sinv, rstd


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("op", [FL.RMSNORM, FL.SWIGLU, FL.DSWIGLU], ids=["rmsnorm", "swiglu", "dswiglu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,cols", [(128, 256), (100, 208), (37, 16), (64, 4096), (1, 64), (64, 96)])
def test_fused_cast_kernel_is_the_steps_kernel_then_the_cast(op, dtype, rows, cols):
    """Every tile shape (full tiles, edge tiles, one row; for SwiGLU's gradient a tile across the d_gate | d_up
    boundary): the bytes of q and q^T, the amax and scale_inv equal the step's own kernel's output (x's dtype) cast by
    cast_transpose (E5M2 for the gradient); RMSNorm's rstd equals the training kernel's."""
    torch.manual_seed(rows + cols)
    width = 2 * cols if op == FL.SWIGLU else cols
    x2 = (torch.randn(rows, width, device="cuda") * 4).to(dtype)
    x2[0, :3] = torch.tensor([0.0, -0.0, 1e-3])
    g = torch.rand(cols, device="cuda") + 0.5
    scale = torch.tensor([7.0], device="cuda")
    fmt, dy = fp8ext.E4M3, None
    if op == FL.DSWIGLU:
        fmt, dy = fp8ext.E5M2, (torch.randn(rows, cols // 2, device="cuda") * 3).to(dtype)
    q, qt, amax, sinv, rstd = _fused_cast(op, x2, g, scale, dy, fmt)
    if op == FL.RMSNORM:
        y, rstd_ref = fused.rms_norm_train_gpu(x2, g, EPS, dtype)
        assert torch.equal(rstd, rstd_ref)
    elif op == FL.SWIGLU:
        y = fused.swiglu(x2)
    else:
        y = fused.swiglu_backward_gpu(x2, dy)
    amax_ref = torch.zeros(1, device="cuda")
    q_ref, qt_ref = fp8ext.cast_transpose(y, fmt, scale.reshape(()), amax_out=amax_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), qt_ref.view(torch.uint8))
    assert torch.equal(amax, amax_ref)
    assert torch.equal(sinv, torch.reciprocal(scale).reshape(()))  # float32 1 / scale, as cast_transpose writes it


def _module_pair(kind):
    torch.manual_seed(1)
    if kind == "linear":
        make = lambda: te.LayerNormLinear(256, 128, normalization="RMSNorm", bias=True, params_dtype=torch.bfloat16,
                                          device="cuda")
    else:  # "mlp" (one node, SwiGLU's gradient fused too) or "mlp_bias" (fc1's bias: each layer fused on its own)
        make = lambda: te.LayerNormMLP(256, 384, normalization="RMSNorm", activation="swiglu", bias=kind == "mlp_bias",
                                       params_dtype=torch.bfloat16, device="cuda")
    a, b = make(), make()
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    b.load_state_dict(a.state_dict())
    return a, b


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp_bias"])
def test_layernorm_modules_on_the_gpu_equal_their_separate_steps(kind, monkeypatch):
    """LayerNormLinear and LayerNormMLP (RMSNorm, SwiGLU) take the fused casts on a GPU and give, over three training
    steps, the output, every gradient and the FP8 scaling state of the same module run step by step."""
    fused_m, sep_m = _module_pair(kind)
    calls = _count_prologue_casts(monkeypatch)
    x = torch.randn(4, 48, 256, device="cuda", dtype=torch.bfloat16) * 2
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    recipe = fp8ext.DelayedScaling(amax_history_len=4)
    for step in range(3):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            ya = fused_m(xa)
            FL.ENABLED = False
            try:
                yb = sep_m(xb)
            finally:
                FL.ENABLED = True
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb), step
        assert torch.equal(xa.grad, xb.grad), step
        for (name, pa), pb in zip(fused_m.named_parameters(), sep_m.parameters()):
            assert torch.equal(pa.grad, pb.grad), (step, name)
        for t in (xa, xb, *fused_m.parameters(), *sep_m.parameters()):
            t.grad = None
    per_step = {"linear": [FL.RMSNORM], "mlp": [FL.RMSNORM, FL.SWIGLU, FL.DSWIGLU], "mlp_bias": [FL.RMSNORM, FL.SWIGLU]}
    assert calls == per_step[kind] * 3
    lins = ([(fused_m.linear, sep_m.linear)] if kind == "linear"
            else [(fused_m.fc1, sep_m.fc1), (fused_m.fc2, sep_m.fc2)])
    for la, lb in lins:
        sa, sb = la.fp8_state(), lb.fp8_state()
        for key in ("amax_history", "scale", "scale_inv"):
            assert torch.equal(sa[key], sb[key]), key


@requires_cuda
@pytest.mark.cuda
def test_transformer_training_with_swiglu_in_the_cast_equals_the_separate_steps(monkeypatch):
    """fp8ext's transformer under bf16 autocast in FP8 (delayed scaling): its SwiGLU goes into the cast of w2's input,
    and two training steps give the losses and every gradient of the same model with that path switched off."""
    from fp8ext.models.transformer import Transformer, preset
    cfg = preset("tiny", d_model=128, n_heads=4, n_kv_heads=2, d_ff=256)
    ids = torch.randint(0, 256, (2, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    calls = _count_prologue_casts(monkeypatch)
    out = {}
    for enabled in (True, False):
        monkeypatch.setattr(FL, "ENABLED", enabled)
        torch.manual_seed(0)
        model = Transformer(cfg, device="cuda")
        recipe = fp8ext.DelayedScaling(amax_history_len=2)
        losses = []
        for _ in range(2):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids[:, :-1], ids[:, 1:], fp8=True, fp8_recipe=recipe)[1]
            loss.backward()
            losses.append(loss.item())
        out[enabled] = (losses, {n: p.grad.clone() for n, p in model.named_parameters()})
    assert calls == [FL.SWIGLU] * (2 * cfg.n_layers)  # 64 tokens: w2's input cast takes SwiGLU, each layer and step
    assert out[True][0] == out[False][0]
    for n, g in out[False][1].items():
        assert torch.equal(out[True][1][n], g), n


@requires_cuda
@pytest.mark.cuda
def test_layernorm_mlp_returns_the_norm_output_when_asked_with_swiglu_in_the_cast():
    """return_layernorm_output=True: the norm runs as a module (its output is returned) while SwiGLU still goes into
    fc2's cast; the tuple equals the separate steps' (with return_bias too)."""
    torch.manual_seed(2)
    kw = dict(normalization="RMSNorm", activation="swiglu", bias=True, return_layernorm_output=True, return_bias=True,
              params_dtype=torch.bfloat16, device="cuda")
    a, b = te.LayerNormMLP(128, 192, **kw), te.LayerNormMLP(128, 192, **kw)
    b.load_state_dict(a.state_dict())
    x = torch.randn(32, 128, device="cuda", dtype=torch.bfloat16)
    with fp8ext.fp8_autocast(enabled=True):
        ya = a(x)
        FL.ENABLED = False
        try:
            yb = b(x)
        finally:
            FL.ENABLED = True
    assert isinstance(ya, tuple) and len(ya) == 3
    for u, v in zip(ya, yb):
        assert torch.equal(u, v)


class _SwiGLULinear(torch.nn.Module):
    """SwiGLU into an FP8 layer as fp8ext's transformer runs it: the fused path, else the separate steps."""

    def __init__(self, lin, reference):
        super().__init__()
        self.lin, self.reference = lin, reference

    def forward(self, h):
        y = FL.fused_input_linear(self.lin, FL.SWIGLU, h, reference=self.reference)
        if y is not None:
            return y
        return self.lin(_ReferenceSwiGLU.apply(h) if self.reference else fused.swiglu(h))


def _assert_same_steps(runs, states):
    """runs[name] = (per step (output, input gradient, parameter gradients), ...): "eager" and "compiled" equal
    "separate" bit for bit, and so do the layers' scaling states (states(run): their fp8_state() dicts)."""
    for name in ("eager", "compiled"):
        for i, (want, got) in enumerate(zip(runs["separate"][0], runs[name][0])):
            assert torch.equal(got[0], want[0]), (name, i, "output")
            assert torch.equal(got[1], want[1]), (name, i, "input gradient")
            for j, (gw, gg) in enumerate(zip(want[2], got[2])):
                assert torch.equal(gg, gw), (name, i, f"gradient of parameter {j}")
        for sa, sb in zip(states(runs[name]), states(runs["separate"])):
            for key in ("amax_history", "scale", "scale_inv"):
                assert torch.equal(sa[key], sb[key]), (name, key)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_swiglu_in_the_one_call_passes_eager_and_compiled_equal_the_separate_steps(device, bias, monkeypatch):
    """SwiGLU into an FP8 layer with delayed scaling takes FP8Linear's one-call passes with SwiGLU inside the input's
    cast (from the first step on, which registers the slots), eagerly and under torch.compile (the calls as torch ops,
    one graph): over three steps with SGD between them, outputs, gradients and scaling state equal those of SwiGLU
    followed by FP8Linear, bit for bit. On the CPU SwiGLU is fp8ext.fused's reference definition (the GPU computes
    it inside the cast)."""
    torch._dynamo.reset()
    ref = device == "cpu"
    dt = torch.bfloat16
    layers = _step_pair(FL.SWIGLU, dt, bias, device)[:2] + (_step_pair(FL.SWIGLU, dt, bias, device)[0],)
    recipes = [fp8ext.DelayedScaling(amax_history_len=4) for _ in layers]
    fp8ext.prepare_fp8(layers[2], recipes[2])  # the compiled run's slots, registered before tracing
    g = torch.Generator().manual_seed(3)
    hs = [(torch.randn(2, 16, 128, generator=g) * (1 + i)).to(device, dt) for i in range(3)]
    gys = [(torch.randn(2, 16, 48, generator=g) * 1e-2).to(device, dt) for _ in range(3)]
    prologue_calls = []
    real = fp8ext._C.linear_fwd
    monkeypatch.setattr(fp8ext._C, "linear_fwd",
                        lambda *a, **kw: prologue_calls.append(kw.get("prologue") == FL.SWIGLU) or real(*a, **kw))
    runs = {}
    for name, lin, r in zip(("separate", "eager", "compiled"), layers, recipes):
        mod = _SwiGLULinear(lin, ref)
        call = mod
        if name == "compiled":
            call = torch.compile(mod, fullgraph=True, backend="aot_eager" if ref else "inductor")
        prologue_calls.clear()
        out = []
        for h, gy in zip(hs, gys):
            h = h.clone().requires_grad_(True)
            with fp8ext.fp8_autocast(fp8_recipe=r):
                if name == "separate":
                    y = lin(_ReferenceSwiGLU.apply(h) if ref else fused.swiglu(h))
                else:
                    y = call(h)
            y.backward(gy)
            out.append((y.detach().clone(), h.grad.clone(), [p.grad.clone() for p in lin.parameters()]))
            with torch.no_grad():
                for p in lin.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
        runs[name] = (out, lin.fp8_state(), sum(prologue_calls) if device == "cuda" else len(prologue_calls))
    # the prologue is a GPU argument (the CPU computes SwiGLU before the call): there, count the one-call passes
    assert runs["eager"][2] == 3, "every step takes the one-call pass with SwiGLU in the cast, the first included"
    assert runs["compiled"][2] == 3, "every compiled step takes it"
    _assert_same_steps(runs, lambda run: [run[1]])


def test_swiglu_prologue_of_the_one_call_op_refuses_what_it_cannot_cast():
    """fp8ext::linear_fwd's SwiGLU prologue takes delayed scaling and keeps the FP8 copies (the C call's rule, also on
    the CPU, where SwiGLU's reference runs first); FP8Linear's fast path takes no other prologue."""
    x, w = torch.randn(32, 128), torch.randn(48, 64)
    one = torch.ones(())
    with pytest.raises(ValueError, match="SwiGLU prologue takes delayed scaling"):  # current scaling (no scales)
        torch.ops.fp8ext.linear_fwd(x, w, None, None, None, None, None, 0, 0.0, torch.float32, True, FL.SWIGLU)
    with pytest.raises(ValueError, match="SwiGLU prologue takes delayed scaling"):  # keep=False
        torch.ops.fp8ext.linear_fwd(x, w, None, one, torch.zeros(()), one, torch.zeros(()), 0, 0.0, torch.float32,
                                    False, FL.SWIGLU)
    y, *_ = torch.ops.fp8ext.linear_fwd(x, w, None, one, torch.zeros(()), one, torch.zeros(()), 0, 0.0, torch.float32,
                                        True, FL.SWIGLU)
    assert y.shape == (32, 48)
    lin = fp8ext.Linear(64, 48, bias=False)
    recipe = fp8ext.DelayedScaling()
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        lin(torch.randn(32, 64))  # registers the slots: the fast path is open from here
        ctx = fp8ext.core.context.current_context()
        assert lin.fast_forward(ctx, torch.randn(32, 128), prologue=FL.Prologue(FL.SWIGLU)) is not None
        assert lin.fast_forward(ctx, torch.randn(32, 128), prologue=FL.Prologue(FL.RMSNORM)) is None


class _SwiGLUMLP(torch.nn.Module):
    """fp8ext's transformer's MLP: w2(swiglu(w13(x))) as one node where it can be, else the separate steps."""

    def __init__(self, w13, w2, reference):
        super().__init__()
        self.w13, self.w2, self.reference = w13, w2, reference

    def forward(self, x):
        y = FL.swiglu_mlp(self.w13, self.w2, x, reference=self.reference)
        if y is not None:
            return y
        h = self.w13(x)
        return self.w2(_ReferenceSwiGLU.apply(h) if self.reference else fused.swiglu(h))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[requires_cuda, pytest.mark.cuda])])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "w2_bias"])
def test_swiglu_mlp_node_eager_and_compiled_equals_the_separate_steps(device, bias, monkeypatch):
    """w2(swiglu(w13(x))) with delayed scaling as one node of the one-call passes (SwiGLU inside w2's input cast, its
    gradient inside the cast of w13's output gradient), eagerly (from the first step on, which registers the slots) and
    under torch.compile: over three steps with SGD between them, the output, every gradient and the scaling state equal
    those of w13, SwiGLU and w2 run separately, bit for bit. On the CPU SwiGLU and its gradient are fp8ext.fused's
    reference definitions (the GPU computes them inside the casts)."""
    from fp8ext.ops import linear_pass as LA
    torch._dynamo.reset()
    ref = device == "cpu"
    dt = torch.bfloat16
    k, f, n = 64, 96, 48

    def layers():
        torch.manual_seed(1)
        return (fp8ext.Linear(k, 2 * f, bias=False, params_dtype=dt, device=device),
                fp8ext.Linear(f, n, bias=bias, params_dtype=dt, device=device))

    runs = {}
    fused_bwd = []
    real = LA.linear_bwd_call
    monkeypatch.setattr(LA, "linear_bwd_call", lambda *a, swiglu_da=None, **kw:
                        fused_bwd.append(swiglu_da is not None) or real(*a, swiglu_da=swiglu_da, **kw))
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(2, 16, k, generator=g) * (1 + i)).to(device, dt) for i in range(3)]
    gys = [(torch.randn(2, 16, n, generator=g) * 1e-2).to(device, dt) for _ in range(3)]
    for name in ("separate", "eager", "compiled"):
        w13, w2 = layers()
        recipe = fp8ext.DelayedScaling(amax_history_len=4)
        mod = _SwiGLUMLP(w13, w2, ref)
        call = mod
        if name == "compiled":
            fp8ext.prepare_fp8(mod, recipe)  # the slots, registered before tracing
            call = torch.compile(mod, fullgraph=True, backend="aot_eager" if ref else "inductor")
        fused_bwd.clear()
        out = []
        for x, gy in zip(xs, gys):
            x = x.clone().requires_grad_(True)
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                if name == "separate":
                    h = w13(x)
                    y = w2(_ReferenceSwiGLU.apply(h) if ref else fused.swiglu(h))
                else:
                    y = call(x)
            y.backward(gy)
            params = [*w13.parameters(), *w2.parameters()]
            out.append((y.detach().clone(), x.grad.clone(), [p.grad.clone() for p in params]))
            with torch.no_grad():
                for p in params:
                    p -= 0.05 * p.grad
                    p.grad = None
        runs[name] = (out, [lin.fp8_state() for lin in (w13, w2)], sum(fused_bwd))
    assert runs["separate"][2] == 0
    assert runs["eager"][2] == 3, "every step takes w13's backward call with SwiGLU's gradient in the cast"
    assert runs["compiled"][2] == 3, "every compiled step takes it"
    _assert_same_steps(runs, lambda run: run[1])


def test_c_backward_call_checks_swiglus_gradient_argument():
    """linear_bwd's d_a (SwiGLU's gradient inside the cast of the layer's output gradient): GPU only, delayed scaling,
    no bias gradient; each refused with a message naming it (on the CPU the caller computes dh first)."""
    one, dl_ = torch.ones(()), torch._C._to_dlpack
    m, k, n = 32, 64, 48
    saved = torch.empty(768 + m * k + n * k + 256, dtype=torch.uint8)
    args = [dl_(torch.randn(m, n)), dl_(saved), dl_(torch.empty(2 * m * n + 4096, dtype=torch.uint8)), m, k, n, 0, 1]
    kw = dict(g_scale=dl_(one), g_amax=dl_(torch.zeros(())), dx=dl_(torch.empty(m, k)), dw=dl_(torch.empty(n, k)))
    d_a = dl_(torch.randn(m, n // 2))
    with pytest.raises(ValueError, match="runs on a GPU"):
        _C.linear_bwd(*args, **kw, d_a=d_a)
    with pytest.raises(ValueError, match="delayed scaling"):
        _C.linear_bwd(*args, **dict(kw, g_scale=None, g_amax=None), margin=0.0, d_a=d_a)
    with pytest.raises(ValueError, match="no db"):
        _C.linear_bwd(*args, **kw, db=dl_(torch.empty(n)), d_a=d_a)
    with pytest.raises(TypeError, match="positional arguments"):  # the options are keywords only
        _C.linear_bwd(*args, None, None, **kw, d_a=d_a)
    assert _C.linear_bwd(*args, **kw, d_a=None) is False  # d_a None: the plain call (the casts ran)
