"""FP8Linear's state dict (docs/training.md, Checkpoints): `weight`, `bias` and `_extra_state` (the FP8 scaling state as
one int32 tensor, fp8ext.core.scaling.pack_slots_state).

- Parameters: FP8Linear is a drop-in for nn.Linear, so a state dict with a wrong shape, dtype, missing or extra key
  gets exactly nn.Linear's answer (torch's RuntimeError naming the key, or the values converted as nn.Linear takes
  them), table-driven.
- _extra_state: a tensor of the wrong dtype or shape, or not a tensor, is a ValueError naming the FP8 scaling state;
  documented acceptances (an empty state starts fresh, a history of another length is cut or zero-padded, non-finite
  amaxes in the history, any finite positive scale such as 1e38) load and compute; a scale that no cast can use
  (NaN, 0, -0, Inf, negative) must be refused when it is loaded.
- Round trip: state_dict -> a new module (other initial weights) -> the same outputs, gradients and next steps, bit for
  bit, directly and through torch.save / torch.load(weights_only=True).
"""

import io
import math
import re
import warnings

import pytest
import torch
from torch import nn

import fp8ext
from prop_support import bounded, one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (prop_support)

IN, OUT = 32, 16


def trained(seed=0, steps=2, dtype=torch.float32, recipe=None):
    """An FP8Linear after `steps` FP8 training steps (its scaling state is no longer the initial one)."""
    torch.manual_seed(seed)
    layer = fp8ext.FP8Linear(IN, OUT, params_dtype=dtype)
    for i in range(steps):
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe or fp8ext.DelayedScaling()):
            y = layer(torch.randn(16, IN, dtype=dtype))
        y.float().pow(2).mean().backward()
    return layer


def forward(layer, x, recipe=None):
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe or fp8ext.DelayedScaling()):
        return layer(x)


def fresh(seed=1, dtype=torch.float32):
    torch.manual_seed(seed)
    return fp8ext.FP8Linear(IN, OUT, params_dtype=dtype)


# ---- parameters: exactly nn.Linear's answer --------------------------------------------------------------------

PARAMS = [  # (id, change of the state dict)
    ("weight-wrong-shape", lambda sd: sd.update(weight=torch.randn(OUT, IN - 1))),
    ("weight-transposed", lambda sd: sd.update(weight=sd["weight"].t().contiguous())),
    ("weight-1-D", lambda sd: sd.update(weight=sd["weight"].reshape(-1))),
    ("weight-0-d", lambda sd: sd.update(weight=torch.tensor(1.0))),
    ("bias-wrong-shape", lambda sd: sd.update(bias=torch.randn(OUT + 1))),
    ("weight-int64", lambda sd: sd.update(weight=torch.randint(-3, 3, (OUT, IN)))),
    ("weight-bool", lambda sd: sd.update(weight=sd["weight"] > 0)),
    ("weight-bfloat16", lambda sd: sd.update(weight=sd["weight"].bfloat16())),
    ("weight-float64", lambda sd: sd.update(weight=sd["weight"].double())),
    ("weight-float8", lambda sd: sd.update(weight=sd["weight"].to(torch.float8_e4m3fn))),
    ("weight-complex", lambda sd: sd.update(weight=sd["weight"].to(torch.complex64))),
    ("weight-NaN", lambda sd: sd["weight"].view(-1).__setitem__(0, math.nan)),
    ("weight-missing", lambda sd: sd.pop("weight")),
    ("bias-missing", lambda sd: sd.pop("bias")),
    ("extra-key", lambda sd: sd.update(extra=torch.ones(1))),
    ("weight-a-list", lambda sd: sd.update(weight=sd["weight"].tolist())),
    ("weight-None", lambda sd: sd.update(weight=None)),
]


def outcome(module, sd):
    """('raised', type, message) or ('loaded', weight, bias) of module.load_state_dict(sd), strict."""
    try:
        with bounded(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's warning on a complex-to-real copy: the same for both modules
            module.load_state_dict(sd)
    except Exception as e:  # noqa: BLE001 - compared with nn.Linear's
        return ("raised", type(e), str(e))
    return ("loaded", module.weight.detach().clone(), module.bias.detach().clone())


@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, c in PARAMS])
def test_parameters_load_as_into_nn_linear(change):
    sd = {k: v.clone() for k, v in trained().state_dict().items()}
    change(sd)
    plain = {k: v for k, v in sd.items() if k != "_extra_state"}
    torch.manual_seed(1)
    want = outcome(nn.Linear(IN, OUT), plain)
    got = outcome(fresh(), sd)
    assert got[0] == want[0], f"nn.Linear {want[0]} ({want[1:]}), FP8Linear {got[0]} ({got[1:]})"
    if got[0] == "raised":
        assert got[1] is want[1], f"FP8Linear raised {got[1].__name__}, nn.Linear {want[1].__name__}: {got[2]}"
        keys = re.findall(r'"(\w+)"|for (\w+):', want[2])
        for key in {a or b for a, b in keys}:
            assert key in got[2], f"FP8Linear's error does not name {key}: {got[2]}"
    else:
        assert torch.equal(got[1], want[1]) or (got[1].isnan() == want[1].isnan()).all() and torch.equal(
            got[1].nan_to_num(), want[1].nan_to_num()), "the weight loads as nn.Linear loads it"
        assert torch.equal(got[2], want[2])


def test_an_nn_linear_state_dict_loads_strictly_and_an_fp8linear_one_into_nn_linear():
    """docs/training.md: FP8Linear.load_state_dict(linear_sd) strictly; nn.Linear takes FP8Linear's with
    strict=False, only _extra_state unexpected."""
    torch.manual_seed(0)
    lin = nn.Linear(IN, OUT)
    layer = fresh()
    assert not layer.load_state_dict(lin.state_dict()).missing_keys
    x = torch.randn(8, IN)
    assert torch.equal(layer(x), lin(x)), "outside fp8_autocast FP8Linear is nn.Linear"
    back = nn.Linear(IN, OUT)
    res = back.load_state_dict(trained().state_dict(), strict=False)
    assert res.unexpected_keys == ["_extra_state"] and not res.missing_keys


# ---- _extra_state ----------------------------------------------------------------------------------------------

def extra(change):
    """The trained layer's state dict with its _extra_state replaced by change(the packed int32 tensor)."""
    def make(sd):
        sd["_extra_state"] = change(sd["_extra_state"].clone())
    return make


def scales(v):
    """Every slot's scale set to v and its scale_inv to 1 / v (float32 bit patterns in columns 1 and 2)."""
    def change(e):
        e[:, 1] = torch.full((e.shape[0],), v, dtype=torch.float32).view(torch.int32)
        inv = 1.0 / v if v not in (0.0,) and not math.isnan(v) else v
        e[:, 2] = torch.full((e.shape[0],), inv, dtype=torch.float32).view(torch.int32)
        return e
    return extra(change)


def history(v):
    def change(e):
        e[:, 3:] = torch.full(e[:, 3:].shape, v, dtype=torch.float32).view(torch.int32)
        return e
    return extra(change)


MALFORMED = [  # (id, change): refused with a ValueError naming the FP8 scaling state
    ("float32", extra(lambda e: e.float())),
    ("int64", extra(lambda e: e.long())),
    ("uint8-bytes", extra(lambda e: e.view(torch.uint8))),
    ("two-rows", extra(lambda e: e[:2])),
    ("four-rows", extra(lambda e: torch.cat([e, e[:1]]))),
    ("two-columns", extra(lambda e: e[:, :2])),
    ("1-D", extra(lambda e: e.reshape(-1))),
    ("3-D", extra(lambda e: e.unsqueeze(0))),
    ("0-d", extra(lambda e: e[0, 0])),
    ("None", extra(lambda e: None)),
    ("a-string", extra(lambda e: "scale=1")),
    ("a-list", extra(lambda e: e.tolist())),
]


@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, c in MALFORMED])
def test_a_malformed_extra_state_is_refused_naming_it(change):
    sd = dict(trained().state_dict())
    change(sd)
    with bounded(), pytest.raises(ValueError, match=r"FP8Linear\(32, 16\)\.set_extra_state: the FP8 scaling state"):
        fresh().load_state_dict(sd)


@pytest.mark.parametrize("value", [math.nan, 0.0, -0.0, math.inf, -math.inf, -1.0], ids=repr)
def test_an_extra_state_scale_no_cast_can_use_is_refused_when_loaded(value):
    sd = dict(trained().state_dict())
    scales(value)(sd)
    with bounded(), pytest.raises(ValueError, match=r"extra_state|FP8 scaling state|scale"):
        fresh().load_state_dict(sd)


@pytest.mark.parametrize("value", [1e38, 2.0**-120, 448.0])
def test_an_extra_state_scale_that_is_finite_and_positive_is_accepted_and_used(value):
    """numerics.md: a scale is any finite positive float32; the loaded layer casts with it (outputs finite)."""
    sd = dict(trained().state_dict())
    scales(value)(sd)
    layer = fresh()
    layer.load_state_dict(sd)
    assert torch.equal(layer.fp8_state()["scale"], torch.full((3,), value, dtype=torch.float32))
    y = forward(layer, torch.randn(16, IN))
    assert torch.isfinite(y).all()


ACCEPTED = [  # (id, change): documented to load; the next forward equals the genuine state's bit for bit
    ("history-NaN", history(math.nan)),  # amaxes enter the next update only (NaN, Inf: DelayedScaling's backoff)
    ("history-Inf", history(math.inf)),
    ("history-zero", history(0.0)),
    ("history-shorter", extra(lambda e: e[:, :10])),  # "a history of another length is cut or zero-padded"
    ("history-longer", extra(lambda e: torch.cat([e, e[:, 3:]], 1))),
]


@pytest.mark.parametrize("change", [pytest.param(c, id=i) for i, c in ACCEPTED])
def test_a_documented_extra_state_variant_loads_and_computes_as_the_genuine_one(change):
    source = trained()
    x = torch.randn(16, IN)
    genuine = fresh()
    genuine.load_state_dict(source.state_dict())
    sd = dict(source.state_dict())
    change(sd)
    layer = fresh()
    layer.load_state_dict(sd)
    assert torch.equal(forward(layer, x), forward(genuine, x))
    y = forward(layer, x)  # after the update the history entered: still a usable scale
    assert torch.isfinite(y).all() and torch.isfinite(layer.fp8_state()["scale"]).all()


def test_an_empty_extra_state_starts_fresh():
    """pack_slots_state: a layer without FP8 state gives an empty tensor; loading it is a fresh start."""
    sd = dict(trained().state_dict())
    sd["_extra_state"] = torch.zeros((0, 3), dtype=torch.int32)
    layer, plain = fresh(), fresh()
    layer.load_state_dict(sd)
    plain.load_state_dict({k: v for k, v in sd.items() if k != "_extra_state"})
    x = torch.randn(16, IN)
    assert torch.equal(forward(layer, x), forward(plain, x))


# ---- round trip ------------------------------------------------------------------------------------------------

def _steps(layer, xs, recipe):
    """Outputs, input gradients and weight gradients of a training step on each x (weights stepped by SGD)."""
    out = []
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt.zero_grad()  # trained() left its gradients
    for x in xs:
        x = x.clone().requires_grad_(True)
        y = forward(layer, x, recipe)
        y.float().pow(2).mean().backward()
        out.append((y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("via", ["state_dict", "torch.save"])
@pytest.mark.parametrize("recipe", [fp8ext.DelayedScaling(), fp8ext.DelayedScaling(amax_compute_algo="most_recent",
                                                                                    margin=1)], ids=["max", "recent"])
def test_a_round_trip_through_the_state_dict_computes_bit_for_bit_as_the_original(dtype, via, recipe):
    source = trained(dtype=dtype, recipe=recipe)
    sd = source.state_dict()
    if via == "torch.save":
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        sd = torch.load(buf, weights_only=True)
    copy = fresh(dtype=dtype)
    copy.load_state_dict(sd)
    assert torch.equal(copy.get_extra_state(), source.get_extra_state())
    torch.manual_seed(5)
    xs = [torch.randn(16, IN, dtype=dtype) * 4 ** i for i in range(3)]  # growing amaxes: the scales move
    for i, (a, b) in enumerate(zip(_steps(source, xs, recipe), _steps(copy, xs, recipe))):
        for what, s, c in zip(("output", "input gradient", "weight gradient", "bias gradient"), a, b):
            assert torch.equal(s, c), f"step {i}: the {what} differs after the round trip"
    assert torch.equal(copy.get_extra_state(), source.get_extra_state()), "the same scaling state after the steps"
