"""Self-speculative decoding with low-precision drafts: acceptance rate and tokens/s against the FP8 target, and a
check that the greedy output is the FP8 target's own, token for token. One run, one device, the same prompts.

    python benchmarks/bench_speculative.py --train_steps 2500 --json $OUT/speculative.json   # train, then measure
    python benchmarks/bench_speculative.py --checkpoint runs/small --json $OUT/speculative.json
    python benchmarks/bench_speculative.py --dry_run --json /tmp/speculative.json          # CPU, seconds

Model: fp8ext's Transformer (fp8ext.models.transformer), a checkpoint of `python -m fp8ext.train`, or one this
script trains first (--train_steps: preset `small`, bf16, 32 x 512 bytes per step of the default corpus, this
Python's standard-library sources; the checkpoint goes to --out_dir). Targets, as `python -m fp8ext.inference`
makes them: bf16 (bf16 KV cache) and FP8 (calibrate + quantize_model: E4M3 weights per --weights, activations per
--activations, calibrated per-head FP8 KV-cache scales; FP8 KV cache). Drafts: make_draft(FP8 target, fmt) for
mxfp4, nvfp4, mxfp6 and fp8 weights; speculative decoding with k = 2, 4, 8 draft tokens per round, greedy, FP8 KV
caches, against the FP8 target.

--hf measures the same weights as a transformers LlamaForCausalLM instead (fp8ext's Llama export, in memory;
needs transformers): the bf16 model decoding through transformers' DynamicCache, eagerly, and drafts
make_draft(that model, fmt) against it, checked against its own greedy output (the FP8 target and CUDA graphs are
fp8ext's Transformer's, not measured there).

Prompts: --prompt_len bytes at fixed random offsets of the held-out split (every 20th standard-library file, which
training never reads; fp8ext/train/data.py); batch 1 takes the first of the batch-8 prompts. Each configuration:
one warm-up generate() (its output is the one checked: greedy decoding is deterministic, and every timed run's
output is compared with it), then --runs timed calls, each between torch.cuda.synchronize() calls; tokens/s =
batch x --new_tokens / the median time of a whole generate() call (prefill included). Speculative rounds run
eagerly, so the speed-up column is against the FP8 target decoding eagerly; the FP8 target's CUDA-graph decode
(generate's default for an FP8 cache on a GPU) is reported beside it. Prints a markdown table; --json writes every
figure with the device, the torch version and the date (rewritten after each configuration, so a run cut short
keeps what it measured). With the defaults, about 6-7 minutes on an H100: see DEFAULT_TRAIN_STEPS.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, List, Optional

import torch

from fp8ext.inference import ACTIVATION_SCHEMES, WEIGHT_SCHEMES

FORMATS = ("mxfp4", "nvfp4", "mxfp6", "fp8")
KS = (2, 4, 8)
BATCHES = (1, 8)
# preset `small` trained in bf16 at 32 x 512 bytes per step: 0.04-0.06 s per step on an H100 (RESULTS.md: 290-390k
# tokens/s), so 2500 steps (41 M bytes, 1.4 passes over the 30 MB corpus) take 2-2.5 minutes. The measurement takes
# 3-4 more: the eager decode step of `small` is about 8 ms (RESULTS.md: 1,886 tokens/s at batch 16), 28
# configurations x 4 generate() calls x 128 tokens x about 2 forwards per token (draft and target)
DEFAULT_TRAIN_STEPS = 2500


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="an fp8ext.train run directory or checkpoint.pt")
    src.add_argument("--train_steps", type=int, default=None,
                     help=f"train the model first, this many steps (default without --checkpoint: "
                          f"{DEFAULT_TRAIN_STEPS})")
    p.add_argument("--preset", default="small", help="preset trained with --train_steps")
    p.add_argument("--out_dir", default="runs/bench_speculative", help="where --train_steps writes its run")
    p.add_argument("--weights", choices=WEIGHT_SCHEMES, default="channel", help="the FP8 target's weight scaling")
    p.add_argument("--activations", choices=ACTIVATION_SCHEMES, default="dynamic",
                   help="the FP8 target's activation scaling")
    p.add_argument("--prompt_len", type=int, default=128, help="bytes per prompt")
    p.add_argument("--new_tokens", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--runs", type=int, default=3, help="timed runs per configuration (after one warm-up)")
    p.add_argument("--device", default=None, help="default: cuda when there is one")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--hf", action="store_true",
                   help="measure the model as a transformers LlamaForCausalLM (bf16 target, drafts against it)")
    p.add_argument("--dry_run", action="store_true",
                   help="CPU, preset tiny trained 2 steps, short prompts: checks the code paths in seconds")
    return p


def settings(argv: Optional[List[str]] = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    args.scratch = None
    if args.dry_run:
        args.device, args.preset = "cpu", "tiny"
        if args.checkpoint is None:
            args.train_steps = args.train_steps or 2  # barely trained: drafts and target still disagree
        args.prompt_len, args.new_tokens, args.runs = 16, 12, 1
        torch.set_num_threads(1)  # thousands of tiny ops: spare threads only wait (tests/inference/test_speculative.py)
        if args.out_dir == parser().get_default("out_dir"):  # a scratch run, removed at the end
            args.out_dir = args.scratch = tempfile.mkdtemp(prefix="bench_speculative_")
    elif args.checkpoint is None and args.train_steps is None:
        args.train_steps = DEFAULT_TRAIN_STEPS
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def train(args) -> dict:
    """Trains args.preset with `python -m fp8ext.train` (in this process) into args.out_dir; its run.json."""
    from fp8ext.train import main as train_main
    big = not args.dry_run
    argv = ["--preset", args.preset, "--max_steps", str(args.train_steps), "--eval_every", str(args.train_steps),
            "--batch_size", "32" if big else "8", "--seq_len", "512" if big else "64", "--out_dir", args.out_dir,
            "--device", args.device] + ([] if big and sys.stderr.isatty() else ["--no_progress"])  # no bar in logs
    print(f"training: python -m fp8ext.train {' '.join(argv)}", flush=True)
    t0 = time.perf_counter()
    train_main(argv)
    run = json.loads((pathlib.Path(args.out_dir) / "run.json").read_text())
    run["seconds"] = time.perf_counter() - t0
    print(f"training: {run['seconds']:.0f} s", flush=True)
    return run


def load_target(path: str, device: torch.device, dtype: torch.dtype):
    """(model, the training arguments) of an fp8ext.train checkpoint, as python -m fp8ext.inference loads it."""
    from fp8ext.models.transformer import Transformer, preset
    from fp8ext.train.checkpoint import read
    _, state = read(path, "--checkpoint")
    a = state["args"]
    cfg = preset(a["preset"], fused_qkv=not a.get("separate_qkv", False),
                 max_seq_len=max(preset(a["preset"]).max_seq_len, a["seq_len"]))
    model = Transformer(cfg)
    model.load_state_dict(state["model"])
    return model.to(device, dtype).eval(), a


def fp8_target(model, corpus, train_args: dict, args, device: torch.device):
    """A copy of `model` quantized as `python -m fp8ext.inference quantize` does: calibrated on training text
    (input amaxes and per-head K/V amaxes), then quantize_model(weights, activations)."""
    from fp8ext.inference import calibrate, quantize_model
    from fp8ext.train.data import batch
    fp8 = copy.deepcopy(model)
    n, size = (2, 4) if args.dry_run else (8, 8)
    calibrate(fp8, [batch(corpus.train, size, train_args["seq_len"], seed=10_007, step=i, device=device)[0]
                    for i in range(n)], progress=False)
    return quantize_model(fp8, args.weights, args.activations, progress=False)


def prompts(corpus, length: int, device: torch.device) -> torch.Tensor:
    """[max(BATCHES), length] held-out byte sequences at fixed random offsets of the validation split."""
    from fp8ext.train.data import batch
    return batch(corpus.val, max(BATCHES), length, seed=30_011, step=0, device=device)[0]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, prompt: torch.Tensor, n: int, runs: int, **kw) -> dict:
    """One warm-up generate(model, prompt, n, **kw), then `runs` timed calls: the warm-up's ids and stats, each
    timed call's seconds and generate's own decode tokens/s, and whether every timed call gave the same ids."""
    from fp8ext.inference import generate
    ids, stats = generate(model, prompt, n, **kw)
    seconds, decode, agree = [], [], True
    for _ in range(runs):
        sync(prompt.device)
        t0 = time.perf_counter()
        got, s = generate(model, prompt, n, **kw)
        sync(prompt.device)
        seconds.append(time.perf_counter() - t0)
        decode.append(s["decode_tokens_per_s"])
        agree = agree and torch.equal(got, ids)
    med = statistics.median(seconds)
    return {"ids": ids, "stats": stats, "seconds": seconds, "tokens_per_s": prompt.shape[0] * n / med,
            "decode_tokens_per_s": statistics.median(decode) if None not in decode else None, "runs_agree": agree}


def first_mismatch(got: torch.Tensor, want: torch.Tensor, prompt_len: int) -> Optional[int]:
    """The first generated position (0-based, over the batch) where got and want differ; None when identical."""
    differs = (got != want).any(0).nonzero()
    return None if differs.numel() == 0 else int(differs[0]) - prompt_len


def row(name: str, batch: int, r: dict, want: Optional[torch.Tensor], prompt_len: int, **extra) -> dict:
    """A result row: the timings of timed_generate's `r` and, with a reference `want`, the greedy check."""
    out = {"config": name, "batch": batch, **extra, "tokens_per_s": r["tokens_per_s"], "seconds": r["seconds"],
           "decode_tokens_per_s": r["decode_tokens_per_s"], "runs_agree": r["runs_agree"]}
    if want is not None:
        miss = first_mismatch(r["ids"], want, prompt_len)
        out.update(identical=miss is None, first_mismatch=miss)
    return out


class Progress:
    """`[i/total] line (elapsed)` per configuration, flushed as it goes; after each, `checkpoint()` (which writes
    the JSON so far: a run cut short keeps what it measured)."""

    def __init__(self, total: int, checkpoint: Callable[[], None]):
        self.i, self.total, self.t0, self.checkpoint = 0, total, time.perf_counter(), checkpoint

    def __call__(self, line: str) -> None:
        self.i += 1
        print(f"[{self.i}/{self.total}] {line} ({time.perf_counter() - self.t0:.0f} s)", flush=True)
        self.checkpoint()


def measure_targets(bf16, fp8, prompt: torch.Tensor, args, rows: List[dict], say: Callable) -> dict:
    """Appends to `rows` bf16 with a bf16 cache and FP8 with an FP8 cache (eager, and on a GPU as a CUDA graph),
    at every batch size; returns {batch: the FP8 target's eager greedy ids}, the reference the CUDA graph's and the
    drafts' outputs are checked against."""
    configs = [("bf16 target", bf16, {"kv_cache": "bf16", "cuda_graph": False}),
               ("fp8 target", fp8, {"kv_cache": "fp8", "cuda_graph": False})]
    if prompt.is_cuda:
        configs.append(("fp8 target, CUDA graph", fp8, {"kv_cache": "fp8", "cuda_graph": True}))
    refs = {}
    for b in BATCHES:
        for name, model, kw in configs:
            r = timed_generate(model, prompt[:b], args.new_tokens, args.runs, **kw)
            want = refs.get(b) if name == "fp8 target, CUDA graph" else None
            rows.append(row(name, b, r, want, args.prompt_len, **kw))
            refs[b] = r["ids"] if name == "fp8 target" else refs.get(b)
            same = "" if want is None else f", identical {'yes' if rows[-1]['identical'] else 'no'}"
            say(f"{name}, batch {b}: {r['tokens_per_s']:,.1f} tokens/s{same}")
    return refs


@torch.no_grad()
def verification_check(fp8, ref: torch.Tensor, prompt_len: int, chunk: int) -> dict:
    """Where greedy speculative output can part from the target's own: the FP8 target teacher-forced over its greedy
    ids `ref` twice, one token per forward (as plain decoding) and `chunk` tokens per forward (as a verification of
    chunk - 1 draft tokens); the positions whose argmax differs between the two, the largest logit difference, and
    at each differing position the one-token logits' margin between their best two tokens."""
    from fp8ext.inference import KVCache
    b, total = ref.shape
    out = []
    for step in (1, chunk):
        cache = KVCache.from_model(fp8, b, total, "fp8", device=ref.device)
        logits = [fp8(ref[:, :prompt_len], kv_cache=cache, start_pos=0)[:, -1:]]
        for t in range(prompt_len, total - 1, step):
            logits.append(fp8(ref[:, t:min(t + step, total - 1)], kv_cache=cache, start_pos=t))
        out.append(torch.cat(logits, 1).float())
    one, many = out
    differ = (one.argmax(-1) != many.argmax(-1)).nonzero().tolist()
    top2 = one.topk(2, -1).values
    return {"chunk": chunk, "positions": one.shape[0] * one.shape[1], "argmax_differs_at": differ,
            "max_abs_logit_difference": float((one - many).abs().max()),
            "margins_where_they_differ": [float(top2[i, j, 0] - top2[i, j, 1]) for i, j in differ]}


def measure_drafts(fp8, prompt: torch.Tensor, refs: dict, args, rows: List[dict], say: Callable, *,
                   kv_cache: str = "fp8", prefix: str = "") -> None:
    """Appends to `rows` one row per draft format, k and batch: speculative decoding against the target `fp8` (the
    FP8 target; with --hf the transformers model), KV caches of `kv_cache`; names begin with `prefix`."""
    from fp8ext import WeightOnlyLinear
    from fp8ext.inference import make_draft
    for fmt in FORMATS:
        draft = make_draft(fp8, fmt)
        nbytes = sum(m.nbytes for m in draft.modules() if isinstance(m, WeightOnlyLinear))
        for b in BATCHES:
            for k in KS:
                r = timed_generate(fp8, prompt[:b], args.new_tokens, args.runs, kv_cache=kv_cache, draft=draft,
                                   speculate=k)
                s = r["stats"]
                rows.append(row(f"{prefix}{fmt} draft", b, r, refs[b], args.prompt_len, format=fmt, k=k,
                                draft_weight_bytes=nbytes, acceptance_rate=s["acceptance_rate"],
                                acceptance_rate_per_sequence=s["acceptance_rate_per_sequence"],
                                rounds=s["rounds"], proposed=s["proposed"], accepted=s["accepted"]))
                say(f"{prefix}{fmt} draft, k={k}, batch {b}: acceptance {s['acceptance_rate']:.1%}, "
                    f"{r['tokens_per_s']:,.1f} tokens/s, identical {'yes' if rows[-1]['identical'] else 'no'}")
        del draft
        if prompt.is_cuda:
            torch.cuda.empty_cache()


def hf_model(model):
    """fp8ext's Transformer `model` as a transformers LlamaForCausalLM with its weights (the Llama export's names
    and config, in memory), in model's dtype and on its device, eval mode."""
    import transformers
    from fp8ext.inference.llama import llama_config, to_llama
    cfg, tied = model.cfg, model.lm_head.weight is model.embed.weight
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg, tied=tied, dtype=dtype)))
    hf.load_state_dict(to_llama(state, cfg, {}), strict=True)
    return hf.to(model.embed.weight.device, model.embed.weight.dtype).eval()


def measure_hf(hf, prompt: torch.Tensor, args, targets: List[dict], drafts: List[dict], say: Callable) -> None:
    """The transformers model alone (DynamicCache, eager) at every batch size, then each draft format and k against
    it, checked against its greedy ids."""
    refs = {}
    for b in BATCHES:
        r = timed_generate(hf, prompt[:b], args.new_tokens, args.runs, kv_cache="bf16")
        targets.append(row("transformers bf16 target", b, r, None, args.prompt_len, kv_cache="bf16"))
        refs[b] = r["ids"]
        say(f"transformers bf16 target, batch {b}: {r['tokens_per_s']:,.1f} tokens/s")
    measure_drafts(hf, prompt, refs, args, drafts, say, kv_cache="bf16", prefix="transformers, ")


def markdown(targets: List[dict], drafts: List[dict], base: str = "fp8 target") -> str:
    """One table: the targets, then each draft configuration, tokens/s against the `base` target's eager decoding
    at the same batch size (the FP8 target's; with --hf the transformers model's)."""
    eager = {r["batch"]: r["tokens_per_s"] for r in targets if r["config"] == base}
    what = "FP8" if base == "fp8 target" else "the model's"
    lines = [f"| configuration | k | batch | acceptance | tokens/s | vs {what} eager | identical to {what} greedy |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in targets + drafts:
        acc = f"{r['acceptance_rate']:.1%}" if r.get("acceptance_rate") is not None else ""
        same = "" if "identical" not in r else "yes" if r["identical"] else f"no (first at {r['first_mismatch']})"
        lines.append(f"| {r['config']} | {r.get('k', '')} | {r['batch']} | {acc} | {r['tokens_per_s']:,.1f} | "
                     f"{r['tokens_per_s'] / eager[r['batch']]:.2f}x | {same} |")
    return "\n".join(lines)


def header(device: torch.device) -> dict:
    import fp8ext
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "fp8ext": fp8ext.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def write_json(path: Optional[str], result: dict) -> None:
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(json.dumps(result, indent=1, default=str))


def main(argv: Optional[List[str]] = None) -> int:
    args = settings(argv)
    device = torch.device(args.device)
    run = train(args) if args.train_steps else None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the trainer's model and optimizer are gone
    # bf16 as python -m fp8ext.inference runs it on a GPU; float32 on a CPU, where the dry run only checks paths
    path = args.checkpoint or args.out_dir
    model, train_args = load_target(path, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    from fp8ext.train.data import load_corpus
    corpus = load_corpus(train_args.get("data"))
    fp8 = fp8_target(model, corpus, train_args, args, device)
    prompt = prompts(corpus, args.prompt_len, device)
    training = run and {k: run.get(k) for k in ("final_val_loss", "tokens_per_s", "seconds", "parameters", "corpus")}
    result = {**header(device), "settings": {**vars(args), "formats": FORMATS, "k": KS, "batches": BATCHES},
              "model": {"checkpoint": str(path), "train_args": train_args, "training": training},
              "targets": [], "speculative": []}
    if args.hf:
        say = Progress(len(BATCHES) * (1 + len(FORMATS) * len(KS)), lambda: write_json(args.json, result))
        measure_hf(hf_model(model), prompt, args, result["targets"], result["speculative"], say)
        result["table"] = markdown(result["targets"], result["speculative"], "transformers bf16 target")
        write_json(args.json, result)
        print(f"\n{result['device']}, {train_args['preset']} preset as a transformers LlamaForCausalLM, "
              f"{args.prompt_len}-byte held-out prompts, {args.new_tokens} new tokens, median of {args.runs} "
              f"runs:\n\n{result['table']}")
        if args.scratch:
            shutil.rmtree(args.scratch, ignore_errors=True)
        return 0
    say = Progress(len(BATCHES) * ((3 if device.type == "cuda" else 2) + len(FORMATS) * len(KS)),
                   lambda: write_json(args.json, result))
    refs = measure_targets(model, fp8, prompt, args, result["targets"], say)
    result["verification_check"] = check = verification_check(fp8, refs[max(BATCHES)], args.prompt_len, 3)
    print(f"one-token steps vs 3-token forwards of the FP8 target over its batch-{max(BATCHES)} greedy ids: argmax "
          f"differs at {len(check['argmax_differs_at'])} of {check['positions']} positions (batch, position: "
          f"{check['argmax_differs_at'][:8]}), max |logit difference| {check['max_abs_logit_difference']:.3g}, "
          f"margins there {[round(m, 4) for m in check['margins_where_they_differ'][:8]]}", flush=True)
    measure_drafts(fp8, prompt, refs, args, result["speculative"], say)
    result["table"] = markdown(result["targets"], result["speculative"])
    write_json(args.json, result)
    print(f"\n{result['device']}, {train_args['preset']} preset, {args.prompt_len}-byte held-out prompts, "
          f"{args.new_tokens} new tokens, median of {args.runs} runs:\n\n{result['table']}")
    if args.json:
        print(f"wrote {args.json}", file=sys.stderr)
    if args.scratch:
        shutil.rmtree(args.scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
