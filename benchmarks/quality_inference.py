"""Quality of FP8 inference on a model trained with fp8ext.train (runs on a CPU): held-out perplexity of bf16
against FP8 for every weight granularity (tensor / channel / block128) x activation scheme (static / dynamic),
and of decoding through an FP8 KV cache against a bf16 one (calibrated K/V scales, or scales from the prefill).

    python benchmarks/quality_inference.py [--run DIR] [--steps N] [--eval_batches N] [--out FILE.md]

Without an existing --run (default runs/quality_inference) it first trains the tiny preset with fp8ext.train
(float32 on a CPU; 400 steps of 16 x 128 bytes) into it. The model is then cast to bf16 (as
`python -m fp8ext.inference eval` does), calibrated once on training text (max|input| of each linear layer,
per-head max|K| and max|V|), and quantized with each scheme. Rows:
  - weights x activations: loss of one forward over each held-out sequence, the median relative L2 error of the
    layers' dequantized weights, and the bytes of the quantized layers' weights + scales against bf16;
  - KV cache: the same held-out text read one byte per step through a KV cache (a one-byte prompt, so every
    later position is a decode step), bf16 against FP8 with calibrated scales and with scales taken from the
    prompt (one byte, times the cache's one-binade margin), for the bf16 model and the FP8 (channel, static)
    model; plus the relative L2 error of the cached K and V against the bf16 cache, and the cache's bytes;
  - prefill with FP8 attention: the FP8 (channel, static / dynamic) models' forward loss with attention in FP8
    (a recipe with fp8_dpa=True, and with fp8_mha=True: its E4M3 output read by o_proj) against bf16 attention.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import pathlib
import statistics
import time

import torch

from fp8ext import Float8CurrentScaling, inference
from fp8ext.inference import FP8InferenceLinear, KVCache, decode_loss
from fp8ext.models.transformer import Transformer, preset
from fp8ext.ops import dequantize
from fp8ext.train import cli
from fp8ext.train.data import batch, load_corpus

SCHEMES = [(w, a) for w in ("tensor", "channel", "block128") for a in ("static", "dynamic")]


def dequantized_weight(layer: FP8InferenceLinear) -> torch.Tensor:
    w = layer.weight.float()
    s = layer.weight_scale
    if layer.weights == "block128":
        s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:w.shape[0], :w.shape[1]]
    return w * s


@torch.no_grad()
def forward_loss(model, data, recipe=None) -> float:
    """Mean loss of one forward over each (x, y); with a recipe, inside its fp8_autocast (FP8 attention)."""
    kw = {} if recipe is None else {"fp8": True, "fp8_recipe": recipe}
    return sum(model(x, y, **kw)[1].item() for x, y in data) / len(data)


@torch.no_grad()
def kv_error(model, x, scales: str) -> tuple:
    """Relative L2 error of the FP8 cache's dequantized K and V against the bf16 cache, after reading x one
    byte per step (a one-byte prompt), as decode_loss does."""
    b, n = x.shape
    c8 = KVCache.from_model(model, b, n, "fp8", scales=scales)
    c16 = KVCache.from_model(model, b, n, "bf16")
    for c in (c8, c16):
        model(x[:, :1], kv_cache=c, start_pos=0)
        for t in range(1, n):
            model(x[:, t:t + 1], kv_cache=c, start_pos=t)
    errs = []
    for kind in ("k", "v"):
        num = den = 0.0
        for layer in range(model.cfg.n_layers):
            ref = getattr(c16, kind)[layer].double()
            scale = c8.scales(layer)[0 if kind == "k" else 1].double()
            got = dequantize(getattr(c8, kind)[layer].contiguous(), 1.0, torch.float32).double() \
                * scale[None, :, None, None]
            num += (got - ref).pow(2).sum().item()
            den += ref.pow(2).sum().item()
        errs.append(math.sqrt(num / den))
    return tuple(errs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", default="runs/quality_inference")
    p.add_argument("--steps", type=int, default=400, help="training steps when --run holds no checkpoint")
    p.add_argument("--calib_batches", type=int, default=16)
    p.add_argument("--eval_batches", type=int, default=8, help="held-out batches of 16 sequences")
    p.add_argument("--out", default=None, help="also write the tables to this markdown file")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    run = pathlib.Path(args.run)
    if not (run / "checkpoint.pt").is_file():
        cli.main(["--preset", "tiny", "--max_steps", str(args.steps), "--batch_size", "16", "--seq_len", "128",
                  "--lr", "3e-3", "--eval_every", str(args.steps), "--out_dir", str(run), "--no_progress",
                  "--device", "cpu"])
    state = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    a = state["args"]
    seq = a["seq_len"]
    fp32 = Transformer(preset(a["preset"], max_seq_len=max(preset(a["preset"]).max_seq_len, seq)))
    fp32.load_state_dict(state["model"])
    fp32.eval()
    base = copy.deepcopy(fp32).to(torch.bfloat16)
    corpus = load_corpus(a.get("data"))
    calib = [batch(corpus.train, 8, seq, seed=10_007, step=i)[0] for i in range(args.calib_batches)]
    data = [batch(corpus.val, 16, seq, seed=20_011, step=i) for i in range(args.eval_batches)]
    inference.calibrate(base, calib, progress=False)
    inference.set_kv_cache_scales(base)  # the bf16 model with an FP8 cache; every quantized copy keeps them
    bf16_bytes = sum(m.weight.numel() * 2 for m in inference.quantizable_linears(base).values())

    ref = forward_loss(base, data)
    rows = [("float32 (as trained)", "", forward_loss(fp32, data), None, None),
            ("bf16 (reference)", "", ref, None, None)]
    models = {}
    for w, act in SCHEMES:
        m = copy.deepcopy(base)
        try:
            inference.quantize_model(m, w, act)
        except ValueError as e:
            rows.append((w, act, None, None, str(e).split(": ", 1)[-1]))
            continue
        models[(w, act)] = m
        layers = [(n, l) for n, l in m.named_modules() if isinstance(l, FP8InferenceLinear)]
        errs = [((dequantized_weight(l) - base.get_submodule(n).weight.float()).norm()
                 / base.get_submodule(n).weight.float().norm()).item() for n, l in layers]
        nbytes = sum(l.weight.numel() + l.weight_scale.numel() * 4
                     + (l.input_scale.numel() * 4 if l.input_scale is not None else 0) for _, l in layers)
        rows.append((w, act, forward_loss(m, data), statistics.median(errs), nbytes / bf16_bytes))

    kv_rows = []
    for name, m in (("bf16", base), ("FP8 channel/static", models[("channel", "static")])):
        m_ref = None
        for kv, scales in (("bf16", "auto"), ("fp8", "calibrated"), ("fp8", "prefill")):
            loss = sum(decode_loss(m, x, y, kv_cache=kv, kv_scales=scales) for x, y in data) / len(data)
            m_ref = loss if kv == "bf16" else m_ref
            err = kv_error(m, data[0][0], scales) if kv == "fp8" else (0.0, 0.0)
            cache = KVCache.from_model(m, 16, seq, kv)
            kv_rows.append((name, kv, scales if kv == "fp8" else "", loss, loss - m_ref, err, cache.nbytes))

    attn_rows = []  # prefill with FP8 attention (the CPU emulation of cuDNN's): the quantized models' forward loss
    for key in (("channel", "static"), ("channel", "dynamic")):
        m = models[key]
        plain = forward_loss(m, data)
        for label, recipe in (("bf16 attention", None), ("FP8 attention (fp8_dpa)", Float8CurrentScaling(fp8_dpa=True)),
                              ("FP8 attention, FP8 output into o_proj (fp8_mha)",
                               Float8CurrentScaling(fp8_mha=True))):
            loss = plain if recipe is None else forward_loss(m, data, recipe)
            attn_rows.append(("/".join(key), label, loss, loss - plain))

    date = datetime.date.today().isoformat()
    lines = [f"Model: `{a['preset']}` preset trained {state.get('step', a['max_steps'])} steps by fp8ext.train "
             f"({run}); held-out text: {args.eval_batches} x 16 x {seq} bytes of {corpus.description}. "
             f"Calibration: {args.calib_batches} x 8 x {seq} bytes of training text. CPU, {date}, "
             f"torch {torch.__version__}.", "",
             "| weights | activations | val loss | perplexity | vs bf16 | weight rel. L2 error (median layer) "
             "| weight bytes vs bf16 |", "|---|---|---:|---:|---:|---:|---:|"]
    for w, act, loss, err, ratio in rows:
        if loss is None:
            lines.append(f"| {w} | {act} | refused: {ratio} | | | | |")
            continue
        lines.append(f"| {w} | {act} | {loss:.4f} | {math.exp(loss):.4f} | {math.exp(loss - ref) - 1:+.2%} | "
                     + ("" if err is None else f"{err:.2%}") + " | " + ("" if ratio is None else f"{ratio:.3f}x")
                     + " |")
    lines += ["", "Decoding the held-out text one byte per step through a KV cache (one-byte prompt):", "",
              "| model | KV cache | K/V scales | val loss | perplexity | vs bf16 cache | K rel. L2 error "
              "| V rel. L2 error | cache bytes (16 x 128) |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, kv, scales, loss, dloss, (ke, ve), nb in kv_rows:
        lines.append(f"| {name} | {kv} | {scales} | {loss:.4f} | {math.exp(loss):.4f} | {math.exp(dloss) - 1:+.2%} "
                     f"| {ke:.2%} | {ve:.2%} | {nb:,} |")
    lines += ["", "Prefill with FP8 attention (one forward over each held-out sequence; attention computed by the CPU "
              "emulation of cuDNN's FP8 fused attention):", "",
              "| model | attention | val loss | perplexity | vs bf16 attention |", "|---|---|---:|---:|---:|"]
    for name, label, loss, dloss in attn_rows:
        lines.append(f"| FP8 {name} | {label} | {loss:.4f} | {math.exp(loss):.4f} | {math.exp(dloss) - 1:+.2%} |")
    lines += ["", f"({time.time() - t0:.0f} s)"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
