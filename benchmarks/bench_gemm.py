"""FP8 GEMM throughput: bf16 torch.matmul, torch._scaled_mm and fp8ext.gemm (heuristic, then autotuned),
side by side in one run, plus block-scaled GEMMs and host time per call.

    python benchmarks/bench_gemm.py [--quick]    # needs a CUDA GPU and fp8ext built with CUDA

Shapes (M, K, N), out = x[M, K] @ w[N, K]^T with bf16 output, per-tensor scales, no fast accumulation
(what torch._scaled_mm's 1280 TFLOP/s anchor used): squares 1024..16384 and LLM layers (M in 2048, 8192,
16384; K, N from 4096/11008/14336). TFLOP/s = 2 M N K / median time (CUDA events, random data).
Goals (issue 3): fp8ext >= torch._scaled_mm everywhere, geometric mean >= 1.05x with autotune,
>= 1300 TFLOP/s at 8192^3, host time per call <= 10 us.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

import fp8ext
from _harness import device_header, host_us, rounds, save, table
from _harness import fp8_gemm_operands as operands

E4 = torch.float8_e4m3fn


def shapes(quick: bool):
    squares = [(s, s, s) for s in (1024, 2048, 4096, 8192, 16384)]
    llm = [(m, k, n) for m in (2048, 8192, 16384)
           for (k, n) in ((4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096))]
    return (squares[:4] + llm[5:8]) if quick else squares + llm


def sweep(quick):
    rows = []
    for (m, k, n) in shapes(quick):
        xb, wb, x8, w8, sxi, swi = operands(m, k, n)
        flop = 2 * m * n * k
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ours = fp8ext.gemm(x8, w8, a_scale_inv=sxi, b_scale_inv=swi, out=out).clone()
        ref = torch._scaled_mm(x8, w8.t(), scale_a=sxi, scale_b=swi, out_dtype=torch.bfloat16)
        diff = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
        fp8ext.gemm(x8, w8, a_scale_inv=sxi, b_scale_inv=swi, out=out, autotune=True)  # tunes its own plan once
        t = rounds({
            "bf16": lambda: xb @ wb.t(),
            "_scaled_mm": lambda: torch._scaled_mm(x8, w8.t(), scale_a=sxi, scale_b=swi, out_dtype=torch.bfloat16),
            "fp8ext": lambda: fp8ext.gemm(x8, w8, a_scale_inv=sxi, b_scale_inv=swi, out=out),
            "fp8ext tuned": lambda: fp8ext.gemm(x8, w8, a_scale_inv=sxi, b_scale_inv=swi, out=out, autotune=True),
        }, reps=10 if flop > 2e12 else 30)
        tf = {name: flop / v[0] / 1e9 for name, v in t.items()}
        spread = max((v[2] - v[1]) / v[0] for v in t.values())
        row = dict(tf) | {"M,K,N": f"{m},{k},{n}", "tuned/_scaled_mm": t["_scaled_mm"][0] / t["fp8ext tuned"][0],
                          "heur/_scaled_mm": t["_scaled_mm"][0] / t["fp8ext"][0],
                          "fp8/bf16": t["bf16"][0] / t["fp8ext tuned"][0], "spread": spread, "diff vs torch": diff}
        rows.append({k2: row[k2] for k2 in ["M,K,N", "bf16", "_scaled_mm", "fp8ext", "fp8ext tuned", "tuned/_scaled_mm",
                                            "heur/_scaled_mm", "fp8/bf16", "spread", "diff vs torch"]})
        print(f"  {row['M,K,N']:>18}: bf16 {tf['bf16']:5.0f}  _scaled_mm {tf['_scaled_mm']:5.0f}  fp8ext "
              f"{tf['fp8ext']:5.0f}  tuned {tf['fp8ext tuned']:5.0f} TFLOP/s  (spread {spread:.1%})", flush=True)
        del xb, wb, x8, w8, out, ours, ref
    torch.cuda.empty_cache()
    return rows


FMT = {"bf16": "{:.0f}", "_scaled_mm": "{:.0f}", "fp8ext": "{:.0f}", "fp8ext tuned": "{:.0f}",
       "tuned/_scaled_mm": "{:.3f}", "heur/_scaled_mm": "{:.3f}", "fp8/bf16": "{:.2f}", "spread": "{:.1%}",
       "diff vs torch": "{:.1e}"}


def block_scaled(quick):
    rows = []
    for (m, k, n) in ([(8192, 8192, 8192)] if quick else [(8192, 8192, 8192), (8192, 4096, 16384), (16384, 8192, 8192)]):
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda") * 0.05
        flop = 2 * m * n * k
        qx, sx = fp8ext.quantize(x, fp8ext.E4M3, 1.0), torch.ones((), device="cuda")
        qw, sw = fp8ext.quantize(w, fp8ext.E4M3, 100.0), torch.full((), 0.01, device="cuda")
        rx, rsx = fp8ext.quantize_rowwise(x)
        rw, rsw = fp8ext.quantize_rowwise(w)
        bx, bsx = fp8ext.quantize_blockwise(x, block=(1, 128))
        bw, bsw = fp8ext.quantize_blockwise(w, block=(128, 128))
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cases = {
            "per-tensor": lambda: fp8ext.gemm(qx, qw, a_scale_inv=sx, b_scale_inv=sw, out=out),
            "per-row": lambda: fp8ext.gemm(rx, rw, a_scale_inv=rsx, b_scale_inv=rsw, out=out),
            "1x128 x 128x128 blocks": lambda: fp8ext.gemm(bx, bw, a_scale_inv=bsx, b_scale_inv=bsw, out=out),
            "torch._scaled_mm per-row": lambda: torch._scaled_mm(rx, rw.t(), scale_a=rsx[:, None].contiguous(),
                                                                 scale_b=rsw[None, :].contiguous(),
                                                                 out_dtype=torch.bfloat16),
        }
        ok = {}
        for name, fn in cases.items():
            try:
                fn()
                ok[name] = fn
            except Exception as e:  # noqa: BLE001 - a refused combination is reported, not hidden
                rows.append({"M,K,N": f"{m},{k},{n}", "scales": name, "TFLOP/s": float("nan"),
                             "vs per-tensor": float("nan"), "note": str(e)[:90]})
        t = rounds(ok, reps=10)
        for name in ok:
            rows.append({"M,K,N": f"{m},{k},{n}", "scales": name, "TFLOP/s": flop / t[name][0] / 1e9,
                         "vs per-tensor": t["per-tensor"][0] / t[name][0], "note": ""})
        del x, w, qx, qw, rx, rw, bx, bw, out
    torch.cuda.empty_cache()
    return rows


def host_time():
    """Microseconds of host time per call for a tiny GEMM (64 x 64 x 64), next to torch._scaled_mm's."""
    m = k = n = 64
    x8 = fp8ext.quantize(torch.randn(m, k, device="cuda"))
    w8 = fp8ext.quantize(torch.randn(n, k, device="cuda"))
    one = torch.ones((), device="cuda")
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cases = {
        "fp8ext.gemm(out=...)": lambda: fp8ext.gemm(x8, w8, a_scale_inv=one, b_scale_inv=one, out=out),
        "fp8ext.gemm (allocates out)": lambda: fp8ext.gemm(x8, w8, a_scale_inv=one, b_scale_inv=one),
        "torch._scaled_mm": lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
        "fp8ext.quantize": lambda: fp8ext.quantize(out, fp8ext.E4M3, one),
    }
    return {name: host_us(fn) for name, fn in cases.items()}


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(14, 5))
    labels = [r["M,K,N"] for r in rows]
    xs = range(len(rows))
    for i, (key, color) in enumerate((("bf16", "gray"), ("_scaled_mm", "tab:orange"), ("fp8ext", "tab:blue"),
                                      ("fp8ext tuned", "tab:green"))):
        label = "torch._scaled_mm" if key == "_scaled_mm" else key  # matplotlib hides labels starting with "_"
        ax.bar([x + (i - 1.5) * 0.2 for x in xs], [r[key] for r in rows], 0.2, label=label, color=color)
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("FP8 GEMM (bf16 out, per-tensor scales) vs bf16 matmul")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    args = ap.parse_args()
    if not fp8ext.cuda_available():
        sys.exit("bench_gemm: needs a CUDA device and fp8ext built with CUDA")
    head = device_header()
    print(f"# {head['device']} ({head['sms']} SMs), torch {head['torch']}, CUDA {head['cuda']}, "
          f"cuBLASLt {fp8ext.build_info()['cublaslt_version']}, {head['date']}")
    torch.manual_seed(0)
    ws = fp8ext.gemm_workspace_info()
    print(f"# fp8ext's cuBLASLt workspace: {ws['owner']}'s, {ws['bytes'] / 2**20:g} MiB")
    rows = sweep(args.quick)
    print(table(rows, list(rows[0]), FMT))
    gm = math.exp(sum(math.log(r["tuned/_scaled_mm"]) for r in rows) / len(rows))
    gm_h = math.exp(sum(math.log(r["heur/_scaled_mm"]) for r in rows) / len(rows))
    worst = min(rows, key=lambda r: r["tuned/_scaled_mm"])
    print(f"geometric mean vs torch._scaled_mm: heuristic {gm_h:.3f}x, autotuned {gm:.3f}x; "
          f"worst autotuned {worst['tuned/_scaled_mm']:.3f}x at {worst['M,K,N']}")
    blocks = block_scaled(args.quick)
    print(table(blocks, ["M,K,N", "scales", "TFLOP/s", "vs per-tensor", "note"],
                {"TFLOP/s": "{:.0f}", "vs per-tensor": "{:.2f}"}))
    host = host_time()
    for k, v in host.items():
        print(f"host time per call, {k}: {v:.1f} us")
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    plot(rows, os.path.join(out_dir, "bench_gemm.png"))
    save("bench_gemm.json", {"header": head, "workspace": ws, "sweep": rows, "geomean_tuned": gm, "geomean_heuristic": gm_h,
                             "blocks": blocks, "host_us": host, "cache": fp8ext.gemm_cache_info()})


if __name__ == "__main__":
    main()
