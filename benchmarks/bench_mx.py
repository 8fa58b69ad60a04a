"""Block-scaled quantization on the GPU: fp8ext.quantize_mx (MXFP8, MXFP6, MXFP4) and fp8ext.quantize_nvfp4 as
one-pass kernels, next to the same arithmetic as torch operations (the CPU reference, run on the GPU: several
passes) and next to a device copy of x, in one run. Bytes moved per call: x read, codes (one per byte) and scales
written; NVFP4 reads x twice (its tensor amax first). Medians of CUDA-event timings after warm-up, random bf16
input.

    python benchmarks/bench_mx.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _harness import bench_ms, copy_tbps, device_header, save, table  # noqa: E402

import fp8ext  # noqa: E402
from fp8ext import mx  # noqa: E402

SHAPES = [(4096, 4096), (8192, 8192), (16384, 8192)]


def torch_path(fn):
    """fp8ext.mx's function with its kernel turned off: the torch composition the CPU runs."""
    def call(*args, **kwargs):
        saved = mx._use_kernel
        mx._use_kernel = lambda x: False
        try:
            return fn(*args, **kwargs)
        finally:
            mx._use_kernel = saved
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_mx: no CUDA device; nothing to measure")
        return
    head = device_header()
    copy_bw = copy_tbps()
    print(f"# block-scaled quantization, {head['device']}, {head['date']}; copy bandwidth {copy_bw:.2f} TB/s")
    rows = []
    for r, c in SHAPES[1:2] if args.quick else SHAPES:
        torch.manual_seed(0)
        x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
        cases = {f"mx {f.name}": (lambda f=f: fp8ext.quantize_mx(x, f), lambda f=f: torch_path(fp8ext.quantize_mx)(x, f))
                 for f in (fp8ext.E4M3, fp8ext.E3M2, fp8ext.E2M1)}
        cases["nvfp4"] = (lambda: fp8ext.quantize_nvfp4(x), lambda: torch_path(fp8ext.quantize_nvfp4)(x))
        t_copy = bench_ms(lambda: x.clone())
        for name, (kernel, composed) in cases.items():
            e1, s1 = kernel()[:2]
            e2, s2 = composed()[:2]
            same = torch.equal(e1.view(torch.uint8), e2.view(torch.uint8)) and torch.equal(s1.view(torch.uint8),
                                                                                          s2.view(torch.uint8))
            t_k, t_c = bench_ms(kernel), bench_ms(composed)
            nbytes = x.numel() * (2 + 1) + s1.numel() * s1.element_size() + (x.numel() * 2 if name == "nvfp4" else 0)
            rows.append({"shape": f"{r}x{c}", "format": name, "kernel us": t_k * 1e3, "torch ops us": t_c * 1e3,
                         "speedup": t_c / t_k, "kernel TB/s": nbytes / t_k / 1e9, "of copy": nbytes / t_k / 1e9 / copy_bw,
                         "copy us": t_copy * 1e3, "same bytes": same})
    print(table(rows, ["shape", "format", "kernel us", "torch ops us", "speedup", "kernel TB/s", "of copy", "copy us",
                       "same bytes"],
                {"kernel us": "{:.1f}", "torch ops us": "{:.1f}", "speedup": "{:.1f}x", "kernel TB/s": "{:.2f}",
                 "of copy": "{:.0%}", "copy us": "{:.1f}"}))
    save("bench_mx.json", {"header": head, "copy_tbps": copy_bw, "rows": rows})


if __name__ == "__main__":
    main()
