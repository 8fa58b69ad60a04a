"""Comparisons of FP8 tensors: byte-exact (assert_fp8_equal) and in units of the format's spacing
(ulp_distance, assert_close_fp8). Everything is compared on the CPU; the inputs may live anywhere."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ._values import (FP8_DTYPES, as_tensor, check_shapes, code_text, codes_of, fail, index_of, is_tie, pick_format,
                      spacing, tie_text, value_table, values_of)

__all__ = ["assert_fp8_equal", "ulp_distance", "assert_close_fp8"]


def assert_fp8_equal(actual: Any, expected: Any, *, fmt: Any = None, input: Any = None, strict_nan: bool = False,
                     max_report: int = 8, msg: Optional[str] = None) -> None:
    """Byte-exact equality of two FP8 tensors of one shape; AssertionError listing the mismatches otherwise.

    actual, expected: torch.float8_e4m3fn / float8_e5m2 tensors, or uint8 codes (a torch tensor or numpy
    array) on any device. The format is their float8 dtype, or `fmt` where both are uint8; two different
    float8 dtypes are a mismatch. Zeros compare with their sign (0x00 != 0x80). NaN: any NaN code equals
    any other NaN code of the format (E4M3 0x7F/0xFF, E5M2 0x7D-0x7F/0xFD-0xFF) unless strict_nan=True,
    where every byte must agree. input: the values that were cast (same number of elements), shown beside
    each mismatch. The message gives the number of mismatches and the first `max_report` of them as
    index: got code (value), expected code (value), input value, and marks an input midway between two
    neighbouring FP8 values (at scale 1) as a tie ("input 1.0625, a tie between 1.0 and 1.125"): the case
    that only a byte-exact comparison catches (assert_close_fp8 accepts either neighbour of a tie).
    """
    __tracebackhide__ = True
    fn = "assert_fp8_equal"
    a, e = as_tensor(actual, fn, "actual"), as_tensor(expected, fn, "expected")
    if a.dtype in FP8_DTYPES and e.dtype in FP8_DTYPES and a.dtype != e.dtype:
        fail(fn, msg, f"formats differ: actual is {a.dtype} but expected is {e.dtype}", [])
    f = pick_format(fn, fmt, ("actual", a), ("expected", e))
    check_shapes(fn, [("actual", a.shape), ("expected", e.shape)])
    x = None if input is None else as_tensor(input, fn, "input")
    if x is not None and x.numel() != a.numel():
        raise ValueError(f"{fn}(): input has {x.numel()} elements but actual has {a.numel()}")
    ga, ge = codes_of(a, fn, "actual"), codes_of(e, fn, "expected")
    bad = (ga != ge).nonzero().reshape(-1)
    if not strict_nan and bad.numel():
        nan = torch.isnan(value_table(f))
        bad = bad[~(nan[ga[bad].long()] & nan[ge[bad].long()])]
    if bad.numel() == 0:
        return
    x = None if x is None else x.detach().cpu().reshape(-1)
    lines = []
    for i in bad[:max_report].tolist():
        row = f"  index {index_of(i, a.shape)}: got {code_text(int(ga[i]), f)}, expected {code_text(int(ge[i]), f)}"
        lines.append(row + (f", input {x[i].item()!r}{tie_text(x[i].item(), f)}" if x is not None else ""))
    if bad.numel() > max_report:
        lines.append(f"  ... and {bad.numel() - max_report} more")
    nan_rule = "every byte compared" if strict_nan else "NaN codes equal any NaN"
    headline = f"{bad.numel()} of {ga.numel()} {f.name} codes differ ({nan_rule})"
    if x is not None:
        ties = int(is_tie(x[bad], f).sum())
        if ties:
            headline += (f"; {ties} of them at ties (inputs midway between two {f.name} values): check the "
                         "rounding of ties (to nearest even)")
    fail(fn, msg, headline, lines)


def ulp_distance(a: Any, b: Any, fmt: Any = None) -> torch.Tensor:
    """|a - b| in units of the FP8 format's spacing at b: a float64 CPU tensor (a and b broadcast).

    b is the reference: the spacing is the format's at |b| (2**(e - mant_bits) for |b| in [2**e, 2**(e+1)),
    min_subnormal below min_normal, the top binade's beyond fmt.max), so a correctly rounded FP8 value of
    any |b| <= fmt.max is within 0.5, and two FP8 values of one binade are as many ulps apart as codes.
    a and b: FP8 tensors or uint8 codes (decoded in the format), or any real tensors, arrays or numbers.
    fmt: fp8ext.E4M3 / E5M2 (or a spelling fp8ext.quantize takes); optional when a or b has a float8 dtype.
    Special values: NaN and NaN are 0 apart, NaN and anything else inf; Inf and the same Inf 0, Inf and
    anything else inf.
    """
    fn = "ulp_distance"
    ta, tb = as_tensor(a, fn, "a"), as_tensor(b, fn, "b")
    f = pick_format(fn, fmt, ("a", ta), ("b", tb))
    va, vb = values_of(ta, f).reshape(ta.shape), values_of(tb, f).reshape(tb.shape)
    va, vb = torch.broadcast_tensors(va, vb)
    with torch.no_grad():
        d = (va - vb).abs() / spacing(vb, f)
        same_special = (torch.isnan(va) & torch.isnan(vb)) | (torch.isinf(va) & (va == vb))
        d = torch.where(same_special, 0.0, d)
        return torch.where(torch.isnan(d), float("inf"), d)


def assert_close_fp8(actual: Any, reference: Any, fmt: Any = None, *, max_ulps: float = 0.5,
                     saturate: bool = False, equal_nan: bool = True, max_report: int = 8,
                     msg: Optional[str] = None) -> None:
    """Every element of `actual` within `max_ulps` of `reference`, in the format's spacing at the reference
    (see ulp_distance); AssertionError with a report like torch.testing's otherwise.

    actual: FP8 values (a float8 tensor, uint8 codes with fmt, or real values); reference: real values of
    the same shape (float64 recommended). max_ulps=0.5 asks for correct rounding, ties either way: a tie is
    0.5 ulp from both neighbours, so a cast that rounds ties up (or away from zero) passes. Use
    assert_fp8_equal against fp8ext.quantize to pin the rounding of ties.
    saturate=True clamps the reference to +-fmt.max first (Inf included), the rule of a saturating cast.
    equal_nan=False makes NaN in both a mismatch.
    """
    __tracebackhide__ = True
    fn = "assert_close_fp8"
    ta, tr = as_tensor(actual, fn, "actual"), as_tensor(reference, fn, "reference")
    f = pick_format(fn, fmt, ("actual", ta), ("reference", tr))
    check_shapes(fn, [("actual", ta.shape), ("reference", tr.shape)])
    if not max_ulps >= 0:
        raise ValueError(f"{fn}(): max_ulps must be >= 0, got {max_ulps!r}")
    va, vr = values_of(ta, f), values_of(tr, f)
    if saturate:
        vr = vr.clamp(-f.max, f.max)
    d = ulp_distance(va, vr, f)
    if not equal_nan:
        d = torch.where(torch.isnan(va) & torch.isnan(vr), float("inf"), d)
    bad = (d > max_ulps).nonzero().reshape(-1)
    if bad.numel() == 0:
        return
    worst = int(d.argmax())
    diff = (va[bad] - vr[bad]).abs().nan_to_num(nan=float("inf"))  # over the mismatches only
    worst_abs = int(bad[int(diff.argmax())])
    n = va.numel()
    lines = [f"Mismatched elements: {bad.numel()} / {n} ({100.0 * bad.numel() / n:.1f}%)",
             f"Greatest ulp distance: {_beyond(d[worst].item(), max_ulps)} at index {index_of(worst, ta.shape)} "
             f"(up to {max_ulps} allowed)",
             f"Greatest absolute difference: {diff.max().item():.6g} at index {index_of(worst_abs, ta.shape)} "
             "(of the mismatches)",
             "First mismatches (index: actual, reference, ulps):"]
    codes = codes_of(ta, fn, "actual") if ta.dtype in (*FP8_DTYPES, torch.uint8) else None
    for i in bad[:max_report].tolist():
        got = code_text(int(codes[i]), f) if codes is not None else repr(va[i].item())
        lines.append(f"  {index_of(i, ta.shape)}: {got}, {vr[i].item()!r}, {_beyond(d[i].item(), max_ulps)}")
    if bad.numel() > max_report:
        lines.append(f"  ... and {bad.numel() - max_report} more")
    fail(fn, msg, f"actual is not within {max_ulps} {f.name} ulps of reference", lines)


def _beyond(ulps: float, bound: float) -> str:
    """`ulps` (over `bound`) with 4 significant digits, or as many more as show it is over: 0.5000000298 is not
    printed as 0.5 next to "up to 0.5 allowed"."""
    for digits in range(4, 18):
        text = f"{ulps:.{digits}g}"
        if float(text) > bound or text != f"{bound:.{digits}g}":
            return text
    return repr(ulps)
