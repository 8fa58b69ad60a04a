"""One weight-only decode GEMM, for a profiler: python benchmarks/dev/wo_one.py FMT K N M [calls]."""
import sys

import torch

from fp8ext.weight_only import WeightOnlyLinear

fmt, k, n, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
calls = int(sys.argv[5]) if len(sys.argv) > 5 else 3
torch.manual_seed(0)
lin = torch.nn.Linear(k, n, bias=False, device="cuda")
layer = WeightOnlyLinear.from_linear(lin, fmt).cuda()
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
print("splits", layer._kernel_args(m)[2])
for _ in range(calls):
    layer(x)
torch.cuda.synchronize()
