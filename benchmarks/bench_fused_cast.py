"""RMSNorm and SwiGLU with the FP8 cast of the next GEMM's input: as separate kernels (the step writing bf16, then
cast_transpose) and fused (the step computed inside cast_transpose; RMSNorm's rstd by a first pass), side by side in
one run with the copy bandwidth.

    python benchmarks/bench_fused_cast.py          # needs a CUDA GPU and fp8ext built with CUDA

Bytes per element of the step's output, bf16 input: RMSNorm separate 2 (x) + 2 (y) + 2 (y read) + 2 (q, q^T) = 8,
fused 2 (x, rstd pass) + 2 (x again) + 2 = 6; SwiGLU separate 4 + 2 + 2 + 2 = 10, fused 4 + 2 = 6. SwiGLU's gradient
(output dh [rows, 2 f], E5M2): separate 3 (h and dy read once per dh element) + 2 (dh) + 2 (dh read) + 2 = 9, fused
2.5 (gate and dy for both halves, up for d_gate) + 2 = 4.5. TB/s: those bytes over the time.
"""

from __future__ import annotations

import torch

import fp8ext
from fp8ext.modules import fused_linear as FL
from fp8ext.tensor import Quantizer
from fp8ext import fused
from _harness import copy_tbps, device_header, rounds, save, table

SHAPES = [("rmsnorm", 8192, 4096), ("rmsnorm", 4096, 8192), ("swiglu", 4096, 14336), ("swiglu", 8192, 14336),
          ("dswiglu", 4096, 28672), ("dswiglu", 16384, 11264)]


def main() -> None:
    if not (torch.cuda.is_available() and fp8ext.cuda_available()):
        raise SystemExit("bench_fused_cast.py needs a CUDA GPU and fp8ext built with CUDA")
    hdr = device_header()
    print(f"# RMSNorm / SwiGLU + FP8 cast_transpose, separate vs fused: {hdr['device']}, torch {hdr['torch']}, "
          f"{hdr['date']}")
    copy = copy_tbps()
    out = []
    fmt = fp8ext.E4M3
    for op, m, k in SHAPES:
        torch.manual_seed(0)
        width = 2 * k if op == "swiglu" else k
        x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(k, device="cuda") + 0.5
        dy = torch.randn(m, k // 2, device="cuda", dtype=torch.bfloat16) if op == "dswiglu" else None
        f = fp8ext.E5M2 if op == "dswiglu" else fmt
        scale = torch.tensor([3.0], device="cuda")
        amax = torch.zeros(1, device="cuda")
        code = {"rmsnorm": FL.RMSNORM, "swiglu": FL.SWIGLU, "dswiglu": FL.DSWIGLU}[op]

        def separate():
            if op == "rmsnorm":
                y = fused.rms_norm_train_gpu(x, g, 1e-5, torch.bfloat16)[0]
            else:
                y = fused.swiglu(x) if op == "swiglu" else fused.swiglu_backward_gpu(x, dy)
            return fp8ext.cast_transpose(y, f, scale.reshape(()), amax_out=amax)

        quantizer = Quantizer(f, 0.0, scale=scale, amax=amax)

        def fused_cast():
            x8, _ = FL._cast_with_prologue(code, x, g if op == "rmsnorm" else None, 1e-5, quantizer, dy=dy)
            return x8.data, x8.data_t

        a, b = separate(), fused_cast()
        same = torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(
            a[1].view(torch.uint8), b[1].view(torch.uint8))
        t = rounds({"separate": separate, "fused": fused_cast}, reps=50)
        n = m * k
        fused_bytes = n * {"rmsnorm": 6, "swiglu": 6, "dswiglu": 4.5}[op]
        sep_bytes = n * {"rmsnorm": 8, "swiglu": 10, "dswiglu": 9}[op]
        row = {"op": op, "rows": m, "cols": k, "separate_ms": t["separate"][0], "fused_ms": t["fused"][0],
               "speedup": t["separate"][0] / t["fused"][0], "separate_tbps": sep_bytes / t["separate"][0] / 1e9,
               "fused_tbps": fused_bytes / t["fused"][0] / 1e9, "copy_tbps": copy, "same_bytes": same}
        row["fused_of_copy"] = row["fused_tbps"] / copy
        out.append(row)
    cols = ["op", "rows", "cols", "separate_ms", "fused_ms", "speedup", "separate_tbps", "fused_tbps", "fused_of_copy",
            "same_bytes"]
    print(table(out, cols, {"separate_ms": "{:.3f}", "fused_ms": "{:.3f}", "speedup": "{:.2f}x",
                            "separate_tbps": "{:.2f}", "fused_tbps": "{:.2f}", "fused_of_copy": "{:.0%}"}))
    print(f"copy bandwidth {copy:.2f} TB/s (read + write)")
    save("bench_fused_cast.json", {"header": hdr, "rows": out, "copy_tbps": copy})


if __name__ == "__main__":
    main()
