"""Threads: the casts and the GEMM called from 4 threads at once (started together by a barrier, over shared inputs)
give the bytes the same calls give one after another; FP8Linear layers trained in two threads at once, each its own
module in its own fp8_autocast (one recipe, so one scaling manager between them), give each module's serial results
bit for bit, scales included (docs/training.md: each layer's slots are its own; core/context.py: a thread's step
boundary updates the slots that thread recorded). Every thread is joined under a timeout: a deadlock fails the test."""

import copy
import threading

import pytest
import torch

import fp8ext
from prop_support import bounded, one_thread  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread (prop_support)

THREADS = 4
U8 = torch.uint8


def in_threads(work, n):
    """[work(i) for i in range(n)], each call in its own thread, all released at once."""
    barrier, results, errors = threading.Barrier(n), [None] * n, []

    def run(i):
        try:
            barrier.wait(timeout=30)
            results[i] = work(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append((i, e))
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish within 60 s (deadlock?)"
    assert not errors, f"thread {errors[0][0]} raised {errors[0][1]!r}"
    return results


def flat(result):
    """A call's results as a list of tensors viewed as bytes-comparable integers."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    out = []
    for t in items:
        t = t.detach().contiguous()
        out.append(t.view(U8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t)
    return out


def calls(g):
    x = torch.randn(64, 128, generator=g, dtype=torch.bfloat16) * 10
    q = fp8ext.quantize(x, fp8ext.E4M3, 4.0)
    one = torch.ones(1)
    return {
        "quantize": lambda: fp8ext.quantize(x, fp8ext.E4M3, 4.0),
        "quantize-stochastic": lambda: fp8ext.quantize(x, fp8ext.E5M2, 0.5, stochastic=True, seed=1234),
        "quantize-amax_out": lambda: (lambda a: (fp8ext.quantize(x, fp8ext.E4M3, 1.0, amax_out=a), a))(torch.zeros(1)),
        "dequantize": lambda: fp8ext.dequantize(q, 0.25, torch.float32),
        "amax": lambda: fp8ext.amax(x),
        "cast_transpose": lambda: fp8ext.cast_transpose(x, fp8ext.E5M2, one),
        "cast_transpose_dbias": lambda: fp8ext.cast_transpose_dbias(x, fp8ext.E5M2, one),
        "quantize_rowwise": lambda: fp8ext.quantize_rowwise(x),
        "quantize_blockwise": lambda: fp8ext.quantize_blockwise(x, fp8ext.E4M3, (1, 128)),
        "gemm": lambda: fp8ext.gemm(q, q, a_scale_inv=one, b_scale_inv=torch.full((1,), 0.5), out_dtype=torch.float32),
    }


@pytest.mark.parametrize("op", list(calls(torch.Generator().manual_seed(0))))
def test_an_op_called_from_4_threads_gives_the_serial_results(op):
    fn = calls(torch.Generator().manual_seed(0))[op]
    rounds = 20
    serial = flat(fn())
    with bounded(seconds=60):
        results = in_threads(lambda i: [flat(fn()) for _ in range(rounds)], THREADS)
    for i, per_thread in enumerate(results):
        for r, got in enumerate(per_thread):
            for k, (a, b) in enumerate(zip(got, serial)):
                assert torch.equal(a, b) or (a.dtype.is_floating_point and torch.equal(a.isnan(), b.isnan()) and
                                             torch.equal(a.nan_to_num(), b.nan_to_num())), \
                    f"thread {i}, round {r}: result {k} of {op} differs from the serial call's"


def _train(layer, xs, recipe):
    """(outputs, input gradients, weight gradients, scaling state) of a training step on each x."""
    out = []
    for x in xs:
        x = x.clone().requires_grad_(True)
        with fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = layer(x)
        y.float().pow(2).mean().backward()
        out.append((y.detach(), x.grad, layer.weight.grad.clone()))
        layer.weight.grad = layer.bias.grad = None
    return out, layer.get_extra_state()


@pytest.mark.parametrize("recipe", [fp8ext.DelayedScaling(), fp8ext.Float8CurrentScaling()], ids=["delayed", "current"])
def test_fp8linear_layers_trained_in_two_threads_give_their_serial_results(recipe):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    layers = [fp8ext.FP8Linear(64, 32), fp8ext.FP8Linear(64, 32)]
    inputs = [[torch.randn(32, 64, generator=g) * (4.0 ** s) * (i + 1) for s in range(4)] for i in range(2)]
    serial = [_train(copy.deepcopy(layer), xs, recipe) for layer, xs in zip(layers, inputs)]
    with bounded(seconds=60):
        threaded = in_threads(lambda i: _train(copy.deepcopy(layers[i]), inputs[i], recipe), 2)
    for i in range(2):
        (s_steps, s_state), (t_steps, t_state) = serial[i], threaded[i]
        for step, (a, b) in enumerate(zip(s_steps, t_steps)):
            for what, sa, tb in zip(("output", "input gradient", "weight gradient"), a, b):
                assert torch.equal(sa, tb), f"layer {i}, step {step}: the {what} differs from the serial run"
        assert torch.equal(s_state, t_state), f"layer {i}: the scaling state differs from the serial run"
