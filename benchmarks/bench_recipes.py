"""FP8 training recipes side by side in one run: bf16, DelayedScaling, CurrentScaling, Float8BlockScaling and
Float8RowwiseScaling.

    python benchmarks/bench_recipes.py [--sections linear host block error train] [--train_steps 300]

linear  FP8Linear fwd+bwd (the weight recast every step) at bench_linear's shapes: ms per step (CUDA events, median
        of interleaved rounds), speed against bf16 and step time against delayed scaling's.
host    host time per step (no synchronisation) at 4096 x 1024 x 1024, where it decides the step time.
block   two Llama-3-8B-size layers (benchmarks/bench_block.py's, 2 x 2048 tokens, fwd+bwd+SGD), eager: ms per step,
        speed against bf16.
error   forward output of one layer (4096 x 4096, 4096 tokens) against float64: Gaussian inputs, and inputs with 8
        outlier channels of 1e4 (an activation's typical outliers) and a weight with one outlier row.
train   fp8ext.train: the 1b preset's tokens/s (each recipe and bf16, 30 steps), and the small preset's validation
        loss after --train_steps steps on the same batches.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from _harness import save  # noqa: E402

import fp8ext  # noqa: E402
from fp8ext._bench import device_header, host_us, rounds, table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = [(4096, 1024, 1024), (8192, 4096, 4096), (8192, 4096, 16384), (16384, 8192, 8192)]
RECIPES = {"delayed": fp8ext.DelayedScaling(), "current": fp8ext.CurrentScaling(),
           "block": fp8ext.Float8BlockScaling(), "rowwise": fp8ext.Float8RowwiseScaling()}


def linear_section() -> list:
    rows = []
    for (m, k, n) in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
        f8.load_state_dict(lin.state_dict())
        impls = {"bf16": lambda: lin(x).backward(gy)}
        for name, recipe in RECIPES.items():
            def step(recipe=recipe):
                with fp8ext.fp8_autocast(fp8_recipe=recipe):
                    y = f8(x)
                y.backward(gy)
            impls[name] = step
        for fn in impls.values():
            fn()
        t = {name: v[0] for name, v in rounds(impls, reps=10 if m * n * k > 1e11 else 30).items()}
        row = {"M,K,N": f"{m},{k},{n}", "bf16 ms": t["bf16"]}
        for name in RECIPES:
            row[f"{name} ms"] = t[name]
            row[f"{name} vs bf16"] = t["bf16"] / t[name]
        row["block / delayed time"] = t["block"] / t["delayed"]
        row["rowwise / delayed time"] = t["rowwise"] / t["delayed"]
        rows.append(row)
        print("  " + ", ".join(f"{k2} {v:.3f}" if isinstance(v, float) else f"{k2} {v}" for k2, v in row.items()),
              flush=True)
        del x, gy, lin, f8, impls
        torch.cuda.empty_cache()
    return rows


def host_section() -> list:
    """Host time per FP8Linear step (fwd+bwd, no synchronisation: what the CPU spends launching) at a small shape,
    where it decides the step time, per recipe next to bf16."""
    m, k, n = 4096, 1024, 1024
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    f8 = fp8ext.FP8Linear(k, n, bias=True, device="cuda", params_dtype=torch.bfloat16)
    rows = [{"recipe": "bf16", "host us/step": host_us(lambda: lin(x).backward(gy))}]
    for name, recipe in RECIPES.items():
        def step(recipe=recipe):
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                y = f8(x)
            y.backward(gy)
        rows.append({"recipe": name, "host us/step": host_us(step)})
    for r in rows:
        r["vs delayed"] = r["host us/step"] / rows[1]["host us/step"]
    return rows


def block_section() -> list:
    import bench_block as bb
    torch.manual_seed(0)
    x = (torch.randn(2, 2048, bb.D, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    gy = torch.randn(2, 2048, bb.D, device="cuda", dtype=torch.bfloat16)
    rows, base = [], None
    for name, recipe in [("bf16", None)] + list(RECIPES.items()):
        mod = bb.model(bb.bf16_linear if recipe is None else bb.fp8_linear)
        ms, host = bb.timed(bb.training_step(mod, x, gy, recipe is not None, recipe))
        base = base or ms
        rows.append({"recipe": name, "ms/step": ms, "host ms/step": host, "vs bf16": base / ms,
                     "tokens/s": 2 * 2048 / ms * 1e3})
        print(f"  {name}: {ms:.2f} ms/step ({base / ms:.3f}x bf16)", flush=True)
        del mod
        torch.cuda.empty_cache()
    return rows


def error_section() -> list:
    rows = []
    m = k = n = 4096
    for case in ("gaussian", "outliers"):
        torch.manual_seed(1)
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda") * k ** -0.5
        if case == "outliers":
            x[:, torch.randperm(k, device="cuda")[:8]] *= 1e4
            w[7] *= 300
        x, w = x.bfloat16(), w.bfloat16()
        y64 = x.double() @ w.double().t()
        row = {"inputs": case}
        for name, recipe in RECIPES.items():
            f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
            with torch.no_grad():
                f8.weight.copy_(w)
            for _ in range(2):  # delayed scaling: the second step scales by the first step's amax
                with fp8ext.fp8_autocast(fp8_recipe=recipe), torch.no_grad():
                    y = f8(x)
            row[name] = ((y.double() - y64).norm() / y64.norm()).item()
        y16 = x @ w.t()
        row["bf16"] = ((y16.double() - y64).norm() / y64.norm()).item()
        rows.append(row)
        print("  " + ", ".join(f"{k2} {v:.5f}" if isinstance(v, float) else str(v) for k2, v in row.items()))
    return rows


def _train(preset: str, recipe, steps: int, batch: int, seq: int, evals: int, timeout: int) -> dict:
    name = f"{preset}_{recipe or 'bf16'}"
    out = os.path.join(os.environ.get("OUT") or os.path.join(HERE, "out"), "bench_recipes_runs", name)
    cmd = [sys.executable, "-m", "fp8ext.train", "--no_progress", "--no_save", "--out_dir", out, "--preset", preset,
           "--batch_size", str(batch), "--seq_len", str(seq), "--max_steps", str(steps), "--eval_every",
           str(steps), "--eval_batches", str(evals)] + (["--use_fp8", "--fp8_recipe", recipe] if recipe else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        s = json.load(open(os.path.join(out, "run.json")))
        return {"tokens_per_s": s["tokens_per_s"], "val_loss": s.get("final_val_loss"),
                "peak_gib": s.get("peak_memory_gib")}
    except (OSError, ValueError, KeyError):
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"  {name}: failed (rc {proc.returncode}): {err}", flush=True)
        return {"error": err}


def train_section(steps: int, timeout: int) -> list:
    rows = []
    for recipe in [None] + list(RECIPES):
        speed = _train("1b", recipe, 30, 8, 2048, 2, timeout)
        quality = _train("small", recipe, steps, 16, 512, 20, timeout)
        row = {"recipe": recipe or "bf16", "1b tokens/s": speed.get("tokens_per_s"),
               "small val loss": quality.get("val_loss"), "small tokens/s": quality.get("tokens_per_s")}
        rows.append(row)
        print(f"  {row}", flush=True)
    base = rows[0]["1b tokens/s"]
    for r in rows:
        r["1b vs bf16"] = r["1b tokens/s"] / base if base and r["1b tokens/s"] else None
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", nargs="+", default=["linear", "host", "block", "error", "train"],
                    choices=["linear", "host", "block", "error", "train"])
    ap.add_argument("--train_steps", type=int, default=300, help="small preset steps for the validation loss")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per training run")
    args = ap.parse_args()
    if not fp8ext.cuda_available():
        print("bench_recipes: needs a CUDA device and fp8ext built with CUDA", file=sys.stderr)
        return 2
    head = device_header()
    print(f"# recipes side by side; {head['device']} ({head['sms']} SMs), torch {head['torch']}, {head['date']}")
    results = {"header": head}
    sections = {"linear": linear_section, "host": host_section, "block": block_section, "error": error_section,
                "train": lambda: train_section(args.train_steps, args.timeout)}
    for name in args.sections:
        print(f"== {name}", flush=True)
        rows = sections[name]()
        results[name] = rows
        fmt = {k: "{:.3f}" for k in rows[0] if all(isinstance(r.get(k), float) for r in rows)}
        print(table(rows, list(rows[0]), fmt))
    save("bench_recipes.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
