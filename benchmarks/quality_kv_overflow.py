"""What an FP8 KV cache with an NVFP4 overflow costs in perplexity (fp8ext.inference.KVCache's overflow="nvfp4"):
held-out text read through the decode path (a one-token prefill, then one true token per step, as
fp8ext.inference.decode_loss does) with a bf16 cache, an all-FP8 cache, and FP8 caches whose budget is a share of
the all-FP8 cache's bytes (the oldest positions move to NVFP4 to stay within it).

    python benchmarks/quality_kv_overflow.py --checkpoint runs/small --device cuda --json kv_overflow.json
    python benchmarks/quality_kv_overflow.py --dry_run                  # tiny untrained model, CPU, seconds

--checkpoint is an fp8ext.train run directory or checkpoint.pt (e.g. `python -m fp8ext.train --preset small
--seq_len 1024 --out_dir runs/small`); the model runs in bf16, its K/V scales calibrated on training text
(fp8ext.inference.calibrate + set_kv_cache_scales), and the text is the run's validation split (fp8ext.train.data:
by default every 20th file of this Python's standard library), in sequences of --seq_len bytes (default: the
run's). A budget below what the sequence length needs with all but the newest chunk in NVFP4 (NVFP4 takes about
56 % of FP8's bytes, more for short sequences) is reported as refused. Rows: the cache, its budget, the bytes it
allocates (batch x seq_len positions), how many positions it keeps in FP8, the loss and perplexity, and the
perplexity against the bf16 cache's.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import torch

from fp8ext import inference
from fp8ext.inference import KVCache
from fp8ext.models.transformer import Transformer, preset
from fp8ext.train.checkpoint import read
from fp8ext.train.data import batch, load_corpus


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="an fp8ext.train run directory or checkpoint.pt")
    p.add_argument("--dry_run", action="store_true",
                   help="no checkpoint: the untrained tiny preset on the CPU, 1 batch of 2 x 128 bytes, chunk 8")
    p.add_argument("--device", default=None, help="default: cuda when there is one (cpu for --dry_run)")
    p.add_argument("--seq_len", type=int, default=None, help="bytes per sequence; default: the run's seq_len")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--eval_batches", type=int, default=4, help="held-out batches")
    p.add_argument("--calib_batches", type=int, default=4, help="training batches for the K/V scales")
    p.add_argument("--budgets", default="0.6,0.75,0.9", help="budgets as shares of the all-FP8 cache's bytes")
    p.add_argument("--chunk", type=int, default=16, help="positions moved to NVFP4 at a time (overflow_chunk)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    return p


def load(args) -> tuple:
    """(model in bf16 on the device, training seq_len, data path or None, what it is)."""
    if args.dry_run:
        torch.manual_seed(0)
        return Transformer(preset("tiny")).to(args.device, torch.bfloat16).eval(), 128, None, \
            "tiny preset, untrained (dry run)"
    if args.checkpoint is None:
        raise SystemExit("quality_kv_overflow: give --checkpoint (an fp8ext.train run) or --dry_run")
    path, state = read(args.checkpoint, "--checkpoint")
    a = state["args"]
    cfg = preset(a["preset"], fused_qkv=not a.get("separate_qkv", False),
                 max_seq_len=max(preset(a["preset"]).max_seq_len, a["seq_len"]))
    model = Transformer(cfg)
    model.load_state_dict(state["model"])
    return model.to(args.device, torch.bfloat16).eval(), a["seq_len"], a.get("data"), \
        f"{a['preset']} preset, {state.get('step', '?')} steps ({path})"


def configs(model, b: int, seq: int, shares) -> list:
    """(name, budget share, KVCache arguments) of each row; the budgets in bytes from the all-FP8 cache's."""
    fp8 = KVCache(model.cfg, b, seq, "fp8", device="meta").nbytes
    rows = [("bf16", None, {"dtype": "bf16"}), ("fp8", None, {"dtype": "fp8"})]
    return rows + [(f"fp8 + nvfp4 at {share:.0%}", share, {"dtype": "fp8", "overflow": "nvfp4",
                                                          "budget_bytes": int(share * fp8)}) for share in shares]


@torch.no_grad()
def decode_loss(model, x: torch.Tensor, y: torch.Tensor, cache: KVCache) -> float:
    """Mean cross-entropy of y given x read through `cache`: x[:, 0] as the prefill, then one true token per
    decode step (fp8ext.inference.decode_loss with prompt_len 1, for a cache built here)."""
    steps = [model(x[:, :1], kv_cache=cache, start_pos=0)]
    steps += [model(x[:, t:t + 1], kv_cache=cache, start_pos=t) for t in range(1, x.shape[1])]
    return torch.nn.functional.cross_entropy(torch.cat(steps, 1).float().flatten(0, 1), y.flatten()).item()


@torch.no_grad()
def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.batch_size, args.eval_batches, args.calib_batches, args.chunk = 2, 1, 1, 8
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.time()
    model, train_seq, data_path, what = load(args)
    seq = args.seq_len or train_seq
    corpus = load_corpus(data_path)
    calib = [batch(corpus.train, args.batch_size, seq, seed=10_007, step=i, device=args.device)[0]
             for i in range(args.calib_batches)]
    data = [batch(corpus.val, args.batch_size, seq, seed=20_011, step=i, device=args.device)
            for i in range(args.eval_batches)]
    inference.calibrate(model, calib, progress=False)
    inference.set_kv_cache_scales(model)  # the FP8 caches use the calibrated per-head scales
    shares = [float(s) for s in args.budgets.split(",") if s]
    rows = []
    bf16_loss = None
    for name, share, kw in configs(model, args.batch_size, seq, shares):
        row = {"cache": name, "budget_share": share, "budget_bytes": kw.get("budget_bytes")}
        make = lambda: KVCache.from_model(model, args.batch_size, seq, device=args.device,  # noqa: E731
                                          overflow_chunk=args.chunk, **kw)
        try:
            cache = make()
        except ValueError as e:  # a budget below what seq_len positions need
            rows.append({**row, "refused": str(e)})
            continue
        loss = sum(decode_loss(model, x, y, make()) for x, y in data) / len(data)
        bf16_loss = loss if name == "bf16" else bf16_loss
        rows.append({**row, "cache_bytes": cache.nbytes, "fp8_positions": cache.fp8_capacity if
                     kw["dtype"] == "fp8" else 0, "loss": loss, "perplexity": math.exp(loss),
                     "vs_bf16_cache": math.exp(loss - bf16_loss)})
    result = {"model": what, "device": str(args.device), "seq_len": seq, "batch_size": args.batch_size,
              "eval_batches": args.eval_batches, "chunk": args.chunk,
              "text": f"validation split of {corpus.description}",
              "torch": torch.__version__, "seconds": round(time.time() - t0, 1), "rows": rows}
    print(table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(result: dict) -> str:
    lines = [f"{result['model']}; {result['eval_batches']} x {result['batch_size']} x {result['seq_len']} bytes of "
             f"the {result['text']}, one byte per decode step; {result['device']}, {result['seconds']} s", "",
             "| KV cache | budget | cache bytes | FP8 positions | val loss | perplexity | vs bf16 cache |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        budget = "" if r["budget_share"] is None else f"{r['budget_share']:.0%} ({r['budget_bytes']:,})"
        if "refused" in r:
            lines.append(f"| {r['cache']} | {budget} | refused: {r['refused'].split(': ', 1)[-1]} | | | | |")
            continue
        lines.append(f"| {r['cache']} | {budget} | {r['cache_bytes']:,} | {r['fp8_positions'] or ''} | "
                     f"{r['loss']:.4f} | {r['perplexity']:.4f} | {r['vs_bf16_cache'] - 1:+.2%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
