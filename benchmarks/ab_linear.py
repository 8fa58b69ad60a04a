"""One side of an A/B run of FP8Linear's step times: whichever fp8ext `import fp8ext` finds (PYTHONPATH picks the
tree), measured next to bf16 in the same process. Run it alternately for two trees, several times, and summarise:

    PYTHONPATH=/path/to/tree python benchmarks/ab_linear.py LABEL   # writes $OUT/ab_LABEL_<n>.json
    python benchmarks/ab_linear.py --summary                         # the table of every ab_*.json in $OUT

Host-bound figures (a small layer, the lab's MLP) move by up to 2x between processes on one machine, so each side runs
in several processes, alternating, and the summary gives each figure's median over them with its range.
Measured: fwd+bwd of one layer, x [M, K] bf16 and W [N, K] bf16, no bias, with delayed and current scaling, at
(4096,1024,1024) (host-bound) and two large shapes, CUDA-event medians with one step between synchronisations and
steps back to back (steady); the lab's SimpleMLP (bench_linear.lab_mlp: eager, and captured as CUDA graphs).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys

import torch
from torch import nn

import fp8ext
from _harness import device_header, rounds, steady_ms, table

SHAPES = [(4096, 1024, 1024), (8192, 4096, 4096), (8192, 4096, 16384)]


def _steps(shape):
    m, k, n = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
    f8.load_state_dict(lin.state_dict())
    recipes = {"delayed": fp8ext.DelayedScaling(), "current": fp8ext.Float8CurrentScaling()}

    def fp8(recipe):
        def step():
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                y = f8(x)
            y.backward(gy)
        return step

    return {"bf16": lambda: lin(x).backward(gy), **{name: fp8(r) for name, r in recipes.items()}}


def measure() -> dict:
    from bench_linear import lab_mlp
    out = {"header": device_header(), "fp8ext": os.path.dirname(fp8ext.__file__), "linear": {}}
    for shape in SHAPES:
        impls = _steps(shape)
        for fn in impls.values():
            fn()
        big = shape[0] * shape[1] * shape[2] > 1e11
        t = {name: v[0] for name, v in rounds(impls, reps=10 if big else 30).items()}
        s = {name: steady_ms(fn, steps=10 if big else 40) for name, fn in impls.items()}
        key = ",".join(map(str, shape))
        out["linear"][key] = {f"{name} vs bf16": t["bf16"] / t[name] for name in ("delayed", "current")}
        out["linear"][key] |= {f"steady {name} vs bf16": s["bf16"] / s[name] for name in ("delayed", "current")}
        print(key, {k: round(v, 3) for k, v in out["linear"][key].items()}, flush=True)
        del impls
        torch.cuda.empty_cache()
    lab = lab_mlp()
    out["lab_mlp"] = {r["variant"]: r["vs bf16 eager"] for r in lab}
    out["lab_mlp"] |= {r["variant"] + " vs bf16 graphed": r["vs bf16 graphed"]
                       for r in lab if "graphed" in r["variant"]}
    print("lab MLP", {k: round(v, 3) for k, v in out["lab_mlp"].items()}, flush=True)
    return out


def summary(out_dir: str) -> str:
    runs = {}
    for path in sorted(glob.glob(os.path.join(out_dir, "ab_*.json"))):
        label = os.path.basename(path)[3:].rsplit("_", 1)[0]
        runs.setdefault(label, []).append(json.load(open(path)))
    figures = {}
    for label, rs in runs.items():
        for r in rs:
            flat = {f"{shape} {k}": v for shape, d in r["linear"].items() for k, v in d.items()}
            flat |= {f"lab MLP {k}": v for k, v in r["lab_mlp"].items()}
            for k, v in flat.items():
                figures.setdefault(k, {}).setdefault(label, []).append(v)
    labels = list(runs)
    rows = []
    for k, per in figures.items():
        row = {"figure (x of bf16's speed)": k}
        for label in labels:
            v = per.get(label, [])
            row[label] = f"{statistics.median(v):.3f} ({min(v):.2f}-{max(v):.2f}, n={len(v)})" if v else "-"
        rows.append(row)
    return table(rows, list(rows[0]))


if __name__ == "__main__":
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    if sys.argv[1:] == ["--summary"]:
        print(summary(out_dir))
        sys.exit(0)
    label = sys.argv[1]
    n = len(glob.glob(os.path.join(out_dir, f"ab_{label}_*.json")))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"ab_{label}_{n}.json"), "w") as f:
        json.dump(measure(), f, indent=1)
