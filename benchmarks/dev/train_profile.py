"""Where the GPU time of one fp8ext.train step goes (development aid): torch.profiler's kernel times of one
optimizer step of a Transformer preset, bf16 next to FP8 (delayed scaling), each with torch's composition of
RMSNorm, RoPE, SwiGLU and grouped-query attention and with fp8ext's fused kernels (fp8ext.fused.TRAINING, the
default on a GPU), grouped into
GEMMs, attention, fp8ext's casts, the optimizer and the rest, with the step's wall time (CUDA events) next to
the kernels' sum.

    python benchmarks/dev/train_profile.py [--preset 1b] [--batch_size 8] [--seq_len 2048]

The step is fp8ext.train's: float32 master weights, torch.autocast(bfloat16), fused AdamW, gradient clipping.
"""
import argparse
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ext
from fp8ext._bench import bench_ms
from fp8ext.models.transformer import Transformer, default_recipe, preset


def group(name: str) -> str:
    n = name.lower()
    if "nvjet" in n or "gemm" in n or "cutlass" in n or "xmma" in n:
        return "GEMM"
    if "flash" in n or "fmha" in n or "attention" in n or "cudnn" in n:
        return "attention"
    if "fp8ext" in n and ("rms_norm" in n or "rope" in n or "swiglu" in n or "fused_rows" in n):
        return "fp8ext fused RMSNorm / RoPE / SwiGLU"
    if "fp8ext" in n:
        return "fp8ext casts / amax / scale update"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer / clipping (foreach)"
    if "norm" in n and "rms" in n or "reduce" in n:
        return "RMSNorm / reductions"
    if "softmax" in n or "nll" in n or "cross" in n:
        return "cross-entropy"
    if "cat" in n or "copy" in n or "direct_copy" in n or "index" in n:
        return "copies / cat / repeat"
    if "elementwise" in n or "silu" in n or "mul" in n or "add" in n:
        return "elementwise"
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, 256, (a.batch_size, a.seq_len + 1), device=dev, generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    summary = {}
    for name, fp8, fused in (("bf16", False, False), ("fp8", True, False), ("bf16 fused", False, True),
                             ("fp8 fused", True, True)):
        fp8ext.fused.TRAINING = fused
        torch.manual_seed(0)
        model = Transformer(preset(a.preset), device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        recipe = default_recipe()

        def step():
            scope = fp8ext.fp8_autocast(fp8_recipe=recipe) if fp8 else contextlib.nullcontext()
            with torch.autocast("cuda", dtype=torch.bfloat16), scope:
                loss = model(x, y, fp8=fp8, fp8_recipe=recipe)[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        wall = bench_ms(step, reps=6, warmup=4)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        groups, kernels = {}, {}
        for ev in prof.key_averages():
            t = ev.self_device_time_total / 2 / 1e3  # ms per step
            if t <= 0:
                continue
            groups[group(ev.key)] = groups.get(group(ev.key), 0.0) + t
            kernels[ev.key] = (t, ev.count // 2)
        total = sum(groups.values())
        summary[name] = (wall, groups)
        tokens = a.batch_size * a.seq_len
        print(f"== {name}: preset {a.preset}, {a.batch_size} x {a.seq_len} tokens: step {wall:.1f} ms (median of 6, "
              f"{tokens / wall * 1e3:,.0f} tokens/s), kernels {total:.1f} ms ({total / wall:.0%} of the step)")
        for k, t in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"   {k:<38} {t:8.2f} ms  {t / total:6.1%}")
        print("   top kernels (ms per step, launches per step):")
        for k, (t, c) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:a.top]:
            print(f"     {t:8.3f} ms {c:5d}x  {k[:120]}")
        del model, opt
        torch.cuda.empty_cache()
    for a_, b_ in (("bf16", "fp8"), ("bf16 fused", "fp8 fused"), ("bf16", "bf16 fused"), ("fp8", "fp8 fused")):
        (wb, gb), (wf, gf) = summary[a_], summary[b_]
        print(f"== {b_} / {a_}: step {wb / wf:.3f}x faster; per group, ms per step:")
        for k in sorted(set(gb) | set(gf), key=lambda k: -gb.get(k, 0.0)):
            print(f"   {k:<38} {gb.get(k, 0.0):8.2f} -> {gf.get(k, 0.0):8.2f}")


if __name__ == "__main__":
    main()
