"""Packing the codes of the sub-byte formats: two FP4 (E2M1) codes per byte, four FP6 (E2M3, E3M2) codes in
three bytes. fp8ext.quantize returns one code per byte; these put them in the layout that is stored and
moved (the element with the lower index in the lower bits, as torch's float4_e2m1fn_x2 and the OCP MX
specification's packed FP4 do), and back.
"""

from __future__ import annotations

import torch

__all__ = ["pack_fp4", "unpack_fp4", "pack_fp6", "unpack_fp6"]


def _check(codes: torch.Tensor, bits: int, group: int, fn: str, values: bool = True) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"{fn}(): codes must be a uint8 tensor (fp8ext.quantize's output), got "
                        f"{getattr(codes, 'dtype', type(codes).__name__)}")
    if codes.dim() == 0 or codes.shape[-1] % group:
        raise ValueError(f"{fn}(): the last dimension of codes must be a multiple of {group}, got shape "
                         f"{list(codes.shape)}")
    # the value check reads the codes on the host (a sync on a GPU); any byte passes for 8 bits
    if values and bits < 8 and codes.numel() and not codes.is_meta and int(codes.max()) >= 1 << bits:
        raise ValueError(f"{fn}(): codes must be below {1 << bits} ({bits}-bit codes), got {int(codes.max())}")


def pack_fp4(codes: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """[..., 2n] FP4 codes (uint8, < 16) -> [..., n] bytes: element 2i in the low nibble, 2i + 1 in the high.
    check=False skips the test that every code is below 16, which reads the codes on the host (a sync on a GPU):
    for codes known to be FP4, e.g. fp8ext's E2M1 quantizer's output."""
    _check(codes, 4, 2, "pack_fp4", values=check)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_fp4: [..., n] bytes -> [..., 2n] codes."""
    _check(packed, 8, 1, "unpack_fp4")
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """[..., 4n] FP6 codes (uint8, < 64) -> [..., 3n] bytes: each 4 codes c0..c3 form the 24-bit little-endian
    word c0 | c1 << 6 | c2 << 12 | c3 << 18."""
    _check(codes, 6, 4, "pack_fp6")
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4).to(torch.int32)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
    return out.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 4 * 3)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_fp6: [..., 3n] bytes -> [..., 4n] codes."""
    _check(packed, 8, 3, "unpack_fp6")
    b = packed.reshape(*packed.shape[:-1], packed.shape[-1] // 3, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    out = torch.stack([(word >> (6 * k)) & 0x3F for k in range(4)], dim=-1)
    return out.to(torch.uint8).reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 4)
