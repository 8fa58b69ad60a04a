"""Linear layer: fp8ext.Linear (FP8Linear) forward and backward under fp8_autocast against float64, then its
training-step time and memory next to nn.Linear in bf16."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .._bench import cuda_memory, rounds, saved_bytes
from ..core.context import fp8_autocast
from ..core.formats import E4M3, E5M2
from ..core.recipe import DelayedScaling
from ..modules.linear import Linear

from ._run import Run

SECTION = "linear"
MIB = 2**20


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    want = want.double()
    return float((got.double() - want).norm() / want.norm())


def _float64_step(lin: nn.Linear, x: torch.Tensor, gy: torch.Tensor):
    """(y, dx, dW) of y = x W^T + b in float64."""
    xr = x.detach().double().requires_grad_()
    w = lin.weight.detach().double().requires_grad_()
    y = xr @ w.t() + lin.bias.detach().double()
    y.backward(gy.double())
    return y.detach(), xr.grad, w.grad


def _step(layer: nn.Module, x: torch.Tensor, gy: torch.Tensor, fp8: bool):
    xx = x.detach().clone().requires_grad_()
    with fp8_autocast(enabled=fp8):
        y = layer(xx)
    y.backward(gy.to(y.dtype))
    return y.detach(), xx.grad, layer.weight.grad


def check(run: Run) -> None:
    torch.manual_seed(0)
    u_fwd, u_bwd = 2.0 ** -(E4M3.mant_bits + 1), 2.0 ** -(E5M2.mant_bits + 1)
    for (m, k, n) in ([(64, 128, 96), (256, 512, 256)] if run.quick else [(64, 128, 96), (256, 512, 256),
                                                                          (512, 1024, 768)]):
        lin = nn.Linear(k, n, device=run.device)
        f8 = Linear(k, n, device=run.device)
        f8.load_state_dict(lin.state_dict())
        x = torch.randn(m, k, device=run.device)
        gy = torch.randn(m, n, device=run.device)
        ref = _float64_step(lin, x, gy)
        got = _step(f8, x, gy, fp8=True)
        b16 = _step(copy.deepcopy(lin).bfloat16(), x.bfloat16(), gy, fp8=False)
        for i, (what, fmt, limit) in enumerate((("output", "E4M3", u_fwd), ("input gradient", "E5M2", u_bwd),
                                                ("weight gradient", "E5M2", u_bwd))):
            err = rel_error(got[i], ref[i])
            run.check(SECTION, f"FP8Linear {what}: relative error against float64 below {fmt}'s unit roundoff",
                      err <= limit, value=err, limit=limit, unit="relative error", shape=(m, k, n))
            run.measure(SECTION, "relative error vs float64", err, "relative", case=what, precision="fp8ext FP8",
                        shape=(m, k, n))
            run.measure(SECTION, "relative error vs float64", rel_error(b16[i], ref[i]), "relative", case=what,
                        precision="bf16", shape=(m, k, n))
    _check_saved_memory(run)
    run.note(SECTION, "FP8Linear computes its output with E4M3 inputs and weights (unit roundoff 2^-4) and its "
                      "gradients with E5M2 output gradients (2^-3); the limits are those roundoffs, bf16 "
                      "nn.Linear's error is listed beside it.")


def _check_saved_memory(run: Run) -> None:
    """Activation memory autograd keeps for backward: FP8Linear keeps x as FP8 (1 byte) where nn.Linear keeps
    bf16 (2 bytes)."""
    m, k, n = 512, 1024, 1024
    x = torch.randn(m, k, device=run.device, dtype=torch.bfloat16, requires_grad=True)
    lin = nn.Linear(k, n, bias=False, device=run.device, dtype=torch.bfloat16)
    f8 = Linear(k, n, bias=False, device=run.device, params_dtype=torch.bfloat16)
    b16, _ = saved_bytes(lambda: lin(x), n * k)
    with fp8_autocast(enabled=True):
        act8, w8 = saved_bytes(lambda: f8(x), n * k)
    # FP8Linear also keeps the weight's FP8 copy (one byte per weight, for the input gradient): a tensor of its own on
    # the composed path, part of the one buffer the fast path keeps; it is not activation memory
    b8 = act8 + w8 - n * k
    for precision, b in (("bf16", b16), ("fp8ext FP8", b8)):
        run.measure(SECTION, "activation memory kept for backward", b / MIB, "MiB", case="one layer",
                    precision=precision, shape=(m, k, n))
    run.check(SECTION, "FP8Linear keeps at most half of bf16 nn.Linear's activation memory for backward",
              b8 <= b16 / 2 + 4096, value=b8 / MIB, limit=b16 / 2 / MIB, unit="MiB", shape=(m, k, n))
    run.trace(SECTION, "FP8Linear forward and backward", {
        "FP8Linear step": lambda: _step(f8, x, torch.randn(m, n, device=run.device), fp8=True),
        "nn.Linear bf16 step": lambda: _step(lin, x, torch.randn(m, n, device=run.device), fp8=False)})


def speed(run: Run) -> None:
    if run.speed_skipped(SECTION, "training-step time and GPU memory of FP8Linear against nn.Linear in bf16"):
        return
    torch.manual_seed(0)
    recipe = DelayedScaling()
    shapes = [(4096, 1024, 1024), (4096, 4096, 4096)] if run.quick else [
        (4096, 1024, 1024), (8192, 4096, 4096), (8192, 4096, 16384)]
    for (m, k, n) in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        f8 = Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
        f8.load_state_dict(lin.state_dict())

        def fp8_forward():
            f8._weight_cache = None  # the weight changes every training step: recast it, as a real step would
            with fp8_autocast(fp8_recipe=recipe):
                return f8(x)

        steps = {"bf16": (lambda: lin(x), lambda y: y.backward(gy)),
                 "fp8ext FP8": (fp8_forward, lambda y: y.backward(gy))}
        impls = {name: (lambda f=f, b=b: b(f())) for name, (f, b) in steps.items()}
        for fn in impls.values():
            fn()
        t = rounds(impls, reps=10 if m * n * k > 1e11 else 30)
        shape = (m, k, n)
        for name, (ms, _, _) in t.items():
            run.measure(SECTION, "step time (forward + backward)", ms, "ms", case="one layer", precision=name,
                        shape=shape)
            for kind, b in cuda_memory(*steps[name]).items():
                run.measure(SECTION, f"GPU memory {kind}", b / MIB, "MiB", case="one layer", precision=name,
                            shape=shape)
        run.measure(SECTION, "speedup vs bf16", t["bf16"][0] / t["fp8ext FP8"][0], "x", case="Linear step",
                    shape=shape)
        run.trace(SECTION, f"linear step {m}x{k}x{n}", impls)
        del x, gy, lin, f8
        torch.cuda.empty_cache()
    run.note(SECTION, "A step is forward and backward of y = x W^T (bf16 x, no bias) with a random output gradient; "
                      "the FP8 step recasts its weight, as a training step with a changed weight does, under "
                      "fp8_autocast(DelayedScaling()). GPU memory of a step is counted from what was allocated "
                      "before it: nn.Linear keeps its input x, which the caller holds anyway, so its figure is "
                      "mostly its output; FP8Linear keeps FP8 copies of x and W besides. The saving shows in a "
                      "model, where x would otherwise stay alive for backward (see the transformer block).")
