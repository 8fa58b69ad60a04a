"""Where a prefill's time goes: the 1b preset's forward over 32 x 2048 tokens (bench_inference.py's prefill row), bf16
against the FP8 model (weights per channel, activations dynamic) with bf16 attention, with FP8 attention (cuDNN's
FP8 forward, a recipe with fp8_dpa=True) and with fp8_mha=True (its E4M3 output read by o_proj): the forward's time (CUDA events) and its kernels grouped by name
with their time per forward (torch.profiler), largest first.

    python benchmarks/profile_prefill.py [--preset 1b] [--batch 32] [--seq 2048] [--rows 14]
"""
import argparse
import copy
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_decode import kernels, timed  # noqa: E402

import fp8ext  # noqa: E402
from fp8ext import inference  # noqa: E402
from fp8ext.models.transformer import Transformer, preset  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=14)
    args = ap.parse_args()
    cfg = preset(args.preset, max_seq_len=max(args.seq, preset(args.preset).max_seq_len))
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = Transformer(cfg, device="cuda").to(torch.bfloat16).eval()
    fp8 = copy.deepcopy(bf16)
    inference.quantize_model(fp8, "channel", "dynamic")
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda", generator=gen)
    dpa, mha = fp8ext.Float8CurrentScaling(fp8_dpa=True), fp8ext.Float8CurrentScaling(fp8_mha=True)
    runs = {"bf16": lambda: bf16(ids), "fp8 dynamic": lambda: fp8(ids),
            "fp8 dynamic + FP8 attention": lambda: fp8(ids, fp8=True, fp8_recipe=dpa),
            "fp8 dynamic + FP8 attention, fp8_mha": lambda: fp8(ids, fp8=True, fp8_recipe=mha)}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, preset {args.preset}, prefill "
          f"{args.batch} x {args.seq}")
    with torch.no_grad():
        for name, step in runs.items():
            for _ in range(3):
                step()
            _, gpu = timed(step, steps=3, rounds=3)
            ks = kernels(step, steps=3)
            busy = sum(v[0] for _, v in ks)
            print(f"\n== {name}: forward {gpu:.2f} ms, kernels {busy / 1e3:.2f} ms in {sum(v[1] for _, v in ks):.0f} "
                  f"launches")
            for kname, (us, count) in ks[:args.rows]:
                print(f"  {us / 1e3:8.3f} ms  {count:5.0f}x  {kname}")


if __name__ == "__main__":
    main()
