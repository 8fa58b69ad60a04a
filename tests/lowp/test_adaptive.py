"""fp8ext.adaptive: fake-quantized weights against an independent numpy / ml_dtypes reference, the byte counts,
the knapsack against brute force, and plans on a small MLP and the tiny Transformer (CPU, a few seconds)."""
import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8ext
import fp8ext.adaptive as ad
from fp8ext.inference.quantize import DEFAULT_IGNORE
from fp8ext.models.transformer import Transformer, preset

ML = {"E4M3": ml_dtypes.float8_e4m3fn, "E3M2": ml_dtypes.float6_e3m2fn, "E2M3": ml_dtypes.float6_e2m3fn,
      "E2M1": ml_dtypes.float4_e2m1fn}
MAX = {"E4M3": 448.0, "E3M2": 28.0, "E2M3": 7.5, "E2M1": 6.0}
EMAX = {"E4M3": 8, "E3M2": 4, "E2M3": 2, "E2M1": 2}


def _cast(x: np.ndarray, elem: str) -> np.ndarray:
    """Round float32 values to `elem` (nearest even, saturating: clamping first is the same for these formats)."""
    return np.clip(x, -MAX[elem], MAX[elem]).astype(ML[elem]).astype(np.float64)


def reference(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """fake_quantize_weight written again from the format definitions with numpy and ml_dtypes."""
    x = w.numpy().astype(np.float32)
    n, k = x.shape
    if fmt == "bf16":
        out = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    elif fmt == "fp8":
        amax = np.abs(x).max(axis=1, keepdims=True)
        scale = np.float32(448.0) / amax                      # float32, as the scale is kept
        out = _cast((x * scale).astype(np.float32), "E4M3") * (np.float32(1) / scale).astype(np.float32)
    elif fmt.endswith("_tensor"):
        elem = {"fp8_tensor": "E4M3", "fp6_tensor": "E3M2", "fp4_tensor": "E2M1"}[fmt]
        scale = np.float32(MAX[elem]) / np.abs(x).max()
        out = _cast((x * scale).astype(np.float32), elem) * np.float32(np.float32(1) / scale)
    elif fmt == "nvfp4":
        xb = x.reshape(n, k // 16, 16).astype(np.float64)
        ts = np.float32(np.abs(x).max() / np.float32(448.0 * 6.0))
        bs = _cast((np.abs(xb).max(axis=-1) / 6.0 / ts).astype(np.float32), "E4M3")
        s = (bs * ts).astype(np.float32)
        out = (_cast((xb / s[..., None]).astype(np.float32), "E2M1") * s[..., None]).reshape(n, k)
    else:
        elem = {"mxfp8": "E4M3", "mxfp6": "E3M2", "mxfp6_e2m3": "E2M3", "mxfp4": "E2M1"}[fmt]
        xb = x.reshape(n, k // 32, 32).astype(np.float64)
        e = np.floor(np.log2(np.abs(xb).max(axis=-1))) - EMAX[elem]  # OCP MX: floor(log2 amax) - emax
        out = (_cast((xb / 2.0 ** e[..., None]).astype(np.float32), elem) * 2.0 ** e[..., None]).reshape(n, k)
    return torch.from_numpy(np.asarray(out, dtype=np.float64)).float()


@pytest.fixture(scope="module")
def gauss():
    g = torch.Generator().manual_seed(1)
    return torch.randn(96, 256, generator=g) * 0.02


@pytest.mark.parametrize("fmt", ad.WEIGHT_FORMATS)
def test_fake_quantize_weight_matches_the_independent_reference(gauss, fmt):
    w = gauss.clone()
    w[3] *= 40.0  # one row far larger: per-channel and per-tensor scales differ
    got = ad.fake_quantize_weight(w, fmt)
    assert got.dtype == torch.float32 and got.shape == w.shape
    want = reference(w, fmt)
    assert torch.equal(got, want), (fmt, (got - want).abs().max().item())


@pytest.mark.parametrize("fmt,elem", [("mxfp8", fp8ext.E4M3), ("mxfp6", fp8ext.E3M2), ("mxfp6_e2m3", fp8ext.E2M3),
                                      ("mxfp4", fp8ext.E2M1)])
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_formats_are_fp8ext_mx_bit_for_bit(gauss, fmt, elem, rule):
    want = fp8ext.dequantize_mx(*fp8ext.quantize_mx(gauss, elem, 32, rule), elem, 32)
    assert torch.equal(ad.fake_quantize_weight(gauss, fmt, scale_rule=rule), want)


def test_nvfp4_and_fp8_are_fp8ext_bit_for_bit(gauss):
    assert torch.equal(ad.fake_quantize_weight(gauss, "nvfp4"), fp8ext.dequantize_nvfp4(*fp8ext.quantize_nvfp4(gauss)))
    q, scale_inv = fp8ext.quantize_rowwise(gauss, fp8ext.E4M3)  # the library's per-row path: 448 / amax per row
    assert torch.equal(ad.fake_quantize_weight(gauss, "fp8"), fp8ext.dequantize(q, 1.0) * scale_inv[:, None])


def test_relative_error_ordering_on_gaussian_weights(gauss):
    err = {f: ((ad.fake_quantize_weight(gauss, f) - gauss).norm() / gauss.norm()).item() for f in ad.WEIGHT_FORMATS}
    assert err["fp4_tensor"] > err["fp6_tensor"] > err["fp8_tensor"] > err["bf16"] > 0
    assert err["mxfp4"] > err["mxfp6"] > err["mxfp8"] > err["bf16"]
    assert err["mxfp4"] > err["nvfp4"] > err["mxfp6"]    # smaller blocks with finer scales, still 4 bits
    assert err["mxfp6"] > err["mxfp6_e2m3"]              # one more mantissa bit wins on a Gaussian
    assert 0.08 < err["mxfp4"] < 0.2 and 0.01 < err["fp8"] < 0.04  # E2M1 about 12 %, E4M3 about 2.5 %


def test_fake_quantize_weight_keeps_device_and_zero_rows():
    w = torch.zeros(32, 64)
    w[1, 5] = 1.0
    for f in ad.WEIGHT_FORMATS:
        out = ad.fake_quantize_weight(w, f)
        assert torch.equal(out, w), f  # zeros stay zero, a single 1.0 is exact in every format
    assert torch.equal(ad.fake_quantize_weight(w.bfloat16(), "mxfp4"), w)


def test_weight_bytes_and_bits_per_weight():
    n, k = 4096, 14336
    for f, bits in ad.BITS_PER_WEIGHT.items():
        b = ad.weight_bytes((n, k), f)
        extra = {"fp8": 4 * n, "fp8_tensor": 4, "fp6_tensor": 4, "fp4_tensor": 4, "nvfp4": 4}.get(f, 0)
        assert b == n * k * bits / 8 + extra, f
    assert ad.weight_bytes((64, 64), "bf16") == 8192 and ad.weight_bytes((64, 64), "mxfp4") == 2048 + 128
    assert not ad.format_applies((64, 48), "mxfp4") and ad.format_applies((64, 48), "nvfp4")
    assert ad.format_applies((64, 40), "fp8") and not ad.format_applies((64, 40), "nvfp4")


@pytest.mark.parametrize("trial", range(30))
def test_knapsack_is_the_brute_force_optimum(trial):
    g = torch.Generator().manual_seed(trial)
    groups = int(torch.randint(2, 6, (1,), generator=g))
    options = []
    for _ in range(groups):
        k = int(torch.randint(1, 4, (1,), generator=g))
        sizes = (torch.randint(1, 40, (k,), generator=g) * 8).tolist()
        costs = torch.rand(k, generator=g).tolist()
        options.append(list(zip(sizes, costs)))
    least, most = sum(min(b for b, _ in o) for o in options), sum(max(b for b, _ in o) for o in options)
    cap = int(torch.randint(least, most + 1, (1,), generator=g))
    best = min(sum(o[j][1] for o, j in zip(options, js)) for js in itertools.product(*[range(len(o)) for o in options])
               if sum(o[j][0] for o, j in zip(options, js)) <= cap)
    choice, exact = ad._knapsack(options, cap, max_cells=100_000)
    assert exact
    assert sum(o[j][0] for o, j in zip(options, choice)) <= cap
    assert math.isclose(sum(o[j][1] for o, j in zip(options, choice)), best, rel_tol=1e-12, abs_tol=1e-12)
    # a coarse table (rounded-up sizes) is not exact but always fits the budget
    choice, exact = ad._knapsack(options, cap, max_cells=16)
    assert sum(o[j][0] for o, j in zip(options, choice)) <= cap


def test_knapsack_prefers_more_bytes_among_equal_costs():
    options = [[(4, 0.0), (8, 0.0), (16, 0.0)]] * 3
    assert ad._knapsack(options, 48, 1000)[0] == [2, 2, 2]
    assert sorted(ad._knapsack(options, 40, 1000)[0]) == [1, 2, 2]


# ------------------------------------------------------------------------------------------------------------------
# plans on a small MLP: the loss is the squared distance to the model's own outputs (0 as given, so every
# quantization error raises it)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(32, 64)  # named as an embedding: skipped by default
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 128), nn.Linear(128, 64)
        self.output = nn.Linear(64, 16)  # and the output head

    def forward(self, x):
        h = self.embed(x)
        h = F.gelu(self.fc1(h))
        h = F.gelu(self.fc2(h))
        return self.output(self.fc3(h))


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = MLP()
    with torch.no_grad():
        model.fc2.weight[:, :8] *= 30.0  # a few large input channels, as trained weights have
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(64, 32, generator=g) for _ in range(4)]
    with torch.no_grad():
        batches = [(x, model(x)) for x in xs]
    sens = ad.measure_sensitivity(model, batches, ("mxfp4", "mxfp6", "fp8", "bf16"), loss_fn=F.mse_loss,
                                  progress=False)
    return model, batches, sens


def test_sensitivities_skip_embeddings_and_head_and_grow_with_fewer_bits(mlp):
    model, batches, sens = mlp
    assert sens.layers == ["fc1", "fc2", "fc3"]
    assert sens.base_loss == 0.0
    for n in sens.layers:
        d = {f: sens.delta(n, f) for f in sens.formats}
        assert d["mxfp4"] > d["mxfp6"] > d["fp8"] > d["bf16"] > 0, (n, d)
    assert [n for n, _ in model.named_modules() if n][:1] == ["embed"] and "embed" in DEFAULT_IGNORE


def test_measuring_leaves_the_model_unchanged(mlp):
    model, batches, sens = mlp
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = sens.plan(0.3)
    plan.measure(model, batches, F.mse_loss)
    with plan.applied(model):
        assert not torch.equal(model.fc2.weight, before["fc2.weight"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.training  # eval() only while measuring


@pytest.mark.parametrize("budget", [0.27, 0.3, 0.35, 0.42, 0.5, 0.6, 0.8, 1.0, 60_000, 100_000])
def test_plan_respects_the_budget(mlp, budget):
    model, batches, sens = mlp
    plan = sens.plan(budget)
    cap = int(budget * sens.bf16_bytes()) if isinstance(budget, float) else budget
    assert plan.budget_bytes == cap and plan.total_bytes <= cap
    assert plan.total_bytes == sum(ad.weight_bytes(plan.shapes[n], f) for n, f in plan.assignment.items())
    # nothing cheaper-or-equal in bytes has a smaller summed sensitivity (all 4^3 assignments checked)
    fmts = sens.formats
    for combo in itertools.product(fmts, repeat=3):
        a = dict(zip(sens.layers, combo))
        if sum(ad.weight_bytes(sens.shapes[n], f) for n, f in a.items()) <= cap:
            assert sum(max(sens.delta(n, f), 0) for n, f in a.items()) >= \
                sum(max(sens.delta(n, f), 0) for n, f in plan.assignment.items()) - 1e-15


def test_full_budget_keeps_bf16_and_the_fp4_budget_gives_fp4(mlp):
    model, batches, sens = mlp
    assert set(sens.plan(1.0).assignment.values()) == {"bf16"}
    assert set(sens.plan(sens.bf16_bytes()).assignment.values()) == {"bf16"}
    fp4 = sens.uniform("mxfp4").total_bytes
    plan = sens.plan(fp4)
    assert set(plan.assignment.values()) == {"mxfp4"} and plan.total_bytes == fp4
    with pytest.raises(ValueError, match=f"budget of {fp4 - 1:,} bytes is below the smallest assignment"):
        sens.plan(fp4 - 1)


def test_adaptive_beats_the_uniform_neighbours(mlp):
    model, batches, sens = mlp
    uni = {f: sens.uniform(f) for f in sens.formats}
    for f, p in uni.items():
        p.measure(model, batches, F.mse_loss)
    for lo, hi in (("mxfp4", "mxfp6"), ("mxfp6", "fp8"), ("fp8", "bf16")):
        plan = ad.assign_precision(model, batches, uni[hi].total_bytes, loss_fn=F.mse_loss, sensitivity=sens)
        assert plan.total_bytes <= uni[hi].total_bytes
        # what the optimisation guarantees: predicted no worse than the uniform plan of the same bytes
        assert plan.predicted_loss <= uni[hi].predicted_loss + 1e-12
        # measured: no worse than the uniform format below it (fewer bytes). Not a law: the errors of several
        # layers do not add exactly (they may partly cancel), and on this model a budget of 30 % of bf16 (just
        # above uniform MXFP4's 26.6 %) measures 0.00154 against uniform MXFP4's 0.00140. It holds at these
        # budgets, which are the ones the assertion checks.
        assert plan.measured_loss <= uni[lo].measured_loss, (lo, hi, plan.measured_loss, uni[lo].measured_loss)
        # between the two: a budget halfway between the uniform sizes
        mid = ad.assign_precision(model, batches, (uni[lo].total_bytes + uni[hi].total_bytes) // 2,
                                  loss_fn=F.mse_loss, sensitivity=sens)
        assert mid.measured_loss < uni[lo].measured_loss
        assert uni[lo].total_bytes <= mid.total_bytes <= uni[hi].total_bytes


def test_predicted_loss_tracks_the_measured_one(mlp):
    model, batches, sens = mlp
    for budget in (0.3, 0.4, 0.55):
        plan = ad.assign_precision(model, batches, budget, loss_fn=F.mse_loss, sensitivity=sens)
        assert plan.measured_loss > 0
        assert 0.5 < plan.predicted_loss / plan.measured_loss < 2.0, budget


def test_apply_writes_the_fake_quantized_weights():
    torch.manual_seed(3)
    model = MLP()
    x = torch.randn(16, 32)
    with torch.no_grad():
        batches = [(x, model(x))]
    plan = ad.assign_precision(model, batches, 0.4, loss_fn=F.mse_loss, progress=False)
    want = {n: ad.fake_quantize_weight(getattr(model, n).weight, f) for n, f in plan.assignment.items()}
    head = model.output.weight.clone()
    assert plan.apply(model) is model
    for n, w in want.items():
        assert torch.equal(getattr(model, n).weight, w), n
    assert torch.equal(model.output.weight, head)
    with torch.no_grad():
        assert math.isclose(F.mse_loss(model(x), batches[0][1]).item(), plan.measured_loss, rel_tol=1e-6)
    with pytest.raises(ValueError, match="backend must be"):
        plan.apply(model, backend="gptq")
    if not hasattr(fp8ext, "WeightOnlyLinear"):
        with pytest.raises(RuntimeError, match="WeightOnlyLinear"):
            plan.apply(model, backend="weight_only")


WOL_FORMATS = ("fp8", "mxfp8", "mxfp6", "mxfp6_e2m3", "mxfp4", "nvfp4")


@pytest.mark.skipif(not hasattr(fp8ext, "WeightOnlyLinear"), reason="this version has no fp8ext.WeightOnlyLinear")
@pytest.mark.parametrize("fmt", WOL_FORMATS)
def test_fake_quantize_weight_is_what_weight_only_linear_stores(gauss, fmt):
    lin = nn.Linear(256, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(gauss)
    layer = fp8ext.WeightOnlyLinear.from_linear(lin, fmt)
    _same_weight(layer.dequantized_weight(torch.float32), ad.fake_quantize_weight(gauss, fmt), fmt)
    nbytes = layer.nbytes() if callable(layer.nbytes) else layer.nbytes
    assert nbytes == ad.weight_bytes(gauss.shape, fmt)


def _same_weight(stored, fake, fmt):
    """Bit for bit, except "fp8": WeightOnlyLinear computes its scale as the Python float 448 / a float32 tensor,
    which torch evaluates as reciprocal(amax) * 448 and which can be one float32 ulp off the quotient 448 / amax
    that fake_quantize_weight and fp8ext.quantize_rowwise use. On these weights the codes agree and the values
    differ by at most that ulp (a product at a rounding midpoint could also change a code)."""
    if fmt == "fp8":
        torch.testing.assert_close(stored, fake, rtol=2 ** -22, atol=0)
    else:
        assert torch.equal(stored, fake), fmt


@pytest.mark.skipif(not hasattr(fp8ext, "WeightOnlyLinear"), reason="this version has no fp8ext.WeightOnlyLinear")
def test_apply_with_weight_only_layers(mlp):
    model, batches, sens = mlp
    plan = sens.plan(0.45)
    fake = plan.fake_weights(model)
    copy = MLP()
    copy.load_state_dict(model.state_dict())
    plan.apply(copy, backend="weight_only")
    for n, f in plan.assignment.items():
        m = getattr(copy, n)
        if f == "bf16":
            assert isinstance(m, nn.Linear) and torch.equal(m.weight, getattr(model, n).weight)
        else:
            assert isinstance(m, fp8ext.WeightOnlyLinear) and m.fmt == f
            _same_weight(m.dequantized_weight(torch.float32), fake[n], f)
    assert isinstance(copy.output, nn.Linear) and isinstance(copy.embed, nn.Linear)
    with pytest.raises(ValueError, match="no per-tensor formats"):
        ad.uniform_plan(model, "fp4_tensor").apply(MLP(), backend="weight_only")


def test_transformer_with_bf16_weights():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())  # as trained in bf16: bf16 holds every weight exactly
    g = torch.Generator().manual_seed(4)
    batches = [tuple(torch.randint(0, 256, (2, 4, 32), generator=g).unbind(0)) for _ in range(2)]
    plan = ad.assign_precision(model, batches, 1.0, progress=False)
    names = [n for n, m in model.named_modules() if isinstance(m, fp8ext.Linear)]
    assert list(plan.assignment) == names and len(names) == 8  # lm_head and the embedding left out
    assert set(plan.assignment.values()) == {"bf16"}
    s = plan.sensitivity
    assert all(s.losses[n]["bf16"] == s.base_loss for n in names)  # exact in bf16: no pass, no change
    assert plan.measured_loss == s.base_loss == plan.predicted_loss
    low = ad.assign_precision(model, batches, 0.3, sensitivity=s)
    assert low.total_bytes <= int(0.3 * s.bf16_bytes()) and "mxfp4" in low.assignment.values()


def test_plot_tradeoff(mlp):
    import matplotlib
    matplotlib.use("Agg")
    model, batches, sens = mlp
    t = ad.plot_tradeoff(model, batches, (0.3, 0.45), loss_fn=F.mse_loss, sensitivity=sens)
    assert list(t.uniform) == ["mxfp4", "mxfp6", "fp8", "bf16"] and len(t.adaptive) == 2
    assert all(p.measured_loss is not None for p in list(t.uniform.values()) + t.adaptive)
    assert [p.total_bytes for p in t.uniform.values()] == sorted(p.total_bytes for p in t.uniform.values())
    assert len(t.ax.lines) >= 3 and "| uniform mxfp4 |" in t.table()
    matplotlib.pyplot.close("all")


def test_bad_arguments_name_themselves(mlp):
    model, batches, sens = mlp
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="fmt must be one of"):
        ad.fake_quantize_weight(w, "int4")
    with pytest.raises(TypeError, match="w must be a float32"):
        ad.fake_quantize_weight(w.to(torch.int32), "fp8")
    with pytest.raises(ValueError, match="2-D"):
        ad.fake_quantize_weight(torch.randn(64), "fp8")
    with pytest.raises(ValueError, match="mxfp4 needs in_features"):
        ad.fake_quantize_weight(torch.randn(32, 48), "mxfp4")
    with pytest.raises(ValueError, match="scale_rule"):
        ad.fake_quantize_weight(w, "mxfp4", scale_rule="ceil")
    with pytest.raises(ValueError, match="NaN or Inf"):
        ad.fake_quantize_weight(torch.full((32, 64), float("nan")), "mxfp4")
    with pytest.raises(ValueError, match=r"budget: a float is a fraction .* in \(0, 1\]"):
        sens.plan(1.5)
    with pytest.raises(ValueError, match="budget must be positive"):
        sens.plan(-5)
    with pytest.raises(TypeError, match="budget must be bytes"):
        sens.plan(True)
    with pytest.raises(TypeError, match="budget must be bytes"):
        sens.plan("50%")
    with pytest.raises(ValueError, match="formats must be one of"):
        ad.assign_precision(model, batches, 0.5, formats=("mxfp4", "int8"), loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="formats is empty"):
        ad.assign_precision(model, batches, 0.5, formats=(), loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="calib_batches is empty"):
        ad.assign_precision(model, [], 0.5, loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match="calib_batches must be an iterable"):
        ad.assign_precision(model, torch.randn(4, 32), 0.5, loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ad.assign_precision(lambda x: x, batches, 0.5, loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match=r"layers names modules .* \['fc9'\]"):
        ad.assign_precision(model, batches, 0.5, layers=["fc1", "fc9"], loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match="not a loss .* pass loss_fn"):
        ad.assign_precision(model, [x for x, _ in batches], 0.5, progress=False)
    with pytest.raises(ValueError, match=r"none of formats \['mxfp4'\] applies to layer odd"):
        odd = nn.Sequential()
        odd.add_module("odd", nn.Linear(48, 32))
        ad.assign_precision(odd, [(torch.randn(2, 48), torch.randn(2, 32))], 0.5, formats=("mxfp4",),
                            loss_fn=F.mse_loss, progress=False)
    with pytest.raises(ValueError, match=r"formats \['nvfp4'\] were not measured"):
        ad.assign_precision(model, batches, 0.5, formats=("nvfp4",), sensitivity=sens)
