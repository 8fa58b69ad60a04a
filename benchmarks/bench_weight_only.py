"""Decode-sized matrix multiplies (M = 1..16 tokens) with weight-only FP8 / MXFP6 / MXFP4 / NVFP4 weights against
bf16 F.linear, in one run on one GPU, with the device's copy bandwidth as the ceiling.

Each layer is held in several copies, more than the L2 cache holds together, and the timed loop cycles through
them, so every call reads its weights from HBM as a decode step does. Three timings per row: "eager" (CUDA events
around a loop of calls from Python: includes the host's work per call when it exceeds the GPU's), "graph" (the
same loop captured once as a CUDA graph and replayed, as decode servers run it: the GPU time alone; back-to-back
weight-only calls overlap one's last blocks with the next one's first loads) and "after op" (graphed, each call
after an elementwise kernel that makes its x, as between a model's norm and its projection). Medians of 5
repeats after warm-up; random weights and inputs.

    python benchmarks/bench_weight_only.py [--quick] [--formats fp8,mxfp4]
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _harness import copy_tbps, device_header, save, steady_ms, table  # noqa: E402

from fp8ext.weight_only import WeightOnlyLinear  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N)
FORMATS = ["fp8", "mxfp6", "mxfp4", "nvfp4"]
GOALS = {"fp8": 1.8, "mxfp6": 2.0, "mxfp4": 2.8, "nvfp4": 2.6}
L2_BYTES = 256 << 20  # the copies of one layer together: well past H100's 50 MB L2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape, M in (1, 16)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {FORMATS}")
    args = ap.parse_args()
    formats = args.formats.split(",")
    if not set(formats) <= set(FORMATS):
        ap.error(f"--formats: choose from {FORMATS}")
    if not torch.cuda.is_available():
        print("bench_weight_only: no CUDA device; nothing to measure")
        return
    shapes = SHAPES[:1] if args.quick else SHAPES
    ms = [1, 16] if args.quick else [1, 4, 16]
    head = device_header()
    copy_bw = copy_tbps()
    print(f"# weight-only decode GEMMs, {head['device']}, {head['date']}; copy bandwidth {copy_bw:.2f} TB/s "
          f"(read + write)")
    rows = []
    for k, n in shapes:
        torch.manual_seed(0)
        w = torch.randn(n, k) * 0.02
        reps = max(2, -(-L2_BYTES // (n * k * 2)))
        bf16 = [w.to("cuda", torch.bfloat16) for _ in range(reps)]
        lin = torch.nn.Linear(k, n, bias=False, device="cuda")
        with torch.no_grad():
            lin.weight.copy_(w)  # packed on the GPU (fp8ext.mx runs there too)
        layers = {}
        for fmt in formats:
            one = WeightOnlyLinear.from_linear(lin, fmt).cuda()
            layers[fmt] = [one] + [copy_layer(one) for _ in range(reps - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            calls = {"bf16": lambda i, a=x: F.linear(a, bf16[i])}
            for fmt in formats:
                assert layers[fmt][0].uses_kernel(x)
                calls[fmt] = lambda i, a=x, L=layers[fmt]: L[i](a)
            eager = {name: cycle_ms(call, reps) for name, call in calls.items()}
            graph = {name: graphed_ms(call, reps) for name, call in calls.items()}
            # the same with an elementwise kernel making each call's x, as in a model (the kernel before the GEMM
            # is then not another GEMM that it can overlap with)
            after_op = {name: graphed_ms(lambda i, c=call: c(i, x.mul(1.0)), reps) for name, call in calls.items()}
            for name, t in graph.items():
                nbytes = n * k * 2 if name == "bf16" else layers[name][0].nbytes
                rows.append({"K": k, "N": n, "M": m, "weights": name, "graph us": t * 1e3,
                             "speedup": graph["bf16"] / t, "goal": GOALS.get(name, ""),
                             "TB/s": nbytes / t / 1e9, "of copy": nbytes / t / 1e9 / copy_bw,
                             "after op us": after_op[name] * 1e3, "after op speedup": after_op["bf16"] / after_op[name],
                             "eager us": eager[name] * 1e3, "eager speedup": eager["bf16"] / eager[name]})
        del bf16, layers
        torch.cuda.empty_cache()
    print(table(rows, ["K", "N", "M", "weights", "graph us", "speedup", "goal", "TB/s", "of copy", "after op us",
                       "after op speedup", "eager us", "eager speedup"],
                {"graph us": "{:.1f}", "speedup": "{:.2f}x", "TB/s": "{:.2f}", "of copy": "{:.0%}",
                 "after op us": "{:.1f}", "after op speedup": "{:.2f}x", "eager us": "{:.1f}",
                 "eager speedup": "{:.2f}x"}))
    print("(TB/s: weight bytes read per second; 'of copy': that over the copy's bandwidth, bytes read + written;\n"
          " 'after op': graphed, each call after an elementwise kernel that makes its x, both sides)")
    save("bench_weight_only.json", {"header": head, "copy_tbps": copy_bw, "rows": rows})


def copy_layer(layer):
    """An independent copy of a layer's buffers on the same device (another place in memory)."""
    return copy.deepcopy(layer)


def cycle_ms(call, reps: int) -> float:
    """Milliseconds per call, cycling through `reps` copies of the weights (4 passes per timed loop)."""
    state = {"i": 0}

    def step():
        call(state["i"])
        state["i"] = (state["i"] + 1) % reps

    return steady_ms(step, steps=4 * reps)


def graphed_ms(call, reps: int) -> float:
    """Milliseconds per call of one pass over the `reps` copies captured as a CUDA graph, replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (workspaces, cuBLAS handles)
        for i in range(reps):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(i)
    return steady_ms(graph.replay, steps=8) / reps


if __name__ == "__main__":
    main()
