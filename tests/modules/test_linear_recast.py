"""FP8Linear under torch.compile with prepare_fp8(..., recast_in_backward=True) keeps x and W for backward and casts
x8^T and W8^T again there (as torchao does), instead of saving FP8 copies: the same outputs and gradients, bit for
bit, and fewer bytes saved."""

import copy

import pytest
import torch

import fp8ext
import fp8ext.modules.linear as L


class SharedInput(torch.nn.Module):
    """Two layers reading one input, as q/k/v or gate/up do."""

    def __init__(self):
        super().__init__()
        self.a = fp8ext.FP8Linear(64, 32, params_dtype=torch.bfloat16)
        self.b = fp8ext.FP8Linear(64, 48, params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.a(x), self.b(x)


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
    torch.autograd.backward(ys, [torch.randn(y.shape, generator=gen).to(y.dtype) for y in ys])
    return ys, x.grad.clone(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", [fp8ext.Float8CurrentScaling], ids=["current"])
def test_compiled_backward_recasts_the_same_bytes_and_saves_no_fp8(recipe, monkeypatch):
    torch.manual_seed(0)
    eager = SharedInput()
    compiled_model = copy.deepcopy(eager)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(L, "_FAST_PATH", False)  # eager: the composed path, which saves the FP8 copies
    eager_saved = []
    x = x.requires_grad_()
    want = _step(eager, recipe(), x, eager_saved)
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


class One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = fp8ext.FP8Linear(64, 32, params_dtype=torch.bfloat16)

    def forward(self, x):
        return self.a(x)


def _pipelined(model, recipe, recast):
    """Forwards of micro-batch i + 1 (a new fp8_autocast each) before micro-batch i's backward, as 1F1B schedules
    run them; each backward's dx and dW."""
    m = copy.deepcopy(model)
    fp8ext.prepare_fp8(m, recipe, recast_in_backward=recast)
    cm = torch.compile(m, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(32, 64, generator=g) * 10 ** i).bfloat16().requires_grad_() for i in range(3)]
    ys, out = [], []
    for i, x in enumerate(xs):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            ys.append(cm(x))
        if i:
            ys[i - 1].float().sum().backward()
            out.append((xs[i - 1].grad.clone(), m.a.weight.grad.clone()))
            m.a.weight.grad = None
    return out


def test_recast_with_pipelined_micro_batches_matches_the_saved_fp8_copies():
    """A later forward between a forward and its backward changes nothing a recast reads (current scaling: each
    cast's scale is its own tensor)."""
    torch.manual_seed(0)
    model, recipe = One(), fp8ext.Float8CurrentScaling()
    for (dx_a, dw_a), (dx_b, dw_b) in zip(_pipelined(model, recipe, False), _pipelined(model, recipe, True)):
        assert torch.equal(dx_a, dx_b) and torch.equal(dw_a, dw_b)


@pytest.mark.parametrize("recipe", [fp8ext.DelayedScaling, fp8ext.Float8BlockScaling, fp8ext.Float8RowwiseScaling],
                         ids=["delayed", "block", "rowwise"])
def test_recast_is_refused_where_a_recast_could_read_another_scale(recipe):
    """Delayed scaling updates a slot's scale in place when a later fp8_autocast begins, before an earlier
    backward would recast with it; row-wise and block scales are not recast: prepare_fp8 says so, and a layer
    flagged by hand refuses its forward."""
    with pytest.raises(ValueError, match="recast_in_backward=True needs Float8CurrentScaling"):
        fp8ext.prepare_fp8(One(), recipe(), recast_in_backward=True)
    layer = One()
    layer.a.fp8_recast_in_backward = True
    with pytest.raises(ValueError, match="fp8_recast_in_backward .* needs Float8CurrentScaling"):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe()):
            layer(torch.randn(32, 64, dtype=torch.bfloat16))
