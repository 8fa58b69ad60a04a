"""fp8ext.testing: helpers for tests of FP8 code, with the FP8 numerics of fp8ext's C core.

    import fp8ext
    from fp8ext.testing import assert_fp8_equal, assert_close_fp8, edge_values

    x = edge_values(fp8ext.E4M3, torch.float32)           # every value, tie, neighbour, overflow, special
    assert_fp8_equal(my_cast(x), fp8ext.quantize(x), input=x)   # byte for byte; the report names the inputs
    assert_close_fp8(my_cast(x), x.double(), max_ulps=0.5, saturate=True)   # correctly rounded

What is here:
- assert_fp8_equal(actual, expected): byte-exact comparison (any NaN code equals another unless strict_nan).
- ulp_distance(a, b, fmt) and assert_close_fp8(actual, reference): distances in the format's spacing at
  the reference value.
- gemm_reference, gemm_error_bound and assert_gemm_close: an FP8 GEMM's output against the float64 product
  of the same FP8 inputs, inside a bound derived for fp32 accumulation and for Hopper's reduced-precision
  tensor-core accumulator, with and without fast accumulation (fp8ext.testing._gemm derives it). The model
  follows the tensors' device unless accum_bits= names it: fp32 for CPU tensors, Hopper's for CUDA ones
  (accum_bits_for); H100_ACCUM_BITS, H100_MMA_K, PROMOTE_INTERVAL and FAST_ACCUM_FACTOR are its constants.
- edge_values(fmt, dtype) (and edge_groups): the inputs an FP8 cast gets wrong.
- fp8ext.testing.strategies: the same cases as hypothesis strategies (needs hypothesis; imported on use).

Which helper catches which bug (tests/testing/test_worked_example.py plants each one):
- ties (round half up or away from zero instead of to nearest even): only assert_fp8_equal against
  fp8ext.quantize; pass input= and the report marks each tie ("input 1.0625, a tie between 1.0 and 1.125").
  assert_close_fp8(max_ulps=0.5) cannot: a tie is 0.5 ulp from both neighbours.
- saturation (NaN or Inf past fmt.max where the cast should clamp to +-fmt.max): assert_close_fp8(...,
  saturate=True) (NaN/Inf is inf ulps from fmt.max) and assert_fp8_equal; edge_values holds the inputs
  around the overflow threshold.
- subnormals (flushed to zero, or rounded on the normal grid): assert_close_fp8 (a flushed min_subnormal is
  1 ulp away) and assert_fp8_equal; edge_values holds every subnormal and the ties between them.
- NaN codes (0x7F where 0xFF was expected): assert_fp8_equal(strict_nan=True) only; by default any NaN code
  equals any other, and assert_close_fp8 compares values.
- accumulation (a GEMM summed in too few bits: bfloat16, a truncating accumulator, K skipped):
  assert_gemm_close, whose bound models the accumulator of the tensors' device.

Conventions: FP8 tensors are torch.float8_e4m3fn / float8_e5m2 tensors, or uint8 codes with fmt=; fmt is
fp8ext.E4M3 / fp8ext.E5M2 or any spelling fp8ext.quantize takes; fp8ext.quantize takes float32, bfloat16 and
float16, not float64 (edge_values says why and what to do). Tensors may live on any device; the
comparisons copy what they report to the CPU. A failed comparison raises AssertionError (with msg= in front);
a wrong call (bad type, conflicting fmt) raises TypeError or ValueError naming the argument. The assertions
set __tracebackhide__, so pytest's traceback of a failure ends at the test's own line.
Depends on torch and numpy only; `pip install "fp8ext[testing]"` adds hypothesis for fp8ext.testing.strategies.
Importing it is light: it loads fp8ext's ops and formats (fp8ext imports its linear modules, and with them
torch._dynamo, on first use), about 0.05 s beyond torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from ._compare import assert_close_fp8, assert_fp8_equal, ulp_distance
from ._edges import edge_groups, edge_values
from ._gemm import (FAST_ACCUM_FACTOR, H100_ACCUM_BITS, H100_MMA_K, PROMOTE_INTERVAL, accum_bits_for,
                    assert_gemm_close, gemm_error_bound, gemm_reference)

__all__ = [
    "assert_fp8_equal",
    "ulp_distance",
    "assert_close_fp8",
    "gemm_reference",
    "gemm_error_bound",
    "assert_gemm_close",
    "H100_ACCUM_BITS",
    "H100_MMA_K",
    "PROMOTE_INTERVAL",
    "FAST_ACCUM_FACTOR",
    "accum_bits_for",
    "edge_values",
    "edge_groups",
    "strategies",
]


def __getattr__(name: str) -> Any:
    """fp8ext.testing.strategies on first use, so that hypothesis is needed only by those who use it."""
    if name == "strategies":
        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
