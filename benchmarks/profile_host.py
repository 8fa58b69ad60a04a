"""Where a small FP8Linear training step's host time goes: the Python functions (cProfile, by own time) of one
fwd+bwd step at a host-bound shape (default 4096 x 1024 x 1024, bf16, bias), for delayed and current scaling,
next to nn.Linear's step, with each step's host time (issued back to back, few enough not to fill the launch queue), its time on the GPU
(CUDA events) and the GPU's busy time (torch.profiler's kernel times) in the same run: a step whose host time
exceeds its busy time is bound by the host.

    python benchmarks/profile_host.py [--shape M K N] [--rows 20] [--steps 300]
"""
import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch import nn

import fp8ext


def timed(step, steps: int):
    """(host us per step issued back to back, GPU ms per step from CUDA events) of one run of `steps` steps."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    host = (time.perf_counter() - t0) / steps * 1e6
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / steps


def kernel_us(step, steps: int) -> tuple:
    """(GPU kernel and memset time per step in us, kernels per step) from torch.profiler: the GPU's busy time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) / steps, len(events) / steps


def runtime_table(step, steps: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def profile_table(step, steps: int, rows: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).strip_dirs().sort_stats("tottime").print_stats(rows)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[4096, 1024, 1024])
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--steps", type=int, default=20, help="steps per timing run (few enough not to fill the launch queue)")
    args = ap.parse_args()
    m, k, n = args.shape
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    steps = {}
    for bias in (False, True):
        lin = nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16)
        steps[f"bf16{' bias' * bias}"] = lambda lin=lin: lin(x).backward(gy)
        for name, recipe in (("delayed", fp8ext.DelayedScaling()), ("current", fp8ext.CurrentScaling())):
            f8 = fp8ext.FP8Linear(k, n, bias=bias, device="cuda", params_dtype=torch.bfloat16)

            def step(recipe=recipe, f8=f8):
                with fp8ext.fp8_autocast(fp8_recipe=recipe):
                    y = f8(x)
                y.backward(gy)
            steps[f"{name}{' bias' * bias}"] = step
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, M,K,N {m},{k},{n}")
    for step in steps.values():
        for _ in range(20):
            step()
    # timings first, in rounds over the variants (a profiler run leaves the host slower for the rest of the process)
    runs = {name: [] for name in steps}
    for _ in range(5):
        for name, step in steps.items():
            runs[name].append(timed(step, args.steps))
    times = {name: (statistics.median(h for h, _ in r), statistics.median(g for _, g in r)) for name, r in runs.items()}
    for name, step in steps.items():
        busy, launches = kernel_us(step, args.steps)
        (host, gpu), base = times[name], times["bf16 bias" if "bias" in name else "bf16"][0]
        print(f"{name:14s} host {host:7.1f} us/step ({host / base:.2f}x bf16's)   GPU {gpu * 1e3:7.1f} us/step   "
              f"kernels {busy:6.1f} us/step ({launches:.0f} per step)")
    for name in ("delayed", "delayed bias"):
        print(f"\n== {name}: Python functions by own time over {args.steps} steps")
        print(profile_table(steps[name], args.steps, args.rows))
        print(f"== {name}: host-side ops and CUDA runtime calls by own CPU time over {args.steps} steps")
        print(runtime_table(steps[name], args.steps, args.rows))


if __name__ == "__main__":
    main()
