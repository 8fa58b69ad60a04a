"""fp8ext.DotProductAttention with fp8_dpa=True (cuDNN's FP8 fused attention, fp8ext's casts around it) against
the same module in bf16 on torch's fastest SDPA backend, forward and forward + backward, in one run.

Layout bshd, head dim 128, causal; the bf16 baseline is the fastest of torch's FLASH, CUDNN and EFFICIENT backends
for each shape and pass. CUDA-event medians after warm-up, random data; and each pass's kernel time on the GPU
(torch.profiler's sum over its kernels), which is what a step sees when its host runs ahead of the GPU (a single
attention call timed alone can be bound by its host work). "fp8/hp" is FP8 attention with its backward in high
precision (fp8_backward=False: torch's bf16 SDPA backward at the dequantized FP8 inputs, after recomputing its
forward), what fp8ext.train --fp8_attention runs by default. Needs `pip install nvidia-cudnn-frontend`.

    python benchmarks/bench_attention.py
"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fp8ext
from _harness import bench_ms, device_header, table

SHAPES = [(2, 4096, 16, 16), (2, 4096, 32, 8), (1, 8192, 16, 4), (1, 16384, 16, 4), (8, 2048, 16, 4)]
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def passes(attn, q, k, v, do, recipe):
    def fwd():
        with torch.no_grad(), fp8ext.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            attn(q, k, v)

    def fwd_bwd():
        with fp8ext.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            out = attn(q, k, v)
        out.backward(do)
    return fwd, fwd_bwd


def kernel_ms(fn, calls: int = 10) -> float:
    """GPU kernel time per call of fn (torch.profiler's sum over the kernels and memsets it launched)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) / calls / 1e3


def best_bf16(fn, measure=bench_ms) -> float:
    times = []
    for backend in BACKENDS:
        try:
            with sdpa_kernel([backend]):
                times.append(measure(fn))
        except RuntimeError:  # a backend that does not take this shape
            pass
    return min(times)


def main() -> None:
    print(device_header())
    rows = []
    recipe = fp8ext.DelayedScaling(fp8_dpa=True)
    for b, s, h, hk in SHAPES:
        torch.manual_seed(0)
        attn = fp8ext.DotProductAttention(h, 128, num_gqa_groups=hk, qkv_format="bshd")
        q = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, s, hk, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn(b, s, h * 128, device="cuda", dtype=torch.bfloat16)
        bf_fwd, bf_both = passes(attn, q, k, v, do, None)
        f8_fwd, f8_both = passes(attn, q, k, v, do, recipe)
        hp = fp8ext.DotProductAttention(h, 128, num_gqa_groups=hk, qkv_format="bshd", fp8_backward=False)
        _, hp_both = passes(hp, q, k, v, do, recipe)
        t = {"bf16 fwd": best_bf16(bf_fwd), "fp8 fwd": bench_ms(f8_fwd, reps=20),
             "bf16 fwd+bwd": best_bf16(bf_both), "fp8 fwd+bwd": bench_ms(f8_both, reps=20),
             "fp8/hp fwd+bwd": bench_ms(hp_both, reps=20)}
        k = {"bf16 fwd": best_bf16(bf_fwd, kernel_ms), "fp8 fwd": kernel_ms(f8_fwd),
             "bf16 fwd+bwd": best_bf16(bf_both, kernel_ms), "fp8 fwd+bwd": kernel_ms(f8_both),
             "fp8/hp fwd+bwd": kernel_ms(hp_both)}
        rows.append({"shape (b, s, h, kv h)": f"{b}, {s}, {h}, {hk}", **t,
                     "fwd x": t["bf16 fwd"] / t["fp8 fwd"], "fwd+bwd x": t["bf16 fwd+bwd"] / t["fp8 fwd+bwd"],
                     "fp8/hp fwd+bwd x": t["bf16 fwd+bwd"] / t["fp8/hp fwd+bwd"],
                     "GPU fwd x": k["bf16 fwd"] / k["fp8 fwd"], "GPU fwd+bwd x": k["bf16 fwd+bwd"] / k["fp8 fwd+bwd"],
                     "GPU fp8/hp fwd+bwd x": k["bf16 fwd+bwd"] / k["fp8/hp fwd+bwd"],
                     "fp8 GPU fwd": k["fp8 fwd"], "fp8 GPU fwd+bwd": k["fp8 fwd+bwd"]})
        print(rows[-1], flush=True)
    cols = list(rows[0])
    print(table(rows, cols, {c: "{:.3f}" for c in cols[1:]}))


if __name__ == "__main__":
    main()
