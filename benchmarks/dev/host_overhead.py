"""Where the host time of one small fp8ext.gemm call goes, piece by piece (development aid).

    python benchmarks/dev/host_overhead.py

Each figure: microseconds per call, issuing 400 calls between synchronisations (fewer than the launch
queue holds), median of 5 runs. The pieces are what fp8ext.gemm does; the last rows are the whole calls.
"""
import os
import sys

import torch

import fp8ext
from fp8ext import _C
from fp8ext._boundary import dl_fp8
from fp8ext._gemm import workspace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _harness import host_us  # noqa: E402


def main():
    x8 = fp8ext.quantize(torch.randn(64, 64, device="cuda"))
    w8 = fp8ext.quantize(torch.randn(64, 64, device="cuda"))
    one = torch.ones((), device="cuda")
    out = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)
    dev = out.device
    stream = torch._C._cuda_getCurrentRawStream(0)
    caps = [dl_fp8(x8), dl_fp8(w8), torch._C._to_dlpack(one), torch._C._to_dlpack(one), torch._C._to_dlpack(out)]
    ws = workspace(dev, stream)
    rows = {
        "x.add_(1) (a trivial torch op)": lambda: out.add_(1),
        "torch.empty(64x64 bf16)": lambda: torch.empty((64, 64), dtype=torch.bfloat16, device=dev),
        "torch._C._to_dlpack(t)": lambda: torch._C._to_dlpack(out),
        "t.view(torch.uint8)": lambda: x8.view(torch.uint8),
        "_cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch.compiler.is_compiling()": lambda: torch.compiler.is_compiling(),
        "_C.gemm, capsules ready (C + cuBLASLt)": lambda: _C.gemm(*caps[:2], 0, 0, *caps[2:], workspace=ws,
                                                                stream=stream),
        "fp8ext.gemm(out=...)": lambda: fp8ext.gemm(x8, w8, a_scale_inv=one, b_scale_inv=one, out=out),
        "fp8ext.gemm (allocates out)": lambda: fp8ext.gemm(x8, w8, a_scale_inv=one, b_scale_inv=one),
        "torch._scaled_mm": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "fp8ext.quantize(bf16 64x64, device scale)": lambda: fp8ext.quantize(out, fp8ext.E4M3, one),
    }
    for name, fn in rows.items():
        print(f"{name:45s} {host_us(fn):7.2f} us")


if __name__ == "__main__":
    main()
