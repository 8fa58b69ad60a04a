"""Timing and reporting shared by the benchmarks (docs/benchmarks.md, "How they measure": CUDA events,
warm-up, medians, random data, the comparison in the same run)."""

from __future__ import annotations

import datetime  # noqa: F401
import json
import os
import statistics  # noqa: F401
import sys
import time  # noqa: F401
from typing import Callable, List, Optional  # noqa: F401  (kept: scripts may import these from here)

import torch  # noqa: F401

# The timing code lives in the package (fp8ext._bench) so that `python -m fp8ext.validate` uses the same
# measurements; the names stay importable from here.
from fp8ext._bench import (bench_ms, copy_tbps, device_header, fp8_gemm_operands, host_us, rounds,  # noqa: F401
                           saved_bytes, spread, steady_ms, table)


def save(name: str, payload: dict) -> str:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)
    return path
