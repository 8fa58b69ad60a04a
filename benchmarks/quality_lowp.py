"""Quality of FP8, FP6 and FP4 weights on a model trained with fp8ext.train (runs on a CPU).

For every element format and scaling (one scale per tensor, MX blocks of 32 with E8M0 scales, NVFP4 for E2M1),
every linear layer's weight of the blocks is quantized and dequantized (weights only; activations and the
embedding / output head stay as trained). Reported: the relative L2 error of the weights (median and worst
layer) and the held-out loss and perplexity of the model with all those weights replaced.

    python benchmarks/quality_lowp.py [--run DIR] [--steps N] [--preset tiny] [--out FILE.md]

Without --run it first trains the preset with fp8ext.train (bf16 on a GPU, float32 on a CPU) into runs/quality.
"""

from __future__ import annotations

import argparse
import math
import pathlib

import torch

import fp8ext
from fp8ext.models.transformer import Transformer, preset
from fp8ext.train import cli
from fp8ext.train.data import batch, load_corpus

FORMATS = [fp8ext.E4M3, fp8ext.E5M2, fp8ext.E3M2, fp8ext.E2M3, fp8ext.E2M1]


def per_tensor(w, f):
    scale = f.max / w.abs().max().item()
    q = fp8ext.quantize(w, f, scale)
    return fp8ext.dequantize(q, 1 / scale, torch.float32, fmt=None if f in (fp8ext.E4M3, fp8ext.E5M2) else f)


def mx(w, f):
    return fp8ext.dequantize_mx(*fp8ext.quantize_mx(w, f), f)


def nvfp4(w, f):
    return fp8ext.dequantize_nvfp4(*fp8ext.quantize_nvfp4(w))


@torch.no_grad()
def evaluate(model, corpus, seq, batches=16):
    total = 0.0
    for i in range(batches):
        x, y = batch(corpus.val, 16, seq, seed=31337, step=i)
        total += model(x, y)[1].item()
    return total / batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    run = pathlib.Path(args.run or "runs/quality")
    if args.run is None:
        cli.main(["--preset", args.preset, "--max_steps", str(args.steps), "--lr", "3e-3", "--eval_every",
                  str(args.steps), "--out_dir", str(run), "--no_progress", "--device", "cpu"])
    state = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    a = state["args"]
    model = Transformer(preset(a["preset"], max_seq_len=max(preset(a["preset"]).max_seq_len, a["seq_len"])))
    model.load_state_dict(state["model"])
    model.eval()
    corpus = load_corpus(a.get("data"))
    seq = a["seq_len"]
    names = [n for n, m in model.named_modules() if isinstance(m, fp8ext.FP8Linear)]
    originals = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    base = evaluate(model, corpus, seq)
    rows = [("float32 (as trained)", "", 0.0, 0.0, base)]
    for f in FORMATS:
        for kind, fn in (("per tensor", per_tensor), ("MX, 32", mx)) + ((("NVFP4, 16", nvfp4),) if f is fp8ext.E2M1 else ()):
            errs = []
            with torch.no_grad():
                for n in names:
                    w = originals[n]
                    wq = fn(w, f)
                    errs.append(((wq - w).norm() / w.norm()).item())
                    model.get_submodule(n).weight.copy_(wq)
            rows.append((f.name, kind, sorted(errs)[len(errs) // 2], max(errs), evaluate(model, corpus, seq)))
    with torch.no_grad():
        for n in names:
            model.get_submodule(n).weight.copy_(originals[n])
    lines = [f"Weights of the `{a['preset']}` preset after {state['step']} steps of fp8ext.train ({len(names)} linear "
             f"layers), quantized and dequantized; held-out loss on 16 x 16 x {seq} bytes.", "",
             "| format | scaling | weight rel. L2 error, median layer | worst layer | val loss | perplexity vs float32 |",
             "|---|---|---:|---:|---:|---:|"]
    for name, kind, med, worst, loss in rows:
        lines.append(f"| {name} | {kind} | {med:.2%} | {worst:.2%} | {loss:.4f} | {math.exp(loss - base) - 1:+.2%} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
