"""Stochastic rounding: it picks one of the two neighbouring FP8 values, is unbiased within a bound
derived below, and is reproducible for a given seed (on the GPU too: see ops/test_cuda_kernels_vs_cpu.py).

The bound: for v between neighbours lo < v < hi (gap d = hi - lo), one stochastic rounding gives hi with
probability p = (v - lo) / d and lo otherwise, so its mean is v and its variance d^2 p (1 - p) <= d^2 / 4.
The mean of N roundings of v (independent bits per element) has standard deviation <= d / (2 sqrt N), and
the 32 random bits per element bias p by at most 2^-32. We assert |mean - v| <= 6 d / (2 sqrt N) + d 2^-32:
a correct implementation fails this with probability about 2e-9.
"""

import numpy as np
import pytest
import torch

import fp8ext
import reference

FORMATS = [fp8ext.E4M3, fp8ext.E5M2]


def sr(x, fmt, seed, scale=1.0):
    return fp8ext.quantize(x, fmt, scale, stochastic=True, seed=seed)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("v", [1.0 + 1 / 3, 0.3, -5.1234, 2.0**-8 * 1.7, 300.0, 0.7 * 2.0**-9])
def test_mean_is_unbiased(fmt, v):
    n = 1 << 20
    x = torch.full((n,), v, dtype=torch.float32)
    q = sr(x, fmt, seed=1234).float().double()
    lo, hi = reference.neighbours(np.float32(v), fmt.name)
    d = float(hi - lo)
    assert set(np.unique(q.abs().numpy())) <= {float(lo), float(hi)}, "only the two neighbours appear"
    bound = 6 * d / (2 * np.sqrt(n)) + d * 2.0**-32
    err = abs(q.mean().item() - float(np.float32(v)))
    assert err <= bound, f"mean error {err:.3g} above the bound {bound:.3g} (gap {d})"
    rne_err = abs(fp8ext.quantize(x[:1], fmt).double().item() - float(np.float32(v)))
    if rne_err > 100 * bound:
        assert err < rne_err / 10, "stochastic rounding removes round-to-nearest's bias"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_results_are_neighbours_for_many_values(fmt):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-12, 8, (200_000,), generator=g).float())
    q = sr(x, fmt, seed=7).double().numpy()
    lo, hi = reference.neighbours(x.numpy(), fmt.name)
    a = np.abs(q)
    fits = (a == lo) | (a == hi) | (np.abs(x.numpy()) > fmt.max)
    assert fits.all(), f"{(~fits).sum()} results are not a neighbour of their input"
    assert (np.sign(q) == np.sign(x.numpy()))[a > 0].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_many_values_is_unbiased(dtype):
    """Per-element errors average out over a tensor (what matters for gradient accumulation)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(1 << 20, generator=g) * 0.9 + 0.05).to(dtype)
    xf = x.double().numpy()
    q = sr(x, fp8ext.E5M2, seed=99).double().numpy()
    lo, hi = reference.neighbours(xf, "E5M2")
    bound = 6 * np.sqrt(np.sum((hi - lo) ** 2 / 4)) / x.numel()
    sr_bias = abs(np.mean(q - xf))
    rne_bias = abs(np.mean(fp8ext.quantize(x, fp8ext.E5M2).double().numpy() - xf))
    assert sr_bias <= bound, f"mean error {sr_bias:.3g} above bound {bound:.3g}"
    assert rne_bias > 0 and sr_bias < rne_bias


def test_same_seed_same_bytes_other_seed_other_bytes():
    x = torch.randn(100_000)
    a, b, c = sr(x, fp8ext.E4M3, 5), sr(x, fp8ext.E4M3, 5), sr(x, fp8ext.E4M3, 6)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert (a.view(torch.uint8) != c.view(torch.uint8)).float().mean() > 0.2


def test_seed_none_follows_torch_manual_seed():
    x = torch.randn(10_000)
    torch.manual_seed(11)
    a = fp8ext.quantize(x, stochastic=True)
    torch.manual_seed(11)
    b = fp8ext.quantize(x, stochastic=True)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_special_values_under_stochastic_rounding():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e6, 448.0, 1e-30])
    q = sr(x, fp8ext.E4M3, 1).view(torch.uint8).tolist()
    assert q == [0x7F, 0x7E, 0xFE, 0x00, 0x80, 0x7E, 0x7E, 0x00]
    q = fp8ext.quantize(x, fp8ext.E5M2, stochastic=True, seed=1, saturate=False).view(torch.uint8).tolist()
    assert q[:3] == [0x7F, 0x7C, 0xFC] and q[5] == 0x7C
