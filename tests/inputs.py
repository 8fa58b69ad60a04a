"""Input sets for the numeric tests: every bfloat16 and float16 bit pattern, and over a million float32
values chosen to hit what rounding code gets wrong (ties, subnormals, zeros, Inf, NaN, overflow)."""

from __future__ import annotations

import numpy as np
import torch

from reference import finite_positive


def all_bf16() -> torch.Tensor:
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def all_f16() -> torch.Tensor:
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def float32_cases(seed: int = 0) -> np.ndarray:
    """>= 1M float32 values (both signs) for formats E4M3 and E5M2 at scale 1, and still dense in
    interesting cases after scaling by small factors."""
    rng = np.random.default_rng(seed)
    parts = []
    for name in ("E4M3", "E5M2"):
        vals = finite_positive(name)
        mids = (vals[:-1] + vals[1:]) / 2  # exact ties; representable in float32
        above_max = vals[-1] + 2.0 ** (np.floor(np.log2(vals[-1])) - (3 if name == "E4M3" else 2))
        edges = np.concatenate([vals, mids, [(vals[-1] + above_max) / 2, above_max, 2 * above_max]])
        e32 = _f32(edges)
        parts += [e32, np.nextafter(e32, np.float32(np.inf)), np.nextafter(e32, np.float32(0))]
        # every value and tie again at many power-of-two offsets, so scaled calls still hit ties
        for k in range(-12, 13):
            parts.append(_f32(edges * 2.0**k))
    specials = _f32([0.0, np.inf, np.nan, 1e38, 3.4028235e38, 1e-45, 1.1754944e-38, 1e-30, 2.0**-10, 2.0**-17,
                     2.0**-16, 2.0**-9, 464.0, 480.0, 61440.0, 65536.0, 57344.0, 448.0])
    nan_payloads = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000], dtype=np.uint32).view(np.float32)
    subnormals32 = (rng.integers(1, 1 << 23, 4096, dtype=np.uint32)).view(np.float32)
    parts += [specials, nan_payloads, subnormals32]
    parts.append(rng.integers(0, 1 << 32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32))  # any bits
    parts.append(_f32(np.exp2(rng.uniform(-24, 20, 400_000))))  # log-uniform magnitudes
    x = np.concatenate(parts).astype(np.float32)
    x = np.concatenate([x, -x])
    assert x.size >= 1_000_000
    return x
