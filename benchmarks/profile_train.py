"""Where a training step's GPU time goes, eager against torch.compile: fp8ext.train's model and step (preset 1b by
default, FP8 with delayed scaling, fused AdamW), a few steps after warm-up and compilation, its kernels grouped
into kinds (GEMMs, FP8 casts, attention, norms and SwiGLU, inductor's fused kernels, the optimizer, the rest) and
by name, per step, side by side for the modes asked for. With --gaps also where the GPU idles: one profiled step
per mode (CPU and CUDA activities), the host's time to issue a step, the time from the step's first CPU event to its
first kernel, the idle gaps over 50 us between kernels with the CPU ops open when each ended.

    python benchmarks/profile_train.py [--preset 1b] [--batch_size 8] [--seq_len 2048] [--modes eager,compiled]
                                       [--bf16] [--rows 25] [--gaps]
"""
import argparse
import collections
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from profile_decode import kernels  # noqa: E402

from fp8ext.train import cli, trainer  # noqa: E402

KINDS = [  # (kind, pattern of the kernel's name), first match wins
    ("GEMM", r"nvjet|gemm|sm90_xmma|cutlass|Kernel2"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("FP8 cast", r"cast_transpose|quantize|amax|scale_update|fp8ext.*(rows|dbias)"),
    ("norm / SwiGLU / RoPE", r"rms_norm|swiglu|rope"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("inductor (triton)", r"^triton_"),
]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def run(mode: str, args) -> dict:
    argv = ["--preset", args.preset, "--batch_size", str(args.batch_size), "--seq_len", str(args.seq_len),
            "--no_progress", "--no_save", "--out_dir", f"/tmp/profile_train_{mode}"]
    if not args.bf16:
        argv.append("--use_fp8")
    if mode == "compiled":
        argv.append("--compile")
    targs = cli.parser().parse_args(argv)
    device = torch.device("cuda")
    corpus, raw, model, opt, recipe, _ = trainer._build(targs, device, 1)
    fwd_kw = dict(fp8=targs.use_fp8, fp8_recipe=recipe, fp8_group=None)
    step_no = [0]

    def step():
        trainer._train_step(model, opt, corpus, targs, step_no[0], 0, 1, device, fwd_kw)
        step_no[0] += 1

    for _ in range(args.warmup):  # compilation and the allocator's warm-up
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    per_name = kernels(step, steps=args.steps)
    idle = gaps(step, args.steps) if args.gaps else None
    del model, opt, raw
    torch.cuda.empty_cache()
    return {"ms": ms, "kernels": per_name, "gaps": idle}


def gaps(step, steps: int, shown: int = 8) -> list:
    """Lines describing where the GPU idles in a step: host issue time (median of `steps`, no synchronisation inside
    a step), then one step under torch.profiler: first CPU event -> first kernel, the gaps over 50 us between kernels
    and, for the largest, the innermost CPU ops open when the gap ended (what the host was doing)."""
    from torch.profiler import ProfilerActivity, profile
    issue = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        issue.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = list(prof.events())
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    first, start = min(e.time_range.start for e in cpu), gpu[0][0]
    idle, end = [], gpu[0][1]
    for s, e in gpu[1:]:
        if s - end > 50:
            idle.append((end, s))
        end = max(end, e)
    lines = [f"host issues a step in {statistics.median(issue):.1f} ms; first kernel {(start - first) / 1e3:.2f} ms "
             f"after the step's first CPU event; {len(idle)} gaps over 50 us, {sum(b - a for a, b in idle) / 1e3:.2f} "
             f"ms idle between kernels"]
    for a, b in sorted(idle, key=lambda g: g[0] - g[1])[:shown]:
        open_ = sorted((e for e in cpu if e.time_range.start <= b - 5 <= e.time_range.end),
                       key=lambda e: e.time_range.start)
        lines.append(f"  gap {(b - a) / 1e3:6.2f} ms at {(a - start) / 1e3:7.1f} ms: "
                     + " > ".join(e.name[:40] for e in open_[-4:]))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--bf16", action="store_true", help="the bf16 model instead of FP8")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--gaps", action="store_true", help="also where the GPU idles (one more profiled step per mode)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    res = {mode: run(mode, args) for mode in modes}
    tokens = args.batch_size * args.seq_len
    print(f"# {args.preset}, {'bf16' if args.bf16 else 'FP8 delayed'}, {args.batch_size} x {args.seq_len} tokens, "
          f"{torch.cuda.get_device_name()}")
    print("| per step | " + " | ".join(modes) + " |")
    print("|---|" + "---:|" * len(modes))
    print("| step ms (tokens/s) | " + " | ".join(f"{res[m]['ms']:.1f} ({tokens / res[m]['ms'] * 1e3:,.0f})"
                                                for m in modes) + " |")
    kinds = {m: collections.defaultdict(lambda: [0.0, 0.0]) for m in modes}
    for m in modes:
        for name, (us, n) in res[m]["kernels"]:
            kinds[m][kind_of(name)][0] += us
            kinds[m][kind_of(name)][1] += n
    for kind in [k for k, _ in KINDS] + ["other"]:
        print(f"| {kind} ms (launches) | " + " | ".join(
            f"{kinds[m][kind][0] / 1e3:.1f} ({kinds[m][kind][1]:.0f})" for m in modes) + " |")
    print("| kernels, all ms | " + " | ".join(f"{sum(v[0] for v in kinds[m].values()) / 1e3:.1f}"
                                             for m in modes) + " |")
    for m in modes:
        print(f"\n== {m}: kernels by name, ms per step (launches)")
        for name, (us, n) in res[m]["kernels"][:args.rows]:
            print(f"  {us / 1e3:8.2f}  {n:6.0f}  {kind_of(name):<22} {name[:80]}")
        if res[m]["gaps"]:
            print(f"== {m}: where the GPU idles")
            print("\n".join(res[m]["gaps"]))


if __name__ == "__main__":
    main()
