"""LayerNormLinear and LayerNormMLP: Transformer Engine's names, arguments, parameter names and return values, and
the arithmetic of the composition they stand for (norm, linear, activation), in high precision and in FP8."""
import pytest
import torch
import torch.nn.functional as F

import fp8ext
import fp8ext as te
from conftest import requires_cuda

RECIPE = fp8ext.DelayedScaling(fp8_format=fp8ext.Format.HYBRID)


def randomize(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return module


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_is_the_norm_then_the_linear_layer(normalization):
    m = randomize(te.LayerNormLinear(64, 48, normalization=normalization, eps=1e-6))
    x = torch.randn(5, 64)
    if normalization == "LayerNorm":
        ln = F.layer_norm(x, (64,), m.layer_norm_weight, m.layer_norm_bias, eps=1e-6)
    else:
        ln = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * m.layer_norm_weight
    want = ln @ m.weight.T + m.bias
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)


def test_parameter_names_are_transformer_engines_and_state_dicts_load_from_them():
    m = te.LayerNormMLP(64, 96, normalization="RMSNorm", activation="swiglu")
    sd = m.state_dict()
    assert {k for k in sd if not k.endswith("_extra_state")} == {"layer_norm_weight", "fc1_weight", "fc1_bias",
                                                                   "fc2_weight", "fc2_bias"}
    assert sd["fc1_weight"].shape == (192, 64) and sd["fc2_weight"].shape == (64, 96)
    te_style = {k: torch.randn_like(v) for k, v in sd.items() if not k.endswith("_extra_state")}
    te_style["_extra_state"] = b"transformer engine's fp8 metadata"
    other = te.LayerNormMLP(64, 96, normalization="RMSNorm", activation="swiglu")
    other.load_state_dict(te_style)  # strict: TE's names, TE's extra state ignored
    assert torch.equal(other.fc1_weight, te_style["fc1_weight"]) and torch.equal(other.fc2.bias, te_style["fc2_bias"])
    lnl = te.LayerNormLinear(32, 16)
    assert set(k for k in lnl.state_dict() if not k.endswith("_extra_state")) == {
        "layer_norm_weight", "layer_norm_bias", "weight", "bias"}


@pytest.mark.parametrize("activation,fn", [("gelu", lambda h: F.gelu(h, approximate="tanh")), ("relu", F.relu),
                                           ("swiglu", None), ("geglu", None), ("reglu", None)])
def test_layernorm_mlp_computes_fc2_of_the_activation_of_fc1(activation, fn):
    m = randomize(te.LayerNormMLP(32, 48, activation=activation))
    x = torch.randn(7, 32)
    ln = F.layer_norm(x, (32,), m.layer_norm_weight, m.layer_norm_bias, eps=1e-5)
    h = ln @ m.fc1_weight.T + m.fc1_bias
    if fn is None:  # gated: act(first half) * second half
        gate, up = h[:, :48], h[:, 48:]
        act = {"swiglu": F.silu, "geglu": lambda t: F.gelu(t, approximate="tanh"), "reglu": F.relu}[activation]
        h = act(gate) * up
    else:
        h = fn(h)
    want = h @ m.fc2_weight.T + m.fc2_bias
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)


def test_return_values_follow_transformer_engines_order():
    m = te.LayerNormLinear(32, 16, return_bias=True, return_layernorm_output=True)
    x = torch.randn(4, 32)
    out, bias, ln = m(x)
    assert bias is m.bias and ln.shape == x.shape
    torch.testing.assert_close(out + bias, ln @ m.weight.T + m.bias)
    mlp = te.LayerNormMLP(32, 64, return_bias=True)
    out, bias = mlp(x)
    assert bias is mlp.fc2_bias and out.shape == (4, 32)


def test_fp8_forward_and_backward_run_and_stay_close_to_high_precision():
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu", bias=False)
    x = torch.randn(32, 64, requires_grad=True)
    ref = m(x)
    with te.fp8_autocast(enabled=True, fp8_recipe=RECIPE):
        y = m(x)
    y.square().sum().backward()
    assert (y - ref).norm() / ref.norm() < 0.1
    assert x.grad is not None and m.fc1_weight.grad is not None and m.layer_norm_weight.grad is not None


@requires_cuda
@pytest.mark.cuda
def test_swiglu_mlp_on_the_gpu_runs_the_fused_kernel_both_ways():
    """On a GPU the SwiGLU of LayerNormMLP is fp8ext.fused's kernel (forward and backward): output and gradients
    against the float64 composition with the module's own weights."""
    m = randomize(te.LayerNormMLP(64, 128, normalization="RMSNorm", activation="swiglu", bias=False,
                                  params_dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    names, todo = set(), [y.grad_fn]
    while todo:
        f = todo.pop()
        if f is not None and type(f).__name__ not in names:
            names.add(type(f).__name__)
            todo += [g for g, _ in f.next_functions]
    assert "_SwiGLUBackward" in names, names
    y.float().square().sum().backward()
    x64 = x.detach().double().requires_grad_()
    ln = F.rms_norm(x64, (64,), m.layer_norm_weight.double(), eps=m.layer_norm.eps)
    gate, up = (ln @ m.fc1_weight.double().T).chunk(2, dim=-1)
    want = (F.silu(gate) * up) @ m.fc2_weight.double().T
    want.square().sum().backward()
    assert ((y.double() - want).norm() / want.norm()).item() < 2e-2
    assert ((x.grad.double() - x64.grad).norm() / x64.grad.norm()).item() < 3e-2


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="normalization must be 'LayerNorm' or 'RMSNorm'"):
        te.LayerNormLinear(32, 16, normalization="BatchNorm")
    with pytest.raises(ValueError, match="activation must be one of"):
        te.LayerNormMLP(32, 16, activation="tanh")
    with pytest.raises(NotImplementedError, match="sequence_parallel=True"):
        te.LayerNormMLP(32, 16, sequence_parallel=True)
