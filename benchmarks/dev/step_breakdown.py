"""GPU kernel times of one FP8Linear training step next to the bf16 step (development aid), from
torch.profiler: which kernels the step runs and how long each takes.

    python benchmarks/dev/step_breakdown.py [M K N]
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ext


def main():
    m, k, n = (int(v) for v in sys.argv[1:4]) if len(sys.argv) >= 4 else (8192, 4096, 4096)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
    recipe = fp8ext.DelayedScaling()

    def fp8_step():
        f8._weight_cache = None
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            y = f8(x)
        y.backward(gy)

    def bf16_step():
        lin(x).backward(gy)

    for name, fn in (("bf16", bf16_step), ("fp8ext", fp8_step)):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        print(f"== {name} step ({m},{k},{n}), kernel times over 10 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))


if __name__ == "__main__":
    main()
