"""A recipe defined outside the package trains FP8Linear layers: one new class (a Recipe subclass and the Quantizer
it makes), nothing edited in fp8ext (docs/contributing.md, "How to add a recipe", walks through this file).

The recipe: per-tensor scales rounded down to a power of two (scale_inv is then exact), each from the tensor's own
amax. Its numbers are checked against torch's own FP8 casts in float64."""
from dataclasses import dataclass

import pytest
import torch

import fp8ext
from fp8ext.tensor import FP8Tensor, Quantizer


class PowerOfTwoQuantizer(Quantizer):
    """Per tensor: scale = the largest power of two <= fmt.max / amax (1 for an all-zero tensor)."""

    __slots__ = ()
    calls = [0]  # counted by the tests: the layer casts through this class

    def quantize(self, t2d: torch.Tensor, keep_scale: bool = False) -> FP8Tensor:
        PowerOfTwoQuantizer.calls[0] += 1
        amax = fp8ext.amax(t2d)
        scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(self.fmt.max / amax))), 1.0).float()
        q, qt = fp8ext.cast_transpose(t2d, self.fmt, scale)
        return FP8Tensor(q, qt, scale.reciprocal(), self.fmt, scale=scale if keep_scale else None)


@dataclass(frozen=True)
class PowerOfTwoScaling(fp8ext.Recipe):
    fp8_format: fp8ext.Format = fp8ext.Format.HYBRID
    per_tensor = True

    def make_quantizers(self, manager=None, slots=None):
        return tuple(PowerOfTwoQuantizer(fmt) for fmt in self.role_formats())


def _pow2_cast(t: torch.Tensor, dtype: torch.dtype):
    """(t cast by torch to `dtype` with the recipe's scale, its scale_inv), in float64."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().max().double()
    scale = torch.exp2(torch.floor(torch.log2(fmax / amax))) if amax > 0 else torch.tensor(1.0, dtype=torch.float64)
    q = (t.double() * scale).to(torch.float32).to(dtype)  # |t * scale| <= fmax: nothing saturates
    return q.double(), 1.0 / scale


def _train(model, x, target, recipe, steps=40):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        with fp8ext.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(fp8ext.Linear(64, 128), torch.nn.GELU(), fp8ext.Linear(128, 32))


def test_an_external_recipe_trains_and_matches_torchs_casts(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(48, 64)
    target = torch.tanh(x @ torch.randn(64, 32) / 8)  # a teacher the model can learn
    monkeypatch.setattr(fp8ext._C, "linear_fwd", lambda *a, **k: pytest.fail("the one-call passes cast per recipe "
                                                                             "kinds of their own"))
    recipe = PowerOfTwoScaling()
    PowerOfTwoQuantizer.calls[0] = 0
    model = _model(1)
    losses = _train(model, x, target, recipe)
    high = _train(_model(1), x, target, None)  # the same training in float32
    assert losses[-1] < 0.3 * losses[0], losses
    assert abs(losses[-1] - high[-1]) < 0.1 * high[-1] + 1e-3, (losses[-1], high[-1])
    assert PowerOfTwoQuantizer.calls[0] >= 40 * 6  # two layers: input, weight and output gradient each step

    layer = model[0]
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    xq, xs = _pow2_cast(x, torch.float8_e4m3fn)
    wq, ws = _pow2_cast(layer.weight.detach(), torch.float8_e4m3fn)
    ref = (xq * xs) @ (wq * ws).t() + layer.bias.detach().double()
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)


def test_its_weight_gradient_is_the_fp8_product_of_torchs_casts():
    torch.manual_seed(1)
    layer = fp8ext.Linear(32, 48, bias=False)
    x = torch.randn(64, 32)
    dy = torch.randn(64, 48)
    with fp8ext.fp8_autocast(fp8_recipe=PowerOfTwoScaling()):
        y = layer(x)
    y.backward(dy)
    gq, gs = _pow2_cast(dy, torch.float8_e5m2)  # HYBRID: gradients in E5M2
    xq, xs = _pow2_cast(x, torch.float8_e4m3fn)
    torch.testing.assert_close(layer.weight.grad.double(), (gq * gs).t() @ (xq * xs), rtol=1e-6, atol=1e-6)


def test_a_recipe_that_makes_no_quantizers_is_named_and_other_objects_are_refused():
    @dataclass(frozen=True)
    class Unfinished(fp8ext.Recipe):
        fp8_format: fp8ext.Format = fp8ext.Format.HYBRID

    with pytest.raises(NotImplementedError, match="Unfinished.make_quantizers"):
        with fp8ext.fp8_autocast(fp8_recipe=Unfinished()):
            fp8ext.Linear(16, 16)(torch.randn(16, 16))
    with pytest.raises(TypeError, match="fp8_autocast\\(\\): fp8_recipe must be .* got dict"):
        fp8ext.fp8_autocast(fp8_recipe={"margin": 0})
    with pytest.raises(TypeError, match="convert_to_fp8\\(\\): fp8_recipe must be None or a recipe"):
        fp8ext.convert_to_fp8(torch.nn.Linear(16, 16), fp8_recipe="delayed")
