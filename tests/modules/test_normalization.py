"""RMSNorm and LayerNorm: Transformer Engine's arguments, torch.nn's parameters, float32 arithmetic."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import DEVICES
from fp8ext.normalization import LayerNorm, RMSNorm

NORMS = [RMSNorm, LayerNorm]
HIDDEN = 64


def reference(kind, x, weight, bias, eps, zero_centered_gamma):
    """The normalisation written out in float64, independent of torch's norm functions."""
    x = x.double()
    gamma = weight.double() + 1 if zero_centered_gamma else weight.double()
    if kind is RMSNorm:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gamma
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gamma + bias.double()


def randomised(kind, zero_centered_gamma=False, device="cpu", **kwargs):
    """A module whose parameters are random (so that a wrong use of weight or bias shows)."""
    g = torch.Generator().manual_seed(0)
    m = kind(HIDDEN, zero_centered_gamma=zero_centered_gamma, device=device, **kwargs)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return m


def inputs(dtype, device, shape=(3, 5, HIDDEN)):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3 + 1).to(device, dtype)
    dy = torch.randn(shape, generator=g).to(device, dtype)
    return x, dy


# bfloat16 results are float32 results rounded once: within one bfloat16 ulp (2^-7 relative) of float64.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=1e-3)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", NORMS)
def test_output_and_gradients_match_float64_reference(kind, dtype, zero_centered_gamma, device):
    m = randomised(kind, zero_centered_gamma, device)
    x, dy = inputs(dtype, device)
    x.requires_grad_(True)
    y = m(x)
    y.backward(dy)

    params = {n: p.detach().double().requires_grad_(True) for n, p in m.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    want = reference(kind, x64, params["weight"], params.get("bias"), m.eps, zero_centered_gamma)
    want.backward(dy.double())

    assert y.dtype == dtype, f"output dtype: expected the input's {dtype}, got {y.dtype}"
    torch.testing.assert_close(y.double(), want.detach(), **TOL[dtype], msg=lambda s: f"output: {s}")
    assert x.grad.dtype == dtype, f"input gradient dtype: expected {dtype}, got {x.grad.dtype}"
    torch.testing.assert_close(x.grad.double(), x64.grad, **TOL[dtype], msg=lambda s: f"dx: {s}")
    for name, p in m.named_parameters():
        # Parameters are float32: their gradients are float32 sums over all tokens.
        torch.testing.assert_close(p.grad.double(), params[name].grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda s: f"d{name}: {s}")


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
@pytest.mark.parametrize("kind", NORMS)
def test_float32_matches_torch_functional(kind, zero_centered_gamma):
    m = randomised(kind, zero_centered_gamma)
    x, _ = inputs(torch.float32, "cpu")
    gamma = m.weight + 1 if zero_centered_gamma else m.weight
    if kind is RMSNorm:
        want = F.rms_norm(x, (HIDDEN,), gamma, m.eps)
    else:
        want = F.layer_norm(x, (HIDDEN,), gamma, m.bias, m.eps)
    torch.testing.assert_close(m(x), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", NORMS)
def test_output_dtype_is_input_dtype(kind, dtype, params_dtype):
    m = kind(HIDDEN, params_dtype=params_dtype)
    x = torch.randn(4, HIDDEN, dtype=dtype, requires_grad=True)
    y = m(x)
    assert y.dtype == dtype, f"expected output dtype {dtype} for {dtype} input, got {y.dtype}"
    y.sum().backward()
    assert m.weight.grad.dtype == params_dtype, f"weight gradient should be {params_dtype}, got {m.weight.grad.dtype}"


@pytest.mark.parametrize("kind", NORMS)
def test_eps_is_added_to_the_variance(kind):
    # Inputs with a mean square of about 1e-4, so that eps=1e-2 dominates and eps=1e-5 does not.
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(3)) * 1e-2
    big, small = kind(HIDDEN, eps=1e-2), kind(HIDDEN, eps=1e-5)
    assert big.eps == 1e-2
    zeros = torch.zeros(HIDDEN)
    torch.testing.assert_close(big(x).double(), reference(kind, x, big.weight.detach(), zeros, 1e-2, False))
    torch.testing.assert_close(small(x).double(), reference(kind, x, small.weight.detach(), zeros, 1e-5, False))
    assert (big(x).abs().mean() < 0.5 * small(x).abs().mean()).item(), "eps=1e-2 should shrink small inputs"


@pytest.mark.parametrize("zero_centered_gamma, gamma0", [(False, 1.0), (True, 0.0)])
@pytest.mark.parametrize("kind", NORMS)
def test_initialisation(kind, zero_centered_gamma, gamma0):
    m = kind(HIDDEN, zero_centered_gamma=zero_centered_gamma)
    assert torch.equal(m.weight, torch.full((HIDDEN,), gamma0)), f"weight should start at {gamma0}"
    if kind is LayerNorm:
        assert torch.equal(m.bias, torch.zeros(HIDDEN)), "bias should start at 0"
    with torch.no_grad():
        m.weight.add_(3.0)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.full((HIDDEN,), gamma0)), "reset_parameters should restore the weight"
    # At initialisation both parametrisations compute the same function.
    x = torch.randn(2, HIDDEN)
    torch.testing.assert_close(m(x), kind(HIDDEN, zero_centered_gamma=not zero_centered_gamma)(x))


@pytest.mark.parametrize("kind", NORMS)
def test_params_dtype_and_default_dtype(kind):
    m = kind(HIDDEN, params_dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters()), "params_dtype=bfloat16 not honoured"
    assert kind(HIDDEN, dtype=torch.float16).weight.dtype == torch.float16, "dtype (TE 2.x name) not honoured"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert kind(HIDDEN).weight.dtype == torch.float64, "params_dtype=None should follow the default dtype"
    finally:
        torch.set_default_dtype(previous)
    with pytest.raises(TypeError, match="params_dtype or dtype"):
        kind(HIDDEN, params_dtype=torch.float32, dtype=torch.float32)


@pytest.mark.parametrize("kind", NORMS)
def test_meta_device_defers_initialisation(kind):
    m = kind(HIDDEN, device="meta", params_dtype=torch.bfloat16, zero_centered_gamma=True)
    assert all(p.is_meta and p.shape == (HIDDEN,) and p.dtype == torch.bfloat16 for p in m.parameters()), \
        "device='meta' should give meta parameters of the right shape and dtype"
    m.reset_parameters()
    assert all(not p.is_meta and p.dtype == torch.bfloat16 for p in m.parameters()), \
        "reset_parameters should give meta parameters storage on the default device"
    assert m.weight.device == torch.get_default_device()
    assert torch.equal(m.weight, torch.zeros(HIDDEN, dtype=torch.bfloat16))
    assert m(torch.randn(2, HIDDEN)).shape == (2, HIDDEN)
    # The torch.nn route: to_empty, then reset_parameters.
    m2 = kind(HIDDEN, device="meta").to_empty(device="cpu")
    m2.reset_parameters()
    assert torch.equal(m2.weight, torch.ones(HIDDEN))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", NORMS)
def test_device_is_honoured(kind, device):
    m = kind(HIDDEN, device=device)
    assert all(p.device.type == device for p in m.parameters()), f"parameters should be on {device}"


def torch_twin(kind):
    if kind is LayerNorm:
        return nn.LayerNorm(HIDDEN)
    if not hasattr(nn, "RMSNorm"):
        pytest.skip("this torch has no nn.RMSNorm")
    return nn.RMSNorm(HIDDEN, eps=1e-5)


@pytest.mark.parametrize("kind", NORMS)
def test_state_dict_matches_torch_nn_and_loads_both_ways(kind):
    ours, theirs = randomised(kind), torch_twin(kind)
    assert list(ours.state_dict()) == list(theirs.state_dict()), "state dict keys should be torch.nn's"
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, HIDDEN)
    torch.testing.assert_close(theirs(x), ours(x), msg=lambda s: f"torch.nn module with our weights: {s}")
    fresh = kind(HIDDEN)
    fresh.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(fresh(x), theirs(x), msg=lambda s: f"our module with torch.nn's weights: {s}")


@pytest.mark.parametrize("shape", [HIDDEN, (HIDDEN,), [HIDDEN], torch.Size([HIDDEN])])
@pytest.mark.parametrize("kind", NORMS)
def test_normalized_shape_forms(kind, shape):
    m = kind(shape)
    assert m.normalized_shape == (HIDDEN,) and m.weight.shape == (HIDDEN,)


@pytest.mark.parametrize("kind", NORMS)
def test_several_normalized_dimensions_match_torch(kind):
    g = torch.Generator().manual_seed(2)
    m = kind((4, 16))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(3, 4, 16, generator=g)
    if kind is RMSNorm:
        want = F.rms_norm(x, (4, 16), m.weight, m.eps)
    else:
        want = F.layer_norm(x, (4, 16), m.weight, m.bias, m.eps)
    torch.testing.assert_close(m(x), want)


@pytest.mark.parametrize("kind", NORMS)
def test_hidden_size_is_a_deprecated_alias(kind):
    with pytest.warns(DeprecationWarning, match="normalized_shape"):
        m = kind(hidden_size=HIDDEN)
    assert m.normalized_shape == (HIDDEN,)
    with pytest.raises(TypeError, match="not both"):
        kind(HIDDEN, hidden_size=HIDDEN)
    with pytest.raises(TypeError, match="normalized_shape is required"):
        kind()


@pytest.mark.parametrize("bad", [0, -3, (), (HIDDEN, 0), 2.5, True])
@pytest.mark.parametrize("kind", NORMS)
def test_bad_normalized_shape_is_refused(kind, bad):
    with pytest.raises(ValueError, match="normalized_shape must be a positive int"):
        kind(bad)


@pytest.mark.parametrize("kind", NORMS)
def test_sequence_parallel_is_not_implemented(kind):
    with pytest.raises(NotImplementedError, match="fp8ext does not have"):
        kind(HIDDEN, sequence_parallel=True)
    for off in (None, False):
        assert kind(HIDDEN, sequence_parallel=off).sequence_parallel is off


@pytest.mark.parametrize("kind", NORMS)
def test_te_keywords_accepted_and_others_refused(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kind(HIDDEN, sm_margin=8)
        kind(HIDDEN, sm_margin={"forward": 8})
    with pytest.raises(TypeError, match="unexpected keyword argument 'normalization'"):
        kind(HIDDEN, normalization="RMSNorm")
    with pytest.raises(TypeError, match="sm_margin must be an int or a dict"):
        kind(HIDDEN, sm_margin="8")


@pytest.mark.parametrize("kind", NORMS)
def test_bad_input_is_refused(kind):
    m = kind(HIDDEN)
    with pytest.raises(ValueError, match=r"input of shape \(2, 32\) does not end in normalized_shape \(64,\)"):
        m(torch.randn(2, 32))
    with pytest.raises(TypeError, match=r"input must be a float32, bfloat16, float16 or float64 tensor, got int64"):
        m(torch.ones(2, HIDDEN, dtype=torch.int64))


def test_reset_parameters_defer_init_is_deprecated():
    m = LayerNorm(HIDDEN)
    with torch.no_grad():
        m.bias.fill_(2.0)
    with pytest.warns(DeprecationWarning, match="device='meta'"):
        m.reset_parameters(defer_init=True)
    assert torch.equal(m.bias, torch.full((HIDDEN,), 2.0)), "defer_init=True should leave the parameters alone"


@pytest.mark.parametrize("kind", NORMS)
def test_extra_repr(kind):
    assert repr(kind(HIDDEN, eps=1e-6, zero_centered_gamma=True)) == \
        f"{kind.__name__}((64,), eps=1e-06, zero_centered_gamma=True)"
