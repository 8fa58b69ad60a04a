"""Decode attention at long context: fp8ext's kernel on an FP8 (E4M3) KV cache against torch's SDPA on a bf16 cache
of the same size, in one run; the bytes each reads, and the copy bandwidth as the ceiling.

One query token per sequence, Llama-3-8B's heads (32 query heads, 8 K/V heads, head_dim 128; also 64 and 256 at
32k context). CUDA events around
loops of calls, medians, after warm-up; random caches and queries.

    python benchmarks/bench_decode_attention.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _harness import copy_tbps, device_header, save, steady_ms, table  # noqa: E402

from fp8ext.inference.attention import decode_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_attention: no CUDA device; nothing to measure")
        return
    head = device_header()
    copy_bw = copy_tbps()
    h, kv = 32, 8
    cases = [(8, 32768, 128)] if args.quick else [(1, 4096, 128), (8, 8192, 128), (8, 32768, 128), (32, 32768, 128),
                                                  (8, 32768, 64), (8, 32768, 256)]
    rows = []
    for b, length, hd in cases:
        torch.manual_seed(0)
        q = torch.randn(b, h, hd, device="cuda", dtype=torch.bfloat16)
        k16 = torch.randn(b, kv, length, hd, device="cuda", dtype=torch.bfloat16)
        v16 = torch.randn(b, kv, length, hd, device="cuda", dtype=torch.bfloat16)
        ks = k16.float().abs().amax(dim=(0, 2, 3)) / 448
        vs = v16.float().abs().amax(dim=(0, 2, 3)) / 448
        k8 = (k16.float() / ks.view(1, kv, 1, 1)).to(torch.float8_e4m3fn)
        v8 = (v16.float() / vs.view(1, kv, 1, 1)).to(torch.float8_e4m3fn)
        sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k16, v16, enable_gqa=True)  # noqa: E731
        fp8 = lambda: decode_attention(q, k8, v8, length, ks, vs)  # noqa: E731
        err = float((fp8().float() - sdpa()[:, :, 0].float()).abs().max())
        t16, t8 = steady_ms(sdpa, steps=20), steady_ms(fp8, steps=20)
        for name, t, nbytes in (("bf16 SDPA", t16, k16.numel() * 4), ("fp8ext FP8", t8, k8.numel() * 2)):
            rows.append({"batch": b, "context": length, "head_dim": hd, "kernel": name, "us": t * 1e3, "speedup": t16 / t,
                         "cache MB": nbytes / 1e6, "TB/s": nbytes / t / 1e9, "of copy": nbytes / t / 1e9 / copy_bw,
                         "max |diff|": f"{err:.3g}" if name != "bf16 SDPA" else "-"})
        del q, k16, v16, k8, v8
        torch.cuda.empty_cache()
    print(f"# decode attention, {head['device']}, {head['date']}; copy bandwidth {copy_bw:.2f} TB/s (read + write)")
    print(table(rows, ["batch", "context", "head_dim", "kernel", "us", "speedup", "cache MB", "TB/s", "of copy", "max |diff|"],
                {"us": "{:.1f}", "speedup": "{:.2f}x", "cache MB": "{:.0f}", "TB/s": "{:.2f}", "of copy": "{:.0%}"}))
    save("bench_decode_attention.json", {"header": head, "copy_tbps": copy_bw, "rows": rows})


if __name__ == "__main__":
    main()
