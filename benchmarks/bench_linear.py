"""Training-step time of one linear layer: fp8ext.FP8Linear vs nn.Linear in bf16 vs a torch-only FP8 baseline,
side by side in one run.

    python benchmarks/bench_linear.py          # needs a CUDA GPU and fp8ext built with CUDA

Step = forward + backward of y = x W^T for x [M, K] bf16, W [N, K] bf16 (no bias, as the issue's H100 anchor
figures), with a random upstream gradient. Implementations:
  bf16           nn.Linear
  torch FP8      torch-only dynamic tensorwise FP8: three torch._scaled_mm with amax-scaled casts, the whole
                 autograd function under torch.compile (the baseline those anchor figures were measured with)
  fp8ext         FP8Linear in fp8_autocast(DelayedScaling()), every step a full step: the scale update on
                 entry, the weight cast (the weight changes every step in training), x and dy cast_transposed
  fp8ext current the same with Float8CurrentScaling (each cast scaled by its tensor's own amax)
  torchao        where torchao is installed: its tensorwise Float8Linear (convert_to_float8_training), compiled
Medians of CUDA-event timings, implementations interleaved over rounds: one step between synchronisations
(as the anchors measured) and, as "steady", many steps back to back (a training loop, host ahead of the GPU). At (4096, 1024, 1024) both bf16 and
fp8ext steps are also captured as CUDA graphs and replayed (launch overhead out of the way).
Goals (issue 4, H100): >= 1.6x bf16 at (8192,4096,16384), >= 1.25x at (8192,4096,4096), >= 0.9x at
(4096,1024,1024) as CUDA graphs.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import fp8ext
from _harness import device_header, host_us, rounds, save, saved_bytes, steady_ms, table

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(8192, 4096, 4096), (8192, 4096, 16384), (16384, 8192, 8192), (4096, 1024, 1024), (2048, 2048, 2048)]
SMALL = [(4096, 1024, 1024), (2048, 2048, 2048)]


def _to8(t, dt):
    amax = t.abs().amax().float().clamp(min=1e-12)
    s = torch.finfo(dt).max / amax
    return (t.float() * s).clamp(-torch.finfo(dt).max, torch.finfo(dt).max).to(dt), s.reciprocal()


class TorchFP8(torch.autograd.Function):
    """The torch-only FP8 baseline: per-tensor scales from each tensor's amax, E4M3 x and W, E5M2 dy, three
    torch._scaled_mm (fast accumulation in the forward)."""

    @staticmethod
    def forward(ctx, x, w):
        x8, sx = _to8(x, E4)
        w8, sw = _to8(w, E4)
        ctx.save_for_backward(x8, sx, w8, sw)
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)

    @staticmethod
    def backward(ctx, g):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = _to8(g, E5)
        dx = torch._scaled_mm(g8, w8.t().contiguous().t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16)
        dw = torch._scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), scale_a=sg, scale_b=sx,
                              out_dtype=torch.bfloat16)
        return dx, dw


def main():
    if not fp8ext.cuda_available():
        sys.exit("bench_linear: needs a CUDA device and fp8ext built with CUDA")
    head = device_header()
    print(f"# {head['device']} ({head['sms']} SMs), torch {head['torch']}, CUDA {head['cuda']}, {head['date']}")
    torch.manual_seed(0)
    recipe = fp8ext.DelayedScaling()
    step_c = torch.compile(lambda x, w: TorchFP8.apply(x, w))
    rows, mem_rows = [], []
    for (m, k, n) in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
        f8.load_state_dict(lin.state_dict())
        w = lin.weight

        def bf16_step():
            lin(x).backward(gy)

        def torch_fp8_step():
            step_c(x, w).backward(gy)

        def fp8ext_step():
            f8._weight_cache = None  # the weight changes every training step: recast it, as a real step would
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                y = f8(x)
            y.backward(gy)

        impls = {"bf16": bf16_step, "torch FP8 (compiled)": torch_fp8_step, "fp8ext FP8Linear": fp8ext_step}
        extra = {"fp8ext current": current_step(lin, x, gy)}  # beside the table's columns: ratios to bf16
        ao = torchao_step(lin, x, gy)
        if ao is not None:
            extra["torchao tensorwise (compiled)"] = ao
        impls |= extra
        for fn in impls.values():
            fn()
        t = {name: v[0] for name, v in rounds(impls, reps=10 if m * n * k > 1e11 else 30).items()}
        row = {"M,K,N": f"{m},{k},{n}"} | {f"{k2} ms": v for k2, v in t.items()}
        row["torch FP8 / bf16"] = t["bf16"] / t["torch FP8 (compiled)"]
        row["fp8ext / bf16"] = t["bf16"] / t["fp8ext FP8Linear"]
        steady = {name: steady_ms(fn, steps=10 if m * n * k > 1e11 else 40) for name, fn in impls.items()}
        row["steady: torch FP8 / bf16"] = steady["bf16"] / steady["torch FP8 (compiled)"]
        row["steady: fp8ext / bf16"] = steady["bf16"] / steady["fp8ext FP8Linear"]
        for name in extra:
            row[f"{name} / bf16"] = t["bf16"] / t[name]
            row[f"steady: {name} / bf16"] = steady["bf16"] / steady[name]
        rows.append(row)
        print(f"  {row['M,K,N']:>16}: bf16 {t['bf16']:.3f} ms, torch FP8 {t['torch FP8 (compiled)']:.3f} ms, "
              f"fp8ext {t['fp8ext FP8Linear']:.3f} ms -> {row['fp8ext / bf16']:.2f}x (steady state "
              f"{row['steady: fp8ext / bf16']:.2f}x)" + "".join(f"; {name} {row[name + ' / bf16']:.2f}x (steady "
                                                                f"{row['steady: ' + name + ' / bf16']:.2f}x)"
                                                                for name in extra), flush=True)
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            b8 = sum(saved_bytes(lambda: f8(x), n * k))
        b16 = sum(saved_bytes(lambda: lin(x), n * k))
        mem_rows.append({"M,K,N": row["M,K,N"], "bf16 kept MiB": b16 / 2**20, "fp8ext kept MiB": b8 / 2**20,
                         "fp8ext / bf16": b8 / b16 if b16 else float("nan")})
        del x, gy, lin, f8, w, impls, extra, ao
        torch.cuda.empty_cache()

    cols = [c for c in rows[0] if not any(c.endswith(f"{name} / bf16") for name in EXTRA)]
    print(table(rows, cols, {k: "{:.3f}" for k in cols if k != "M,K,N"}))
    more = [c for c in rows[0] if c not in cols]
    print("the same steps, fp8ext with Float8CurrentScaling and torchao's tensorwise Float8Linear (compiled) where "
          "torchao is installed, vs bf16:")
    print(table(rows, ["M,K,N"] + more, {k: "{:.3f}x" for k in more}))
    print("memory kept for backward per layer, parameters excluded (bf16 keeps x; fp8ext keeps x8^T and the FP8 copy")
    print("W8^T of the weight):")
    print(table(mem_rows, list(mem_rows[0]), {"bf16 kept MiB": "{:.1f}", "fp8ext kept MiB": "{:.1f}",
                                               "fp8ext / bf16": "{:.2f}x"}))
    graphs = {f"{m},{k},{n}": graph_small(recipe, (m, k, n)) for (m, k, n) in SMALL}
    for shape, g in graphs.items():
        print(f"CUDA graphs at ({shape}): bf16 {g['bf16_ms']:.4f} ms, fp8ext {g['fp8ext_ms']:.4f} ms "
              f"-> {g['ratio']:.2f}x of bf16's speed")
    host = host_times(recipe)
    print(f"host time per step (4096,1024,1024, no sync): bf16 {host['bf16_us']:.0f} us, fp8ext "
          f"{host['fp8ext_us']:.0f} us ({host['fp8ext_us'] / host['bf16_us']:.2f}x bf16's)" +
          "".join(f", {name} {host[name + '_us']:.0f} us" for name in EXTRA if name + "_us" in host))
    lab = lab_mlp()
    print("the lab's SimpleMLP (768-3072-768, batch 32, AdamW, loss.item() every step):")
    print(table(lab, list(lab[0]), {"ms/step": "{:.3f}", "vs bf16 eager": "{:.3f}x", "vs bf16 graphed": "{:.3f}x"}))
    save("bench_linear.json", {"header": head, "steps": rows, "memory": mem_rows, "graphs": graphs, "host": host,
                               "lab_mlp": lab})


def small_layer(recipe, shape=(4096, 1024, 1024)):
    """A small layer of the launch-overhead measurements: (bf16 step, fp8ext step)."""
    m, k, n = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)

    def bf16_step():
        lin(x).backward(gy)

    def fp8_step():
        f8._weight_cache = None  # a new weight every step, as in training (graphs never reuse the cast)
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            y = f8(x)
        y.backward(gy)

    return bf16_step, fp8_step


def graph_small(recipe, shape):
    """Both steps captured as CUDA graphs and replayed."""
    out = {}
    for name, fn in zip(("bf16", "fp8ext"), small_layer(recipe, shape)):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        out[name] = g
    t = {name: v[0] for name, v in rounds({k2: g.replay for k2, g in out.items()}, reps=200, n_rounds=4).items()}
    return {"bf16_ms": t["bf16"], "fp8ext_ms": t["fp8ext"], "ratio": t["bf16"] / t["fp8ext"]}


def host_times(recipe):
    bf16_step, fp8_step = small_layer(recipe)
    out = {"bf16_us": host_us(bf16_step, calls=50), "fp8ext_us": host_us(fp8_step, calls=50)}
    m, k, n = 4096, 1024, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    out["fp8ext current_us"] = host_us(current_step(lin, x, gy), calls=50)
    ao = torchao_step(lin, x, gy)
    if ao is not None:
        ao()
        out["torchao tensorwise (compiled)_us"] = host_us(ao, calls=50)
    return out


EXTRA = ("fp8ext current", "torchao tensorwise (compiled)")


def current_step(lin, x, gy):
    """fp8ext's step with Float8CurrentScaling (each cast scaled by its tensor's own amax), on an FP8Linear of its own
    with `lin`'s weight."""
    recipe = fp8ext.Float8CurrentScaling()
    f8 = fp8ext.FP8Linear(lin.in_features, lin.out_features, bias=False, device="cuda", params_dtype=lin.weight.dtype)
    f8.load_state_dict(lin.state_dict())

    def step():
        f8._weight_cache = None
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            y = f8(x)
        y.backward(gy)
    return step


def torchao_step(lin, x, gy):
    """torchao's tensorwise Float8Linear (dynamic scales, its default recipe) on a copy of `lin`, compiled, or None
    where torchao is not installed."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    import copy
    model = convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)),
                                       config=Float8LinearConfig.from_recipe_name("tensorwise"))
    model = torch.compile(model)

    def step():
        model(x).backward(gy)
    return step


class LabMLP(nn.Module):
    """The lab's SimpleMLP (notebooks/lab_3_2_3_fp8_training_inference.ipynb): 768-3072-768, GELU; `lin` makes the
    layers (nn.Linear or fp8ext.Linear)."""

    def __init__(self, lin):
        super().__init__()
        self.fc1, self.fc2 = lin(768, 3072), lin(3072, 768)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def lab_mlp(steps=100):
    """The lab's model (notebooks/lab_3_2_3_fp8_training_inference.ipynb): SimpleMLP 768-3072-768 (GELU, biases), batch 32, AdamW, MSE, loss.item() every step
    (so every step waits for the GPU), bf16 next to fp8ext (the lab's recipe: HYBRID, history 16, most_recent)
    with the lab's fp32 parameters and with bf16 ones; and forward+backward captured with make_graphed_callables
    (torch's for bf16, fp8ext's for FP8) where fp8ext has it."""
    import statistics
    import time

    recipe = fp8ext.DelayedScaling(fp8_format=fp8ext.Format.HYBRID, amax_history_len=16, amax_compute_algo="most_recent")
    x = torch.randn(32, 768, device="cuda", dtype=torch.bfloat16)
    target = torch.randn(32, 768, device="cuda", dtype=torch.bfloat16)

    def make(kind):
        torch.manual_seed(0)
        if kind == "bf16":
            return LabMLP(nn.Linear).cuda().to(torch.bfloat16), None
        if kind == "fp8ext, fp32 parameters (the lab's)":
            return LabMLP(lambda i, o: fp8ext.Linear(i, o, device="cuda")), recipe
        return LabMLP(lambda i, o: fp8ext.Linear(i, o, device="cuda", params_dtype=torch.bfloat16)), recipe

    def run(model, rec, graphed):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        fwd = model
        if graphed:
            sample = (x.clone().requires_grad_(False),)
            if rec is None:
                fwd = torch.cuda.make_graphed_callables(model, sample)
            else:
                fwd = fp8ext.make_graphed_callables(model, sample, fp8_enabled=True, fp8_recipe=rec)

        def one():
            opt.zero_grad(set_to_none=not graphed)
            if rec is None or graphed:
                loss = F.mse_loss(fwd(x), target)
            else:
                with fp8ext.fp8_autocast(fp8_recipe=rec):
                    loss = F.mse_loss(fwd(x), target)
            loss.backward()
            opt.step()
            return loss.item()

        for _ in range(10):
            one()
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps // 5):
                one()
            times.append((time.perf_counter() - t0) / (steps // 5) * 1e3)
        return statistics.median(times)

    rows = []
    kinds = ["bf16", "fp8ext, fp32 parameters (the lab's)", "fp8ext, bf16 parameters"]
    for graphed in (False, True):
        for kind in kinds:
            if graphed and kind != "bf16" and not hasattr(fp8ext, "make_graphed_callables"):
                continue
            if graphed and kind == "fp8ext, fp32 parameters (the lab's)":
                continue
            model, rec = make(kind)
            try:
                ms = run(model, rec, graphed)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
                print(f"  {kind}{' graphed' if graphed else ''}: {type(e).__name__}: {e}")
                continue
            rows.append({"variant": kind + (", fwd+bwd graphed" if graphed else ", eager"), "ms/step": ms})
    eager = next((r["ms/step"] for r in rows if r["variant"] == "bf16, eager"), float("nan"))
    graph = next((r["ms/step"] for r in rows if r["variant"] == "bf16, fwd+bwd graphed"), float("nan"))
    for r in rows:
        r["vs bf16 eager"], r["vs bf16 graphed"] = eager / r["ms/step"], graph / r["ms/step"]
    return rows


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
