"""FP8 attention's accuracy on a trained model's own activations, per head, next to bf16 attention's.

    python benchmarks/attention_accuracy.py --checkpoint RUN_DIR --preset 1b --out accuracy.json --plot accuracy.png

One validation batch goes through the model (a fp8ext.train checkpoint, or fresh weights without --checkpoint) in
bf16; every layer's Q, K, V (after RoPE) and the gradient of its attention output (dO, from the loss's backward)
are kept. Each layer's attention then runs again, from those same bf16 tensors, in four ways:

    float64      torch's SDPA in float64: the reference
    bf16         torch's fastest bf16 SDPA (what a bf16 model runs)
    fp8          fp8ext's FP8 attention (cuDNN's FP8 fused attention on a GPU, the emulation on a CPU)
    fp8, high-precision backward   the same forward, the backward in bf16 (fp8_backward=False, NVTE_FP8_DPA_BWD=0)
    fp8 inputs   float64 attention of Q, K, V cast to E4M3 and back (and dO to E5M2): the error the input casts
                 alone cause, so that fp8 - fp8 inputs is what P, O, dS and the gradients in FP8 add

The error of a head is ||x - x_float64|| / ||x_float64|| over the head's elements, for O (query heads), dQ (query
heads), dK and dV (key/value heads). The table gives the median and the largest over every (layer, head); the plot
(--plot) each layer's median and largest, FP8 next to bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from fp8ext.core.casts import amax, scale_from_amax  # noqa: E402
from fp8ext.core.formats import E4M3, E5M2  # noqa: E402
from fp8ext.models.transformer import Transformer, preset  # noqa: E402
from fp8ext.modules.attention import FP8_ATTENTION_ENGINES  # noqa: E402
from fp8ext.ops import dequantize, quantize  # noqa: E402
from fp8ext.train.data import batch, load_corpus  # noqa: E402

QUANTITIES = ("O", "dQ", "dK", "dV")
ENGINES = ("bf16", "fp8", "fp8, high-precision backward", "fp8 inputs")
# --backward_variants: three ways to run the backward in high precision after the same FP8 forward (the emulation's,
# float32 math, gradients rounded to bf16), O the FP8 forward's in each
RECOMPUTED = "hp backward: recomputed at Q8, K8, V8 (fp8ext)"
FROM_FORWARD = "hp backward: FP8 forward's O and statistics, at Q8, K8, V8"
TE_WAY = "hp backward: FP8 forward's O and statistics, at Q, K, V (TE's NVTE_FP8_DPA_BWD=0)"
BACKWARD_VARIANTS = (RECOMPUTED, FROM_FORWARD, TE_WAY)


def capture(model, ids, targets, device_type: str):
    """[{q, k, v, do, causal}] of every attention call of one forward and backward of the model (bf16)."""
    records = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or scale is not None or dropout_p:
            raise ValueError("attention_accuracy: the model called SDPA with a mask, a scale or dropout")
        if k.shape[1] != q.shape[1] and not enable_gqa:
            raise ValueError("attention_accuracy: grouped K/V heads without enable_gqa")
        rec = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone(), "causal": is_causal}
        y = sdpa(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
        if y.requires_grad:
            y.register_hook(lambda g: rec.__setitem__("do", g.detach().clone()))
        records.append(rec)
        return y

    F.scaled_dot_product_attention = spy
    try:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            _, loss = model(ids, targets)
        loss.backward()
    finally:
        F.scaled_dot_product_attention = sdpa
    missing = [i for i, r in enumerate(records) if "do" not in r]
    if missing or not records:
        raise RuntimeError(f"attention_accuracy: no output gradient for attention calls {missing}")
    return records, loss.item()


def _cast_back(x: torch.Tensor, fmt) -> torch.Tensor:
    """x cast to fmt with its current scale (fp8ext's casts) and dequantized, float64."""
    x = x.contiguous()
    scale, scale_inv = scale_from_amax(amax(x), fmt, 0.0)
    return dequantize(quantize(x, fmt, scale), scale_inv, torch.float32).double()


def run(fn, q, k, v, do, dtype):
    """(O, dQ, dK, dV) of attention fn over q, k, v (as dtype) with output gradient do, float64. Where the engine
    has no backward for these tensors (cuDNN's FP8 backward on Hopper takes head_dim 128 only) it says so once, O
    is the forward's (under no_grad) and the gradients are NaN: reported as n/a, never another engine's."""
    q_, k_, v_ = (t.to(dtype).detach().requires_grad_() for t in (q, k, v))
    try:
        o = fn(q_, k_, v_)
    except NotImplementedError as e:
        if str(e) not in _SAID:
            _SAID.add(str(e))
            print(f"attention_accuracy: gradients n/a: {e}", file=sys.stderr)
        with torch.no_grad():
            o = fn(q_, k_, v_).double()
        nan = [torch.full_like(t, float("nan"), dtype=torch.float64) for t in (q, k, v)]
        return (o, *nan)
    o.backward(do.to(dtype))
    return tuple(t.detach().double() for t in (o, q_.grad, k_.grad, v_.grad))


_SAID: set = set()


def head_errors(x: torch.Tensor, ref: torch.Tensor):
    """||x - ref|| / ||ref|| per head of [batch, heads, seq, head_dim] tensors."""
    num = (x - ref).square().sum(dim=(0, 2, 3)).sqrt()
    den = ref.square().sum(dim=(0, 2, 3)).sqrt().clamp_min(1e-300)
    return (num / den).tolist()


def backward_variants(q, k, v, do, causal):
    """{variant: (O, dQ, dK, dV)} float64, for BACKWARD_VARIANTS: after the emulation's FP8 forward, the backward
    (1) at the dequantized Q8, K8, V8 with the softmax recomputed there (fp8ext's high-precision backward);
    (2) there, but with P normalised by the FP8 forward's statistics and D = rowsum(dO * O) from its output O8;
    (3) as (2) at the bf16 Q, K, V themselves: what Transformer Engine's FusedAttnFunc runs with NVTE_FP8_DPA_BWD=0
        (cuDNN's bf16 backward given the bf16 inputs, the FP8 forward's output and its softmax statistics)."""
    from fp8ext.ops.attention_fp8 import (FP8AttentionOptions, _dequantize, _group_sum, _heads, attention_forward,
                                          high_precision_backward)
    opts = FP8AttentionOptions(q.shape[-1] ** -0.5, causal, fp8_backward=False)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    st = attention_forward(q, k, v, None, opts)
    o, g = _dequantize(st.o8), q.shape[1] // k.shape[1]
    out = {RECOMPUTED: (o, *high_precision_backward(st.q8, st.k8, st.v8, None, do, opts))}
    for name, (qq, kk, vv) in ((FROM_FORWARD, [_dequantize(t) for t in (st.q8, st.k8, st.v8)]),
                               (TE_WAY, [t.float() for t in (q, k, v)])):
        s = qq @ _heads(kk, g).transpose(-2, -1) * opts.softmax_scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
        p = torch.exp(s - st.row_max) * st.zinv
        dof = do.float()
        dp = dof @ _heads(vv, g).transpose(-2, -1)
        ds = p * (dp - (dof * o).sum(-1, keepdim=True))
        grads = (ds @ _heads(kk, g) * opts.softmax_scale, _group_sum(ds.transpose(-2, -1) @ qq, g) *
                 opts.softmax_scale, _group_sum(p.transpose(-2, -1) @ dof, g))
        out[name] = (o, *(t.to(torch.bfloat16) for t in grads))
    return {n: tuple(t.double() for t in x) for n, x in out.items()}


def layer_errors(rec, fp8_attention, variants: bool = False):
    q, k, v, do, causal = rec["q"], rec["k"], rec["v"], rec["do"], rec["causal"]
    gqa = k.shape[1] != q.shape[1]

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=gqa)

    ref = run(sdpa, q, k, v, do, torch.float64)
    outs = {"bf16": run(sdpa, q, k, v, do, torch.bfloat16),
            "fp8": run(lambda a, b, c: fp8_attention(a, b, c, None, is_causal=causal, enable_gqa=gqa,
                                                     fp8_backward=True), q, k, v, do, torch.bfloat16),
            "fp8, high-precision backward": run(lambda a, b, c: fp8_attention(a, b, c, None, is_causal=causal,
                                                                              enable_gqa=gqa, fp8_backward=False),
                                                q, k, v, do, torch.bfloat16),
            "fp8 inputs": run(sdpa, _cast_back(q, E4M3), _cast_back(k, E4M3), _cast_back(v, E4M3),
                              _cast_back(do, E5M2), torch.float64)}
    if variants:
        outs.update(backward_variants(q, k, v, do, causal))
    return {e: {n: head_errors(x, r) for n, x, r in zip(QUANTITIES, outs[e], ref)} for e in outs}


def summarise(layers):
    """{engine: {quantity: (median, max) over every (layer, head)}}."""
    out = {}
    for e in layers[0]:
        out[e] = {}
        for n in QUANTITIES:
            vals = [x for lay in layers for x in lay[e][n]]
            out[e][n] = (None, None) if any(math.isnan(x) for x in vals) else (statistics.median(vals), max(vals))
    return out


def table(summary, title: str) -> str:
    lines = [title, "", "| attention | " + " | ".join(f"{n} median | {n} max" for n in QUANTITIES) + " |",
             "| --- |" + " --- | --- |" * len(QUANTITIES)]
    for e in summary:
        cells = " | ".join("n/a | n/a" if summary[e][n][0] is None else
                           f"{summary[e][n][0] * 100:.2f} % | {summary[e][n][1] * 100:.2f} %" for n in QUANTITIES)
        lines.append(f"| {e} | {cells} |")
    return "\n".join(lines)


def plot(layers, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(4.2 * len(QUANTITIES), 4.2), sharey=True)
    xs = list(range(len(layers)))
    for ax, n in zip(axes, QUANTITIES):
        for e, colour in (("bf16", "tab:blue"), ("fp8", "tab:red"), ("fp8, high-precision backward", "tab:green"),
                          ("fp8 inputs", "tab:orange")):
            med = [statistics.median(lay[e][n]) * 100 for lay in layers]
            top = [max(lay[e][n]) * 100 for lay in layers]
            ax.plot(xs, med, color=colour, label=f"{e} (median head)")
            ax.plot(xs, top, color=colour, linestyle=":", label=f"{e} (worst head)")
        ax.set_yscale("log")
        ax.set_title(n)
        ax.set_xlabel("layer")
        ax.set_xticks(xs if len(xs) <= 12 else xs[::max(1, len(xs) // 11)])
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative error vs float64, %")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", help="a fp8ext.train run directory or checkpoint.pt (default: fresh weights)")
    p.add_argument("--preset", default="1b")
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", help="write the per-head errors and the summary here (JSON)")
    p.add_argument("--plot", help="write the per-layer plot here (PNG)")
    p.add_argument("--save", help="also save some layers' Q, K, V and dO here (one .pt file per layer), to study "
                                  "them elsewhere with --load")
    p.add_argument("--save_layers", default="1,7,14,21", help="which layers --save keeps")
    p.add_argument("--save_kv_heads", type=int, default=2,
                   help="--save keeps this many K/V heads and the query heads that read them")
    p.add_argument("--backward_variants", action="store_true",
                   help="also three high-precision backwards after the same FP8 forward, computed by the emulation: "
                        "fp8ext's (recomputed), and two from the forward's output and statistics (Transformer "
                        "Engine's NVTE_FP8_DPA_BWD=0 among them)")
    p.add_argument("--load", help="instead of running a model, take the Q, K, V and dO that --save wrote here")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.load:
        files = sorted(pathlib.Path(args.load).glob("layer*.pt"), key=lambda f: int(f.stem[5:]))
        records = [torch.load(f, map_location=dev, weights_only=True) for f in files]
        source = f"{args.load}: layers {', '.join(f.stem[5:] for f in files)}"
        return report(records, FP8_ATTENTION_ENGINES[dev.type], f"{source}, {records[0]['title']}", args)
    cfg = preset(args.preset, max_seq_len=max(preset(args.preset).max_seq_len, args.seq_len))
    model = Transformer(cfg, device=dev)
    source = "fresh weights"
    if args.checkpoint:
        from fp8ext.train.checkpoint import read
        path, state = read(args.checkpoint, "--checkpoint")
        model.load_state_dict(state["model"])
        source = f"{path} (step {state['step']})"
        del state
    corpus = load_corpus()
    ids, targets = batch(corpus.val, args.batch_size, args.seq_len, args.seed, 0, device=dev)
    t0 = time.perf_counter()
    records, loss = capture(model, ids.to(dev), targets.to(dev), dev.type)
    model.zero_grad(set_to_none=True)
    del model
    title = (f"preset {args.preset}, {source}, validation batch {args.batch_size} x {args.seq_len} (loss {loss:.4f}), "
             f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}")
    if args.save:
        keep = [int(x) for x in args.save_layers.split(",")]
        pathlib.Path(args.save).mkdir(parents=True, exist_ok=True)
        for i in keep:
            r = records[i]
            kv, group = args.save_kv_heads, r["q"].shape[1] // r["k"].shape[1]
            torch.save({"q": r["q"][:1, :kv * group].clone(), "do": r["do"][:1, :kv * group].clone(),
                        "k": r["k"][:1, :kv].clone(), "v": r["v"][:1, :kv].clone(), "causal": r["causal"],
                        "title": f"layer {i} of {title}"}, pathlib.Path(args.save, f"layer{i}.pt"))
    print(f"({time.perf_counter() - t0:.0f} s to capture)")
    return report(records, FP8_ATTENTION_ENGINES[dev.type], title, args)


def report(records, fp8_attention, title: str, args) -> int:
    t0 = time.perf_counter()
    layers = []
    for i, rec in enumerate(records):
        layers.append(layer_errors(rec, fp8_attention, args.backward_variants))
        rec.clear()
        print(f"layer {i}: O fp8 {statistics.median(layers[-1]['fp8']['O']) * 100:.2f} % / bf16 "
              f"{statistics.median(layers[-1]['bf16']['O']) * 100:.3f} % (median head)", flush=True)
    summary = summarise(layers)
    title = f"{title}, {len(layers)} layers"
    print(table(summary, title))
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        strict = [{e: {n: [None if math.isnan(x) else x for x in v] for n, v in lay[e].items()} for e in lay}
                  for lay in layers]  # NaN (n/a) as null: strict JSON
        pathlib.Path(args.out).write_text(json.dumps({"title": title, "summary": summary, "layers": strict}))
    if args.plot:
        plot(layers, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
