"""FSDP2's FP8 all-gather (fp8ext/modules/fsdp.py), over gloo on the CPU: the same training as FSDP2's high-precision
all-gather, bit for bit, with one byte per weight element on the wire; and FP8Linear with a weight that arrives cast.

The fixture runs this file under torch.distributed.run; each rank trains a small model of FP8Linear layers sharded
with fully_shard (weights gathered in high precision, then in FP8) and writes what it saw to a JSON file."""
import gc
import json
import os
import sys

import pytest
import torch

STEPS = 4


def _model(seed: int):
    import fp8ext
    torch.manual_seed(seed)
    return torch.nn.Sequential(fp8ext.FP8Linear(64, 128), torch.nn.GELU(), fp8ext.FP8Linear(128, 64),
                               fp8ext.FP8Linear(64, 32, bias=False))


def _train(recipe, fp8_gather: bool, precompute: bool, mesh, sent: list, reduces: list, param_dtype=None):
    """(losses, each parameter after training (DTensor.full_tensor()), the all-gather bytes this rank sent per step,
    the all-reduces it made per step). param_dtype: MixedPrecisionPolicy's (gradients reduced in float32)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp8ext
    from fp8ext.modules.fsdp import enable_fp8_all_gather, precompute_fp8_weight_scales
    # a model of an earlier run in this process may still hold scaling slots of the same recipe until the garbage
    # collector frees it (its layers sit in reference cycles); each run starts from the same, empty state
    gc.collect()
    model = _model(0)
    if fp8_gather:
        enable_fp8_all_gather(model, recipe)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, per_step, reduces_per_step = [], [], []
    group = mesh.get_group()
    for _ in range(STEPS):
        before, reduces_before = sum(sent), len(reduces)
        if precompute:
            precompute_fp8_weight_scales(model)
        x = torch.randn(32, 64, generator=gen)
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        per_step.append(sum(sent) - before)
        reduces_per_step.append(len(reduces) - reduces_before)
    params = [(name, p.detach().full_tensor().flatten().tolist()) for name, p in model.named_parameters()]
    return losses, params, per_step, reduces_per_step


def _worker(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fp8ext
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sent, gather, reduces, all_reduce = [], dist.all_gather_single, [], dist.all_reduce

    def recording_gather(output_tensor, input_tensor, *args, **kwargs):  # FSDP2's all-gather (DefaultAllGather)
        sent.append(input_tensor.numel() * input_tensor.element_size())
        return gather(output_tensor, input_tensor, *args, **kwargs)

    def recording_all_reduce(tensor, *args, **kwargs):
        reduces.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_gather_single, dist.all_reduce = recording_gather, recording_all_reduce
    result = {}
    for name, recipe in (("current", fp8ext.CurrentScaling()), ("delayed", fp8ext.DelayedScaling())):
        runs = {"hp": (False, False), "fp8": (True, True)}
        if name == "current":
            runs["fp8_no_precompute"] = (True, False)
        result[name] = {run: _train(recipe, fp8, pre, mesh, sent, reduces) for run, (fp8, pre) in runs.items()}
    current = fp8ext.CurrentScaling()
    result["bf16"] = {run: _train(current, fp8, fp8, mesh, sent, reduces, torch.bfloat16)
                      for run, fp8 in (("hp", False), ("fp8", True))}
    result["delayed_without_fp8_group"] = _error_without_fp8_group(mesh)
    result["stale_precomputed_scale"] = _error_of_a_stale_scale(mesh)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _error_without_fp8_group(mesh) -> str:
    """The error of an FP8-gathered DelayedScaling forward whose fp8_autocast has no fp8_group (every rank raises
    before its all-gather)."""
    from torch.distributed.fsdp import fully_shard

    import fp8ext
    from fp8ext.modules.fsdp import enable_fp8_all_gather
    recipe = fp8ext.DelayedScaling()
    model = enable_fp8_all_gather(_model(0), recipe)
    fully_shard(model, mesh=mesh)
    try:
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            model(torch.randn(16, 64))
    except ValueError as e:
        return str(e)
    return ""


def _error_of_a_stale_scale(mesh) -> str:
    """The error of a CurrentScaling step whose precomputed scales are older than the last optimizer step."""
    from torch.distributed.fsdp import fully_shard

    import fp8ext
    from fp8ext.modules.fsdp import enable_fp8_all_gather, precompute_fp8_weight_scales
    recipe = fp8ext.CurrentScaling()
    model = enable_fp8_all_gather(_model(0), recipe)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    precompute_fp8_weight_scales(model)
    try:
        for _ in range(2):
            with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
                model(torch.randn(16, 64)).sum().backward()
            opt.step()
    except RuntimeError as e:
        return str(e)
    return ""


@pytest.fixture(scope="module", params=[2, 3], ids=["2 processes", "3 processes"])
def ranks(request, tmp_path_factory):
    """Each rank's results (see _worker) from `request.param` processes. With 3, every weight's rows split
    unevenly (128 = 43 + 43 + 42), so FSDP2 pads the last shard."""
    from conftest import run_ranks  # here, not at the top: the ranks run this file as a script
    out = tmp_path_factory.mktemp("fsdp_fp8")
    run_ranks(__file__, out, request.param)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(request.param)]


# ---- one process: FP8Linear with a weight that arrives cast ------------------------------------------------

def _gathered_twin(layer):
    """A copy of `layer` whose weight is what FSDP2's FP8 all-gather would hand it under CurrentScaling."""
    import copy

    import fp8ext
    from fp8ext.modules.fsdp import FP8GatheredWeight
    twin = copy.deepcopy(layer)
    scale, scale_inv = fp8ext.scale_from_amax(fp8ext.amax(layer.weight.detach()), fp8ext.E4M3)
    q = fp8ext.quantize(layer.weight.detach(), fp8ext.E4M3, scale)
    twin.weight = torch.nn.Parameter(FP8GatheredWeight(q, scale_inv, fp8ext.E4M3, layer.weight.dtype))
    return twin


def test_fp8linear_computes_with_a_weight_gathered_in_fp8_as_with_its_own_cast():
    import fp8ext
    torch.manual_seed(0)
    layer = fp8ext.FP8Linear(64, 32)
    twin = _gathered_twin(layer)
    x = torch.randn(48, 64)
    results = []
    for m in (layer, twin):
        xi = x.clone().requires_grad_()
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.CurrentScaling()):
            y = m(xi)
        y.float().pow(2).mean().backward()
        results.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
    for what, a, b in zip(("output", "input gradient", "weight gradient", "bias gradient"), *results):
        assert torch.equal(a, b), f"the {what} equals the layer's with its own weight cast, bit for bit"
    assert type(results[1][2]) is torch.Tensor and results[1][2].dtype == torch.float32, \
        "the weight's gradient is a plain float32 tensor of its shape (what FSDP2 reduce-scatters)"


def test_a_weight_gathered_in_fp8_refuses_high_precision_and_other_recipes():
    import fp8ext
    twin = _gathered_twin(fp8ext.FP8Linear(64, 32))
    x = torch.randn(16, 64)
    with pytest.raises(NotImplementedError, match="all-gathered in FP8"):
        twin(x)  # outside fp8_autocast: its high-precision values were never gathered
    with pytest.raises(ValueError, match="pass enable_fp8_all_gather the recipe fp8_autocast uses"):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.Float8RowwiseScaling()):
            twin(x)


def test_enable_fp8_all_gather_takes_per_tensor_recipes_only():
    import fp8ext
    from fp8ext.modules.fsdp import FP8ShardedWeight, enable_fp8_all_gather
    model = torch.nn.Sequential(fp8ext.FP8Linear(64, 32), torch.nn.Linear(32, 16))
    with pytest.raises(TypeError, match="CurrentScaling or DelayedScaling"):
        enable_fp8_all_gather(model, fp8ext.Float8RowwiseScaling())
    before = model[0].weight.detach().clone()
    enable_fp8_all_gather(model, fp8ext.CurrentScaling())
    assert isinstance(model[0].weight, torch.nn.Parameter) and isinstance(model[0].weight, FP8ShardedWeight)
    assert torch.equal(model[0].weight.hp, before), "the same values"
    assert type(model[1].weight) is torch.nn.Parameter, "nn.Linear is left alone"


# ---- FSDP2 over gloo, 2 and 3 processes ---------------------------------------------------------------------------

# the model's parameters (_model): three weights [rows, cols] and two biases [rows]
WEIGHTS, BIASES = ((128, 64), (64, 128), (32, 64)), (128, 64)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_all_gather_trains_as_the_high_precision_all_gather_bit_for_bit(ranks, recipe):
    for r, result in enumerate(ranks):
        hp, fp8 = result[recipe]["hp"], result[recipe]["fp8"]
        assert fp8[0] == hp[0], f"rank {r}: the losses of the FP8 all-gather equal the high-precision one's"
        assert fp8[1] == hp[1], f"rank {r}: every parameter after {STEPS} steps equals the high-precision one's"


def test_precomputed_current_scales_take_one_all_reduce_per_step_for_all_weights(ranks):
    """The weights' amaxes in one all-reduce per step (torchao's precompute_float8_dynamic_scale_for_fsdp)."""
    for r, result in enumerate(ranks):
        assert result["current"]["fp8"][3] == [1] * STEPS, f"rank {r}: one all-reduce of the three weights' amaxes"
        assert result["current"]["hp"][3] == [0] * STEPS, f"rank {r}: no all-reduce in the high-precision run"


def test_current_scaling_without_precomputed_scales_reduces_each_amax_at_each_gather(ranks):
    """Each gather (the forward's, the backward's after resharding) all-reduces its weight's amax: the same scale
    twice, since the weight changes only at the optimizer's step."""
    for r, result in enumerate(ranks):
        hp, fp8 = result["current"]["hp"], result["current"]["fp8_no_precompute"]
        assert fp8[0] == hp[0] and fp8[1] == hp[1], f"rank {r}: the same training without precompute_fp8_weight_scales"
        assert fp8[3] == [2 * len(WEIGHTS)] * STEPS, f"rank {r}: one all-reduce per weight and gather"


def test_a_precomputed_scale_the_optimizer_made_stale_raises_on_every_rank(ranks):
    for r, result in enumerate(ranks):
        assert "changed since precompute_fp8_weight_scales()" in result["stale_precomputed_scale"], \
            f"rank {r}: a scale precomputed before the last optimizer step is refused, on every rank alike"


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_all_gather_sends_one_byte_per_weight_element(ranks, recipe):
    """Each step gathers every parameter twice (forward, then backward after resharding), each rank its shard of
    the rows (padded to ceil(rows / processes)); float32 weights cost 4 bytes an element in high precision and 1
    in FP8, biases 4 either way."""
    world = len(ranks)
    weights = sum(-(-rows // world) * cols for rows, cols in WEIGHTS)
    biases = sum(-(-rows // world) for rows in BIASES)
    for r, result in enumerate(ranks):
        hp, fp8 = result[recipe]["hp"][2], result[recipe]["fp8"][2]
        assert hp == [2 * 4 * (weights + biases)] * STEPS, f"rank {r}: float32 all-gather bytes"
        assert fp8 == [2 * (weights + 4 * biases)] * STEPS, f"rank {r}: FP8 all-gather bytes"


def test_bfloat16_parameters_gather_in_fp8_and_train_close_to_a_bfloat16_gather(ranks):
    """With MixedPrecisionPolicy(param_dtype=torch.bfloat16) the shard is cast to FP8 from its float32 values (one
    rounding), the high-precision gather's from their bfloat16 copy (two): close, not the same bytes."""
    world = len(ranks)
    weights = sum(-(-rows // world) * cols for rows, cols in WEIGHTS)
    biases = sum(-(-rows // world) for rows in BIASES)
    for r, result in enumerate(ranks):
        hp, fp8 = result["bf16"]["hp"], result["bf16"]["fp8"]
        assert hp[2] == [2 * 2 * (weights + biases)] * STEPS, f"rank {r}: bfloat16 all-gather bytes"
        assert fp8[2] == [2 * (weights + 2 * biases)] * STEPS, f"rank {r}: FP8 weights, bfloat16 biases"
        assert fp8[0] == pytest.approx(hp[0], rel=0.05), f"rank {r}: the losses stay close"


def test_delayed_scaling_refuses_to_gather_in_fp8_without_an_fp8_group(ranks):
    for r, result in enumerate(ranks):
        assert "give fp8_autocast an fp8_group" in result["delayed_without_fp8_group"], \
            f"rank {r}: without max-reduced amaxes the ranks' shards would be cast with different scales"


if __name__ == "__main__":  # one rank of the fixture's torch.distributed.run
    _worker(sys.argv[1])
