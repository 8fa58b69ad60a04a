"""Activation checkpointing with fp8ext's layers: every form training code uses (torch.utils.checkpoint in both modes,
fp8ext.checkpoint, torch's checkpoint_wrapper, selective checkpointing, an fp8_autocast inside the checkpointed
function, torch.compile) trains bit for bit as the same steps without checkpointing, for every recipe: the
recomputed forward runs in the original forward's fp8_autocast, with its scales (fp8ext/modules/checkpoint.py)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fp8ext
from conftest import DEVICES

RECIPES = {
    "delayed": lambda: fp8ext.DelayedScaling(amax_history_len=4),
    "current": fp8ext.Float8CurrentScaling,
    "block": fp8ext.Float8BlockScaling,
    "rowwise": fp8ext.Float8RowwiseScaling,
}


class Block(nn.Module):
    """Norm, attention-free mixer and a SwiGLU MLP: fp8ext's FP8 modules as a transformer block uses them."""

    def __init__(self, d=64):
        super().__init__()
        self.qkv = fp8ext.LayerNormLinear(d, d, normalization="RMSNorm", bias=False)
        self.mlp = fp8ext.LayerNormMLP(d, 2 * d, normalization="RMSNorm", activation="swiglu", bias=False)

    def forward(self, x):
        x = x + F.gelu(self.qkv(x))
        return x + self.mlp(x)


class Net(nn.Module):
    """Two blocks between FP8Linear layers; `wrap(block, x)` runs a block (checkpointed or not)."""

    def __init__(self, d=64):
        super().__init__()
        self.inp = fp8ext.Linear(32, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.out = fp8ext.Linear(d, 16)
        self.wrap = lambda block, x: block(x)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = self.wrap(block, x)
        return self.out(x)


def net(device, dtype):
    torch.manual_seed(0)
    return Net().to(device=device, dtype=dtype)


def train(model, recipe, device, dtype, steps=3, autocast_inside=False):
    """SGD steps on random batches; returns the parameters and every FP8 layer's scaling state afterwards."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = (torch.randn(4, 16, 32, generator=g) * (1 + i)).to(device, dtype).requires_grad_(True)
        if autocast_inside:
            loss = model(x).float().square().mean()
        else:
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    states = {k: m.fp8_state() for k, m in model.named_modules() if isinstance(m, fp8ext.Linear)}
    return params, states


def assert_same_training(got, want, what):
    (pg, sg), (pw, sw) = got, want
    for k in pw:
        assert torch.equal(pg[k], pw[k]), f"{what}: parameter {k} differs from the run without checkpointing " \
                                          f"(max {(pg[k].float() - pw[k].float()).abs().max().item():.3g})"
    for k in sw:
        assert sg[k].keys() == sw[k].keys(), f"{what}: scaling state of {k}"
        for key in set(sw[k]) - {"steps"}:  # equal recipes share a manager: its update count spans both runs
            a, b = sg[k][key], sw[k][key]
            same = torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
            assert same, f"{what}: scaling state {key} of {k} differs from the run without checkpointing"


def _save_mm(ctx, op, *args, **kwargs):
    """A selective policy as torchtitan's: keep the matrix products' outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten._scaled_mm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


MODES = {
    "non_reentrant": lambda block, x: checkpoint(block, x, use_reentrant=False),
    "reentrant": lambda block, x: checkpoint(block, x, use_reentrant=True),
    "fp8ext.checkpoint": lambda block, x: fp8ext.checkpoint(block, x),
    "selective": lambda block, x: checkpoint(block, x, use_reentrant=False,
                                             context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                          _save_mm)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("mode", list(MODES))
def test_checkpointed_training_equals_training_without_it(device, recipe, mode):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    want = train(net(device, dtype), RECIPES[recipe](), device, dtype)
    model = net(device, dtype)
    model.wrap = MODES[mode]
    assert_same_training(train(model, RECIPES[recipe](), device, dtype), want, f"{mode}, {recipe}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_torch_checkpoint_wrapper_and_apply_activation_checkpointing(device, recipe):
    """torch's wrappers (what FSDP2 training scripts apply to each block): non-reentrant and reentrant."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                              apply_activation_checkpointing)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    want = train(net(device, dtype), RECIPES[recipe](), device, dtype)
    for impl in (CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT):
        model = net(device, dtype)
        wrapper = functools.partial(
            __import__("torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
                       fromlist=["checkpoint_wrapper"]).checkpoint_wrapper, checkpoint_impl=impl)
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Block))
        assert sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()) == 2, "each block wrapped"
        got = train(model, RECIPES[recipe](), device, dtype)
        got = ({k.replace("_checkpoint_wrapped_module.", ""): v for k, v in got[0].items()},
               {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in got[1].items()})
        assert_same_training(got, want, f"apply_activation_checkpointing {impl.name}, {recipe}")


class Scoped(nn.Module):
    """A model whose forward enters fp8_autocast itself (as fp8ext's Transformer does): checkpointing the whole of it
    reruns the context's entry in the backward pass."""

    def __init__(self, recipe, reentrant):
        super().__init__()
        self.net, self.recipe, self.reentrant = net("cpu", torch.float32), recipe, reentrant

    def forward(self, x):
        return checkpoint(self._fp8_forward, x, use_reentrant=self.reentrant)

    def _fp8_forward(self, x):
        with fp8ext.fp8_autocast(fp8_recipe=self.recipe):
            return self.net(x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_an_fp8_autocast_rerun_in_the_backward_updates_no_scales(reentrant):
    """The rerun enters fp8_autocast during the backward pass: no scale update there (the step's amaxes would be
    half recorded), so the run equals the one without checkpointing and the manager updated once per step."""
    # a recipe of this test's own: a manager that other tests' compiled steps marked (prepare_fp8) is marked at every
    # outermost exit, which adds an update
    r_ref, r = fp8ext.DelayedScaling(amax_history_len=5), fp8ext.DelayedScaling(amax_history_len=5)
    ref = Scoped(r_ref, reentrant)
    ref.forward = ref._fp8_forward
    want = train(ref, r_ref, "cpu", torch.float32, autocast_inside=True)
    mgr = fp8ext.get_scaling_manager(r, "cpu")  # equal recipes: the same manager as the reference run's
    with fp8ext.fp8_autocast(fp8_recipe=r):
        pass  # the update of the reference run's last step
    before = mgr.steps
    got = train(Scoped(r, reentrant), r, "cpu", torch.float32, autocast_inside=True)
    assert_same_training(got, want, "fp8_autocast inside the checkpointed function")
    assert mgr.steps - before == 2, "three steps: two updates, at the second and third steps' entries, none in a backward"


def test_a_rerun_after_a_scale_update_raises_naming_the_cause():
    """Delayed scales updated between a checkpointed forward and its backward (the next step's fp8_autocast entered
    first, here by other layers' forward): the rerun would cast with other scales, so it raises instead of training
    on different bytes."""
    recipe = fp8ext.DelayedScaling()
    model, other = net("cpu", torch.float32), fp8ext.Linear(32, 16)
    model.wrap = MODES["non_reentrant"]
    x = torch.randn(4, 16, 32)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        loss = model(x).square().mean()
    with fp8ext.fp8_autocast(fp8_recipe=recipe):  # the next step begins before this one's backward
        other(x)
    with pytest.raises(RuntimeError, match="recomputing this layer's forward after its FP8 scales were updated"):
        loss.backward()


def test_a_forward_outside_fp8_autocast_reruns_in_high_precision():
    """The layers remember only their last forward's context: a checkpointed forward outside fp8_autocast after FP8
    steps reruns in high precision, as it ran (non-reentrant checkpointing would raise on a different path)."""
    model = net("cpu", torch.float32)
    model.wrap = MODES["non_reentrant"]
    x = torch.randn(4, 16, 32)
    with fp8ext.fp8_autocast():
        model(x).square().mean().backward()
    model.zero_grad()
    model(x).square().mean().backward()
    plain = net("cpu", torch.float32)
    plain.load_state_dict(model.state_dict())
    plain(x).square().mean().backward()
    for (k, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), k


def test_te_checkpoint_refuses_tensor_parallel_arguments():
    block = Block()
    with pytest.raises(NotImplementedError, match="distribute_saved_activations=True asks for tensor parallelism"):
        fp8ext.checkpoint(block, torch.randn(2, 64), distribute_saved_activations=True)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_compiled_checkpointed_training_equals_compiled_training_without_it(recipe, selective):
    """torch.compile traces the checkpointed model (recomputed inside the compiled backward) as one graph: the same
    weights and scaling state as the compiled steps without checkpointing."""
    from torch._dynamo.utils import counters
    runs = []
    for wrap in (None, MODES["selective" if selective else "non_reentrant"]):
        torch._dynamo.reset()
        counters.clear()
        model = net("cpu", torch.float32)
        r = RECIPES[recipe]()
        fp8ext.prepare_fp8(model, r)
        # the whole model checkpointed: its first FP8 layer inside the checkpointed region
        compiled = torch.compile(model if wrap is None else functools.partial(wrap, model), backend="aot_eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        for i in range(3):
            x = torch.randn(4, 16, 32, generator=g) * (1 + i)
            with fp8ext.fp8_autocast(fp8_recipe=r):
                loss = compiled(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        assert not counters["graph_break"], dict(counters["graph_break"])
        runs.append(({k: v.detach().clone() for k, v in model.named_parameters()},
                     {k: m.fp8_state() for k, m in model.named_modules() if isinstance(m, fp8ext.Linear)}))
    assert_same_training(runs[1], runs[0], f"compiled, {'selective' if selective else 'full'}, {recipe}")
