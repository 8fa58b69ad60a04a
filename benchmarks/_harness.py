"""Timing and reporting shared by the benchmarks (METHOD.md: CUDA events, warm-up, medians, random
data, the comparison in the same run)."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable, List, Optional

import torch


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


def device_header() -> dict:
    p = torch.cuda.get_device_properties(0)
    return {"device": p.name, "sms": p.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def copy_tbps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written (the anchors' definition)."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = bench_ms(lambda: b.copy_(a), reps=20)
    del a, b
    return 2 * nbytes / t / 1e9


def table(rows: List[dict], cols: List[str], fmt: Optional[dict] = None) -> str:
    fmt = fmt or {}
    widths = {c: max(len(c), *(len(fmt.get(c, "{}").format(r.get(c, ""))) for r in rows)) for c in cols}
    line = "  ".join(c.rjust(widths[c]) for c in cols)
    out = [line, "-" * len(line)]
    for r in rows:
        out.append("  ".join(fmt.get(c, "{}").format(r.get(c, "")).rjust(widths[c]) for c in cols))
    return "\n".join(out)


def save(name: str, payload: dict) -> str:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)
    return path
