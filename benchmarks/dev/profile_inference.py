"""Kernel-time profile of a prefill and a decode step of the `1b` preset, bf16 vs FP8 (development aid):
which kernels take the time, and how many launches a step makes.

    python benchmarks/dev/profile_inference.py [--prefill_batch 8] [--preset 1b]
"""
import argparse
import copy
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_inference import decode_step, filled_cache  # noqa: E402

from fp8ext import inference  # noqa: E402
from fp8ext.models.transformer import Transformer, preset  # noqa: E402


def kernel_table(fn, label, top=28):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t and t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    launches = sum(r[1] for r in rows)
    print(f"\n== {label}: GPU time {total / 1e3:.3f} ms in {launches} kernel/memcpy events")
    for t, c, k in rows[:top]:
        print(f"{t / 1e3:9.3f} ms {100 * t / total:5.1f}% {c:6d}x  {k[:110]}")
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="1b")
    p.add_argument("--prefill_batch", type=int, default=8)
    p.add_argument("--prefill_len", type=int, default=2048)
    p.add_argument("--decode_batch", type=int, default=128)
    p.add_argument("--decode_context", type=int, default=1024)
    args = p.parse_args()
    cfg = preset(args.preset)
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = Transformer(cfg, device="cuda").to(torch.bfloat16).eval()
    models = {"bf16": bf16}
    with torch.no_grad():
        for act in ("dynamic", "static"):
            m = copy.deepcopy(bf16)
            if act == "static":
                calib = [torch.randint(0, cfg.vocab_size, (2, 1024), device="cuda", generator=gen) for _ in range(2)]
                inference.calibrate(m, calib, progress=False)
            inference.quantize_model(m, "channel", act)
            models[f"fp8 {act}"] = m
        ids = torch.randint(0, cfg.vocab_size, (args.prefill_batch, args.prefill_len), device="cuda", generator=gen)
        for name, m in models.items():
            kernel_table(lambda m=m: m(ids), f"prefill {args.prefill_batch} x {args.prefill_len}, {name}")
        tok = torch.randint(0, cfg.vocab_size, (args.decode_batch, 1), device="cuda", generator=gen)
        if os.environ.get("VARIANTS"):
            variants(models, ids, tok, args, gen)
        for name, m in models.items():
            cache = filled_cache(m, args.decode_batch, args.decode_context, "bf16" if name == "bf16" else "fp8", gen)
            kernel_table(decode_step(m, cache, tok, args.decode_context),
                         f"decode step batch {args.decode_batch}, {args.decode_context} cached, {name}")
            del cache
            torch.cuda.empty_cache()


def variants(models, ids, tok, args, gen):
    """Prefill and graphed decode of FP8 dynamic with cuBLASLt fast accumulation and/or GEMM autotuning, next
    to bf16, in one run."""
    import fp8ext
    from bench_inference import graphed
    from fp8ext._bench import rounds
    from fp8ext.inference import FP8InferenceLinear
    m8, m16 = models["fp8 dynamic"], models["bf16"]
    caches = {n: filled_cache(m, args.decode_batch, args.decode_context, "bf16" if n == "bf16" else "fp8", gen)
              for n, m in (("bf16", m16), ("fp8", m8))}
    res = {}
    for fast in (False, True):
        for tune in (False, True):
            FP8InferenceLinear.fast_accum = fast
            fp8ext.set_gemm_autotune(tune)
            label = f"fast_accum={fast} autotune={tune}"
            pre = rounds({"bf16": lambda: m16(ids), "fp8": lambda: m8(ids)}, reps=3, n_rounds=3)
            dec = rounds({"bf16": graphed(decode_step(m16, caches["bf16"], tok, args.decode_context)),
                          "fp8": graphed(decode_step(m8, caches["fp8"], tok, args.decode_context))}, reps=20,
                         n_rounds=3)
            res[label] = (pre["bf16"][0], pre["fp8"][0], dec["bf16"][0], dec["fp8"][0])
            print(f"{label}: prefill bf16 {pre['bf16'][0]:.2f} ms fp8 {pre['fp8'][0]:.2f} ms "
                  f"({pre['bf16'][0] / pre['fp8'][0]:.3f}x); decode graph bf16 {dec['bf16'][0]:.3f} ms "
                  f"fp8 {dec['fp8'][0]:.3f} ms ({dec['bf16'][0] / dec['fp8'][0]:.3f}x)", flush=True)
    FP8InferenceLinear.fast_accum = False
    fp8ext.set_gemm_autotune(False)
    del caches
    torch.cuda.empty_cache()
    return res


def sdpa_gqa_check(b=8, s=2048, h=16, kv=4, hd=128):
    """Prefill attention: K/V repeated to every query head vs enable_gqa=True, timed with CUDA events."""
    import torch.nn.functional as F
    from fp8ext._bench import rounds
    q = torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, kv, s, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, kv, s, hd, device="cuda", dtype=torch.bfloat16)

    def rep():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1),
                                              is_causal=True)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    print("\n== SDPA prefill", (b, h, kv, s, hd), "max diff", (rep() - gqa()).abs().max().item())
    t = rounds({"repeat": rep, "enable_gqa": gqa}, reps=10, n_rounds=3)
    print({k_: round(v_[0], 3) for k_, v_ in t.items()})
    kernel_table(gqa, "SDPA enable_gqa kernels", top=5)


if __name__ == "__main__":
    if os.environ.get("SDPA_CHECK"):
        sdpa_gqa_check()
    elif not os.environ.get("ATTN_SPLITS"):
        main()


def attn_splits(b=128, h=16, kv=4, hd=128, length=1025, max_len=1025):
    """decode_attention at one decode step's shape, over the number of splits, next to bf16 SDPA."""
    import torch.nn.functional as F
    from fp8ext import _C
    from fp8ext._boundary import dl, dl_fp8, stream_of
    from fp8ext._bench import rounds
    import fp8ext.inference.attention as att
    q = torch.randn(b, h, hd, device="cuda", dtype=torch.bfloat16)
    k8 = torch.randn(b, kv, max_len, hd, device="cuda").to(torch.float8_e4m3fn)
    v8 = torch.randn(b, kv, max_len, hd, device="cuda").to(torch.float8_e4m3fn)
    k16 = torch.randn(b, kv, max_len, hd, device="cuda", dtype=torch.bfloat16)
    v16 = torch.randn(b, kv, max_len, hd, device="cuda", dtype=torch.bfloat16)
    ks = torch.full((kv,), 0.01, device="cuda")
    out = torch.empty_like(q)
    impls = {"sdpa bf16": lambda: F.scaled_dot_product_attention(q[:, :, None], k16, v16, enable_gqa=True)}
    default = att._splits(b, h, kv, length, q.device, att._tensor_cores(hd, q.dtype))
    least = 1 if att._tensor_cores(hd, q.dtype) else -(-length // (12288 // (h // kv)))
    for sp in sorted({least * f for f in (1, 2, 3, 4, 6, 8, 12, 16)} | {default, 24, 32, 48, 64, 96} - {0}):
        if sp < least:
            continue
        if sp > 65535 or -(-length // sp) < 16:
            continue
        ws = torch.empty(b * h * sp * (hd + 2), dtype=torch.float32, device="cuda")
        impls[f"splits {sp}" + (" (default)" if sp == default else "")] = (
            lambda sp=sp, ws=ws: _C.decode_attention(dl(q), dl_fp8(k8), dl_fp8(v8), dl(ks), dl(ks), dl(out), dl(ws),
                                                     length, hd ** -0.5, sp, stream_of(q.device)))
    t = rounds(impls, reps=30, n_rounds=3)
    base = t["sdpa bf16"][0]
    print(f"\n== decode_attention b={b} h={h} kv={kv} L={length}")
    for name, v in t.items():
        print(f"{name:>22}: {v[0] * 1e3:8.1f} us  {base / v[0]:.2f}x of SDPA bf16  "
              f"{2 * b * kv * length * hd / v[0] / 1e9:.2f} TB/s of FP8 cache")


if __name__ == "__main__" and os.environ.get("ATTN_SPLITS"):
    for b in (int(x) for x in os.environ["ATTN_SPLITS"].split(",")):
        attn_splits(b=b, h=32, kv=8, length=32768, max_len=32768)
