"""The training API in ordinary training loops: checkpoints and resuming, inference mode, torch.compile without
prepare_fp8, weights changed in every usual way, edge shapes, slot lifetimes, torch.autocast, debug checks."""

import copy
import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8ext
from conftest import DEVICES, requires_cuda


def mlp(seed=0, device="cpu", dtype=torch.float32):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
    return fp8ext.convert_to_fp8(m.to(device=device, dtype=dtype))


def batch(i, device="cpu"):
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(24, 32, generator=g).to(device) * (1 + i % 3)


# ---- resuming from a checkpoint ------------------------------------------------------------------

RUN_SCRIPT = textwrap.dedent("""
    import json, sys, torch, fp8ext
    sys.path[:0] = [{tests!r}, {tests_root!r}]
    from test_training_loops import mlp, train_steps, RESUME_RECIPE
    recipe = fp8ext.DelayedScaling(**RESUME_RECIPE, interval={interval})
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if {path!r}:
        ckpt = torch.load({path!r}, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    print(json.dumps(train_steps(model, opt, recipe, range({k}, {n}))))
""")
RESUME_RECIPE = dict(amax_history_len=3, margin=1)  # used by this test only: its manager starts fresh


def train_steps(model, opt, recipe, steps):
    losses = []
    for i in steps:
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            loss = model(batch(i)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    return losses


def run_in_new_process(interval, path, k, n):
    here = os.path.dirname(__file__)
    script = RUN_SCRIPT.format(tests=here, tests_root=os.path.dirname(here), interval=interval, path=path, k=k, n=n)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("interval", [1, 2])
def test_a_run_resumed_in_a_new_process_gives_the_losses_of_the_run_that_never_stopped(tmp_path, interval):
    k, n = 3, 7
    straight = run_in_new_process(interval, "", 0, n)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = train_steps(model, opt, fp8ext.DelayedScaling(**RESUME_RECIPE, interval=interval), range(k))
    path = str(tmp_path / "ckpt.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    resumed = run_in_new_process(interval, path, k, n)
    assert first == straight[:k]
    assert resumed == straight[k:], "a resumed run must repeat the uninterrupted run's losses bit for bit"


def test_saved_fp8_state_is_what_the_next_step_uses():
    recipe = fp8ext.DelayedScaling(amax_history_len=4)
    layer = fp8ext.FP8Linear(32, 16)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        layer(batch(0)).sum().backward()
    saved = layer.fp8_state()  # the update of this step's amaxes is still pending
    with fp8ext.fp8_autocast(fp8_recipe=recipe):  # entering runs it
        live = layer._manager.slots_state(layer._slot_names())
    for key in ("amax_history", "scale", "scale_inv"):
        assert torch.equal(saved[key], live[key]), key
    assert (saved["scale"] != 1).all(), "the scales moved off their initial 1 after the update"


def test_loading_fp8_state_between_forward_and_backward_of_other_layers():
    """Loading writes the scaling buffers; backward of layers that ran before must not mind."""
    recipe = fp8ext.DelayedScaling(amax_history_len=4)
    src = mlp(1)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        src(batch(0)).sum().backward()
    sd = src[2].state_dict()
    model = mlp(2)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        y = model(batch(1))
        model[2].load_state_dict(sd)
    y.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_deepcopy_is_a_new_layer_with_the_same_fp8_state():
    recipe = fp8ext.DelayedScaling(amax_history_len=4)
    layer = fp8ext.FP8Linear(32, 16)
    for i in range(2):
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            layer(batch(i)).sum().backward()
    twin = copy.deepcopy(layer)
    assert twin._slot_names() != layer._slot_names(), "a copy must not share the original's scaling slots"
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        a, b = layer(batch(5)), twin(batch(5))
    assert torch.equal(a, b), "the copy scales as the original does"


# ---- inference mode ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_training_after_evaluation_under_inference_mode(device):
    recipe = fp8ext.DelayedScaling(amax_history_len=5)
    model = mlp(device=device)
    with torch.inference_mode(), fp8ext.fp8_autocast(fp8_recipe=recipe):
        model(batch(0, device))
    for i in range(2):
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            model(batch(i, device)).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_a_recipe_first_used_under_inference_mode_serves_later_training(device):
    recipe = fp8ext.DelayedScaling(amax_history_len=6)  # a recipe no other test uses: a new manager
    with torch.inference_mode(), fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling(amax_history_len=6)):
        mlp(device=device)(batch(0, device))
    mgr = fp8ext.get_scaling_manager(recipe, device)
    assert not any(t.is_inference() for t in (mgr.amax_history, mgr.scale, mgr.scale_inv))
    model = mlp(3, device=device)
    for i in range(2):
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            model(batch(i, device)).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


# ---- torch.compile without prepare_fp8 ------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_without_prepare_fp8_trains_like_eager(device):
    torch._dynamo.reset()
    recipe = fp8ext.DelayedScaling(amax_history_len=3)
    eager, compiled_model = mlp(device=device), mlp(device=device)
    compiled = torch.compile(compiled_model, backend="inductor" if device == "cuda" else "aot_eager")
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, compiled_model)]
    for i in range(5):
        with fp8ext.fp8_autocast(fp8_recipe=recipe):  # one autocast: one scale update per step for both
            losses = [m(batch(i, device)).square().mean() for m in (eager, compiled)]
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        if device == "cpu":
            assert losses[1].item() == losses[0].item(), f"step {i}: compiled {losses[1].item()} vs eager"
        else:
            assert losses[1].item() == pytest.approx(losses[0].item(), rel=2e-2), f"step {i}"
    grad_scales = [m._manager.get_scale(m._slot_names()[2]).item() for m in compiled_model if
                   isinstance(m, fp8ext.FP8Linear)]
    assert all(s != 1.0 for s in grad_scales), "compiled backward recorded the gradients' amaxes"


# ---- a weight changed in any usual way is recast ---------------------------------------------------

def _change(how, layer, new):
    if how == "data.copy_":
        layer.weight.data.copy_(new)
    elif how == "copy_ under no_grad":
        with torch.no_grad():
            layer.weight.copy_(new)
    elif how == "optimizer step":
        opt = torch.optim.SGD([layer.weight], lr=1.0)
        layer.weight.grad = layer.weight.detach() - new
        opt.step()
    elif how == "load_state_dict":
        layer.load_state_dict({"weight": new, "bias": layer.bias.detach().clone()})
    elif how == "data assignment":
        layer.weight.data = new.clone()


@pytest.mark.parametrize("is_first_microbatch", [None, True])
@pytest.mark.parametrize("how", ["data.copy_", "copy_ under no_grad", "optimizer step", "load_state_dict",
                                 "data assignment"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_changed_weight_is_never_served_stale(device, how, is_first_microbatch):
    recipe = fp8ext.CurrentScaling()  # the output depends on the weight and x only
    layer = fp8ext.FP8Linear(32, 16, device=device)
    new = torch.randn(16, 32, device=device)
    x = batch(0, device)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        layer(x, is_first_microbatch=is_first_microbatch)
    _change(how, layer, new)
    if how != "data.copy_":  # a promise to reuse is kept only while the weight provably did not change
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            reused = layer(x, is_first_microbatch=False if is_first_microbatch else None)
    fresh = fp8ext.FP8Linear(32, 16, device=device)
    fresh.load_state_dict(layer.state_dict())
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        want = fresh(x)
        got = layer(x, is_first_microbatch=is_first_microbatch)
    assert torch.equal(got, want), f"the weight changed by {how} must be recast"
    if how != "data.copy_":
        assert torch.equal(reused, want)


# ---- edge shapes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(0, 32), (2, 0, 32)])
@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_batch_gives_an_empty_output_and_zero_gradients(device, shape, monkeypatch):
    import fp8ext.linear_autograd as L
    monkeypatch.setattr(L, "_gemm", lambda *a, **k: pytest.fail("no GEMM for an empty batch"))
    layer = fp8ext.FP8Linear(32, 16, device=device)
    x = torch.randn(shape, device=device, requires_grad=True)
    with fp8ext.fp8_autocast():
        y = layer(x)
    assert y.shape == (*shape[:-1], 16) and y.dtype == x.dtype
    y.sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
    assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("input_dtype, weight_dtype", [(torch.float64, torch.float32), (torch.float32, torch.float64),
                                                        (torch.int64, torch.float32)])
def test_an_input_or_weight_fp8_cannot_take_raises_naming_the_layer(input_dtype, weight_dtype):
    layer = fp8ext.FP8Linear(32, 16, params_dtype=weight_dtype)
    x = torch.ones(4, 32, dtype=input_dtype)
    with fp8ext.fp8_autocast(), pytest.raises(TypeError, match=r"FP8Linear\(32, 16\): in FP8 the input and the weight "
                                                               r"must be float32, bfloat16 or float16"):
        layer(x)


def test_a_0d_input_raises_what_nn_linear_raises():
    layer = fp8ext.FP8Linear(32, 16)
    with pytest.raises(Exception) as want:
        nn.Linear(32, 16)(torch.tensor(1.0))
    with fp8ext.fp8_autocast(), pytest.raises(type(want.value)) as got:
        layer(torch.tensor(1.0))
    assert str(got.value) == str(want.value)


def test_a_1d_input_gives_a_1d_output():
    layer = fp8ext.FP8Linear(32, 16)
    x = torch.randn(32)
    with fp8ext.fp8_autocast():
        y = layer(x)
    assert y.shape == (16,)
    assert F.cosine_similarity(y, F.linear(x, layer.weight, layer.bias), dim=0) > 0.99


def test_meta_tensors_give_the_output_shape():
    layer = fp8ext.FP8Linear(32, 16, device="meta")
    with fp8ext.fp8_autocast():
        y = layer(torch.empty(4, 7, 32, device="meta", dtype=torch.bfloat16))
    assert y.device.type == "meta" and y.shape == (4, 7, 16) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("fn", [lambda t: fp8ext.quantize(t), lambda t: fp8ext.amax(t),
                                lambda t: fp8ext.cast_transpose(t), lambda t: fp8ext.quantize_rowwise(t)])
def test_casts_of_meta_tensors_raise_naming_the_function(fn):
    with pytest.raises(ValueError, match=r"\w+\(\): x is on meta"):
        fn(torch.empty(16, 16, device="meta"))


def test_gemm_of_meta_tensors_raises_naming_the_function():
    a = torch.empty(16, 32, device="meta", dtype=torch.float8_e4m3fn)
    one = torch.ones((), device="meta")
    with pytest.raises(ValueError, match=r"gemm\(\): a is on meta"):
        fp8ext.gemm(a, a, a_scale_inv=one, b_scale_inv=one)


# ---- scaling slots have a lifetime ---------------------------------------------------------------------

def test_slot_names_are_unique_and_a_new_layer_never_inherits_a_dead_layers_scale():
    recipe = fp8ext.DelayedScaling(amax_history_len=2, margin=3)
    seen = set()
    for i in range(30):
        layer = fp8ext.FP8Linear(32, 16)
        names = layer._slot_names()
        assert not seen & set(names), "slot names are never reused"
        seen |= set(names)
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            mgr, views = layer._manager_views(recipe)
            assert all(v[0].item() == 1.0 for v in views), f"layer {i} starts with scale 1"
            layer(batch(i) * 100).sum().backward()
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            pass  # the update moves the scales off 1
        del layer, views  # freed by reference counting: no cycle keeps a layer alive


def test_dropped_models_release_their_slots():
    recipe = fp8ext.DelayedScaling(amax_history_len=2, margin=2)
    for i in range(40):
        model = mlp(i)
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            model(batch(i)).sum().backward()
        del model
    gc.collect()
    mgr = fp8ext.get_scaling_manager(recipe, "cpu")
    assert mgr.num_slots == 0, "every layer was dropped"
    assert mgr.capacity <= 64, f"buffers grew to {mgr.capacity} slots for 9 live slots at a time"


def test_gradient_amaxes_land_in_the_buffers_when_the_manager_grows_between_forward_and_backward():
    recipe = fp8ext.DelayedScaling(amax_history_len=2, margin=4)  # a fresh manager: 64 slots to start with
    torch.manual_seed(0)
    layers = [fp8ext.FP8Linear(32, 32) for _ in range(30)]  # 90 slots, registered during the first forward
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        loss = sum(layer(batch(0)).square().sum() for layer in layers)
    mgr = layers[0]._manager
    assert mgr.generation > 0, "the manager grew during the forward"
    loss.backward()
    g_amax = [mgr.amax_history[mgr.slot(m._slot_names()[2]), 0].item() for m in layers]
    assert all(a > 0 for a in g_amax), f"gradient amaxes not recorded for layers {[i for i, a in enumerate(g_amax) if a <= 0]}"


# ---- torch.autocast ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [True, False])
def test_inside_torch_autocast_the_output_has_the_autocast_dtype(fp8):
    layer = fp8ext.FP8Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8ext.fp8_autocast(enabled=fp8):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize("norm", [fp8ext.RMSNorm, fp8ext.LayerNorm])
def test_norms_inside_torch_autocast_return_the_autocast_dtype(norm):
    m = norm(32)
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, m(x).to(torch.bfloat16)), "computed in float32, rounded once to the autocast dtype"


# ---- debug checks ------------------------------------------------------------------------------------

@pytest.fixture
def debug_checks():
    fp8ext.set_debug_checks(True)
    yield
    fp8ext.set_debug_checks(False)


def test_debug_checks_report_non_finite_inputs_naming_the_argument(debug_checks):
    x = torch.randn(16, 32)
    x[3, 4] = float("nan")
    with pytest.raises(ValueError, match=r"quantize\(\): x holds 1 NaN"):
        fp8ext.quantize(x)
    layer = fp8ext.FP8Linear(32, 16)
    with fp8ext.fp8_autocast(), pytest.raises(ValueError, match=r"FP8Linear\(\): input holds 1 NaN"):
        layer(x)


def test_without_debug_checks_nan_input_passes_through():
    x = torch.randn(16, 32)
    x[3, 4] = float("nan")
    assert fp8ext.quantize(x).float().isnan().sum() == 1


def test_fp8ext_debug_environment_variable_turns_the_checks_on():
    env = dict(os.environ, FP8EXT_DEBUG="1")
    out = subprocess.run([sys.executable, "-c", "import fp8ext; print(fp8ext.debug_checks_enabled())"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


@requires_cuda
@pytest.mark.cuda
def test_debug_checks_catch_bad_device_scales(debug_checks):
    x = torch.randn(16, 32, device="cuda")
    bad = torch.tensor(float("nan"), device="cuda")
    with pytest.raises(ValueError, match=r"quantize\(\): scale must be finite and positive"):
        fp8ext.quantize(x, fp8ext.E4M3, bad)
    q = fp8ext.quantize(x)
    one = torch.ones((), device="cuda")
    with pytest.raises(ValueError, match=r"gemm\(\): b_scale_inv must be finite and positive"):
        fp8ext.gemm(q, q, a_scale_inv=one, b_scale_inv=-one)
    fp8ext.set_debug_checks(False)
    fp8ext.quantize(x, fp8ext.E4M3, bad)  # unchecked on the device without debug checks: no sync, no error
