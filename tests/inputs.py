"""Input sets for the numeric tests: every bfloat16 and float16 bit pattern, over a million float32
values chosen to hit what rounding code gets wrong (fp8ext.testing.edge_values at many scales, random
bits, log-uniform magnitudes), and random FP8 GEMM operands with each kind of scale."""

from __future__ import annotations

import numpy as np
import torch

import fp8ext
from fp8ext.testing import edge_values


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
    for fmt in (fp8ext.E4M3, fp8ext.E5M2):
        edges = edge_values(fmt, torch.float32).numpy()  # values, ties and their neighbours, overflow, specials
        with np.errstate(over="ignore"):  # float32's largest value steps up to inf, and scales past it
            parts += [edges, np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(0))]
            # every value and tie again at many power-of-two offsets, so scaled calls still hit ties
            parts += [_f32(edges * np.float32(2.0**k)) for k in range(-12, 13)]
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


def gemm_operands(m: int, k: int, n: int, fa, fb, kind: str, device, seed: int = 0):
    """(a [M, K], b [N, K], a_scale_inv, b_scale_inv): random FP8 GEMM operands with scales of one kind:
    "tensor", "row", "block" (1x128 for a, 128x128 for b) or "block1x128" (1x128 for both). Rows of x span
    2**-3 .. 2**3 so that per-row scales differ."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-3, 4, (m, 1), generator=g).float())
    w = torch.randn(n, k, generator=g) * 0.05
    x, w = x.to(device), w.to(device)
    if kind == "tensor":
        sa = torch.tensor(fa.max / x.abs().max().item(), device=device)
        sb = torch.tensor(fb.max / w.abs().max().item(), device=device)
        return fp8ext.quantize(x, fa, sa), fp8ext.quantize(w, fb, sb), sa.reciprocal(), sb.reciprocal()
    if kind == "row":
        (a, sa), (b, sb) = fp8ext.quantize_rowwise(x, fa), fp8ext.quantize_rowwise(w, fb)
    else:
        a, sa = fp8ext.quantize_blockwise(x, fa, (1, 128))
        b, sb = fp8ext.quantize_blockwise(w, fb, (128, 128) if kind == "block" else (1, 128))
    return a, b, sa, sb
