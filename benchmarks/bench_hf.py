"""Training speed and peak memory of a Hugging Face LlamaForCausalLM in bf16 and with fp8ext, eager and compiled,
next to torchao's float8 training where torchao is installed; and fp8ext's own 1b preset through fp8ext.train.

    python benchmarks/bench_hf.py                        # every variant: the ~1B config, 8 x 2048 tokens
    python benchmarks/bench_hf.py --variants bf16-eager fp8ext-eager --steps 10
    python benchmarks/bench_hf.py --preset 1b            # fp8ext.train --preset 1b: bf16 / FP8, eager / compiled
    python benchmarks/bench_hf.py --preset 1b --fp8_attention   # and FP8 linear layers with FP8 attention
    python benchmarks/bench_hf.py --variants bf16-compiled fp8ext-compiled fp8ext-attention-compiled
                                                         # the Llama with FP8 attention too (cudnn frontend)
    python benchmarks/bench_hf.py --tiny --device cpu    # a dry run of every code path (no speed claims)
    python benchmarks/bench_hf.py --activation_checkpointing both --variants bf16-eager fp8ext-eager
                                                         # each variant without and with checkpointing

The model is built from a config, so nothing is downloaded (needs transformers: the "test" extra): hidden 2048,
intermediate 8192, 16 layers, 16 heads, 8 KV heads, vocabulary 32000, bf16 parameters, fused AdamW, random
tokens (the same in every variant). FP8 variants convert every linear layer of the blocks and leave lm_head in
bf16: fp8ext with convert_to_fp8 under fp8_autocast (delayed scaling, or current scaling), compiled after
prepare_fp8; torchao with convert_to_float8_training (tensorwise) and torch.compile. Each variant runs in its
own process (its peak memory alone, no shared compilation cache); a variant that fails or does not fit prints
its error and the others go on. Timing: CUDA events around each step after the warm-up steps (compilation
happens there), median; tokens/s = tokens per step / median step time; peak = torch.cuda.max_memory_allocated
over the whole run (compilation included: inductor's kernel timing allocates memory of its own), and the timed
steps' peak apart. Ratios are against bf16 eager and bf16 compiled of the same run (with checkpointing, against
bf16 with checkpointing). --activation_checkpointing full: transformers' gradient_checkpointing_enable() (torch's
non-reentrant checkpoint around each decoder layer); with --preset, fp8ext.train's --activation_checkpointing full.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VARIANTS = ["bf16-eager", "bf16-compiled", "fp8ext-eager", "fp8ext-current-eager", "fp8ext-compiled",
            "fp8ext-current-compiled", "fp8ext-recast-compiled", "fp8ext-current-recast-compiled", "torchao-compiled",
            "fp8ext-attention-eager", "fp8ext-attention-compiled"]
DEFAULT_VARIANTS = VARIANTS[:9]  # the FP8-attention ones need the cudnn frontend: asked for by name
FULL = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=8, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def build(args, variant: str):
    """The model of `variant` and the context its steps run in: (model, step context factory)."""
    import contextlib

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import fp8ext
    sizes = TINY if args.tiny else FULL
    cfg = LlamaConfig(**sizes, max_position_embeddings=args.seq_len, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(args.device, torch.bfloat16)
    if args.activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks_only = lambda layer, name: "lm_head" not in name  # noqa: E731  (lm_head stays bf16, as torchao's recipes)
    context = contextlib.nullcontext
    if variant.startswith("fp8ext"):
        attention = "attention" in variant  # FP8 attention too, its backward in bf16 unless NVTE_FP8_DPA_BWD=1
        recipe = fp8ext.Float8CurrentScaling(fp8_dpa=attention) if "current" in variant else \
            fp8ext.DelayedScaling(amax_history_len=args.amax_history, fp8_dpa=attention)
        if attention:
            os.environ.setdefault("NVTE_FP8_DPA_BWD", "0")
            model.set_attn_implementation(fp8ext.register_hf_attention())
        fp8ext.convert_to_fp8(model, filter_fn=blocks_only)
        if "compiled" in variant:  # recast: keep x and W for backward and cast them again there (less memory)
            fp8ext.prepare_fp8(model, recipe, recast_in_backward="recast" in variant)
        context = lambda: fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe)  # noqa: E731
    elif variant.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=lambda m, name: blocks_only(m, name))
    if variant.endswith("compiled"):
        model = torch.compile(model)
    return model, context


def run_variant(args, variant: str) -> dict:
    """Trains `variant` for warm-up + timed steps in this process; tokens/s and peak memory."""
    import torch
    cuda = args.device == "cuda"
    model, context = build(args, variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    gen = torch.Generator(device=args.device).manual_seed(1)
    vocab = (TINY if args.tiny else FULL)["vocab_size"]
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len), device=args.device, generator=gen)
    times, losses = [], []
    warm_peak = None

    def one_step():
        with context():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for step in range(args.warmup + args.steps):
        if cuda and step == args.warmup:  # the timed steps' own peak, apart from compilation's and the first steps'
            warm_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        loss = one_step()
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if step >= args.warmup:
            times.append(ms)
            losses.append(loss.item())
    med = statistics.median(times)
    steady = torch.cuda.max_memory_allocated() if cuda else None
    row = {"variant": _name(variant, args.activation_checkpointing), "tokens_per_s": args.batch * args.seq_len / (med / 1e3), "step_ms": med,
           "peak_gib": max(steady, warm_peak or 0) / 2**30 if cuda else None,
           "timed_peak_gib": steady / 2**30 if cuda else None, "last_loss": losses[-1]}
    if args.profile and cuda:  # after the timed steps, so that their peak and time are not the profiler's
        row["profile"] = profile_steps(one_step, steps=2)
    return row


def profile_steps(step, steps: int) -> dict:
    """The GPU's kernel time per step under torch.profiler, by kind (profile_train.py's kinds) and the largest
    kernels by name: {"kinds": {kind: [ms, launches]}, "top": [[name, ms, launches], ...]}."""
    from profile_decode import kernels
    from profile_train import KINDS, kind_of
    per_name = kernels(step, steps=steps)
    kinds = {k: [0.0, 0.0] for k, _ in KINDS + [("other", None)]}
    for name, (us, n) in per_name:
        kinds[kind_of(name)][0] += us / 1e3
        kinds[kind_of(name)][1] += n
    return {"kinds": kinds, "top": [[name, us / 1e3, n] for name, (us, n) in per_name[:20]]}


def _name(variant: str, checkpointing: str) -> str:
    return variant + (" +ckpt" if checkpointing == "full" else "")


def in_subprocess(args, variant: str, checkpointing: str = "none") -> dict:
    name = _name(variant, checkpointing)
    cmd = [sys.executable, __file__, "--child", variant, "--device", args.device, "--batch", str(args.batch),
           "--seq_len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--activation_checkpointing", checkpointing]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--amax_history", str(args.amax_history)] + (["--profile"] if args.profile else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:  # a variant past its time is reported like a failed one; the others go on
        print(f"{name}: did not finish in {args.timeout} s (--timeout)", file=sys.stderr)
        return {"variant": name, "error": f"timed out after {args.timeout} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT "):])
            print(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, peak {row['peak_gib']} GiB", flush=True)
            return row
    err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    print(f"{name}: failed (rc {proc.returncode}): {err}", file=sys.stderr)
    return {"variant": name, "error": err}


def preset_runs(args) -> list:
    """fp8ext.train --preset P in bf16 and FP8, eager and compiled (without and/or with activation checkpointing):
    its own summary (tokens/s, peak memory)."""
    rows = []
    kinds = ("bf16", "FP8", "FP8 + FP8 attention") if args.fp8_attention else ("bf16", "FP8")
    modes = [m == "compiled" for m in ("eager", "compiled") if m in args.modes]
    for compiled, ckpt, kind in [(c, a, k) for c in modes for a in _checkpointing(args) for k in kinds]:
        fp8 = kind != "bf16"
        name = _name(f"fp8ext.train {args.preset} {kind} {'compiled' if compiled else 'eager'}", ckpt)
        out = os.path.join(os.environ.get("OUT") or os.path.join(HERE, "out"), "bench_hf_runs",
                           name.replace(" ", "_"))
        cmd = [sys.executable, "-m", "fp8ext.train", "--no_progress", "--no_save", "--out_dir", out, "--preset",
               args.preset, "--batch_size", str(args.batch), "--seq_len", str(args.seq_len), "--max_steps",
               str(args.warmup + args.steps), "--eval_every", "1000000", "--eval_batches", "2",
               "--device", args.device]
        cmd += (["--use_fp8"] if fp8 else []) + (["--compile"] if compiled else [])
        cmd += ["--fp8_attention"] if "attention" in kind else []  # its backward in bf16 (fp8ext.train's default)
        cmd += ["--activation_checkpointing", ckpt] if ckpt != "none" else []
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        try:
            s = json.load(open(os.path.join(out, "run.json")))
            rows.append({"variant": name, "tokens_per_s": s["tokens_per_s"], "peak_gib": s["peak_memory_gib"]})
        except (OSError, ValueError, KeyError):
            err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"{name}: failed (rc {proc.returncode}): {err}", file=sys.stderr)
            rows.append({"variant": name, "error": err})
    return rows


def _checkpointing(args) -> list:
    return ["none", "full"] if args.activation_checkpointing == "both" else [args.activation_checkpointing]


def report(rows: list, args) -> None:
    from _harness import device_header, save, table
    base = {r["variant"]: r.get("tokens_per_s") for r in rows}
    for r in rows:
        ck = "full" if r["variant"].endswith(" +ckpt") else "none"
        eager = base.get(_name("bf16-eager", ck)) or base.get(_name(f"fp8ext.train {args.preset} bf16 eager", ck))
        comp = base.get(_name("bf16-compiled", ck)) or base.get(_name(f"fp8ext.train {args.preset} bf16 compiled", ck))
        tps = r.get("tokens_per_s")
        r["vs bf16 eager"] = f"{tps / eager:.3f}x" if tps and eager else "-"
        r["vs bf16 compiled"] = f"{tps / comp:.3f}x" if tps and comp else "-"
        r["tokens/s"] = f"{tps:,.0f}" if tps else r.get("error", "-")[:60]
        r["peak GiB"] = f"{r['peak_gib']:.3f}" if r.get("peak_gib") is not None else "-"
        r["timed steps' peak GiB"] = f"{r['timed_peak_gib']:.3f}" if r.get("timed_peak_gib") is not None else "-"
    head = device_header() if args.device == "cuda" else {"device": "cpu"}
    print(head)
    print(f"{args.batch} x {args.seq_len} tokens per step, {args.steps} timed steps after {args.warmup} warm-up")
    print(table(rows, ["variant", "tokens/s", "vs bf16 eager", "vs bf16 compiled", "peak GiB",
                       "timed steps' peak GiB"]))
    profiled = [r for r in rows if r.get("profile")]
    if profiled:  # where each variant's GPU time goes
        from profile_train import KINDS
        kinds = [k for k, _ in KINDS] + ["other"]
        print("kernel time per step, ms (launches), torch.profiler, 2 steps after the timed ones:")
        print("| kind | " + " | ".join(r["variant"] for r in profiled) + " |")
        print("|---|" + "---:|" * len(profiled))
        for k in kinds + ["all"]:
            cells = []
            for r in profiled:
                v = r["profile"]["kinds"]
                ms, n = (sum(x[0] for x in v.values()), sum(x[1] for x in v.values())) if k == "all" else v[k]
                cells.append(f"{ms:.1f} ({n:.0f})")
            print(f"| {k} | " + " | ".join(cells) + " |")
        for r in profiled:
            print(f"== {r['variant']}: largest kernels, ms per step (launches)")
            for name, ms, n in r["profile"]["top"][:12]:
                print(f"  {ms:8.2f}  {n:6.0f}  {name[:90]}")
    if args.device == "cuda":
        save(f"bench_hf_{'preset_' + args.preset if args.preset else 'llama'}.json", {"header": head, "rows": rows})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS,
                    help="fp8ext-attention-*: FP8 linear layers and FP8 attention (register_hf_attention, fp8_dpa; "
                         "its backward in bf16 unless NVTE_FP8_DPA_BWD=1), which needs the cudnn frontend on a GPU")
    ap.add_argument("--fp8_attention", action="store_true",
                    help="with --preset: also FP8 linear layers with FP8 attention (fp8ext.train --fp8_attention)")
    ap.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"],
                    help="with --preset: eager runs, compiled runs or both (one device call may not hold both)")
    ap.add_argument("--preset", default=None, help="instead: fp8ext.train's preset (e.g. 1b)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="a small config (dry runs of the code paths)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    ap.add_argument("--amax_history", type=int, default=1024,
                    help="DelayedScaling's amax_history_len for the fp8ext variants that are not 'current' (the "
                         "history is float32 per FP8 tensor slot: 2 MiB on this model with 1024 steps)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile two steps per variant after the timed ones: kernel time by kind and by name")
    ap.add_argument("--activation_checkpointing", choices=["none", "full", "both"], default="none",
                    help="full: each decoder layer checkpointed (recomputed in the backward pass); both: every variant "
                         "without and with it, in the same call")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one variant, in this process
        print("RESULT " + json.dumps(run_variant(args, args.child)))
        return 0
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("bench_hf.py: no CUDA GPU here; use --device cpu --tiny for a dry run", file=sys.stderr)
            return 2
    if args.preset:
        rows = preset_runs(args)
    else:
        variants = list(args.variants)
        try:
            import torchao  # noqa: F401
        except ImportError:
            if "torchao-compiled" in variants:
                print("torchao is not installed: its variant is left out", file=sys.stderr)
                variants.remove("torchao-compiled")
        rows = [in_subprocess(args, v, ck) for ck in _checkpointing(args) for v in variants]
    report(rows, args)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
