"""Where a generate() decode step's time goes: bf16 model + bf16 cache, FP8 model + FP8 cache (eager), at the
sizes of bench_inference's generate rows; per-step wall time of generate() next to a hand loop of model calls,
then torch.profiler's top operators (CPU and CUDA time) over a few steps of each.

    python benchmarks/dev/profile_generate.py [--batch 128] [--prompt 1024] [--new 16]
"""
import argparse
import time

import torch

from fp8ext import inference
from fp8ext.inference import KVCache, generate
from fp8ext.models.transformer import Transformer, preset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=16)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = preset("1b")
    bf16 = Transformer(cfg, device="cuda").to(torch.bfloat16).eval()
    fp8 = Transformer(cfg, device="cuda").to(torch.bfloat16).eval()
    fp8.load_state_dict(bf16.state_dict())
    with torch.no_grad():
        inference.quantize_model(fp8, "channel", "dynamic")
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device="cuda")
    for name, model, kv in (("bf16", bf16, "bf16"), ("fp8", fp8, "fp8")):
        with torch.no_grad():
            generate(model, prompt[:, :8], 4, kv_cache=kv, cuda_graph=False)
            _, st = generate(model, prompt, args.new, kv_cache=kv, cuda_graph=False)
            print(f"{name}: generate() decode {args.batch / st['decode_tokens_per_s'] * 1e3:.2f} ms per step")
            cache = KVCache.from_model(model, args.batch, args.prompt + args.new, kv)
            logits = model(prompt, kv_cache=cache, start_pos=0)[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for pos in range(args.prompt, args.prompt + args.new // 2):
                nxt = model(nxt, kv_cache=cache, start_pos=pos)[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            print(f"{name}: hand loop {(time.perf_counter() - t0) / (args.new // 2) * 1e3:.2f} ms per step")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for pos in range(args.prompt + args.new // 2, args.prompt + args.new - 1):
                    nxt = model(nxt, kv_cache=cache, start_pos=pos)[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
