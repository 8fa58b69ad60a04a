"""FP8 attention (fp8ext.DotProductAttention under a recipe with fp8_dpa=True, the CPU emulation engine) with DDP and
FSDP2 over gloo, two processes on the CPU.

The fixture runs this file under torch.distributed.run. Each rank trains fp8ext's `tiny` Transformer (FP8 linear
layers and FP8 attention) for a few SGD steps on its half of each global batch, once wrapped in
DistributedDataParallel and once sharded with fully_shard (each block, then the root); rank 0 also trains the same
model alone on the same global batches. Each rank saves what it saw (torch.save) for the tests to compare."""
import os
import sys

import pytest
import torch

STEPS = 3
BATCH, SEQ = 2, 32  # per rank: the global batch is 2 * BATCH sequences
LR = 0.1
RECIPES = ("delayed", "current")


def _recipe(name: str):
    import fp8ext
    if name == "delayed":
        return fp8ext.DelayedScaling(fp8_dpa=True, amax_history_len=4)
    return fp8ext.CurrentScaling(fp8_dpa=True)


def _global_batches():
    """The STEPS global batches [2 * BATCH, SEQ + 1] of token ids, the same in every process."""
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (2 * BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _model():
    from fp8ext.models.transformer import Transformer, preset
    torch.manual_seed(0)
    return Transformer(preset("tiny"))


def _snapshot(model) -> dict:
    """Every parameter as a plain float32 tensor (DTensors gathered whole)."""
    out = {}
    for name, p in model.named_parameters():
        p = p.detach()
        out[name.removeprefix("module.")] = (p.full_tensor() if hasattr(p, "full_tensor") else p).clone()
    return out


class _AttentionCalls:
    """Counts the CPU FP8 attention engine's forward calls and the backward passes through their outputs."""

    def __init__(self):
        from fp8ext.modules import attention
        self.forward = self.backward = 0
        self.engine = attention.FP8_ATTENTION_ENGINES["cpu"]
        attention.FP8_ATTENTION_ENGINES["cpu"] = self

    def __call__(self, *args, **kwargs):
        self.forward += 1
        out = self.engine(*args, **kwargs)
        if out.requires_grad:
            out.register_hook(self._backward)
        return out

    def _backward(self, grad):
        self.backward += 1

    def take(self):
        counts, self.forward, self.backward = (self.forward, self.backward), 0, 0
        return counts


def _train_parallel(recipe_name: str, mode: str, group, mesh, calls: _AttentionCalls) -> dict:
    """DDP or FSDP2 training on this rank's half of each global batch: per step the loss, the FP8 attention calls
    (forward, backward) and every full parameter after the optimizer step."""
    import torch.distributed as dist
    rank = dist.get_rank()
    recipe = _recipe(recipe_name)  # a recipe object of its own: a fresh scaling state
    model = _model()
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(wrapped.parameters(), lr=LR)
    result = {"init": _snapshot(model), "losses": [], "calls": [], "params": []}
    calls.take()
    for batch in _global_batches():
        ids = batch[rank * BATCH:(rank + 1) * BATCH]
        _, loss = wrapped(ids[:, :-1], ids[:, 1:], fp8=True, fp8_recipe=recipe, fp8_group=group)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        result["losses"].append(loss.item())
        result["calls"].append(calls.take())
        result["params"].append(_snapshot(model))
    return result


def _train_alone(recipe_name: str, micro_batches: bool, calls: _AttentionCalls) -> dict:
    """One process on the whole global batch, as _train_parallel's results after each step.

    micro_batches False: one forward and backward of all 2 * BATCH sequences (mean loss over the global batch).
    micro_batches True: each rank's half in turn, both inside one fp8_autocast (so that DelayedScaling's scales
    update once per step, from the amaxes of both halves, as the ranks' max-reduced update does), and the gradient
    g0 / 2 + g1 / 2, the sum DDP's all-reduce makes of the gradients it divided by the world size."""
    import fp8ext
    recipe = _recipe(recipe_name)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    result = {"losses": [], "calls": [], "params": []}
    calls.take()
    for batch in _global_batches():
        if not micro_batches:
            _, loss = model(batch[:, :-1], batch[:, 1:], fp8=True, fp8_recipe=recipe)
            loss.backward()
            losses = [loss.item()]
        else:
            grads, losses = [], []
            with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
                for r in range(2):
                    ids = batch[r * BATCH:(r + 1) * BATCH]
                    _, loss = model(ids[:, :-1], ids[:, 1:], fp8=True, fp8_recipe=recipe)
                    loss.backward()
                    grads.append({n: p.grad for n, p in model.named_parameters()})
                    losses.append(loss.item())
                    model.zero_grad(set_to_none=True)
            for n, p in model.named_parameters():
                p.grad = grads[0][n] / 2 + grads[1][n] / 2
        opt.step()
        opt.zero_grad(set_to_none=True)
        result["losses"].append(losses)
        result["calls"].append(calls.take())
        result["params"].append(_snapshot(model))
    return result


def _worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    calls = _AttentionCalls()
    result = {}
    for name in RECIPES:
        result[name] = {"ddp": _train_parallel(name, "ddp", dist.group.WORLD, mesh, calls),
                        "fsdp": _train_parallel(name, "fsdp", mesh.get_group(), mesh, calls)}
        if rank == 0:
            result[name]["alone"] = _train_alone(name, False, calls)
            result[name]["micro"] = _train_alone(name, True, calls)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    # DTensor's caches keep the mesh, and the mesh its gloo group, alive: drop them while the interpreter is alive
    # (as fp8ext.train.parallel.release_meshes does), so that the group's threads do not outlive it
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Each rank's results (see _worker), two processes."""
    from conftest import run_ranks  # here, not at the top: the ranks run this file as a script
    out = tmp_path_factory.mktemp("fp8_attention_distributed")
    run_ranks(__file__, out, 2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _differing(a: dict, b: dict) -> dict:
    """The parameters whose values differ, each with its largest difference."""
    return {n: (a[n] - b[n]).abs().max().item() for n in a if not torch.equal(a[n], b[n])}


def _n_layers() -> int:
    from fp8ext.models.transformer import preset
    return preset("tiny").n_layers


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_run_computes_attention_in_fp8_forward_and_backward(ranks, recipe):
    """Each block's attention goes through the CPU FP8 engine in the forward, and the backward passes through each
    of its outputs (so the gradients compared below are those of FP8 attention's backward)."""
    per_pass = (_n_layers(), _n_layers())
    for r, result in enumerate(ranks):
        for mode in ("ddp", "fsdp"):
            assert result[recipe][mode]["calls"] == [per_pass] * STEPS, f"rank {r}, {mode}"
    assert ranks[0][recipe]["alone"]["calls"] == [per_pass] * STEPS
    assert ranks[0][recipe]["micro"]["calls"] == [(2 * _n_layers(), 2 * _n_layers())] * STEPS, "one per half"


@pytest.mark.parametrize("recipe", RECIPES)
def test_ddp_keeps_the_parameters_bit_identical_across_ranks_after_every_step(ranks, recipe):
    ddp = [result[recipe]["ddp"] for result in ranks]
    for r, run in enumerate(ddp):
        assert all(torch.isfinite(torch.tensor(run["losses"]))), f"rank {r}: finite losses {run['losses']}"
    assert all(a != b for a, b in zip(ddp[0]["losses"], ddp[1]["losses"])), "the ranks trained on different data"
    assert _differing(ddp[0]["init"], ddp[1]["init"]) == {}, "the same initial parameters"
    for step in range(STEPS):
        assert _differing(ddp[0]["params"][step], ddp[1]["params"][step]) == {}, \
            f"after step {step + 1} every parameter is the same on both ranks, bit for bit"
        assert _differing(ddp[0]["params"][step], ddp[0]["init"]).keys() == ddp[0]["init"].keys(), \
            f"step {step + 1}: every parameter trained"


@pytest.mark.parametrize("recipe", RECIPES)
def test_ddp_trains_bit_for_bit_as_one_process_averaging_the_gradients_of_the_ranks_halves(ranks, recipe):
    """One process computing each rank's half of the global batch in turn, with the same FP8 scales (DelayedScaling:
    the amaxes of both halves, as fp8_group's max-reduction gives each rank; FP8 attention and CurrentScaling: each
    call's own amaxes, of the same half as the rank's) and the gradient g0 / 2 + g1 / 2 (DDP divides by the world
    size, then all-reduces): the same losses and the same parameters after every step, bit for bit. So what DDP
    all-reduces is exactly the gradient of FP8 attention's backward (and the FP8 linear layers')."""
    ddp0, ddp1, micro = ranks[0][recipe]["ddp"], ranks[1][recipe]["ddp"], ranks[0][recipe]["micro"]
    assert micro["losses"] == [list(pair) for pair in zip(ddp0["losses"], ddp1["losses"])], "each half's loss"
    for step in range(STEPS):
        assert _differing(ddp0["params"][step], micro["params"][step]) == {}, f"after step {step + 1}"


# The concatenated batch computes with other FP8 scales than the ranks' halves: FP8 attention scales Q, K, V, dO (and
# with CurrentScaling the linear layers' operands) by the amax of the whole batch, not of each half; so every FP8
# rounding falls differently. Measured on this model, one step's gradients from the whole batch differ from the
# halves' average by 10-13% (relative norm, worst parameter), about as much as FP8's gradients differ from float32's
# (10%, E5M2 keeps 2 mantissa bits); after STEPS steps the parameter updates differ by at most 15%. A gradient that
# was not averaged (the sum of the ranks', or one rank's own) changes the update by 100% or more: 0.3 tells them apart.
UPDATE_RTOL = 0.3


@pytest.mark.parametrize("recipe", RECIPES)
def test_ddp_trains_close_to_one_process_on_the_concatenated_batch(ranks, recipe):
    ddp0, ddp1, alone = ranks[0][recipe]["ddp"], ranks[1][recipe]["ddp"], ranks[0][recipe]["alone"]
    init = ddp0["init"]
    assert _differing(init, alone["params"][0]) != {}, "the single process trained"
    # the first step's loss: the same parameters, the mean of the halves' mean cross-entropies; only FP8 roundings
    assert alone["losses"][0][0] == pytest.approx((ddp0["losses"][0] + ddp1["losses"][0]) / 2, rel=1e-3)
    last, ref = ddp0["params"][-1], alone["params"][-1]
    worst = {n: ((last[n] - ref[n]).norm() / (ref[n] - init[n]).norm()).item() for n in init}
    assert max(worst.values()) < UPDATE_RTOL, f"each parameter's update after {STEPS} steps, relative: {worst}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_fsdp2_trains_bit_for_bit_as_ddp(ranks, recipe):
    """fully_shard per block and the root: each rank computes with the whole (all-gathered) weights, as DDP, and
    FSDP2 reduce-scatters the gradients it divided by the world size (gloo has no average): the same sums as DDP's
    all-reduce. The same losses on each rank, and the same full parameters after every step, bit for bit."""
    for r, result in enumerate(ranks):
        fsdp, ddp = result[recipe]["fsdp"], result[recipe]["ddp"]
        assert all(torch.isfinite(torch.tensor(fsdp["losses"]))), f"rank {r}: finite losses {fsdp['losses']}"
        assert fsdp["losses"] == ddp["losses"], f"rank {r}: the losses of DDP"
        assert _differing(fsdp["init"], ddp["init"]) == {}, f"rank {r}: the same initial parameters"
        for step in range(STEPS):
            assert _differing(fsdp["params"][step], ddp["params"][step]) == {}, f"rank {r}, after step {step + 1}"


if __name__ == "__main__":  # one rank of the fixture's torch.distributed.run
    _worker(sys.argv[1])
