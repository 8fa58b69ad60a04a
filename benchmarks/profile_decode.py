"""Where a decode step's time goes: the 1b preset, one token for each of 128 sequences over a KV cache of 1024
positions (bench_inference.py's decode row), bf16 weights + bf16 cache against FP8 weights + FP8 cache (activations
dynamic and static): the step's time (CUDA events), its host time (issued back to back), its kernels grouped by
name with their time per step (torch.profiler), largest first, and its Python functions by own time (cProfile).

    python benchmarks/profile_decode.py [--preset 1b] [--batch 128] [--context 1024] [--rows 12]
"""
import argparse
import collections
import copy
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_inference import decode_step, filled_cache  # noqa: E402
from profile_host import profile_table  # noqa: E402

from fp8ext import inference  # noqa: E402
from fp8ext.models.transformer import Transformer, preset  # noqa: E402


def timed(step, steps=10, rounds=5):
    """(host ms per step, GPU ms per step): medians over rounds of `steps` steps issued back to back."""
    host, gpu = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        for _ in range(steps):
            step()
        b.record()
        host.append((time.perf_counter() - t0) / steps * 1e3)
        torch.cuda.synchronize()
        gpu.append(a.elapsed_time(b) / steps)
    return statistics.median(host), statistics.median(gpu)


def kernels(step, steps=5):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name[:90]][0] += e.device_time / steps
            by[e.name[:90]][1] += 1 / steps
    return sorted(by.items(), key=lambda kv: -kv[1][0])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=12)
    args = ap.parse_args()
    cfg = preset(args.preset, max_seq_len=args.context + 8)
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = Transformer(cfg, device="cuda").to(torch.bfloat16).eval()
    models = {"bf16": bf16}
    with torch.no_grad():
        for act in ("dynamic", "static"):
            m = copy.deepcopy(bf16)
            if act == "static":
                inference.calibrate(m, [torch.randint(0, cfg.vocab_size, (4, 512), device="cuda", generator=gen)
                                        for _ in range(2)], progress=False)
            inference.quantize_model(m, "channel", act)
            models[f"fp8 {act}"] = m
        tok = torch.randint(0, cfg.vocab_size, (args.batch, 1), device="cuda", generator=gen)
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, preset {args.preset}, batch {args.batch}, "
              f"{args.context} cached")
        for name, m in models.items():
            cache = filled_cache(m, args.batch, args.context, "bf16" if name == "bf16" else "fp8", gen)
            step = decode_step(m, cache, tok, args.context)
            for _ in range(3):
                step()
            host, gpu = timed(step)
            ks = kernels(step)
            busy = sum(v[0] for _, v in ks)
            print(f"\n== {name}: step {gpu:.3f} ms (host {host:.3f} ms), kernels {busy / 1e3:.3f} ms in "
                  f"{sum(v[1] for _, v in ks):.0f} launches")
            for kname, (us, count) in ks[:args.rows]:
                print(f"  {us:8.1f} us  {count:5.0f}x  {kname}")
            print(f"-- {name}: Python functions by own time over 5 steps")
            print(profile_table(step, 5, 2 * args.rows + 6))
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
