"""FP8 inference speed and memory against bf16, side by side in one run, on one GPU.

    python benchmarks/bench_inference.py [--preset 1b] [--quick]   # needs a CUDA GPU and fp8ext built with CUDA

Model: fp8ext.models.transformer's preset (default `1b`: 22 layers, d_model 2048, 16 heads, 4 KV heads of 128),
random init in bf16 (speed does not depend on training). FP8: quantize_model(weights="channel") with
activations "dynamic" (per token) and "static" (calibrated per-tensor input scales and per-head K/V scales, from
two random batches); the embedding and output head stay bf16 in both. Rows:
  prefill        forward of 32 x 2048 tokens (no cache): FP8 dynamic and static vs bf16        goal >= 1.4x
                 and each with FP8 attention too (cuDNN's FP8 forward, a recipe with fp8_dpa=True; where the
                 cudnn frontend is installed), and with fp8_mha=True as well (attention's E4M3 output
                 handed to o_proj, no bf16 round trip)                                         goal >= 1.7x
  decode step    one token for each of 128 sequences over a KV cache holding 1024 positions (random K/V),
                 FP8 weights + FP8 cache (decode_attention on the E4M3 bytes) vs bf16 weights + bf16 cache
                 (SDPA); eagerly, and replayed as a CUDA graph (launch overhead out of the way)  goal >= 1.2x
  weight memory  bytes of the quantized layers' weights + scales vs their bf16 weights           goal <= 0.52x
  KV cache       bytes of the FP8 cache vs the bf16 cache (same batch and length)               0.5x
  decode_attention  one query token per sequence over a 32k-token cache, batch 8, Llama-8B heads (32 query,
                 8 KV, head_dim 128): fp8ext's kernel on the FP8 cache vs torch SDPA (enable_gqa) on a bf16
                 cache of the same shape; also its error against the float32 reference             goal >= 1.6x
  generate()     what a user runs: batch 128, a 1024-token prompt, 128 new tokens; ms per decode step of
                 bf16 + bf16 cache (eager) against FP8 + FP8 cache eager, and FP8 + FP8 cache with its decode
                 steps as one CUDA graph (generate's default on a GPU; the capture counted in the time)
Timings: CUDA events after warm-up, medians; the implementations of a row interleaved over rounds. A row whose
code raises prints the error and the run goes on. Random data throughout (never zeros). About 1-2 minutes on
an H100; --quick shrinks the sizes (a smoke test). The JSON goes to $OUT (benchmarks/out by default).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import traceback

import torch
import torch.nn.functional as F

import fp8ext
from _harness import bench_ms, device_header, rounds, save

GOALS = {"prefill": 1.4, "prefill_fp8_attention": 1.7, "decode": 1.2, "weights": 0.52, "kv": 0.5, "attention": 1.6}


def row(rows, name, bf16=None, fp8=None, ratio=None, goal=None, unit="ms", higher_is_better=True, note="",
        error=None):
    rows.append({"name": name, "bf16": bf16, "fp8": fp8, "ratio": ratio, "goal": goal, "unit": unit,
                 "higher": higher_is_better, "note": note, "error": error})
    if error:
        print(f"  {name}: ERROR {error}", flush=True)
    else:
        print(f"  {name}: bf16 {bf16} fp8 {fp8} ratio {ratio}", flush=True)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def try_once(fn):
    """Runs fn once (and synchronises): None when it works, the error text otherwise."""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (report and go on)
        traceback.print_exc(limit=3)
        return error_text(e)


def linear_bytes(model, quantized: bool) -> int:
    from fp8ext.inference import FP8InferenceLinear
    if quantized:
        return sum(m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * 4
                   + (m.input_scale.numel() * 4 if m.input_scale is not None else 0)
                   for m in model.modules() if isinstance(m, FP8InferenceLinear))
    from fp8ext.inference import quantizable_linears
    return sum(m.weight.numel() * m.weight.element_size() for m in quantizable_linears(model).values())


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def filled_cache(model, batch: int, context: int, dtype: str, gen: torch.Generator):
    """A KV cache for `model` holding `context` positions of random K/V (normal, std 1), room for one more."""
    from fp8ext.inference import KVCache
    cfg = model.cfg
    device = gen.device
    cache = KVCache.from_model(model, batch, context + 1, dtype, device=device)
    for layer in range(cfg.n_layers):
        k = torch.randn(batch, cfg.n_kv_heads, context, cfg.head_dim, device=device, generator=gen,
                        dtype=torch.bfloat16)
        v = torch.randn(batch, cfg.n_kv_heads, context, cfg.head_dim, device=device, generator=gen,
                        dtype=torch.bfloat16)
        cache.update(layer, k, v, 0)
        del k, v
    return cache


def decode_step(model, cache, tok, context):
    def step():
        cache.truncate(context)
        return model(tok, kv_cache=cache, start_pos=context)
    return step


def graphed(step_fn):
    """step_fn captured as a CUDA graph (after warm-up on a side stream); returns the replay function."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step_fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step_fn()
    torch.cuda.synchronize()
    return g.replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="1b")
    p.add_argument("--prefill_batch", type=int, default=32)
    p.add_argument("--prefill_len", type=int, default=2048)
    p.add_argument("--decode_batch", type=int, default=128)
    p.add_argument("--decode_context", type=int, default=1024)
    p.add_argument("--attn_batch", type=int, default=8)
    p.add_argument("--attn_context", type=int, default=32768)
    p.add_argument("--gen_tokens", type=int, default=128, help="new tokens per generate() run")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test of the script")
    p.add_argument("--prefill_only", action="store_true", help="the weight-memory and prefill rows alone")
    args = p.parse_args()
    if not torch.cuda.is_available() or not fp8ext.cuda_available():
        sys.exit("bench_inference: needs a CUDA GPU and fp8ext built with CUDA (FP8EXT_CUDA=1); "
                 f"cuda available: {torch.cuda.is_available()}, fp8ext CUDA kernels: {fp8ext.cuda_available()}")
    if args.quick:
        args.prefill_batch, args.prefill_len, args.decode_batch, args.decode_context = 4, 512, 16, 256
        args.attn_batch, args.attn_context, args.gen_tokens = 2, 4096, 16

    from fp8ext import inference
    from fp8ext.inference.attention import decode_attention, decode_attention_reference
    from fp8ext.models.transformer import Transformer, preset
    try:
        from fp8ext._bench import warm_up_gpu
    except ImportError:  # an older fp8ext._bench
        def warm_up_gpu(seconds):
            return None

    head = device_header()
    print(f"bench_inference: {head}", flush=True)
    cfg = preset(args.preset)
    need = max(args.prefill_len, args.decode_context + args.gen_tokens)
    if need > cfg.max_seq_len:
        cfg = preset(args.preset, max_seq_len=need)
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    bf16 = Transformer(cfg, device="cuda").to(torch.bfloat16).eval()
    print(f"preset {args.preset}: {bf16.num_parameters() / 1e9:.2f}B parameters", flush=True)
    models = {"bf16": bf16}
    with torch.no_grad():
        for act in ("dynamic", "static"):
            try:
                m = copy.deepcopy(bf16)
                if act == "static":
                    calib = [torch.randint(0, cfg.vocab_size, (4, min(2048, cfg.max_seq_len)), device="cuda",
                                           generator=gen) for _ in range(2)]
                    inference.calibrate(m, calib, progress=False)
                inference.quantize_model(m, "channel", act)
                models[f"fp8 {act}"] = m
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(limit=3)
                row(rows, f"quantize_model(channel, {act})", error=error_text(e))
    torch.cuda.empty_cache()
    warm_up_gpu(1.0)

    # memory of the weights
    for name in ("fp8 dynamic", "fp8 static"):
        if name in models:
            lb, lq = linear_bytes(bf16, False), linear_bytes(models[name], True)
            row(rows, f"weight memory, linear layers ({name})", lb / 2**30, lq / 2**30, lq / lb, GOALS["weights"],
                "GiB", higher_is_better=False)
            wb, wq = model_bytes(bf16), model_bytes(models[name])
            row(rows, f"weight memory, whole model ({name})", wb / 2**30, wq / 2**30, wq / wb, None, "GiB",
                higher_is_better=False, note="embedding and output head stay bf16")

    # prefill
    with torch.no_grad():
        ids = torch.randint(0, cfg.vocab_size, (args.prefill_batch, args.prefill_len), device="cuda", generator=gen)
        impls = {name: (lambda m=m: m(ids)) for name, m in models.items()}
        from fp8ext.ops.attention_cudnn import cudnn_available
        if cudnn_available():  # the FP8 models with attention in FP8 as well (the forward only: cuDNN's FP8 kernel)
            dpa = fp8ext.Float8CurrentScaling(fp8_dpa=True)
            mha = fp8ext.Float8CurrentScaling(fp8_mha=True)
            for name, m in models.items():
                if name != "bf16":
                    impls[f"{name} + FP8 attention"] = lambda m=m: m(ids, fp8=True, fp8_recipe=dpa)
                    impls[f"{name} + FP8 attention, FP8 output (fp8_mha)"] = \
                        lambda m=m: m(ids, fp8=True, fp8_recipe=mha)
        else:
            row(rows, f"prefill {args.prefill_batch} x {args.prefill_len}, FP8 attention",
                error="not run: needs NVIDIA's cudnn frontend (pip install nvidia-cudnn-frontend)")
        ok = {}
        for name, fn in impls.items():
            err = try_once(fn)
            if err:
                row(rows, f"prefill {args.prefill_batch} x {args.prefill_len}, {name}", error=err)
            else:
                ok[name] = fn
        if "bf16" in ok and len(ok) > 1:
            t = rounds(ok, reps=5, n_rounds=3)
            tokens = args.prefill_batch * args.prefill_len
            for name in ok:
                if name != "bf16":
                    row(rows, f"prefill {args.prefill_batch} x {args.prefill_len}, {name}", t["bf16"][0], t[name][0],
                        t["bf16"][0] / t[name][0],
                        GOALS["prefill_fp8_attention" if "attention" in name else "prefill"],
                        note=f"{tokens / t[name][0]:,.0f}k tokens/s FP8, {tokens / t['bf16'][0]:,.0f}k bf16")
        del ids
        torch.cuda.empty_cache()

    if args.prefill_only:
        return report(rows, head, args)

    # decode step (eager), and the KV cache's memory
    with torch.no_grad():
        tok = torch.randint(0, cfg.vocab_size, (args.decode_batch, 1), device="cuda", generator=gen)
        label = f"decode step, batch {args.decode_batch}, {args.decode_context} cached"
        steps, caches = {}, {}
        for name, m in models.items():
            kv = "bf16" if name == "bf16" else "fp8"
            try:
                cache = filled_cache(m, args.decode_batch, args.decode_context, kv, gen)
                fn = decode_step(m, cache, tok, args.decode_context)
                err = try_once(fn)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(limit=3)
                err = error_text(e)
            if err:
                row(rows, f"{label}, {name} + {kv} cache (eager)", error=err)
                continue
            steps[name], caches[name] = fn, cache
        if "bf16" in caches:
            for name, cache in caches.items():
                if name != "bf16":
                    nb, n8 = caches["bf16"].nbytes, cache.nbytes
                    row(rows, f"KV cache memory, batch {args.decode_batch} x {args.decode_context + 1}", nb / 2**30,
                        n8 / 2**30, n8 / nb, GOALS["kv"], "GiB", higher_is_better=False,
                        note=f"scales: {cache.scale_source}")
                    break
        if "bf16" in steps and len(steps) > 1:
            t = rounds(steps, reps=20, n_rounds=3)
            for name in steps:
                if name != "bf16":
                    row(rows, f"{label}, {name} + fp8 cache vs bf16 + bf16 cache (eager)", t["bf16"][0], t[name][0],
                        t["bf16"][0] / t[name][0], GOALS["decode"],
                        note=f"KV scales {caches[name].scale_source}")
        torch.cuda.empty_cache()

    # decode_attention at 32k
    with torch.no_grad():
        b, h, kv, hd, L = args.attn_batch, 32, 8, 128, args.attn_context
        label = f"decode_attention, batch {b}, {L} cached, 32/8 heads x 128"
        try:
            q = torch.randn(b, h, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
            k16 = torch.randn(b, kv, L, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
            v16 = torch.randn(b, kv, L, hd, device="cuda", dtype=torch.bfloat16, generator=gen)
            k_scale = (k16.float().abs().amax(dim=(0, 2, 3)) / 448).contiguous()
            v_scale = (v16.float().abs().amax(dim=(0, 2, 3)) / 448).contiguous()
            k8 = fp8ext.quantize((k16.float() / k_scale[None, :, None, None]).contiguous(), fp8ext.E4M3)
            v8 = fp8ext.quantize((v16.float() / v_scale[None, :, None, None]).contiguous(), fp8ext.E4M3)
            q4 = q[:, :, None]

            def sdpa():
                return F.scaled_dot_product_attention(q4, k16, v16, enable_gqa=True)

            def fp8_kernel():
                return decode_attention(q, k8, v8, L, k_scale, v_scale)

            errs = {"bf16": try_once(sdpa), "fp8": try_once(fp8_kernel)}
            if errs["bf16"] or errs["fp8"]:
                row(rows, label, error="; ".join(f"{k}: {e}" for k, e in errs.items() if e))
            else:
                ref = decode_attention_reference(q.float(), k8, v8, L, k_scale, v_scale)
                got = fp8_kernel().float()
                rel = ((got - ref).norm() / ref.norm()).item()
                t = rounds({"bf16": sdpa, "fp8": fp8_kernel}, reps=30, n_rounds=3)
                gbs = 2 * b * kv * L * hd / t["fp8"][0] / 1e6
                row(rows, label, t["bf16"][0], t["fp8"][0], t["bf16"][0] / t["fp8"][0], GOALS["attention"],
                    note=f"FP8 kernel reads {gbs:,.0f} GB/s of cache; rel. error vs float32 reference {rel:.2e}")
            del q, k16, v16, k8, v8
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=3)
            row(rows, label, error=error_text(e))
        torch.cuda.empty_cache()

    # decode step as CUDA graphs (last: a failed capture should not disturb the rows above)
    with torch.no_grad():
        label = f"decode step, batch {args.decode_batch}, {args.decode_context} cached"
        replays = {}
        for name, fn in steps.items():
            try:
                replays[name] = graphed(fn)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(limit=3)
                row(rows, f"{label}, {name} (CUDA graph)", error=error_text(e))
        if "bf16" in replays and len(replays) > 1:
            t = rounds(replays, reps=20, n_rounds=3)
            for name in replays:
                if name != "bf16":
                    row(rows, f"{label}, {name} + fp8 cache vs bf16 + bf16 cache (CUDA graph)", t["bf16"][0],
                        t[name][0], t["bf16"][0] / t[name][0], GOALS["decode"])

    # generate(): prefill + decode as a user runs it; the FP8 cache's decode steps eager and as a CUDA graph
    with torch.no_grad():
        from fp8ext.inference import generate
        prompt = torch.randint(0, cfg.vocab_size, (args.decode_batch, args.decode_context), device="cuda",
                               generator=gen)
        new = args.gen_tokens
        label = f"generate(), batch {args.decode_batch}, {args.decode_context}-token prompt + {new} new"
        runs = {"bf16": ("bf16", "bf16", False)}
        if "fp8 dynamic" in models:
            runs["fp8 eager"] = ("fp8 dynamic", "fp8", False)
            runs["fp8 graph"] = ("fp8 dynamic", "fp8", True)
        per_step = {}
        for name, (mname, kv, graph) in runs.items():
            try:
                generate(models[mname], prompt[:, :8], 4, kv_cache=kv, cuda_graph=graph)  # warm-up
                _, st = generate(models[mname], prompt, new, kv_cache=kv, cuda_graph=graph)
                per_step[name] = args.decode_batch / st["decode_tokens_per_s"] * 1e3  # ms per decode step
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(limit=3)
                row(rows, f"{label}, {name}", error=error_text(e))
            torch.cuda.empty_cache()
        if "bf16" in per_step:
            for name, note in (("fp8 eager", "FP8 model + FP8 cache, eager decode"),
                               ("fp8 graph", "FP8 model + FP8 cache, decode steps as one CUDA graph (capture "
                                             "included)")):
                if name in per_step:
                    row(rows, f"{label}: ms per decode step, bf16 + bf16 cache (eager) vs {note}", per_step["bf16"],
                        per_step[name], per_step["bf16"] / per_step[name],
                        note=f"{args.decode_batch / per_step[name] * 1e3:,.0f} tokens/s FP8, "
                             f"{args.decode_batch / per_step['bf16'] * 1e3:,.0f} bf16")
        del prompt

    report(rows, head, args)


def report(rows, head, args) -> None:
    """The rows as a markdown table, and the JSON."""
    print()
    print(f"{head['device']}, torch {head['torch']}, CUDA {head['cuda']}, {head['date']}; preset {args.preset}"
          + (" (--quick sizes)" if args.quick else ""))
    print()
    print("| measurement | bf16 | FP8 | FP8 vs bf16 | goal | met | note |")
    print("|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        if r["error"]:
            print(f"| {r['name']} | | | error | | | {r['error']} |")
            continue
        unit = r["unit"]
        speed = r["unit"] == "ms"
        ratio = f"{r['ratio']:.2f}x" + (" faster" if speed else "")
        goal = "" if r["goal"] is None else (f">= {r['goal']}x" if r["higher"] else f"<= {r['goal']}x")
        met = "" if r["goal"] is None else ("yes" if (r["ratio"] >= r["goal"] if r["higher"]
                                                      else r["ratio"] <= r["goal"] + 1e-9) else "NO")
        print(f"| {r['name']} | {r['bf16']:.3f} {unit} | {r['fp8']:.3f} {unit} | {ratio} | {goal} | {met} | "
              f"{r['note']} |")
    save(f"bench_inference_{args.preset}.json", {"header": head, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
