"""FP8 / FP6 / FP4 weights of a trained model, measured: weight error per format, perplexity with every linear
layer in one format, and adaptive per-layer assignments (fp8ext.adaptive) at a few byte budgets. CPU.

    python benchmarks/quality_model_lowp.py [--run DIR] [--steps N] [--budgets 0.3,0.35,0.45] [--out FILE.md]

Without --run it first trains the `tiny` preset with fp8ext.train into runs/quality_model (the high-precision
run: bf16 autocast on a GPU, float32 on a CPU). Then, for the linear layers of the blocks (the embedding and the
output head stay as trained):
  (a) the relative L2 error ||Q(w) - w|| / ||w|| of every weight in each format and scaling, mean and max over
      the layers (formats as fp8ext.adaptive.fake_quantize_weight names them);
  (b) the held-out loss and perplexity with every layer in that format, next to float32 and bf16;
  (c) fp8ext.adaptive.assign_precision at each budget (fractions of the layers' bf16 bytes), sensitivities from
      training-split calibration batches, perplexity on the same held-out batches as (b).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import torch

import fp8ext
from fp8ext import adaptive
from fp8ext.models.transformer import Transformer, preset
from fp8ext.train import cli
from fp8ext.train.data import batch, load_corpus

# (name in fp8ext.adaptive, element format, scaling)
FORMATS = [
    ("fp8_tensor", "E4M3", "per tensor"),
    ("fp8", "E4M3", "per output channel"),
    ("mxfp8", "E4M3", "MX, 32"),
    ("fp6_tensor", "E3M2", "per tensor"),
    ("mxfp6", "E3M2", "MX, 32"),
    ("mxfp6_e2m3", "E2M3", "MX, 32"),
    ("fp4_tensor", "E2M1", "per tensor"),
    ("mxfp4", "E2M1", "MX, 32"),
    ("nvfp4", "E2M1", "NVFP4, 16 (E4M3 scales)"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="a run directory of fp8ext.train (default: train one)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--calib_batches", type=int, default=8)
    p.add_argument("--eval_batches", type=int, default=16)
    p.add_argument("--budgets", default="0.3,0.35,0.45")
    p.add_argument("--device", default="cpu", help="where to train and measure (cpu or cuda)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    run = pathlib.Path(args.run or "runs/quality_model")
    t0 = time.perf_counter()
    if args.run is None:
        cli.main(["--preset", args.preset, "--max_steps", str(args.steps), "--lr", "3e-3", "--eval_every",
                  str(args.steps), "--out_dir", str(run), "--no_progress", "--device", args.device])
    t_train = time.perf_counter() - t0
    state = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    a = state["args"]
    model = Transformer(preset(a["preset"], max_seq_len=max(preset(a["preset"]).max_seq_len, a["seq_len"])))
    model.load_state_dict(state["model"])
    model.to(args.device).eval()
    corpus = load_corpus(a.get("data"))
    seq = a["seq_len"]
    evals = [batch(corpus.val, 16, seq, seed=31337, step=i, device=args.device) for i in range(args.eval_batches)]
    calib = [batch(corpus.train, 16, seq, seed=4242, step=i, device=args.device) for i in range(args.calib_batches)]
    t1 = time.perf_counter()

    names = [n for n, m in model.named_modules() if isinstance(m, fp8ext.Linear)]
    weights = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    with torch.no_grad():
        base = sum(model(x, y)[1].item() for x, y in evals) / len(evals)
    rows = [("float32 (as trained)", "", "", 32.0, None, None, base)]
    bf16 = adaptive.uniform_plan(model, "bf16")
    errs = {n: ((adaptive.fake_quantize_weight(w, "bf16") - w).norm() / w.norm()).item() for n, w in weights.items()}
    rows.append(("bf16", "bf16", "", bf16.bits_per_weight, sum(errs.values()) / len(errs), max(errs.values()),
                 bf16.measure(model, evals)))
    for fmt, elem, scaling in FORMATS:
        errs = {n: ((adaptive.fake_quantize_weight(w, fmt) - w).norm() / w.norm()).item() for n, w in weights.items()}
        plan = adaptive.uniform_plan(model, fmt)
        rows.append((fmt, elem, scaling, plan.bits_per_weight, sum(errs.values()) / len(errs), max(errs.values()),
                     plan.measure(model, evals)))

    budgets = [float(b) for b in args.budgets.split(",")]
    t2 = time.perf_counter()
    sens = adaptive.measure_sensitivity(model, calib, progress=False)
    t_sens = time.perf_counter() - t2
    plans = [adaptive.assign_precision(model, calib, b, sensitivity=sens, eval_batches=evals) for b in budgets]
    uniform = {f: sens.uniform(f) for f in sens.formats}
    for u in uniform.values():
        u.measure(model, evals)

    n_weights = sum(w.numel() for w in weights.values())
    where = "the CPU" if args.device == "cpu" else torch.cuda.get_device_name(torch.device(args.device))
    trained = "float32" if state["args"].get("device", args.device) == "cpu" else "bf16 autocast"
    lines = [f"Weights of the `{a['preset']}` preset after {state['step']} steps of fp8ext.train ({trained}; measured "
             f"in float32 on {where}; "
             f"{len(names)} linear layers, {n_weights:,} weights), quantized and dequantized (weights only; embedding "
             f"and output head as trained). Held-out loss: {len(evals)} batches of 16 x {seq} bytes of the validation "
             f"split. " + (f"Train {t_train:.0f} s, " if args.run is None else f"Run {run} reused, ")
             + f"formats (a)+(b) {t2 - t1:.0f} s, sensitivities {t_sens:.1f} s.", "",
             "(a), (b): every linear layer in one format", "",
             "| format | element | scaling | bits/weight | weight rel. L2 error, mean | max | val loss | perplexity "
             "| vs float32 |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for fmt, elem, scaling, bits, mean, worst, loss in rows:
        e = ("", "") if mean is None else (f"{mean:.2%}", f"{worst:.2%}")
        lines.append(f"| {fmt} | {elem} | {scaling} | {bits:.2f} | {e[0]} | {e[1]} | {loss:.4f} | "
                     f"{math.exp(loss):.4f} | {math.exp(loss - base) - 1:+.2%} |")
    lines += ["", f"(c) adaptive assignment (formats {', '.join(sens.formats)}; sensitivities from {len(calib)} "
              f"training-split batches, calibration loss {sens.base_loss:.4f}), next to the uniform plans. Predicted: "
              "exp(summed single-layer loss increases on the calibration batches) - 1; held-out: measured", "",
              "| weights | layers per format | bytes | of bf16 | bits/weight | predicted (calib.) | held-out ppl "
              "| vs float32 |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for label, pl in [(f"uniform {f}", u) for f, u in uniform.items()] + \
                     [(f"adaptive, budget {b:.0%}", pl) for b, pl in zip(budgets, plans)]:
        counts = ", ".join(f"{f} {c}" for f, c in sorted(pl.counts().items()))
        lines.append(f"| {label} | {counts} | {pl.total_bytes:,} | {pl.fraction:.1%} | {pl.bits_per_weight:.2f} | "
                     f"{math.exp(pl.predicted_loss - pl.base_loss) - 1:+.2%} | {pl.measured_perplexity:.4f} | "
                     f"{math.exp(pl.measured_loss - base) - 1:+.2%} |")
    lines += ["", "Per layer, calibration loss increase with only that layer in the format:", "", sens.table()]
    for b, pl in zip(budgets, plans):
        lines += ["", f"Budget {b:.0%}: " + ", ".join(f"{n} {f}" for n, f in pl.assignment.items())]
    text = "\n".join(lines)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
