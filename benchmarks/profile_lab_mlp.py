"""Where the lab's MLP step spends its host time: the model of notebooks/lab_3_2_3_fp8_training_inference.ipynb
(SimpleMLP 768-3072-768, GELU, biases, batch 32, AdamW, MSE, loss.item() every step; bf16 parameters), nn.Linear in bf16
next to fp8ext.Linear under fp8_autocast (the lab's recipe: HYBRID, history 16, most_recent), eager. For each: the step
time (with the loss.item() sync), the host time to issue a step (no sync), the Python functions by own time (cProfile,
100 steps) and the host-side ops and CUDA runtime calls by own CPU time (torch.profiler, 20 steps).

    python benchmarks/profile_lab_mlp.py        # needs a CUDA GPU and fp8ext built with CUDA
"""
import cProfile
import io
import pstats

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import fp8ext
from bench_linear import LabMLP
from fp8ext._bench import host_us

RECIPE = fp8ext.DelayedScaling(fp8_format=fp8ext.Format.HYBRID, amax_history_len=16, amax_compute_algo="most_recent")


def make(kind: str):
    torch.manual_seed(0)
    if kind == "bf16":
        return LabMLP(nn.Linear).cuda().to(torch.bfloat16), None
    return LabMLP(lambda i, o: fp8ext.Linear(i, o, device="cuda", params_dtype=torch.bfloat16)), RECIPE


def stepper(model, recipe, x, target, sync: bool = True):
    """One training step; with sync, loss.item() (the lab's loop waits for the GPU every step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def one():
        opt.zero_grad(set_to_none=True)
        if recipe is None:
            loss = F.mse_loss(model(x), target)
        else:
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        return loss.item() if sync else loss
    return one


def main() -> None:
    x = torch.randn(32, 768, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(32, 768, device="cuda", dtype=torch.bfloat16)
    for kind in ("bf16", "fp8"):
        model, recipe = make(kind)
        one, issue = stepper(model, recipe, x, target), stepper(model, recipe, x, target, sync=False)
        for _ in range(20):
            one()
        step_us, issue_us = host_us(one, calls=20), host_us(issue, calls=10)
        print(f"== {kind}: step {step_us:.1f} us (loss.item() each step); host issue {issue_us:.1f} us (no sync)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            one()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(28)
        print(out.getvalue()[-5000:])
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
            for _ in range(20):
                one()
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))


if __name__ == "__main__":
    main()
