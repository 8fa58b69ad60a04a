"""Where the two-layer block's peak memory goes (bench_block.py's layers): peak allocated per variant, and the
tensors autograd saves for backward, summed by dtype and shape (a saved_tensors_hooks census, one forward).

    python benchmarks/dev/block_memory.py
"""
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_block as bb  # noqa: E402

import fp8ext  # noqa: E402
from fp8ext import fused  # noqa: E402


def norm_swap(m):
    """model(fp8_linear, True) with each nn.RMSNorm replaced by fp8ext.RMSNorm (bf16 weight)."""
    for blk in m:
        for name in ("n1", "n2"):
            setattr(blk, name, fp8ext.RMSNorm(bb.D, eps=1e-6, params_dtype=torch.bfloat16).cuda())
    return m


def census(mod, x, fp8):
    seen = collections.Counter()

    def pack(t):
        if isinstance(t, torch.Tensor):
            seen[(str(t.dtype).removeprefix("torch."), tuple(t.shape))] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with fp8ext.fp8_autocast(enabled=fp8, fp8_recipe=fp8ext.DelayedScaling()):
            y = mod(x)
    del y
    return seen


def main():
    torch.manual_seed(0)
    x = (torch.randn(2, 2048, bb.D, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    gy = torch.randn(2, 2048, bb.D, device="cuda", dtype=torch.bfloat16)
    recipe = fp8ext.DelayedScaling()
    variants = [
        ("bf16, torch ops", lambda: bb.model(bb.bf16_linear), False),
        ("fp8, fused SwiGLU, nn.RMSNorm", lambda: bb.model(bb.fp8_linear, True), True),
        ("fp8, fused SwiGLU, fp8ext.RMSNorm", lambda: norm_swap(bb.model(bb.fp8_linear, True)), True),
        ("fp8, LayerNorm* modules", bb.fused_model, True),
        ("bf16, LayerNorm* modules", bb.fused_model, False),
    ]
    for name, make, fp8 in variants:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        mod = make()
        params = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        step = bb.training_step(mod, x, gy, fp8, recipe)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        seen = census(mod, x, fp8)
        print(f"== {name}: parameters {params / 2**30:.2f} GiB, peak over the step {peak / 2**30:.2f} GiB, "
              f"saved for backward {sum(seen.values()) / 2**30:.2f} GiB")
        for (dt, shape), b in seen.most_common(8):
            print(f"   {b / 2**20:9.1f} MiB  {dt:14s} {list(shape)}")
        del mod, step, seen
    print("fused.TRAINING", fused.TRAINING)


if __name__ == "__main__":
    main()
