"""fp8ext.make_graphed_callables: argument checks and the FP8 state bookkeeping (CPU), and graphed training that
matches eager training step for step, losses and scaling state bit for bit (CUDA).

The eager twin of a graphed model uses a recipe that differs only in reduce_amax (which does nothing without an
fp8_group), so the two have separate scaling managers with the same numerics."""

import pytest
import torch
from torch import nn

import fp8ext
from fp8ext.core.graph_state import FP8Replay, ManagerState, UpdateGate
from fp8ext.graphs import _check_like, make_graphed_callables
from conftest import requires_cuda

STEPS = 5


# ---- argument checks (no GPU needed: they run before anything touches CUDA) ----------------------------------------
def _cpu_model():
    return nn.Sequential(fp8ext.Linear(16, 16))


@pytest.mark.parametrize("kwargs, error, words", [
    ({"fp8_weight_caching": True}, NotImplementedError, "fp8_weight_caching"),
    ({"fp8_enabled": True, "fp8_recipe": fp8ext.DelayedScaling(interval=2)}, NotImplementedError, "interval"),
    ({"fp8_calibrating": True, "fp8_recipe": fp8ext.DelayedScaling(interval=3)}, NotImplementedError, "interval"),
    ({"fp8_enabled": True, "fp8_recipe": "hybrid"}, TypeError, "fp8_recipe"),
    ({"_order": [1, -1]}, NotImplementedError, "_order"),
    ({"_reuse_graph_input_output_buffers": True}, NotImplementedError, "_reuse_graph_input_output_buffers"),
    ({"num_warmup_iters": -1}, ValueError, "num_warmup_iters"),
    ({"fp8_enabled": (True, False)}, ValueError, "fp8_enabled"),
])
def test_unsupported_options_are_refused_by_name(kwargs, error, words):
    with pytest.raises(error, match=words):
        make_graphed_callables(_cpu_model(), (torch.randn(4, 16),), **kwargs)


def test_interval_is_accepted_when_fp8_is_off():
    """A recipe's interval matters only when the graphs update scales: with FP8 off the refusal must not fire (the
    call then fails later, on the CPU parameters, not on the interval)."""
    with pytest.raises(ValueError, match="CUDA"):
        make_graphed_callables(_cpu_model(), (torch.randn(4, 16),), fp8_recipe=fp8ext.DelayedScaling(interval=2))


def test_cpu_parameters_are_refused_naming_the_module():
    with pytest.raises(ValueError, match=r"modules\[0\] parameter '0.weight' is on cpu.*CUDA"):
        make_graphed_callables(_cpu_model(), (torch.randn(4, 16),))


def test_cpu_sample_args_are_refused():
    with pytest.raises(ValueError, match="sample_args of callable 0 holds a tensor on cpu; CUDA graphs need CUDA"):
        make_graphed_callables(lambda x: x * 2, (torch.randn(4, 16),))


def test_cpu_sample_kwargs_are_refused():
    with pytest.raises(ValueError, match="sample_kwargs of callable 0 holds a tensor on cpu"):
        make_graphed_callables(lambda x: x * 2, (), sample_kwargs={"x": torch.randn(4)})


def test_sample_args_that_are_not_tensors_are_refused():
    with pytest.raises(TypeError, match="sample_args must hold only tensors.*float"):
        make_graphed_callables(lambda x, s: x * s, (torch.randn(4), 2.0))


def test_sample_args_must_be_a_tuple():
    with pytest.raises(TypeError, match="sample_args must be a tuple of tensors, got Tensor"):
        make_graphed_callables(lambda x: x, torch.randn(4))


def test_a_tuple_of_modules_needs_one_sample_tuple_each():
    with pytest.raises(ValueError, match="tuple of 2 modules, sample_args must be a tuple of 2"):
        make_graphed_callables((lambda x: x, lambda x: x), ((torch.randn(4),),))


def test_a_module_that_is_not_callable_is_refused():
    with pytest.raises(TypeError, match=r"modules\[1\] must be an nn.Module or a callable"):
        make_graphed_callables((lambda x: x, 3), ((torch.randn(4),), (torch.randn(4),)))


def test_modules_with_hooks_are_refused():
    m = _cpu_model()
    m.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="hooks"):
        make_graphed_callables(m, (torch.randn(4, 16),))


def test_modules_in_mixed_training_modes_are_refused():
    with pytest.raises(ValueError, match="all in training mode or all in eval mode"):
        make_graphed_callables((nn.ReLU(), nn.ReLU().eval()), ((torch.randn(4),), (torch.randn(4),)))


def test_fp8_autocast_graph_switch_leaves_the_update_to_the_caller():
    """_graph=True (make_graphed_callables' switch): entering does not run the pending scale update, which the graph
    runs itself; without it the entry runs it, as always."""
    recipe = fp8ext.DelayedScaling(amax_history_len=4, margin=3)
    mgr = fp8ext.get_scaling_manager(recipe, "cpu")
    mgr.update_amax("graph-switch", 2.0)
    with fp8ext.fp8_autocast(fp8_recipe=recipe, _graph=True):
        pass
    assert (mgr.steps, mgr.dirty) == (0, True), "the _graph=True entry must leave the update pending"
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        pass
    assert (mgr.steps, mgr.dirty) == (1, False), "a plain entry runs the pending update"


def test_replay_refuses_an_input_that_requires_grad_when_its_sample_did_not():
    """The backward graph has no gradient for an input whose sample did not require grad: refused, not dropped."""
    with pytest.raises(ValueError, match="tensor argument 0 requires grad but its sample did not"):
        _check_like([torch.zeros(2, requires_grad=True)], [torch.zeros(2)])
    _check_like([torch.zeros(2)], [torch.zeros(2, requires_grad=True)])  # the other way round is harmless


# ---- the gradients a replay hands to autograd (CPU: graphs replaced by functions writing the static buffers) -------
class _FakeGraph:
    def __init__(self, fn):
        self.replay = fn


def _graphed_linear():
    """A graphed y = x W^T whose "graphs" write the static buffers as a replay would: (callable, W, static dW)."""
    from fp8ext.modules.graphs import _graphed_function
    from torch.utils._pytree import tree_flatten
    w = nn.Parameter(torch.randn(3, 4))
    x_s, y_s, gy_s, gw_s, gx_s = torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 4), \
        torch.zeros(2, 4)

    def fwd():
        y_s.copy_(x_s @ w.detach().t())

    def bwd():
        gw_s.copy_(gy_s.t() @ x_s)
        gx_s.copy_(gy_s @ w.detach())

    spec = tree_flatten((y_s,))[1]
    fn = _graphed_function(_FakeGraph(fwd), _FakeGraph(bwd), (w,), 1, [], spec, (x_s, w), (y_s,), (gy_s,),
                           (None, gw_s), None)
    return fn, w, gw_s


def _x_grad(x):
    return x.t() @ torch.ones(2, 3)  # dW of (x W^T).sum()


def test_replayed_gradients_accumulate_without_aliasing_the_static_buffer():
    """.grad unset: a clone (autograd would keep the tensor itself); .grad set: added into it, and .grad never
    shares memory with the buffer the next replay overwrites; torch.autograd.grad and a tensor hook get clones."""
    fn, w, gw_s = _graphed_linear()
    x1, x2, x3 = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    fn(x1)[0].sum().backward()
    assert w.grad.data_ptr() != gw_s.data_ptr()
    assert torch.allclose(w.grad, _x_grad(x1).t())
    fn(x2)[0].sum().backward()  # accumulation: .grad is set, the static buffer is added in place
    assert w.grad.data_ptr() != gw_s.data_ptr()
    assert torch.allclose(w.grad, (_x_grad(x1) + _x_grad(x2)).t())
    (g,) = torch.autograd.grad(fn(x3)[0].sum(), [w])  # .grad is set, but autograd.grad returns the gradient
    assert g.data_ptr() != gw_s.data_ptr()
    fn(x1)[0].sum().backward()
    assert torch.allclose(g, _x_grad(x3).t()), "a later replay changed what torch.autograd.grad returned"
    kept = []
    handle = w.register_hook(lambda grad: kept.append(grad))
    fn(x2)[0].sum().backward()
    handle.remove()
    assert kept[0].data_ptr() != gw_s.data_ptr(), "a tensor hook may keep the gradient: it must be a clone"


def _graphed_bias():
    """A graphed y = x + b (b's gradient needs no activation): (callable, b)."""
    from fp8ext.modules.graphs import _graphed_function
    from torch.utils._pytree import tree_flatten
    b = nn.Parameter(torch.zeros(4))
    x_s, y_s, gy_s, gb_s = torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(4)

    def fwd():
        y_s.copy_(x_s + b.detach())

    def bwd():
        gb_s.copy_(gy_s.sum(0))

    spec = tree_flatten((y_s,))[1]
    return _graphed_function(_FakeGraph(fwd), _FakeGraph(bwd), (b,), 1, [], spec, (x_s, b), (y_s,), (gy_s,),
                             (None, gb_s), None), b


def test_two_forwards_in_flight_keep_both_gradients():
    """Two forwards before one backward: the second backward replay must not overwrite the first's gradient while
    autograd still holds it for the parameter's accumulation."""
    fn, b = _graphed_bias()
    fn(torch.ones(2, 4))[0].sum().backward()  # .grad set: 2 per element
    y1, y2 = fn(torch.ones(2, 4))[0], fn(torch.ones(2, 4))[0]
    (y1.sum() + 2 * y2.sum()).backward()
    assert torch.equal(b.grad, torch.full((4,), 2.0 + 2 + 4)), b.grad


def test_a_second_backward_through_an_earlier_forward_keeps_both_gradients():
    """A backward that replays the graph twice (through a forward whose backward already ran, and a new one) must
    not let the second replay overwrite the first's gradient while autograd still holds it."""
    fn, b = _graphed_bias()
    fn(torch.ones(2, 4))[0].sum().backward()  # .grad set: 2 per element
    y_a = fn(torch.ones(2, 4))[0]
    y_a.sum().backward()  # 4
    y_b = fn(torch.ones(2, 4))[0]
    (5 * y_a.sum() + y_b.sum()).backward()  # + 2 * 5 + 2 * 1
    assert torch.equal(b.grad, torch.full((4,), 16.0)), b.grad


def test_a_graphed_callable_in_a_reference_cycle_is_collected():
    """The callable keeps no reference to a parameter that Python's garbage collector cannot see."""
    import gc
    import weakref

    class Owner:
        pass
    fn, w, _ = _graphed_linear()
    fn(torch.randn(2, 4))[0].sum().backward()
    owner = Owner()
    owner.fn, owner.w, w.owner = fn, w, owner
    gone = weakref.ref(owner)
    del owner, fn, w
    gc.collect()
    assert gone() is None


# ---- the FP8 state bookkeeping (runs on the CPU: the same code the graphs capture) ---------------------------------
def _manager_with_amaxes(history_len=3):
    mgr = fp8ext.FP8ScalingManager(fp8ext.DelayedScaling(amax_history_len=history_len), device="cpu")
    for name, amax in (("a", 3.0), ("b", 100.0)):
        mgr.update_amax(name, amax)
    mgr.update()
    mgr.update_amax("a", 5.0)
    return mgr


def _buffers(mgr):
    return [t.clone() for t in (mgr.amax_history, mgr.scale, mgr.scale_inv)]


def test_gate_with_flag_set_is_the_eager_update():
    mgr, twin = _manager_with_amaxes(), _manager_with_amaxes()
    gate = UpdateGate(mgr)
    gate.flag.fill_(True)
    gate.run()
    twin.update()
    for got, want in zip(_buffers(mgr), _buffers(twin)):
        assert torch.equal(got, want), "a gated update whose flag is set must equal FP8ScalingManager.update"


def test_gate_with_flag_clear_leaves_the_state_alone():
    mgr = _manager_with_amaxes()
    before = _buffers(mgr)
    UpdateGate(mgr).run()
    for got, want in zip(_buffers(mgr), before):
        assert torch.equal(got, want), "a gated update whose flag is clear must change nothing"


def test_gate_bookkeeping_follows_the_dirty_flag():
    mgr = _manager_with_amaxes()
    gate = UpdateGate(mgr)
    assert mgr.dirty
    gate.before_replay()
    assert (bool(gate.flag), mgr.steps, mgr.dirty) == (True, 2, False), "dirty: the replay updates, as eager entry"
    gate.before_replay()
    assert (bool(gate.flag), mgr.steps, mgr.dirty) == (False, 2, False), "clean: the replay must skip the update"


def test_replay_marks_the_manager_dirty_after_a_recording_forward():
    mgr = _manager_with_amaxes()
    gate = UpdateGate(mgr)
    FP8Replay(gate, owns_update=True, records=True).before_forward()
    assert not mgr.dirty
    FP8Replay(gate, owns_update=True, records=True).after_forward()
    assert mgr.dirty, "a forward that records amaxes leaves the manager dirty, as FP8Linear.forward does"


def test_replay_refuses_buffers_reallocated_after_capture():
    mgr = _manager_with_amaxes()
    gate = UpdateGate(mgr)
    gate.generation = mgr.generation
    for i in range(mgr.capacity):
        mgr.register(f"late{i}")
    with pytest.raises(RuntimeError, match="reallocated after the capture.*prepare_fp8"):
        FP8Replay(gate, owns_update=False, records=True).before_forward()


def test_manager_state_is_written_back_and_warm_up_slots_start_fresh():
    mgr = _manager_with_amaxes()
    before, steps = _buffers(mgr), mgr.steps
    saved = ManagerState(mgr)
    mgr.update()
    slot = mgr.register("warm-up")
    mgr.update_amax("warm-up", 7.0)
    mgr.update()
    saved.restore()
    got = _buffers(mgr)
    for g, w in zip(got, before):
        assert torch.equal(g[: w.shape[0]][[0, 1]], w[[0, 1]]), "the saved slots must get their values back"
    assert torch.all(mgr.amax_history[slot] == 0) and mgr.scale[slot] == 1 and mgr.scale_inv[slot] == 1
    assert (mgr.steps, mgr.dirty) == (steps, True)


# ---- graphed training on the GPU -----------------------------------------------------------------------------------
_recipe_tags = iter(range(1, 256))


def _recipes(**kw):
    """(graphed recipe, eager recipe): equal numerics, separate managers, new ones for each test (managers are per
    recipe and process). backoff_factor only acts on an overflow, which these tests never have: it tells recipes
    apart."""
    kw.setdefault("backoff_factor", 0.5 - next(_recipe_tags) / 1024)
    return fp8ext.DelayedScaling(reduce_amax=False, **kw), fp8ext.DelayedScaling(reduce_amax=True, **kw)


def _linear_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(fp8ext.Linear(64, 128, device="cuda"), nn.GELU(), fp8ext.Linear(128, 64, device="cuda"),
                         nn.GELU(), fp8ext.Linear(64, 32, device="cuda"))


def _norm_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(fp8ext.LayerNormLinear(64, 128, device="cuda"),
                         fp8ext.LayerNormMLP(128, 256, normalization="RMSNorm", activation="swiglu", device="cuda"))


def _inputs(n=STEPS, rows=32, cols=64, shrinking=False):
    """Per step an input whose amax changes (shrinking: falls, so that a stale history entry wins the max)."""
    torch.manual_seed(1)
    return [torch.randn(rows, cols, device="cuda") * ((n - i) if shrinking else (1 + i)) for i in range(n)]


def _train(forward, params, xs, lr=0.05):
    """SGD steps; forward(x) -> y. Returns the losses (one tensor; no host sync inside the loop)."""
    opt = torch.optim.SGD(params, lr=lr)
    losses = []
    for x in xs:
        loss = forward(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _eager_forward(model, recipe, **autocast):
    def forward(x):
        with fp8ext.fp8_autocast(fp8_recipe=recipe, **autocast):
            return model(x)
    return forward


def _fp8_layers(model):
    return [m for m in model.modules() if isinstance(m, fp8ext.FP8Linear)]


def _assert_same_fp8_state(graphed_model, graphed_recipe, eager_model, eager_recipe):
    """Every FP8 tensor's amax history, scale and scale_inv rows are equal, and so are the managers' step counts and
    dirty flags; the scales moved away from their initial 1 (else the comparison would prove little)."""
    gm = fp8ext.get_scaling_manager(graphed_recipe, "cuda")
    em = fp8ext.get_scaling_manager(eager_recipe, "cuda")
    assert (gm.steps, gm.dirty) == (em.steps, em.dirty), "graphed replays must keep the eager step count and flag"
    moved = False
    for g, e in zip(_fp8_layers(graphed_model), _fp8_layers(eager_model)):
        gi = [gm.slot(n) for n in g._slot_names()]
        ei = [em.slot(n) for n in e._slot_names()]
        for what in ("amax_history", "scale", "scale_inv"):
            got, want = getattr(gm, what)[gi], getattr(em, what)[ei]
            assert torch.equal(got, want), f"{what} of the graphed model differs from eager's:\n{got}\n{want}"
        moved |= bool((gm.scale[gi] != 1).any())
    assert moved, "the scales never left 1: the test inputs do not exercise the scale update"


def _graph_and_compare(make_model, xs, graphed_recipe, eager_recipe, warm_steps=(), **graph_kwargs):
    graphed_model, eager_model = make_model(), make_model()
    for x in warm_steps:  # the same eager history for both before graphing
        _train(_eager_forward(graphed_model, graphed_recipe), graphed_model.parameters(), [x])
        _train(_eager_forward(eager_model, eager_recipe), eager_model.parameters(), [x])
    mgr = fp8ext.get_scaling_manager(graphed_recipe, "cuda")
    fp8ext.prepare_fp8(graphed_model, graphed_recipe)
    buffers = [t.data_ptr() for t in (mgr.amax_history, mgr.scale, mgr.scale_inv)]
    g = make_graphed_callables(graphed_model, (torch.zeros_like(xs[0]),), fp8_enabled=True,
                               fp8_recipe=graphed_recipe, **graph_kwargs)
    assert g is graphed_model
    got = _train(g, graphed_model.parameters(), xs)
    want = _train(_eager_forward(eager_model, eager_recipe), eager_model.parameters(), xs)
    assert torch.equal(got, want), f"graphed losses {got.tolist()} differ from eager losses {want.tolist()}"
    assert buffers == [t.data_ptr() for t in (mgr.amax_history, mgr.scale, mgr.scale_inv)], \
        "replays must update the manager's own buffers, which eager code reads"
    _assert_same_fp8_state(graphed_model, graphed_recipe, eager_model, eager_recipe)
    return graphed_model, eager_model


@requires_cuda
@pytest.mark.cuda
def test_graphed_linear_training_matches_eager_losses_and_scales():
    graphed_recipe, eager_recipe = _recipes(amax_history_len=2)
    _graph_and_compare(_linear_model, _inputs(), graphed_recipe, eager_recipe)


@requires_cuda
@pytest.mark.cuda
def test_graphed_layernorm_modules_training_matches_eager():
    graphed_recipe, eager_recipe = _recipes(amax_history_len=4)
    _graph_and_compare(_norm_model, _inputs(), graphed_recipe, eager_recipe)


@requires_cuda
@pytest.mark.cuda
def test_graphing_after_eager_steps_continues_like_eager():
    """Graphed after two eager steps (the manager is dirty, the histories full): the warm-up leaves no trace and the
    first replay runs the update that the next eager entry runs."""
    graphed_recipe, eager_recipe = _recipes(amax_history_len=3)
    xs = _inputs(STEPS + 2, shrinking=True)
    _graph_and_compare(_linear_model, xs[2:], graphed_recipe, eager_recipe, warm_steps=xs[:2])


@requires_cuda
@pytest.mark.cuda
def test_first_replay_skips_the_update_when_the_manager_is_clean():
    """An fp8_autocast entered with no FP8 work ran the update and left the manager clean with a full history: the
    next eager entry does not update, so the first replay must not either (the device flag skips it)."""
    graphed_recipe, eager_recipe = _recipes(amax_history_len=2)
    xs = _inputs(STEPS + 1, shrinking=True)
    graphed_model, eager_model = _linear_model(), _linear_model()
    for model, recipe in ((graphed_model, graphed_recipe), (eager_model, eager_recipe)):
        _train(_eager_forward(model, recipe), model.parameters(), xs[:1])
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            pass
        assert not fp8ext.get_scaling_manager(recipe, "cuda").dirty
    g = make_graphed_callables(graphed_model, (torch.zeros_like(xs[0]),), fp8_enabled=True, fp8_recipe=graphed_recipe)
    got = _train(g, graphed_model.parameters(), xs[1:])
    want = _train(_eager_forward(eager_model, eager_recipe), eager_model.parameters(), xs[1:])
    assert torch.equal(got, want), f"graphed losses {got.tolist()} differ from eager losses {want.tolist()}"
    _assert_same_fp8_state(graphed_model, graphed_recipe, eager_model, eager_recipe)


@requires_cuda
@pytest.mark.cuda
def test_graphed_callable_inside_fp8_autocast_updates_once_per_step():
    """Called inside the user's fp8_autocast of the same recipe, the entry runs the update and the graph skips its
    own: one update per step, as eager."""
    graphed_recipe, eager_recipe = _recipes(amax_history_len=2)
    xs = _inputs(shrinking=True)
    graphed_model, eager_model = _linear_model(), _linear_model()
    g = make_graphed_callables(graphed_model, (torch.zeros_like(xs[0]),), fp8_enabled=True, fp8_recipe=graphed_recipe)
    got = _train(_eager_forward(g, graphed_recipe), graphed_model.parameters(), xs)
    want = _train(_eager_forward(eager_model, eager_recipe), eager_model.parameters(), xs)
    assert torch.equal(got, want), f"graphed losses {got.tolist()} differ from eager losses {want.tolist()}"
    _assert_same_fp8_state(graphed_model, graphed_recipe, eager_model, eager_recipe)


@requires_cuda
@pytest.mark.cuda
def test_eager_forward_after_graphed_training_sees_the_graphs_scales():
    graphed_recipe, eager_recipe = _recipes(amax_history_len=2)
    xs = _inputs()
    graphed_model, eager_model = _graph_and_compare(_linear_model, xs, graphed_recipe, eager_recipe)
    graphed_model.eval()  # eval: the graphed module runs its original, eager forward
    eager_model.eval()
    got = _eager_forward(graphed_model, graphed_recipe)(xs[0])
    want = _eager_forward(eager_model, eager_recipe)(xs[0])
    assert torch.equal(got, want), "an eager step after graphed ones must scale exactly as after eager ones"


@requires_cuda
@pytest.mark.cuda
def test_graphed_tuple_of_modules_updates_once_per_step():
    graphed_recipe, eager_recipe = _recipes(amax_history_len=2)
    xs = _inputs(shrinking=True)
    graphed_model, eager_model = _linear_model(), _linear_model()
    (g1, g2), (e1, e2) = (graphed_model[:2], graphed_model[2:]), (eager_model[:2], eager_model[2:])
    h = torch.zeros(32, 128, device="cuda", requires_grad=True)
    graphed = make_graphed_callables((g1, g2), ((torch.zeros_like(xs[0]),), (h,)), fp8_enabled=True,
                                     fp8_recipe=graphed_recipe)
    assert graphed == (g1, g2)
    params = list(g1.parameters()) + list(g2.parameters())
    got = _train(lambda x: g2(g1(x)), params, xs)
    want = _train(_eager_forward(lambda x: e2(e1(x)), eager_recipe), list(e1.parameters()) + list(e2.parameters()),
                  xs)
    assert torch.equal(got, want), f"graphed losses {got.tolist()} differ from eager losses {want.tolist()}"
    _assert_same_fp8_state(graphed_model, graphed_recipe, eager_model, eager_recipe)


@requires_cuda
@pytest.mark.cuda
def test_fp8_disabled_is_a_plain_graph_in_high_precision():
    xs = _inputs()
    graphed_model, eager_model = _linear_model(), _linear_model()
    g = make_graphed_callables(graphed_model, (torch.zeros_like(xs[0]),))
    got = _train(lambda x: g(x), graphed_model.parameters(), xs)
    want = _train(eager_model, eager_model.parameters(), xs)
    assert torch.equal(got, want), f"graphed losses {got.tolist()} differ from eager losses {want.tolist()}"
    want = eager_model(xs[0])
    with fp8ext.fp8_autocast():  # the captured setting (FP8 off) holds inside a caller's fp8_autocast
        got = g(xs[0])
    assert torch.equal(got, want), "fp8_enabled=False graphs compute in high precision wherever they are called"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [fp8ext.CurrentScaling(), fp8ext.Float8BlockScaling(),
                                    fp8ext.Float8RowwiseScaling()], ids=["current", "block", "rowwise"])
def test_graphed_recipes_without_state_match_eager(recipe):
    xs = _inputs()
    graphed_model, eager_model = _linear_model(), _linear_model()
    g = make_graphed_callables(graphed_model, (torch.zeros_like(xs[0]),), fp8_enabled=True, fp8_recipe=recipe)
    got = _train(g, graphed_model.parameters(), xs)
    want = _train(_eager_forward(eager_model, recipe), eager_model.parameters(), xs)
    assert torch.equal(got, want), f"graphed losses {got.tolist()} differ from eager losses {want.tolist()}"


@requires_cuda
@pytest.mark.cuda
def test_graphed_calibration_records_the_eager_amaxes():
    graphed_recipe, eager_recipe = _recipes(amax_history_len=4)
    xs = _inputs()
    graphed_model, eager_model = _linear_model(), _linear_model()
    g = make_graphed_callables(graphed_model, (torch.zeros_like(xs[0]),), fp8_calibrating=True,
                               fp8_recipe=graphed_recipe)
    got = _train(g, graphed_model.parameters(), xs)
    want = _train(_eager_forward(eager_model, eager_recipe, enabled=False, calibrating=True),
                  eager_model.parameters(), xs)
    assert torch.equal(got, want), "calibration computes in high precision: the same losses"
    _assert_same_fp8_state(graphed_model, graphed_recipe, eager_model, eager_recipe)


@requires_cuda
@pytest.mark.cuda
def test_parameter_gradients_accumulate_across_graphed_backwards():
    """Without zero_grad between micro-batches the gradients add up: the graph's static gradient buffers must not
    become .grad (the next replay would overwrite them)."""
    graphed_recipe, eager_recipe = _recipes(amax_history_len=2)
    xs = _inputs(3)
    graphed_model, eager_model = _linear_model(), _linear_model()
    g = make_graphed_callables(graphed_model, (torch.zeros_like(xs[0]),), fp8_enabled=True, fp8_recipe=graphed_recipe)
    eager = _eager_forward(eager_model, eager_recipe)
    for x in xs:
        g(x).float().pow(2).mean().backward()
        eager(x).float().pow(2).mean().backward()
    for (name, p), q in zip(graphed_model.named_parameters(), eager_model.parameters()):
        assert torch.equal(p.grad, q.grad), f"{name}.grad: accumulated graphed gradients differ from eager's"


@requires_cuda
@pytest.mark.cuda
def test_inputs_of_another_shape_are_refused():
    graphed_recipe, _ = _recipes()
    x = torch.zeros(32, 64, device="cuda")
    g = make_graphed_callables(_linear_model(), (x,), fp8_enabled=True, fp8_recipe=graphed_recipe)
    with pytest.raises(ValueError, match=r"tensor argument 0 must be torch.float32 \[32, 64\]"):
        g(torch.zeros(16, 64, device="cuda"))


@requires_cuda
@pytest.mark.cuda
def test_replay_after_the_manager_grew_is_refused():
    graphed_recipe, _ = _recipes(amax_history_len=5)
    x = torch.zeros(32, 64, device="cuda")
    g = make_graphed_callables(_linear_model(), (x,), fp8_enabled=True, fp8_recipe=graphed_recipe)
    mgr = fp8ext.get_scaling_manager(graphed_recipe, "cuda")
    for i in range(mgr.capacity):
        mgr.register(f"late{i}")
    with pytest.raises(RuntimeError, match="prepare_fp8"):
        g(x)
