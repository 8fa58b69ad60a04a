"""Two models trained in one process with delayed scaling never change each other's training: their recipes may
compare equal (one FP8ScalingManager holds both models' slots) or be the same object, they may take turns in one
thread (actor and critic, teacher and student, a GAN's two halves) or train in two threads; each model's weights
and scaling state equal those of training it alone, bit for bit."""

import copy
import threading

import pytest
import torch
from torch import nn

import fp8ext
from conftest import DEVICES


def model(seed: int, device: str = "cpu", width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(fp8ext.Linear(width, 64), nn.GELU(), fp8ext.Linear(64, width)).to(device)


def batches(seed: int, steps: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    # a growing input scale: every step's amaxes differ, so a history moved by another model's step shows
    return [(torch.randn(16, 32, generator=g) * (1 + 3 * i)).to(device) for i in range(steps)]


class Trainer:
    """One model, its optimizer, its data and its recipe: step(i) is one training step."""

    def __init__(self, net: nn.Module, recipe, seed: int, steps: int):
        device = next(net.parameters()).device
        self.net, self.recipe, self.xs = net, recipe, batches(seed, steps, device)
        self.opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(self, i: int) -> None:
        with fp8ext.fp8_autocast(fp8_recipe=self.recipe):
            loss = self.net(self.xs[i]).float().square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def result(self):
        with fp8ext.fp8_autocast(fp8_recipe=self.recipe):
            pass  # the boundary after the last step: its update
        params = {k: v.detach().clone() for k, v in self.net.named_parameters()}
        states = {k: m.fp8_state() for k, m in self.net.named_modules() if isinstance(m, fp8ext.Linear)}
        return params, states


def assert_same(got, want, what):
    (pg, sg), (pw, sw) = got, want
    for k in pw:
        assert torch.equal(pg[k], pw[k]), f"{what}: parameter {k} differs from training alone " \
                                          f"(max {(pg[k] - pw[k]).abs().max().item():.3g})"
    for k in sw:
        for key in ("scale", "scale_inv", "amax_history", "steps"):
            assert torch.equal(torch.as_tensor(sg[k][key]), torch.as_tensor(sw[k][key])), \
                f"{what}: scaling state {key} of {k} differs from training alone"


STEPS = 6


def alone(seed: int, recipe):
    t = Trainer(model(seed), recipe, seed, STEPS)
    for i in range(STEPS):
        t.step(i)
    return t.result()


RECIPES = {
    "equal recipes": lambda: (fp8ext.DelayedScaling(amax_history_len=3), fp8ext.DelayedScaling(amax_history_len=3)),
    "one recipe": lambda: (lambda r: (r, r))(fp8ext.DelayedScaling(amax_history_len=3)),
    "interval 2": lambda: (fp8ext.DelayedScaling(amax_history_len=3, interval=2),
                           fp8ext.DelayedScaling(amax_history_len=3, interval=2)),
    "most_recent": lambda: (fp8ext.DelayedScaling(amax_compute_algo="most_recent"),
                            fp8ext.DelayedScaling(amax_compute_algo="most_recent")),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipes", RECIPES, ids=list(RECIPES))
def test_two_models_taking_turns_train_as_each_alone(recipes, device):
    r1, r2 = RECIPES[recipes]()
    a, b = Trainer(model(1, device), r1, 1, STEPS), Trainer(model(2, device), r2, 2, STEPS)
    assert a.net[0].scaling_manager(r1) is b.net[0].scaling_manager(r2), "the models share one manager"
    for i in range(STEPS):
        a.step(i)
        b.step(i)
        if i % 2:  # and sometimes model 2 twice: the turns need not alternate
            b.step(i)
            a.step(i)
    # what each model saw: a's and b's step sequences; replay them alone
    order_a = [i for i in range(STEPS) for _ in range(2 if i % 2 else 1)]
    ta = Trainer(model(1, device), copy.copy(r1), 1, STEPS)
    for i in order_a:
        ta.step(i)
    tb = Trainer(model(2, device), copy.copy(r2), 2, STEPS)
    for i in order_a:
        tb.step(i)
    assert_same(a.result(), ta.result(), f"model 1 ({recipes}, turns with model 2)")
    assert_same(b.result(), tb.result(), f"model 2 ({recipes}, turns with model 1)")


def test_two_models_in_two_threads_train_as_each_alone():
    r1, r2 = fp8ext.DelayedScaling(amax_history_len=3), fp8ext.DelayedScaling(amax_history_len=3)
    want1, want2 = alone(1, r1), alone(2, r2)
    trainers = [Trainer(model(1), r1, 1, STEPS), Trainer(model(2), r2, 2, STEPS)]
    barrier = threading.Barrier(2)
    errors = []

    def run(t: Trainer, first: bool) -> None:
        try:
            for i in range(STEPS):
                # interleave on purpose: one thread's step boundary falls between the other's forward and backward
                barrier.wait()
                if first:
                    with fp8ext.fp8_autocast(fp8_recipe=t.recipe):
                        loss = t.net(t.xs[i]).float().square().mean()
                    barrier.wait()
                    barrier.wait()
                    loss.backward()
                else:
                    barrier.wait()
                    with fp8ext.fp8_autocast(fp8_recipe=t.recipe):
                        loss = t.net(t.xs[i]).float().square().mean()
                    barrier.wait()
                    loss.backward()
                t.opt.step()
                t.opt.zero_grad()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(t, k == 0)) for k, t in enumerate(trainers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    results = []
    for t in trainers:  # each thread's last update: at its own next boundary
        results.append(t.result())
    assert_same(results[0], want1, "model 1 (trained in a thread beside model 2)")
    assert_same(results[1], want2, "model 2 (trained in a thread beside model 1)")


def test_a_failed_step_of_one_model_keeps_the_other_models_amaxes():
    r = fp8ext.DelayedScaling(amax_history_len=3)
    want = alone(1, r)
    a, b = Trainer(model(1), r, 1, STEPS), Trainer(model(2), r, 2, STEPS)
    for i in range(STEPS):
        a.step(i)
        with pytest.raises(RuntimeError, match="on purpose"):
            with fp8ext.fp8_autocast(fp8_recipe=r):
                b.net(b.xs[i])
                raise RuntimeError("a step that fails on purpose")
    assert_same(a.result(), want, "model 1 beside a model whose steps fail")


def test_the_update_touches_only_the_recorded_slots():
    mgr = fp8ext.FP8ScalingManager(fp8ext.DelayedScaling(amax_history_len=2))
    for n in "abc":
        mgr.update_amax(n, 4.0)
    mgr.update()
    before = (mgr.amax_history.clone(), mgr.scale.clone())
    mgr.update_amax("b", 8.0)
    mgr.update(slots=[mgr.slot("b")])
    b, others = mgr.slot("b"), [mgr.slot("a"), mgr.slot("c")]
    assert torch.equal(mgr.amax_history[others], before[0][others]), "slots not named must keep their histories"
    assert torch.equal(mgr.scale[others], before[1][others])
    assert mgr.amax_history[b].tolist() == [0.0, 8.0] and mgr.scale[b].item() == 448.0 / 8.0
    assert (mgr.slot_steps(b), mgr.slot_steps(mgr.slot("a"))) == (2, 1)


def test_a_model_prepared_for_compile_beside_them_changes_nothing():
    """prepare_fp8 (for torch.compile) of a third model with an equal recipe: its slots are recorded at every step's
    exit, not the whole manager, so the two eager models still train as each alone."""
    r = fp8ext.DelayedScaling(amax_history_len=3)
    third = model(3)
    fp8ext.prepare_fp8(third, fp8ext.DelayedScaling(amax_history_len=3))
    want = alone(1, r)
    a, b = Trainer(model(1), r, 1, STEPS), Trainer(model(2), r, 2, STEPS)
    for i in range(STEPS):
        a.step(i)
        b.step(i)
    assert_same(a.result(), want, "model 1 beside a prepared model")
    del third
