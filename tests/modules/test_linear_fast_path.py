"""FP8Linear's fast path (one fp8ext._C call per pass) against the composed path (separate casts and GEMMs): the
same outputs, gradients and scaling state, bit for bit, over several delayed-scaling steps; when each path is
taken; and the C entry points' argument checks."""
import pytest
import torch

import fp8ext
import fp8ext.linear as L
from conftest import DEVICES

HYBRID = fp8ext.Format.HYBRID


def twins(device, dtype, bias, fuse_wgrad=False, shape=(64, 32)):
    torch.manual_seed(0)
    a = fp8ext.Linear(*shape, bias=bias, device=device, params_dtype=dtype, fuse_wgrad_accumulation=fuse_wgrad)
    b = fp8ext.Linear(*shape, bias=bias, device=device, params_dtype=dtype, fuse_wgrad_accumulation=fuse_wgrad)
    b.load_state_dict(a.state_dict())
    if fuse_wgrad:
        for m in (a, b):
            m.weight.main_grad = torch.zeros(m.weight.shape, device=device)
        a.weight.main_grad.normal_()
        b.weight.main_grad.copy_(a.weight.main_grad)
    return a, b


def run_steps(layer, recipe, xs, gys, fast, monkeypatch, lr=0.05):
    """Eager steps (fwd, bwd, SGD) with the fast path on or off; everything each step produced."""
    monkeypatch.setattr(L, "_FAST_PATH", fast)
    out = []
    for x, gy in zip(xs, gys):
        x = x.clone().requires_grad_(True)
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
        y.backward(gy)
        grads = [p.grad.clone() if p.grad is not None else None for p in layer.parameters()]
        mg = getattr(layer.weight, "main_grad", None)
        out.append((y.detach().clone(), x.grad.clone(), grads, None if mg is None else mg.clone()))
        with torch.no_grad():
            for p in layer.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
    return out, layer.fp8_state()


def same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what} differs (max difference {(a.double() - b.double()).abs().max():.3g})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("margin", [0, 2])
def test_current_scaling_fast_path_matches_composed_path_bit_for_bit(device, dtype, bias, fuse_wgrad, margin,
                                                                     monkeypatch):
    """Per-tensor current scaling on the fast path (each tensor's amax and scale by two small kernels, then the one
    C call per pass): every output and gradient of the composed path, bit for bit; a new but equal recipe object
    each step (as `fp8_recipe=CurrentScaling()` inline gives) still takes it."""
    fast, slow = twins(device, dtype, bias, fuse_wgrad)
    g = torch.Generator().manual_seed(2)
    xs = [(torch.randn(2, 24, 64, generator=g) * (1 + i)).to(device, dtype) for i in range(3)]
    gys = [(torch.randn(2, 24, 32, generator=g) * 1e-3).to(device, dtype) for _ in range(3)]
    calls = []
    real = L._C.linear_fwd
    monkeypatch.setattr(L._C, "linear_fwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    outs = {}
    for fast_path, layer in ((True, fast), (False, slow)):
        monkeypatch.setattr(L, "_FAST_PATH", fast_path)
        out = []
        for x, gy in zip(xs, gys):
            x = x.clone().requires_grad_(True)
            with fp8ext.fp8_autocast(fp8_recipe=fp8ext.CurrentScaling(fp8_format=HYBRID, margin=margin)):
                y = layer(x)
            y.backward(gy)
            out.append((y.detach(), x.grad, [None if p.grad is None else p.grad.clone() for p in layer.parameters()],
                        getattr(layer.weight, "main_grad", None)))
            for p in layer.parameters():
                p.grad = None
        outs[fast_path] = out
    assert len(calls) == len(xs), "every step takes the fast path, the first included"
    for i, (f, s) in enumerate(zip(outs[True], outs[False])):
        same(f[0], s[0], f"step {i}: output")
        same(f[1], s[1], f"step {i}: input gradient")
        for j, (gf, gs) in enumerate(zip(f[2], s[2])):
            same(gf, gs, f"step {i}: gradient of parameter {j}")
        same(f[3], s[3], f"step {i}: main_grad")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("fuse_wgrad", [False, True], ids=["grad", "main_grad"])
def test_fast_path_matches_composed_path_bit_for_bit(device, dtype, bias, fuse_wgrad, monkeypatch):
    fast, slow = twins(device, dtype, bias, fuse_wgrad)
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(2, 24, 64, generator=g) * (1 + i)).to(device, dtype) for i in range(4)]
    gys = [(torch.randn(2, 24, 32, generator=g) * 1e-3).to(device, dtype) for _ in range(4)]
    calls = []
    real = L._C.linear_fwd
    monkeypatch.setattr(L._C, "linear_fwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rf = fp8ext.DelayedScaling(fp8_format=HYBRID, amax_history_len=4)
    rs = fp8ext.DelayedScaling(fp8_format=HYBRID, amax_history_len=4)
    steps_fast, state_fast = run_steps(fast, rf, xs, gys, True, monkeypatch)
    assert len(calls) == len(xs), "every step takes the fast path, the first included"
    steps_slow, state_slow = run_steps(slow, rs, xs, gys, False, monkeypatch)
    assert len(calls) == len(xs), "the composed run makes no fast-path call"
    for i, (f, s) in enumerate(zip(steps_fast, steps_slow)):
        same(f[0], s[0], f"step {i}: output")
        same(f[1], s[1], f"step {i}: input gradient")
        for j, (gf, gs) in enumerate(zip(f[2], s[2])):
            same(gf, gs, f"step {i}: gradient of parameter {j}")
        same(f[3], s[3], f"step {i}: main_grad")
    for key in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(state_fast[key], state_slow[key]), f"scaling state {key} differs"


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_the_fast_path_leaves_to_the_composed_one(device, monkeypatch):
    layer = fp8ext.Linear(64, 32, device=device)
    recipe = fp8ext.DelayedScaling()
    calls = []
    real = L._C.linear_fwd
    monkeypatch.setattr(L._C, "linear_fwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = torch.randn(32, 64, device=device)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        layer(x)  # registers the slots and takes the fast path
        layer(x)
        assert len(calls) == 2
        layer(torch.randn(24, 64, device=device))  # 24 tokens: not a multiple of 16
        layer(torch.randn(64, 32, device=device).t())  # not contiguous
        layer(x, is_first_microbatch=True)  # weight caching
        with torch.no_grad():
            layer(x)  # no gradient needed: still the fast path
        assert len(calls) == 3
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.Float8BlockScaling()):
        layer(x)
        layer(x)  # block scales: the composed path
    assert len(calls) == 3
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.CurrentScaling()):
        layer(x)  # a new recipe: fast from its first call
        layer(x)
    assert len(calls) == 5, "per-tensor current scaling takes the fast path too"


def _call_args():
    """Valid arguments of _C.linear_fwd and _C.linear_bwd on the CPU (M=32, K=64, N=48): (positional, keywords)
    of each."""
    dl = torch._C._to_dlpack
    one = dl(torch.ones(()))
    saved = torch.empty(768 + 32 * 64 + 48 * 64, dtype=torch.uint8)
    fwd = ([dl(torch.randn(32, 64)), dl(torch.randn(48, 64)), dl(saved),
            dl(torch.empty(32 * 64 + 48 * 64 + 256, dtype=torch.uint8)), dl(torch.empty(32, 48)), 0],
           dict(x_scale=one, x_amax=dl(torch.zeros(())), w_scale=one, w_amax=dl(torch.zeros(()))))
    bwd = ([dl(torch.randn(32, 48)), dl(saved), dl(torch.empty(32 * 48 * 2, dtype=torch.uint8)), 32, 64, 48, 0, 1],
           dict(g_scale=one, g_amax=dl(torch.zeros(())), dx=dl(torch.empty(32, 64)), dw=dl(torch.empty(48, 64))))
    return fwd, bwd


def test_c_entry_points_run_the_casts_on_the_cpu():
    (fwd, fkw), (bwd, bkw) = _call_args()
    assert fp8ext._C.linear_fwd(*fwd, **fkw) is False  # the casts ran; the GEMMs are left to the caller
    assert fp8ext._C.linear_bwd(*bwd, **bkw) is False
    with pytest.raises(TypeError, match="missing required argument 'fmt'"):
        fp8ext._C.linear_fwd(*fwd[:-1], **fkw)


_dl = torch._C._to_dlpack
FWD_ERRORS = [  # changes of the positional arguments (index) or of the keywords (name)
    ({3: _dl(torch.empty(16, dtype=torch.uint8))}, "scratch holds 16 bytes"),
    ({0: _dl(torch.randn(24, 64))}, "multiples of 16"),
    ({5: 7}, "fmt must be"),
    ({4: _dl(torch.empty(32, 32))}, r"y must have shape \[32, 48\]"),
    ({"x_scale": _dl(torch.ones(2))}, "x_scale"),
    ({3: "saved"}, "overlap"),
]
BWD_ERRORS = [
    ({6: 1, 7: 1}, "E5M2 x E5M2"),
    ({"dw": None, "accumulate": True}, "accumulate=True adds into dw"),
    ({"dx": _dl(torch.empty(64, 32))}, r"dx must have shape \[32, 64\]"),
    ({"db": _dl(torch.empty(48))}, "scratch holds 3072 bytes, needs 3264"),  # db needs room for the per-tile sums
    ({2: _dl(torch.empty(8192, dtype=torch.uint8)), "db": _dl(torch.empty(48, dtype=torch.bfloat16))}, "db must be"),
]


def _changed(args, change):
    """(positional, keywords) with `change` applied: an int key replaces a positional argument, a str key a keyword;
    "saved" stands for the call's saved buffer."""
    pos, kw = list(args[0]), dict(args[1])
    for key, v in change.items():
        v = pos[2] if isinstance(v, str) and v == "saved" else v
        if isinstance(key, int):
            pos[key] = v
        else:
            kw[key] = v
    return pos, kw


@pytest.mark.parametrize("which,change,message", [("fwd", c, m) for c, m in FWD_ERRORS] +
                         [("bwd", c, m) for c, m in BWD_ERRORS])
def test_c_entry_points_check_their_arguments(which, change, message):
    fwd, bwd = _call_args()
    pos, kw = _changed(fwd if which == "fwd" else bwd, change)
    with pytest.raises((ValueError, TypeError), match=message):
        (fp8ext._C.linear_fwd if which == "fwd" else fp8ext._C.linear_bwd)(*pos, **kw)


def test_c_entry_points_with_operands_of_their_own_check_them():
    """linear_bwd's x_t and w_t (x8^T and W8^T cast again in backward, `saved` then only its header): each checked
    where its GEMM runs, by size and dtype; linear_fwd with keep=False needs only the header."""
    (fwd, fkw), (bwd, bkw) = _call_args()
    header = _dl(torch.empty(768, dtype=torch.uint8))
    x_t, w_t = torch.zeros(64 * 32, dtype=torch.uint8), torch.zeros(64 * 48, dtype=torch.uint8)
    fwd[2] = header
    assert fp8ext._C.linear_fwd(*fwd, **fkw, keep=False) is False
    bwd[1] = header
    assert fp8ext._C.linear_bwd(*bwd, **bkw, x_t=_dl(x_t), w_t=_dl(w_t)) is False
    with pytest.raises(ValueError, match="x_t holds 2047 bytes, needs 2048"):
        fp8ext._C.linear_bwd(*bwd, **bkw, x_t=_dl(x_t[1:]), w_t=_dl(w_t))
    with pytest.raises(TypeError, match="w_t"):
        fp8ext._C.linear_bwd(*bwd, **bkw, x_t=_dl(x_t), w_t=_dl(w_t.float()))
    no_dw = dict(bkw, dw=None)
    assert fp8ext._C.linear_bwd(*bwd, **no_dw, w_t=_dl(w_t)) is False  # x8^T is not read without dW
    with pytest.raises(ValueError, match="saved holds 768 bytes"):
        fp8ext._C.linear_bwd(*bwd, **bkw)  # without x_t and w_t the header is too small
    with pytest.raises(TypeError, match="w_t"):  # dx is wanted: W8^T too
        fp8ext._C.linear_bwd(*bwd, **bkw, x_t=_dl(x_t))


def _slots(saved, i):
    """Slot i of a saved buffer as float32 (scale_inv, amax, scale): x 0, W 1, dy 2 (py_linear.c's layout)."""
    return saved[256 * i:256 * i + 12].view(torch.float32).tolist()


@pytest.mark.parametrize("margin", [0, 1.5])
def test_c_entry_points_compute_current_scales_from_the_tensors(margin):
    """With a margin and no scale arguments each tensor's amax, scale and scale_inv are computed by the call
    itself: max|t|, then fmt_max / amax / 2^margin, and the casts use them (the codes of quantize with that scale)."""
    (fwd, _), (bwd, bkw) = _call_args()
    torch.manual_seed(0)
    x, w, dy = torch.randn(32, 64) * 3, torch.randn(48, 64) / 7, torch.randn(32, 48) * 1e-4
    saved = torch.full((768 + 32 * 64 + 48 * 64,), 0xFF, dtype=torch.uint8)  # NaNs: nothing read before written
    scratch = torch.empty(32 * 64 + 48 * 64 + 256, dtype=torch.uint8)
    fwd[0], fwd[1], fwd[2], fwd[3] = _dl(x), _dl(w), _dl(saved), _dl(scratch)
    assert fp8ext._C.linear_fwd(*fwd, margin=margin) is False
    bwd[0], bwd[1] = _dl(dy), _dl(saved)
    assert fp8ext._C.linear_bwd(*bwd, **dict(bkw, g_scale=None, g_amax=None), margin=margin) is False
    for i, (t, fmt) in enumerate([(x, fp8ext.E4M3), (w, fp8ext.E4M3), (dy, fp8ext.E5M2)]):
        scale_inv, amax, scale = _slots(saved, i)
        want_amax = t.abs().max().item()
        want_scale = torch.tensor(fmt.max / want_amax / 2.0 ** margin, dtype=torch.float32).item()
        assert amax == want_amax and scale == want_scale, (i, amax, scale)
        assert scale_inv == torch.tensor(1.0, dtype=torch.float32).div(torch.tensor(scale)).item()
    q = fp8ext.quantize(x, fp8ext.E4M3, scale=torch.tensor(_slots(saved, 0)[2]))
    assert torch.equal(scratch[:32 * 64].view(32, 64), q.view(torch.uint8)), "x's cast used the computed scale"


_NO_X_SCALES = dict(x_scale=None, x_amax=None, w_scale=None, w_amax=None)
CURRENT_ERRORS = [
    ("fwd", {"margin": 1.0}, "x_scale must be None with a margin"),
    ("fwd", {"margin": None, "x_scale": None}, "x_scale is required without a margin"),
    ("fwd", {**_NO_X_SCALES, "margin": -1.0}, r"margin must be in \[0, 64\)"),
    ("fwd", {**_NO_X_SCALES, "margin": "1"}, "margin must be None or a number"),
    ("bwd", {"margin": 0.0}, "g_scale must be None with a margin"),
    ("bwd", {"g_scale": None, "g_amax": None, "margin": float("nan")}, r"margin must be in \[0, 64\)"),
]


@pytest.mark.parametrize("which,change,message", CURRENT_ERRORS)
def test_c_entry_points_check_their_current_scaling_arguments(which, change, message):
    fwd, bwd = _call_args()
    pos, kw = _changed(fwd if which == "fwd" else bwd, change)
    with pytest.raises((ValueError, TypeError), match=message):
        (fp8ext._C.linear_fwd if which == "fwd" else fp8ext._C.linear_bwd)(*pos, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_compiled_fast_path_is_the_eager_one_bit_for_bit(device, recipe, bias, monkeypatch):
    """Under torch.compile the fast path's two C calls run as the torch ops fp8ext::linear_fwd / linear_bwd (one
    graph, one op per pass): the outputs, gradients and scaling state of eager steps, bit for bit, over several
    steps with SGD between them."""
    torch._dynamo.reset()
    eager, comp = twins(device, torch.bfloat16, bias)

    def make():
        if recipe == "delayed":
            return fp8ext.DelayedScaling(fp8_format=HYBRID, amax_history_len=4)
        return fp8ext.CurrentScaling(fp8_format=HYBRID)

    r_eager, r_comp = make(), make()
    fp8ext.prepare_fp8(comp, r_comp)  # delayed scaling: the slots registered before tracing
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(2, 24, 64, generator=g) * (1 + i)).to(device, torch.bfloat16) for i in range(3)]
    gys = [(torch.randn(2, 24, 32, generator=g) * 1e-3).to(device, torch.bfloat16) for _ in range(3)]
    calls = []
    real = L._C.linear_fwd
    monkeypatch.setattr(L._C, "linear_fwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    compiled = torch.compile(comp, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    runs = {}
    for name, layer, call, r in (("eager", eager, eager, r_eager), ("compiled", comp, compiled, r_comp)):
        calls.clear()
        out = []
        for x, gy in zip(xs, gys):
            x = x.clone().requires_grad_(True)
            with fp8ext.fp8_autocast(fp8_recipe=r):
                y = call(x)
            y.backward(gy)
            out.append((y.detach().clone(), x.grad.clone(), [p.grad.clone() for p in layer.parameters()]))
            with torch.no_grad():
                for p in layer.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
        runs[name] = (out, layer.fp8_state() if recipe == "delayed" else None, len(calls))
    assert runs["compiled"][2] == len(xs), "every compiled step takes the fast path's forward call"
    for i, (e, c) in enumerate(zip(runs["eager"][0], runs["compiled"][0])):
        same(c[0], e[0], f"step {i}: output")
        same(c[1], e[1], f"step {i}: input gradient")
        for j, (ge, gc) in enumerate(zip(e[2], c[2])):
            same(gc, ge, f"step {i}: gradient of parameter {j}")
    if recipe == "delayed":
        for key in ("amax_history", "scale", "scale_inv"):
            assert torch.equal(runs["compiled"][1][key], runs["eager"][1][key]), f"scaling state {key} differs"
