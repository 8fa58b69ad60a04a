"""Timing and measuring shared by fp8ext's benchmarks (benchmarks/*.py) and `python -m fp8ext.validate`.

The method: CUDA-event timings after warm-up, medians over repetitions, implementations interleaved over
rounds (the GPU's clock drifts under sustained load), random data (never zeros: some kernels skip work on
zeros), and the comparison (bf16, the device's copy bandwidth) measured in the same run, so that ratios are
read within one run. Everything here that times needs a CUDA device; saved_bytes runs anywhere.
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Callable, List, Optional, Tuple

import torch

__all__ = ["bench_ms", "rounds", "host_us", "spread", "steady_ms", "device_header", "copy_tbps", "table",
           "saved_bytes", "fp8_gemm_operands", "cuda_memory", "warm_up_gpu"]


def bench_ms(fn: Callable[[], object], reps: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of `fn` over `reps` runs, each timed with CUDA events after `warmup` runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rounds(impls: dict, reps: int, n_rounds: int = 3) -> dict:
    """Times every implementation n_rounds times, rotating the order each round so that none always runs
    first or last (the GPU's clock drifts under sustained load); returns name -> (median, min, max) ms."""
    times = {k: [] for k in impls}
    names = list(impls)
    for r in range(n_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(bench_ms(impls[name], reps))
    return {k: (statistics.median(v), min(v), max(v)) for k, v in times.items()}


def host_us(fn: Callable[[], object], calls: int = 400, repeats: int = 5) -> float:
    """Microseconds of host time per call: `calls` calls issued between synchronisations (fewer than the
    launch queue holds for small work, so the host does not wait on the GPU), median of `repeats` runs."""
    runs = []
    for _ in range(repeats):
        for _ in range(min(calls, 20)):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def spread(fn: Callable[[], object], reps: int = 30) -> tuple:
    """(median, min, max) of two medians taken back to back: how much a figure moves run to run."""
    a, b = bench_ms(fn, reps), bench_ms(fn, reps)
    return statistics.mean([a, b]), min(a, b), max(a, b)


def steady_ms(fn: Callable[[], object], steps: int = 20, repeats: int = 5) -> float:
    """Milliseconds per step with `steps` steps back to back (no synchronisation between them, as in a training
    loop, so the host runs ahead of the GPU), median over repeats."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def device_header() -> dict:
    """Name, SM count, torch and CUDA versions of CUDA device 0, and the date (UTC)."""
    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def copy_tbps(nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus written (the anchors' definition)."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    t = bench_ms(lambda: b.copy_(a), reps=20)
    del a, b
    return 2 * nbytes / t / 1e9


def table(rows: List[dict], cols: List[str], fmt: Optional[dict] = None) -> str:
    """A plain-text table of `rows` (dicts) with the columns `cols`, right-aligned; `fmt` maps a column to a
    format string."""
    fmt = fmt or {}
    widths = {c: max(len(c), *(len(fmt.get(c, "{}").format(r.get(c, ""))) for r in rows)) for c in cols}
    line = "  ".join(c.rjust(widths[c]) for c in cols)
    out = [line, "-" * len(line)]
    for r in rows:
        out.append("  ".join(fmt.get(c, "{}").format(r.get(c, "")).rjust(widths[c]) for c in cols))
    return "\n".join(out)


def saved_bytes(fn: Callable[[], object], weight_numel: int) -> Tuple[int, int]:
    """(activation bytes, weight-copy bytes) autograd keeps for backward of `fn()`: storages counted once,
    parameters left out, and tensors of the weight's size (fp8ext's cast weight, reused across micro-batches)
    apart. Runs on any device."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = (t.numel(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn()
    del y
    act = sum(b for n, b in seen.values() if n != weight_numel)
    return act, sum(b for n, b in seen.values() if n == weight_numel)


def fp8_gemm_operands(m: int, k: int, n: int, device: str = "cuda"):
    """Random operands of out = x[M, K] @ w[N, K]^T: (x bf16, w bf16, x E4M3, w E4M3, x scale_inv, w scale_inv),
    the FP8 ones scaled so that their largest value is E4M3's 448."""
    from .core.formats import E4M3
    from .ops import quantize

    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device) * 0.05
    sx = torch.tensor(448.0 / x.abs().max().item(), device=device)
    sw = torch.tensor(448.0 / w.abs().max().item(), device=device)
    x8, w8 = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    return x.bfloat16(), w.bfloat16(), x8, w8, sx.reciprocal(), sw.reciprocal()


def cuda_memory(forward: Callable[[], object], backward: Optional[Callable[[object], object]] = None) -> dict:
    """GPU memory of one step, in bytes: `forward()` runs, and what it returns is kept alive until
    `backward(result)` has run. allocated: bytes held after the forward (activations kept for backward, the
    output); peak: the most allocated at any time during the step; both relative to what was allocated before.
    reserved: what torch's caching allocator holds from the device after the step."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = forward()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - base
    if backward is not None:
        backward(out)
    del out
    torch.cuda.synchronize()
    return {"allocated": allocated, "peak": torch.cuda.max_memory_allocated() - base,
            "reserved": torch.cuda.memory_reserved()}


def warm_up_gpu(seconds: float = 1.0, device: str = "cuda") -> None:
    """bf16 matrix products for `seconds`, so that the GPU's clocks are up before the first timing (an idle GPU
    runs its first milliseconds of work at a low clock)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
