"""An independent reference for FP8 rounding, written from the OCP definitions with numpy float64.

It shares no code or method with fp8ext's C core: it decodes the 256 codes from the bit-field formula,
then rounds by searching the sorted list of representable values for the nearest one (ties to the even
code), where the C core manipulates float32 bits. Tests compare the two byte for byte.
"""

from __future__ import annotations

import numpy as np

SPEC = {  # name: (exp_bits, mant_bits, bias, has_inf)
    "E4M3": (4, 3, 7, False),
    "E5M2": (5, 2, 15, True),
}


def decode_table(name: str) -> np.ndarray:
    """float64 value of each of the 256 codes (NaN for NaN codes, +-inf for E5M2's Inf)."""
    e_bits, m_bits, bias, has_inf = SPEC[name]
    out = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e = (code >> m_bits) & ((1 << e_bits) - 1)
        m = code & ((1 << m_bits) - 1)
        if has_inf and e == (1 << e_bits) - 1:
            out[code] = sign * np.inf if m == 0 else np.nan
        elif not has_inf and e == (1 << e_bits) - 1 and m == (1 << m_bits) - 1:
            out[code] = np.nan
        elif e == 0:
            out[code] = sign * m * 2.0 ** (1 - bias - m_bits)
        else:
            out[code] = sign * (1 + m / 2**m_bits) * 2.0 ** (e - bias)
    return out


def finite_positive(name: str) -> np.ndarray:
    """The representable values 0 <= v <= max in increasing order; index == code."""
    t = decode_table(name)[:128]
    n = int(np.argmax(~np.isfinite(t))) if not np.all(np.isfinite(t)) else 128
    vals = t[:n]
    assert np.all(np.diff(vals) > 0)
    return vals


def quantize(v: np.ndarray, name: str, saturate: bool, x=None) -> np.ndarray:
    """Codes of fp8(v) for float32 values v = x * scale (already scaled), round to nearest, ties to
    even. A NaN takes the sign of the unscaled x when x is given (fp8ext's rule), else of v."""
    v = np.asarray(v, dtype=np.float32).astype(np.float64)
    vals = finite_positive(name)
    max_code = len(vals) - 1
    overflow_code = 0x7F if name == "E4M3" else 0x7C
    a = np.abs(v)
    lo = np.clip(np.searchsorted(vals, a, side="right") - 1, 0, max_code)
    hi = np.minimum(lo + 1, max_code)
    # The value one step above max (the would-be next code) decides overflow by the same rule.
    e_bits, m_bits, bias, _ = SPEC[name]
    step_above_max = vals[-1] + 2.0 ** (np.floor(np.log2(vals[-1])) - m_bits)
    hi_val = np.where(lo == max_code, step_above_max, vals[hi])
    lo_val = vals[lo]
    d_lo, d_hi = a - lo_val, hi_val - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1))
    code = np.where(pick_hi, lo + 1, lo).astype(np.int64)
    overflow = code > max_code
    code = np.where(overflow, max_code if saturate else overflow_code, code)
    code = np.where(np.isinf(a), max_code if saturate else overflow_code, code)
    code = np.where(np.isnan(a), 0x7F, code)
    sign = np.signbit(v)
    if x is not None:
        sign = np.where(np.isnan(a), np.signbit(np.asarray(x, dtype=np.float32)), sign)
    return (code | np.where(sign, 0x80, 0)).astype(np.uint8)


def neighbours(v: np.ndarray, name: str):
    """For finite |v| <= max: the representable magnitudes just below/at and above |v|."""
    vals = finite_positive(name)
    a = np.abs(np.asarray(v, dtype=np.float64))
    lo = np.clip(np.searchsorted(vals, a, side="right") - 1, 0, len(vals) - 1)
    hi = np.minimum(lo + 1, len(vals) - 1)
    return vals[lo], vals[hi]
