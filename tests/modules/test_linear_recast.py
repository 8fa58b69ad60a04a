"""FP8Linear under torch.compile with prepare_fp8(..., recast_in_backward=True) keeps x and W for backward and casts
x8^T and W8^T again there (as torchao does), instead of saving FP8 copies: the same outputs and gradients, bit for
bit, and fewer bytes saved."""

import copy

import pytest
import torch

import fp8ext
import fp8ext.modules.linear as L
from conftest import DEVICES


class SharedInput(torch.nn.Module):
    """Two layers reading one input, as q/k/v or gate/up do."""

    def __init__(self):
        super().__init__()
        self.a = fp8ext.FP8Linear(64, 32, params_dtype=torch.bfloat16)
        self.b = fp8ext.FP8Linear(64, 48, params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.a(x), self.b(x)


class ScaledSharedInput(SharedInput):
    """SharedInput behind a scale as a norm's, which the backward can compute again from x (kept anyway for the
    scale's gradient), as it can a Llama's RMSNorm before q/k/v."""

    def __init__(self):
        super().__init__()
        self.g = torch.nn.Parameter(1 + 0.1 * torch.randn(64, dtype=torch.bfloat16))

    def forward(self, x):
        return super().forward(x * self.g)


def _new_bytes(model, x, sink):
    """A pack hook that adds to `sink` the bytes of saved storages other than the parameters' and x's own."""
    old = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}

    def pack(t):
        if t.untyped_storage().data_ptr() not in old:
            sink.append(t.untyped_storage().nbytes())
        return t
    return pack, lambda t: t


def _step(model, recipe, x, sink):
    hooks = _new_bytes(model, x, sink)
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            ys = model(x)
    gen = torch.Generator().manual_seed(1)
    torch.autograd.backward(ys, [torch.randn(y.shape, generator=gen).to(y.device, y.dtype) for y in ys])
    return ys, x.grad.clone(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe,fast", [(fp8ext.Float8CurrentScaling, False), (fp8ext.Float8CurrentScaling, True),
                                         (fp8ext.DelayedScaling, True)],
                         ids=["current-composed", "current-fast", "delayed-fast"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_backward_recasts_the_same_bytes_and_saves_no_fp8(recipe, fast, device, monkeypatch):
    torch.manual_seed(0)
    eager = SharedInput().to(device)
    compiled_model = copy.deepcopy(eager)
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device)
    monkeypatch.setattr(L, "_FAST_PATH", False)  # eager: the composed path, which saves the FP8 copies
    eager_saved = []
    x = x.requires_grad_()
    want = _step(eager, recipe(), x, eager_saved)
    monkeypatch.setattr(L, "_FAST_PATH", fast)  # compiled: the fast path's ops, or the composed path's
    r = recipe()
    fp8ext.prepare_fp8(compiled_model, r, recast_in_backward=True)
    saved = []
    x.grad = None
    got = _step(torch.compile(compiled_model, fullgraph=True), r, x, saved)
    assert all(torch.equal(g, w) for g, w in zip(got[0], want[0])), "both outputs, bit for bit"
    assert torch.equal(got[1], want[1]), "dx, bit for bit"
    for g, w in zip(got[2], want[2]):
        assert torch.equal(g, w), "every weight and bias gradient, bit for bit"
    # the partitioner may still move a recast into the forward where saving its output is cheaper: fewer bytes
    assert sum(saved) < sum(eager_saved), f"compiled saves less than the FP8 copies: {saved} vs {eager_saved}"


@pytest.mark.parametrize("recipe", [fp8ext.Float8CurrentScaling, fp8ext.DelayedScaling], ids=["current", "delayed"])
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_recast_keeps_no_fp8_copy_where_the_input_can_be_made_again(recipe, device):
    """On the fast path an input the backward can compute again (here from x and the scale, as from a norm's) is
    not kept in any form for the linear layers: each keeps its forward's header of scales (LINEAR_SINV_BYTES) and
    nothing else; without recast each keeps its FP8 copies of x and W. The compiler computes the scaled input again
    inside the recast's kernel, in float32: the recast rounds it to bfloat16 as the forward stored it, so that
    outputs and every gradient are those of the saved FP8 copies, bit for bit."""
    torch.manual_seed(0)
    model = ScaledSharedInput().to(device)
    with torch.no_grad():
        model.g.copy_(1 + 0.37 * torch.randn(64))  # scaled values far from bfloat16's grid
    x = torch.randn(32, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    header = L._C.LINEAR_SINV_BYTES
    results = {}
    for recast in (True, False):
        m, r, saved = copy.deepcopy(model), recipe(), []
        fp8ext.prepare_fp8(m, r, recast_in_backward=recast)
        x.grad = None
        ys, dx, _ = _step(torch.compile(m, fullgraph=True), r, x, saved)
        results[recast] = [*ys, dx] + [p.grad for p in m.parameters()]
        if recast:
            assert sorted(saved) == [header, header], f"two headers of {header} bytes, nothing else: {saved}"
        else:
            assert len(saved) == 2 and min(saved) > header + 32 * 64, f"each layer's saved buffer: {saved}"
    names = ["y_a", "y_b", "dx"] + [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, results[True], results[False]):
        assert torch.equal(a, b), f"{name}: recast and saved copies differ"


def test_the_recast_rounds_a_value_computed_again_as_bfloat16_stores_it():
    """_bf16_rounded (what the recast applies to a bfloat16 value the compiler computed again in float32): the
    values of torch's float32 -> bfloat16 cast, ties to even, overflow to infinity, NaN kept, zeros' signs."""
    from fp8ext.modules.linear_autograd import _bf16_rounded
    g = torch.Generator().manual_seed(2)
    v = torch.cat([torch.randn(1 << 16, generator=g) * 10.0 ** torch.randint(-38, 38, (1 << 16,), generator=g),
                   torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 16,), generator=g, dtype=torch.int32).view(torch.float32),
                   torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4e38, -3.4e38, float("inf"),
                                 -float("inf"), float("nan"), 0.0, -0.0, 1e-40, -1e-40])])
    got, want = _bf16_rounded(v), v.to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), "the same bits, signs of zero too"


class One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = fp8ext.FP8Linear(64, 32, params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.a(x)


def _pipelined(model, recipe, recast, scales=None, device="cpu"):
    """Forwards of micro-batch i + 1 (a new fp8_autocast each) before micro-batch i's backward, as 1F1B schedules
    run them; each backward's dx and dW. scales: a list that gets the input's delayed scale after each forward."""
    m = copy.deepcopy(model)
    fp8ext.prepare_fp8(m, recipe, recast_in_backward=recast)
    cm = torch.compile(m, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(32, 64, generator=g) * 10 ** i).to(device, torch.bfloat16).requires_grad_() for i in range(3)]
    ys, out = [], []
    for i, x in enumerate(xs):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            ys.append(cm(x))
        if scales is not None:
            scales.append(m.a.quantizers(recipe)[0].scale.item())
        if i:
            ys[i - 1].float().sum().backward()
            out.append((xs[i - 1].grad.clone(), m.a.weight.grad.clone()))
            m.a.weight.grad = None
    return out


@pytest.mark.parametrize("recipe", [fp8ext.Float8CurrentScaling, fp8ext.DelayedScaling], ids=["current", "delayed"])
@pytest.mark.parametrize("device", DEVICES)
def test_recast_with_pipelined_micro_batches_matches_the_saved_fp8_copies(recipe, device):
    """A later forward between a forward and its backward changes nothing a recast reads: with current scaling
    each cast's scale is its own tensor; with delayed scaling the slot's scale changes in place when the next
    fp8_autocast begins, and the backward recasts with the scale its forward op used."""
    torch.manual_seed(0)
    model, scales = One().to(device), []
    delayed = recipe is fp8ext.DelayedScaling
    saved = _pipelined(model, recipe(), False, device=device)
    recast = _pipelined(model, recipe(), True, scales if delayed else None, device)
    if delayed:
        assert len(set(scales)) == len(scales), f"each micro-batch ran with a new scale: {scales}"
    for (dx_a, dw_a), (dx_b, dw_b) in zip(saved, recast):
        assert torch.equal(dx_a, dx_b) and torch.equal(dw_a, dw_b)


@pytest.mark.parametrize("recipe", [fp8ext.Float8BlockScaling, fp8ext.Float8RowwiseScaling], ids=["block", "rowwise"])
def test_recast_is_refused_where_a_recast_could_read_another_scale(recipe):
    """Row-wise and block scales are not recast: prepare_fp8 says so, and a layer flagged by hand refuses its
    forward."""
    with pytest.raises(ValueError, match="recast_in_backward=True needs per-tensor scales"):
        fp8ext.prepare_fp8(One(), recipe(), recast_in_backward=True)
    layer = One()
    layer.a.fp8_recast_in_backward = True
    with pytest.raises(ValueError, match="fp8_recast_in_backward .* needs per-tensor scales"):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe()):
            layer(torch.randn(32, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("fmt", [fp8ext.E4M3, fp8ext.E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_recast_in_torch_ops_is_the_c_cast_bit_for_bit(fmt, dtype, device):
    """The backward's recast (torch ops, compiled as the training step compiles it) writes the bytes of fp8ext's
    own cast_transpose: rounding to nearest even, ties, subnormals, saturation, +-Inf, NaN of either sign, zeros
    of either sign and float32 subnormals."""
    from fp8ext.modules.linear_autograd import _recast_t
    g = torch.Generator().manual_seed(5)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 1e-40, -1e-40,
                            448.0, 464.0, 465.0, -500.0, 57344.0, 61440.0, 1e30, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -11,
                            2.0 ** -16, 2.0 ** -17, 1.0625, 1.1875, -1.0625, 17.0, 19.0, 240.0, 248.0])
    x = torch.cat([special, torch.randn(64 * 48 - special.numel(), generator=g) * 30]).view(64, 48)
    x = x[torch.randperm(64, generator=g)].to(device, dtype)
    for s in (1.0, 0.37, 1024.0):
        scale = torch.tensor(s, dtype=torch.float32, device=device)
        _, want = fp8ext.cast_transpose(x, fmt, scale)
        got = torch.compile(_recast_t, fullgraph=True)(x, scale, fmt)
        assert got.dtype == torch.uint8 and got.shape == (48, 64)
        assert torch.equal(got.cpu(), want.view(torch.uint8).cpu()), f"scale {s}"


@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_one_call_ops_without_a_saved_buffer_give_the_same_bytes(delayed, device):
    """fp8ext::linear_fwd with keep=False makes only the saved buffer's header (the scale_invs and the scales it
    cast with) and the same y and amaxes; fp8ext::linear_bwd from that header and x8^T, W8^T cast again gives the
    dx, dW and db of the saved buffer, bit for bit."""
    from fp8ext.modules.linear_autograd import _recast_t
    from fp8ext.ops.linear_pass import CUR_SCALE as _CUR_SCALE, SINV_STEP as _SINV_STEP
    g = torch.Generator().manual_seed(7)
    m, k, n = 64, 96, 48
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / 8).to(device, torch.bfloat16)
    b = torch.randn(n, generator=g).to(device, torch.bfloat16)
    dy = torch.randn(m, n, generator=g).to(device, torch.bfloat16)
    f32 = dict(dtype=torch.float32, device=device)
    scales = (torch.tensor(3.0, **f32), torch.tensor(0.5, **f32), torch.tensor(40.0, **f32), torch.tensor(0.2, **f32),
              torch.tensor(2.0, **f32), torch.tensor(0.0, **f32)) if delayed else (None,) * 6
    xs, xa, ws, wa, gs, ga = scales
    e4m3, e5m2 = fp8ext.E4M3.code, fp8ext.E5M2.code
    ops = torch.ops.fp8ext
    y1, saved, xa1, wa1 = ops.linear_fwd(x, w, b, xs, xa, ws, wa, e4m3, 0.0, torch.bfloat16, True)
    y2, header, xa2, wa2 = ops.linear_fwd(x, w, b, xs, xa, ws, wa, e4m3, 0.0, torch.bfloat16, False)
    hb = L._C.LINEAR_SINV_BYTES
    assert header.shape == (hb,) and saved.numel() > hb
    assert torch.equal(y1, y2) and torch.equal(xa1, xa2) and torch.equal(wa1, wa2)
    hf, sf = header.view(torch.float32), saved[:hb].view(torch.float32)
    for i in (0, _SINV_STEP):  # the scale_invs; the scales (delayed: the slots'; current: computed by the call)
        assert torch.equal(hf[i], sf[i])
        want = (xs if i == 0 else ws) if delayed else sf[i + _CUR_SCALE]
        assert torch.equal(hf[i + _CUR_SCALE], want)
    x_t = _recast_t(x, hf[_CUR_SCALE], fp8ext.E4M3)
    w_t = _recast_t(w, hf[_SINV_STEP + _CUR_SCALE], fp8ext.E4M3)
    assert torch.equal(x_t, saved[hb:hb + m * k].view(k, m)), "x8^T cast again: the forward's bytes"
    args = (m, k, n, e4m3, e5m2, gs, ga, 0.0, True, True, True, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    want = ops.linear_bwd(dy, saved, *args)
    header_before = header.clone()
    got = ops.linear_bwd(dy, header, *args, x_t, w_t)
    assert torch.equal(header, header_before), "the op is pure: the header it was given is left as it was"
    for a, b_, what in zip(got, want, ("dx", "dW", "db", "the gradient's amax")):
        assert torch.equal(a, b_), what
    dx_only = ops.linear_bwd(dy, header, *args[:9], False, False, *args[11:], None, w_t)
    assert torch.equal(dx_only[0], want[0]) and dx_only[1].numel() == 0


@pytest.mark.parametrize("recipe, recast", [(fp8ext.DelayedScaling, True), (fp8ext.DelayedScaling, False),
                                            (fp8ext.Float8CurrentScaling, True), (fp8ext.Float8CurrentScaling, False),
                                            (fp8ext.Float8RowwiseScaling, False), (fp8ext.Float8BlockScaling, False)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_after_prepare_fp8_a_compiled_model_compiles_once(monkeypatch, recipe, recast):
    """The second and later steps reuse the first step's graph: prepare_fp8 made every cached quantizer before
    the first trace, so no guard on that cache fails afterwards."""
    from torch._dynamo.testing import CompileCounterWithBackend
    import fp8ext.core.tensor as T
    monkeypatch.setattr(T, "_role_quantizers", {})  # as in a fresh process
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, r = ScaledSharedInput(), recipe()
    fp8ext.prepare_fp8(model, r, recast_in_backward=recast)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        _step(compiled, r, x, [])
    assert counter.frame_count == 1, f"{counter.frame_count} compilations in 3 steps"
