"""Where the GPU time of the two-layer Llama-3-8B-size block goes (development aid): torch.profiler's CUDA kernel
times of one training step, bf16 next to fp8ext, grouped into GEMMs, fp8ext casts, attention, norms and
elementwise work, and the rest.

    python benchmarks/dev/block_profile.py
"""
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_block as B  # noqa: E402

import fp8ext  # noqa: E402


def group(name: str) -> str:
    n = name.lower()
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "sm90_xmma" in n:
        return "GEMM"
    if "fp8ext" in n:
        return "fp8ext casts / scale update"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "norm" in n:
        return "RMSNorm"
    if "elementwise" in n or "foreach" in n or "reduce" in n or "silu" in n or "mul" in n or "copy" in n:
        return "elementwise / SGD / copies"
    return "other"


def main():
    recipe = fp8ext.DelayedScaling()
    x = torch.randn(2, 2048, B.D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn_like(x)
    for name, lin, fp8 in (("bf16", B.bf16_linear, False), ("fp8ext", B.fp8_linear, True)):
        mod = B.model(lin)
        step = B.training_step(mod, x, gy, fp8, recipe)
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        groups, kernels = {}, {}
        for e in prof.key_averages():
            t = e.self_device_time_total / 3 / 1e3  # ms per step
            if t <= 0:
                continue
            groups[group(e.key)] = groups.get(group(e.key), 0.0) + t
            kernels[e.key] = t
        total = sum(groups.values())
        print(f"== {name}: {total:.2f} ms of kernels per step")
        for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"   {g:<30} {t:7.2f} ms  {t / total:6.1%}")
        print("   top kernels:")
        for k, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
            print(f"     {t:7.3f} ms  {k[:110]}")
        del mod, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
