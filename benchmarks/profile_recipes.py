"""Where a training step's GPU time goes under each FP8 recipe: torch.profiler's CUDA kernel table for FP8Linear
fwd+bwd at one shape (default 16384 x 8192 x 8192), delayed scaling next to block and row-wise scaling.

    python benchmarks/profile_recipes.py [--shape M K N] [--rows 12]
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[16384, 8192, 8192])
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    m, k, n = args.shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    layer = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
    for name, recipe in (("delayed", fp8ext.DelayedScaling()), ("block", fp8ext.Float8BlockScaling()),
                         ("rowwise", fp8ext.Float8RowwiseScaling())):
        def step():
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            y.backward(gy)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(f"== {name}: FP8Linear({k}, {n}) on {m} tokens, 5 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
