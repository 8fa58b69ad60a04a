"""Two transformer layers at Llama-3-8B sizes (d 4096, 32 heads, 8 KV heads, SwiGLU 14336), 2 x 2048 tokens:
one training step (forward, backward, SGD) in bf16 and with fp8ext's FP8 linear layers, eager, compiled and
captured as a CUDA graph, side by side in one run; torchao float8 (tensorwise, compiled) where it is installed;
rows with SwiGLU as fp8ext's fused kernel (forward and backward), in bf16 and FP8; and rows with the layer built
from fp8ext.LayerNormLinear and fp8ext.LayerNormMLP, Transformer Engine's fused modules (RMSNorm and SwiGLU as fused
kernels). Speedups are against the first row, bf16 eager with torch's RMSNorm and SwiGLU.

The layers: RMSNorm, one fused QKV projection with grouped-query attention through SDPA (flash), SwiGLU; bf16
parameters; the four linear layers of each block are FP8 in the fp8ext rows (delayed scaling, HYBRID), norms and
attention stay bf16. Timing: CUDA events around 5 back-to-back steps, median of 5 rounds after warm-up; host time
per step from the same loop; peak memory: torch.cuda.max_memory_allocated over the variant's setup and steps, less
what was allocated before it (the inputs; every earlier variant is released first). A row whose variant raises
prints the error and the run goes on.

    python benchmarks/bench_block.py [--tokens 2048] [--batch 2]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _harness import device_header, save, table  # noqa: E402

import fp8ext  # noqa: E402
from fp8ext import fused  # noqa: E402

D, H, KV, HD, FF, LAYERS = 4096, 32, 8, 128, 14336, 2


class Block(nn.Module):
    def __init__(self, linear, fused_swiglu=False):
        super().__init__()
        self.fused_swiglu = fused_swiglu  # fp8ext.fused.swiglu: one kernel forward, one backward
        self.n1 = nn.RMSNorm(D, eps=1e-6, dtype=torch.bfloat16)
        self.n2 = nn.RMSNorm(D, eps=1e-6, dtype=torch.bfloat16)
        self.qkv, self.o = linear(D, (H + 2 * KV) * HD), linear(H * HD, D)
        self.w13, self.w2 = linear(D, 2 * FF), linear(FF, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([H * HD, KV * HD, KV * HD], -1)
        q, k, v = (z.view(b, t, -1, HD).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, H * HD))
        h = self.w13(self.n2(x))
        if self.fused_swiglu:
            return x + self.w2(fused.swiglu(h))
        g, u = h.chunk(2, -1)
        return x + self.w2(F.silu(g) * u)


class FusedBlock(nn.Module):
    """The same layer written with Transformer Engine's fused modules, as fp8ext provides them: LayerNormLinear
    (RMSNorm + the QKV projection) and LayerNormMLP (RMSNorm + SwiGLU MLP), so the norms and the SwiGLU run as
    fp8ext's fused kernels forward and backward. In bf16 rows FP8 is simply off (fp8_autocast(enabled=False))."""

    def __init__(self):
        super().__init__()
        bf16 = dict(bias=False, params_dtype=torch.bfloat16)
        self.ln_qkv = fp8ext.LayerNormLinear(D, (H + 2 * KV) * HD, eps=1e-6, normalization="RMSNorm", **bf16)
        self.o = fp8ext.Linear(H * HD, D, **bf16)
        self.mlp = fp8ext.LayerNormMLP(D, FF, eps=1e-6, normalization="RMSNorm", activation="swiglu", **bf16)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.ln_qkv(x).split([H * HD, KV * HD, KV * HD], -1)
        q, k, v = (z.view(b, t, -1, HD).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, H * HD))
        return x + self.mlp(x)


def fused_model():
    torch.manual_seed(0)
    return nn.Sequential(*[FusedBlock() for _ in range(LAYERS)]).cuda()


def bf16_linear(i, o):
    return nn.Linear(i, o, bias=False, dtype=torch.bfloat16)


def fp8_linear(i, o):
    return fp8ext.Linear(i, o, bias=False, params_dtype=torch.bfloat16)


def model(linear, fused_swiglu=False):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(linear, fused_swiglu) for _ in range(LAYERS)]).cuda()


def training_step(mod, x, gy, fp8: bool, recipe):
    params = list(mod.parameters())

    def step():
        for p in params:
            p.grad = None
        with fp8ext.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            y = mod(x)
        y.backward(gy)
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-1e-7)
    return step


def graphed(step):
    """The whole step captured once as a CUDA graph (after warm-up on a side stream), replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def timed(step, n=5, rounds=5, warm=4):
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(n):
            step()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) / n)
        host.append((t1 - t0) * 1e3 / n)
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_block: no CUDA device; nothing to measure")
        return
    torch.manual_seed(0)
    x = (torch.randn(args.batch, args.tokens, D, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
    gy = torch.randn(args.batch, args.tokens, D, device="cuda", dtype=torch.bfloat16)
    recipe = fp8ext.DelayedScaling()

    def fp8_compiled(fused_swiglu=False, make=None):
        m = make() if make is not None else model(fp8_linear, fused_swiglu)
        fp8ext.prepare_fp8(m, recipe)
        return torch.compile(m)

    variants = [
        ("bf16 eager", lambda: model(bf16_linear), False, False),
        ("bf16 compiled", lambda: torch.compile(model(bf16_linear)), False, False),
        ("bf16 graphed", lambda: model(bf16_linear), False, True),
        ("fp8ext eager", lambda: model(fp8_linear), True, False),
        ("fp8ext compiled", fp8_compiled, True, False),
        ("fp8ext graphed", lambda: model(fp8_linear), True, True),
        # SwiGLU as fp8ext's fused kernel (as fp8ext.LayerNormMLP and the transformer run it on a GPU), in both
        ("bf16 eager, fused SwiGLU", lambda: model(bf16_linear, True), False, False),
        ("fp8ext eager, fused SwiGLU", lambda: model(fp8_linear, True), True, False),
        ("fp8ext graphed, fused SwiGLU", lambda: model(fp8_linear, True), True, True),
        # the layer from fp8ext.LayerNormLinear and fp8ext.LayerNormMLP (fused RMSNorm and SwiGLU kernels)
        ("bf16 eager, LayerNorm* modules", fused_model, False, False),
        ("fp8ext eager, LayerNorm* modules", fused_model, True, False),
        ("fp8ext graphed, LayerNorm* modules", fused_model, True, True),
        # compiled: the fused kernels run as torch ops (torch.ops.fp8ext.swiglu, rms_norm_train)
        ("fp8ext compiled, fused SwiGLU", lambda: fp8_compiled(True), True, False),
        ("fp8ext compiled, LayerNorm* modules", lambda: fp8_compiled(True, fused_model), True, False),
    ]
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        def ao():
            m = model(bf16_linear)
            convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"))
            return torch.compile(m)
        variants.append(("torchao tensorwise compiled", ao, False, False))
    except ImportError:
        print("torchao is not installed: its row is left out")
    rows, base, base_mem = [], None, None
    for name, make, fp8, graph in variants:
        mod = step = None
        try:
            torch._dynamo.reset()  # the previous variant's compiled code, model, gradients and graph are gone ...
            gc.collect()
            torch.cuda.empty_cache()
            floor = torch.cuda.memory_allocated()  # ... and what stays (x, gy, caches) is not counted
            torch.cuda.reset_peak_memory_stats()
            mod = make()
            step = training_step(mod, x, gy, fp8, recipe)
            if graph:
                step = graphed(step)
            ms, host = timed(step)
            peak = (torch.cuda.max_memory_allocated() - floor) / 2**30
            base = ms if base is None else base
            base_mem = peak if base_mem is None else base_mem
            rows.append({"variant": name, "ms/step": ms, "host ms/step": host, "speedup": base / ms,
                         "tokens/s": args.batch * args.tokens / ms * 1e3, "peak GiB": peak, "peak vs bf16": peak / base_mem})
        except Exception as e:  # noqa: BLE001  (report and go on)
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            nan = float("nan")
            rows.append({"variant": name, "ms/step": nan, "host ms/step": nan, "speedup": nan, "tokens/s": nan,
                         "peak GiB": nan, "peak vs bf16": nan})
        del mod, step
    head = device_header()
    print(f"# two Llama-3-8B-size layers, {args.batch} x {args.tokens} tokens, fwd+bwd+SGD; {head['device']}, "
          f"{head['date']}")
    print(table(rows, ["variant", "ms/step", "host ms/step", "speedup", "tokens/s", "peak GiB", "peak vs bf16"],
                {"ms/step": "{:.2f}", "host ms/step": "{:.2f}", "speedup": "{:.3f}x", "tokens/s": "{:,.0f}",
                 "peak GiB": "{:.2f}", "peak vs bf16": "{:.2f}x"}))
    save("bench_block.json", {"header": head, "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
