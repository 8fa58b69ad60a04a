"""An FP8 layer's saved scaling state (get_extra_state's tensor, or the dict of older checkpoints) is checked when it
is loaded: a scale that is NaN, 0, negative or infinite, or a scale_inv that is not its inverse, would fail in a kernel
at the next forward or scale every later step wrongly; it is refused by load_state_dict, naming the key."""

import pytest
import torch

import fp8ext


def trained_state():
    layer = fp8ext.Linear(32, 32)
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling(amax_history_len=8)):
        layer(torch.randn(16, 32)).sum().backward()
    return layer.state_dict()


def with_value(state, column, value, row=0):
    state = dict(state)
    t = state["_extra_state"].clone()
    t[row, column] = torch.tensor([value], dtype=torch.float32).view(torch.int32)
    state["_extra_state"] = t
    return state


BAD = {"NaN scale": (1, float("nan")), "zero scale": (1, 0.0), "negative scale": (1, -2.0),
       "infinite scale": (1, float("inf")), "1e38 scale, scale_inv unchanged": (1, 1e38),
       "scale_inv not the inverse": (2, 3.0), "NaN scale_inv": (2, float("nan"))}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_malformed_scale_is_refused_naming_the_key(case):
    column, value = BAD[case]
    state = with_value(trained_state(), column, value, row=2)
    layer = fp8ext.Linear(32, 32)
    with pytest.raises(ValueError, match=r"_extra_state: .*slot 2 has scale .* scale_inv its inverse"):
        layer.load_state_dict(state)


def test_a_negative_update_count_is_refused():
    state = trained_state()
    state["_extra_state"] = state["_extra_state"].clone()
    state["_extra_state"][:, 0] = -1
    with pytest.raises(ValueError, match=r"_extra_state: .*steps.* got -1"):
        fp8ext.Linear(32, 32).load_state_dict(state)


def test_the_old_dict_form_is_checked_too():
    layer = fp8ext.Linear(32, 32)
    packed = trained_state()["_extra_state"]
    as_dict = {"steps": int(packed[0, 0]), "scale": packed[:, 1].clone().view(torch.float32),
               "scale_inv": packed[:, 2].clone().view(torch.float32),
               "amax_history": packed[:, 3:].clone().view(torch.float32)}
    layer.set_extra_state(as_dict)  # a good one loads
    as_dict["scale"] = as_dict["scale"].clone()
    as_dict["scale"][1] = 0.0
    with pytest.raises(ValueError, match="slot 1 has scale 0.0"):
        fp8ext.Linear(32, 32).set_extra_state(as_dict)
    with pytest.raises(ValueError, match="has no 'scale_inv'"):
        fp8ext.Linear(32, 32).set_extra_state({"scale": as_dict["scale"], "amax_history": as_dict["amax_history"]})


def test_a_good_state_loads_and_the_next_forward_equals_the_saving_layers():
    r = fp8ext.DelayedScaling(amax_history_len=8)
    src = fp8ext.Linear(32, 32)
    with fp8ext.fp8_autocast(fp8_recipe=r):
        src(torch.randn(16, 32)).sum().backward()
    dst = fp8ext.Linear(32, 32)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(16, 32)
    with fp8ext.fp8_autocast(fp8_recipe=r):
        assert torch.equal(dst(x), src(x))


def test_a_tiny_scale_inv_that_is_the_inverse_loads():
    # amax tiny: scale near float32's largest, scale_inv a subnormal; such a state is one a history can give
    state = trained_state()
    state = with_value(with_value(state, 1, 3.0e38), 2, float(torch.tensor(1 / 3.0e38, dtype=torch.float32)))
    fp8ext.Linear(32, 32).load_state_dict(state)
