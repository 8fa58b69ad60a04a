"""Weight-only quantized linear layers: FP8, MXFP8, MXFP6, MXFP4 and NVFP4 weights, bf16 activations.

A decode step reads every weight once, so its time is about (weight bytes) / (memory bandwidth): bf16 stores
16 bits per weight, FP8 8 (plus a float32 scale per output channel), MXFP6 6.25, MXFP4 4.25 and NVFP4 4.5 (the
block scales included). Hopper has no FP4/FP6 tensor cores, so the saving is in the bytes moved, not in the math.

    layer = fp8ext.WeightOnlyLinear.from_linear(linear, "mxfp4")   # packs on the CPU, keeps linear's device
    y = layer(x)                                                   # x [..., in_features], bf16

Formats:
    "fp8"         E4M3, one float32 scale per output channel (448 / amax of the row)
    "mxfp8"       E4M3 in OCP MX blocks of 32 values along K with an E8M0 (power-of-two) scale each
    "mxfp6"       E3M2 (max 28) in MX blocks of 32, codes packed 16 in 12 bytes
    "mxfp6_e2m3"  E2M3 (max 7.5) in MX blocks of 32
    "mxfp4"       E2M1 (max 6) in MX blocks of 32, codes packed 8 per 32-bit word
    "nvfp4"       E2M1 in blocks of 16 with an E4M3 scale each and one float32 scale for the tensor
Quantization follows fp8ext.mx (round to nearest even, saturating; MX scales by the specification's floor rule).
The layer holds only the packed codes and the scales: no high-precision copy of the weight. Layers the kernel can
run store them in the kernel's tiles; FP4 and FP6 codes are bit-interleaved in the kernel's order (in every layer);
`dequantized_weight()` gives the plain weight, and a state dict saved in an earlier layout (module versions 1 and 2)
is converted when loaded (by its metadata: save state dicts with torch.save, which keeps it; a whole pickled module
of an earlier version is not converted). On Hopper the kernel reads the codes and scales while the kernel before it in
the stream may still run (programmatic dependent launch): change them with copies (copy_, load_state_dict, pack_),
not in place with a CUDA kernel right before a call.
The weight is not an fp8ext.FP8Tensor (fp8ext/core/tensor.py), not even in "fp8": an FP8Tensor is float8 data in
[rows, cols] order with float32 scale_invs, per tensor, row or 128-wide block, read by the FP8 GEMMs; these codes
are uint8 (FP4 and FP6 packed), in the kernel's tiles wherever the kernel can run the layer, with E8M0 or E4M3
scales per block of 32 or 16 values (NVFP4 with a second, per-tensor scale), and only the weight-only kernel or a
dequantize reads them.

Forward: on a GPU with bf16 input and at most 16 tokens (decode), a CUDA kernel streams the packed weights once,
dequantizes them in registers and multiplies on the tensor cores (bf16 in, float32 accumulation); it needs
in_features % 256 == 0 and out_features % 64 == 0. Otherwise (more tokens, another dtype, the CPU, other sizes, or
an input that needs a gradient) the weight is dequantized to x's dtype and F.linear runs: the same values, through
cuBLAS's GEMM, differentiable with respect to x (the packed weight itself is not trained). Each call on the GPU
path uses a per-layer counter buffer: do not run one layer on two CUDA streams at the same time.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.formats import E2M1, E2M3, E3M2, E4M3
from ..ops.mx import dequantize_mx, dequantize_nvfp4, quantize_mx, quantize_nvfp4, refuse_non_finite
from ..ops import quantize
from .. import _C
from ..core.boundary import dl
from ..ops.packing import unpack_fp4, unpack_fp6

__all__ = ["WeightOnlyLinear", "WEIGHT_ONLY_FORMATS", "bits_per_weight"]

# FP4 codes are stored bit-interleaved in the kernel's order: each 32-bit word (4 bytes, little-endian) holds 8
# consecutive values along K, bit b of value v at bit _FP4_BITS[v][b] (bit 3 is the sign), placed so that the kernel
# turns pair p (values 2p, 2p + 1) into two bfloat16 bit patterns (sign at bit 15, the three magnitude bits at 6-8;
# the same 16 bits higher) by rotating the word left and masking: by 0, 4 and 10 for pairs 0-2; pair 3 takes its
# magnitude bits 6 and 22 from a rotation by 6 and the rest from one by 14 (csrc/kernels/weight_only.cu, decode).
_FP4_ROTATIONS = (0, 4, 10)


def _fp4_bit_positions():
    positions = []
    for v in range(8):
        pair, high = divmod(v, 2)
        row = []
        for b in range(4):
            target = (15 if b == 3 else 6 + b) + 16 * high  # where the decoded bfloat16 pair wants this bit
            r = _FP4_ROTATIONS[pair] if pair < 3 else (6 if b == 0 else 14)
            row.append((target - r) % 32)  # rotating left by r brings stored bit (target - r) to target
        positions.append(tuple(row))
    return tuple(positions)


_FP4_BITS = _fp4_bit_positions()


def _pack_interleaved(codes: torch.Tensor, positions) -> torch.Tensor:
    """[..., K] codes (one per byte) -> bytes with bit b of value v of each group of len(positions) values at bit
    positions[v][b] of the group's bytes."""
    group, nbytes = len(positions), (max(max(p) for p in positions) + 1) // 8
    c = codes.reshape(*codes.shape[:-1], -1, group)
    out = torch.zeros(*c.shape[:-1], nbytes, dtype=torch.uint8, device=codes.device)
    for v, bits in enumerate(positions):
        for b, pos in enumerate(bits):
            out[..., pos // 8] |= ((c[..., v] >> b) & 1) << (pos % 8)
    return out.reshape(*codes.shape[:-1], -1)


def _unpack_interleaved(packed: torch.Tensor, positions) -> torch.Tensor:
    """The inverse of _pack_interleaved."""
    group, nbytes = len(positions), (max(max(p) for p in positions) + 1) // 8
    w = packed.reshape(*packed.shape[:-1], -1, nbytes)
    codes = torch.zeros(*w.shape[:-1], group, dtype=torch.uint8, device=packed.device)
    for v, bits in enumerate(positions):
        for b, pos in enumerate(bits):
            codes[..., v] |= ((w[..., pos // 8] >> (pos % 8)) & 1) << b
    return codes.reshape(*packed.shape[:-1], -1)


def _fp4_pack_kernel(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] FP4 codes (one per byte, K % 8 == 0) -> [..., K / 2] bytes in the kernel's bit order."""
    return _pack_interleaved(codes, _FP4_BITS)


def _fp4_unpack_kernel(packed: torch.Tensor) -> torch.Tensor:
    return _unpack_interleaved(packed, _FP4_BITS)


# FP6 codes are stored bit-interleaved in groups of 16 values along K (three 32-bit words, 12 bytes): the kernel forms
# pair j of a group (values 2j, 2j + 1) as bfloat16 bit patterns (the sign at bit 15, the other five bits at 5-9 for
# E3M2, 4-8 for E2M3; the same 16 bits higher) from one or two parts, each a funnel shift of two of the group's words
# (word lo low, word hi high; a rotation where lo == hi) left by rot, masked. The same tables as the kernel's
# (csrc/kernels/weight_only.cu, fp6_pair): (lo, hi, rot, mask) per part.
_FP6_PAIRS = {
    "e3m2": (((0, 0, 0, 0x83E083E0),), ((0, 0, 5, 0x83E083E0),), ((0, 1, 5, 0x83E083E0),), ((0, 2, 5, 0x83E083E0),),
             ((1, 1, 0, 0x03E003E0), (0, 0, 1, 0x80008000)), ((1, 0, 26, 0x03E003E0), (0, 0, 2, 0x80008000)),
             ((2, 2, 0, 0x03E003E0), (0, 0, 3, 0x80008000)), ((2, 0, 26, 0x03E003E0), (0, 0, 4, 0x80008000))),
    "e2m3": (((0, 1, 20, 0x81F081F0),), ((1, 2, 18, 0x81F081F0),),
             ((0, 0, 0, 0x000081F0), (0, 0, 10, 0x81F00000)), ((1, 0, 6, 0x000081F0), (0, 1, 14, 0x81F00000)),
             ((1, 0, 12, 0x000081F0), (0, 1, 8, 0x81F00000)), ((0, 2, 14, 0x000081F0), (0, 2, 12, 0x81F00000)),
             ((0, 2, 8, 0x000081F0), (0, 2, 6, 0x81F00000)), ((2, 1, 10, 0x000081F0), (2, 2, 0, 0x81F00000))),
}


def _fp6_bit_positions(elem: str):
    """For each of a group's 16 values and each of its 6 code bits (bit 5 the sign), the bit of the group's 96."""
    low = 5 if elem == "e3m2" else 4  # where bit 0 of the code goes in a bfloat16 pattern
    positions = []
    for v in range(16):
        pair, high = divmod(v, 2)
        row = []
        for b in range(6):
            target = (15 if b == 5 else low + b) + 16 * high
            lo, hi, rot, _ = next(part for part in _FP6_PAIRS[elem][pair] if part[3] >> target & 1)
            src = target + 32 - rot  # bit of the 64-bit (word hi : word lo) that the funnel shift brings to target
            if lo == hi:
                row.append(32 * lo + (target - rot) % 32)
            else:
                row.append(32 * lo + src if src < 32 else 32 * hi + src - 32)
        positions.append(tuple(row))
    return tuple(positions)


_FP6_BITS = {elem: _fp6_bit_positions(elem) for elem in _FP6_PAIRS}


def _fp6_pack_kernel(codes: torch.Tensor, elem: str) -> torch.Tensor:
    """[..., K] FP6 codes (one per byte, K % 16 == 0) -> [..., 3K / 4] bytes in the kernel's bit order."""
    return _pack_interleaved(codes, _FP6_BITS[elem])


def _fp6_unpack_kernel(packed: torch.Tensor, elem: str) -> torch.Tensor:
    return _unpack_interleaved(packed, _FP6_BITS[elem])


def _fp6_name(fmt: str) -> str:
    return "e2m3" if fmt == "mxfp6_e2m3" else "e3m2"


# The nibble order of module version 2 (value _FP4_NIBBLES_V2[i] in nibble i of each 32-bit word): read when such a
# state dict is loaded.
_FP4_NIBBLES_V2 = (6, 4, 2, 0, 7, 5, 3, 1)


def _fp4_from_v2(packed: torch.Tensor) -> torch.Tensor:
    """Bytes in version 2's nibble order -> the codes in K order."""
    nibbles = unpack_fp4(packed)
    c = nibbles.reshape(*nibbles.shape[:-1], -1, 8)
    order = torch.tensor([_FP4_NIBBLES_V2.index(v) for v in range(8)], device=packed.device)
    return c.index_select(-1, order).reshape(nibbles.shape)


# Layers the kernel can run (in_features % 256 == 0, out_features % 64 == 0) store codes and block scales in
# tiles of 64 rows x 256 values, ordered by group of 64 rows and then along K; a tile is four contiguous quarters
# (K values 0-127 then 128-255; within each, rows 0-31 then 32-63), each row by row. One warp of the kernel
# streams one quarter per step: one contiguous read.
_TILE_ROWS, _TILE_K = 64, 256


def _tiled(in_features: int, out_features: int) -> bool:
    return in_features % _TILE_K == 0 and out_features % _TILE_ROWS == 0


def _tile(t: torch.Tensor, k: int, inverse: bool = False) -> torch.Tensor:
    """[N, bytes] of rows covering k values -> the same bytes in the kernel's tiles (or back)."""
    n, width = t.shape
    groups, chunks = n // _TILE_ROWS, k // _TILE_K
    half = width // chunks // 2  # bytes of a row in one quarter (128 values)
    rows = (groups, 2, 32, chunks, 2, half)  # group, row half, row, chunk, K half, bytes
    if inverse:
        return t.reshape(groups, chunks, 2, 2, 32, half).permute(0, 3, 4, 1, 2, 5).reshape(n, width)
    return t.reshape(rows).permute(0, 3, 4, 1, 2, 5).reshape(n, width)


# name -> (kernel code, element format, block size, bits per stored code)
_FORMATS = {
    "fp8": (0, E4M3, None, 8), "mxfp8": (1, E4M3, 32, 8), "mxfp6": (2, E3M2, 32, 6),
    "mxfp6_e2m3": (3, E2M3, 32, 6), "mxfp4": (4, E2M1, 32, 4), "nvfp4": (5, E2M1, 16, 4),
}
WEIGHT_ONLY_FORMATS = tuple(_FORMATS)


def bits_per_weight(fmt: str, in_features: int = 4096) -> float:
    """Stored bits per weight, scales included (per-channel scales spread over in_features)."""
    _, _, block, bits = _fmt(fmt, "bits_per_weight")
    return bits + (32 / in_features if block is None else 8 / block)


def _fmt(fmt, fn):
    if fmt not in _FORMATS:
        raise ValueError(f"{fn}(): fmt must be one of {list(_FORMATS)}, got {fmt!r}")
    return _FORMATS[fmt]


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _splits(chunks: int, groups: int, slots: int) -> int:
    """How many blocks share a group of 64 output columns along K (chunks of 256 values each), given how many
    blocks the GPU runs at once (`slots`): as many as one wave of blocks holds, evened out so that every block
    streams the same number of chunks. (Measured on the H100: spreading more, smaller blocks evenly over the
    multiprocessors was as fast for FP4 and slower for FP8 and for 16 tokens.)"""
    fit = max(1, min(chunks, slots // groups))
    per = -(-chunks // fit)
    return -(-chunks // per)


class WeightOnlyLinear(nn.Module):
    """y = x W^T (+ bias) with W held as packed low-precision codes and scales (see the module docstring)."""

    # 3: codes and block scales in the kernel's tiles, FP4 and FP6 codes bit-interleaved (_FP4_BITS, _FP6_BITS);
    # 2: the tiles, FP4 in a nibble order (_FP4_NIBBLES_V2), FP6 in pack_fp6's; 1: plain rows, pack_fp4's and
    # pack_fp6's order. load_state_dict converts a state dict saved as version 1 or 2 (its metadata says so; one
    # without metadata is taken as the current layout).
    _version = 3

    def __init__(self, in_features: int, out_features: int, fmt: str, bias: bool = False, device=None):
        super().__init__()
        code, elem, block, bits = _fmt(fmt, "WeightOnlyLinear")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"WeightOnlyLinear: in_features and out_features must be positive, got "
                             f"{in_features}, {out_features}")
        if block and in_features % block:
            raise ValueError(f"WeightOnlyLinear: in_features ({in_features}) must be a multiple of {fmt}'s block "
                             f"size {block}")
        if bits in (4, 6) and in_features % (8 if bits == 4 else 16):  # also implied by the block sizes
            raise ValueError(f"WeightOnlyLinear: {fmt} packs its codes in groups of {8 if bits == 4 else 16} values: "
                             f"in_features ({in_features}) must be a multiple of that")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        row_bytes = in_features * bits // 8
        self.register_buffer("codes", torch.zeros(out_features, row_bytes, dtype=torch.uint8, device=device))
        nblk = in_features // block if block else 0
        self.register_buffer("block_scales", torch.zeros(out_features, nblk, dtype=torch.uint8, device=device)
                             if block else None)
        self.register_buffer("channel_scale", torch.ones(out_features, device=device) if fmt == "fp8" else None)
        self.register_buffer("tensor_scale", torch.ones(1, device=device) if fmt == "nvfp4" else None)
        self.register_buffer("bias", torch.zeros(out_features, dtype=torch.bfloat16, device=device) if bias else None)
        self._kernel_cache = {}
        self.register_buffer("_counters", torch.zeros(max(1, out_features // 64), dtype=torch.int32, device=device),
                             persistent=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        version = local_metadata.get("version", self._version)
        codes, scales = prefix + "codes", prefix + "block_scales"
        bits = _FORMATS[self.fmt][3]
        # FP4 and FP6 codes of an 8- or 16-value group stay within its 4 or 12 bytes in every layout (tiles included):
        # re-packed in place. Codes of another shape are left to the size check of load_state_dict; packed bytes
        # of another dtype would be cast by it, so they are refused.
        if version < 3 and bits in (4, 6) and codes in state_dict and state_dict[codes].shape == self.codes.shape:
            stored = state_dict[codes]
            if stored.dtype != torch.uint8:
                raise ValueError(f"WeightOnlyLinear.load_state_dict(): {codes} must be uint8 packed codes, got "
                                 f"{stored.dtype}")
            if bits == 4:
                state_dict[codes] = _fp4_pack_kernel(unpack_fp4(stored) if version < 2 else _fp4_from_v2(stored))
            else:
                state_dict[codes] = _fp6_pack_kernel(unpack_fp6(stored), _fp6_name(self.fmt))
        if version < 2 and _tiled(self.in_features, self.out_features):
            if codes in state_dict:
                state_dict[codes] = _tile(state_dict[codes], self.in_features)
            if scales in state_dict and state_dict[scales] is not None:
                state_dict[scales] = _tile(state_dict[scales], self.in_features)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def __getstate__(self):  # copies and pickles leave the per-call cache (DLPack capsules) behind
        state = self.__dict__.copy()
        state["_kernel_cache"] = {}
        return state

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt!r}, " \
               f"bias={self.bias is not None}"

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight: codes and scales (the bias not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.block_scales, self.channel_scale,
                                                           self.tensor_scale) if t is not None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Module, fmt: str) -> "WeightOnlyLinear":
        """Quantizes and packs `linear`'s weight into a new layer on the weight's device (the packing runs there
        too, on the CPU or a GPU, with the same result). ValueError if the weight holds NaN or Inf."""
        if not hasattr(linear, "weight") or not isinstance(linear.weight, torch.Tensor) or linear.weight.dim() != 2:
            raise TypeError(f"WeightOnlyLinear.from_linear(): linear must have a 2-D weight, got "
                            f"{type(linear).__name__}")
        w = linear.weight.detach()
        refuse_non_finite(w, "WeightOnlyLinear.from_linear()", f"{type(linear).__name__}.weight",
                          "the packed formats cannot keep them (clean or replace the weight first)")
        out_f, in_f = w.shape
        bias = getattr(linear, "bias", None)
        layer = cls(in_f, out_f, fmt, bias=bias is not None, device=w.device)
        layer.pack_(w)
        if bias is not None:
            layer.bias.copy_(bias.detach().to(torch.bfloat16))
        return layer

    @torch.no_grad()
    def pack_(self, weight: torch.Tensor) -> "WeightOnlyLinear":
        """Quantizes `weight` [out_features, in_features] into this layer's codes and scales. A weight holding NaN
        or Inf is refused (ValueError naming the weight, the count and the first position): it would turn every
        output it touches into NaN (from_linear checks its linear's weight the same way)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"WeightOnlyLinear.pack_(): weight must be [{self.out_features}, {self.in_features}], "
                             f"got {list(weight.shape)}")
        w = weight.detach().to(self.codes.device, torch.float32).contiguous()
        refuse_non_finite(w, "WeightOnlyLinear.pack_()", "weight",
                          "the packed formats cannot keep them (clean or replace the weight first)")
        code, elem, block, bits = _FORMATS[self.fmt]
        dev = self.codes.device  # w is there too
        if self.fmt == "fp8":
            amax = w.abs().amax(dim=1)
            scale = torch.where(amax > 0, torch.full_like(amax, E4M3.max) / amax, torch.ones_like(amax))  # the quotient
            q = quantize((w * scale[:, None]).contiguous(), E4M3, 1.0)
            self.codes.copy_(q.view(torch.uint8).to(dev))
            self.channel_scale.copy_((1.0 / scale).to(dev))
        elif self.fmt == "nvfp4":
            codes, bscales, tscale = quantize_nvfp4(w)
            self.codes.copy_(_fp4_pack_kernel(codes).to(dev))
            self.block_scales.copy_(bscales.view(torch.uint8).to(dev))
            self.tensor_scale.copy_(tscale.reshape(1).to(dev))
        else:
            elements, scales = quantize_mx(w, elem, block=32)
            codes = elements.view(torch.uint8) if elements.dtype != torch.uint8 else elements
            packed = (_fp4_pack_kernel(codes) if bits == 4 else
                      _fp6_pack_kernel(codes, _fp6_name(self.fmt)) if bits == 6 else codes)
            self.codes.copy_(packed.to(dev))
            self.block_scales.copy_(scales.to(dev))
        if _tiled(self.in_features, self.out_features):
            self.codes.copy_(_tile(self.codes, self.in_features))
            if self.block_scales is not None:
                self.block_scales.copy_(_tile(self.block_scales, self.in_features))
        return self

    def _rows(self):
        """(codes, block_scales) as plain rows [out_features, ...] (the stored ones may be tiled)."""
        if not _tiled(self.in_features, self.out_features):
            return self.codes, self.block_scales
        k = self.in_features
        return _tile(self.codes, k, True), None if self.block_scales is None else _tile(self.block_scales, k, True)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight these codes and scales stand for, [out_features, in_features], rounded to dtype."""
        code, elem, block, bits = _FORMATS[self.fmt]
        stored, block_scales = self._rows()
        if self.fmt == "fp8":
            w = stored.view(torch.float8_e4m3fn).float() * self.channel_scale[:, None]
            return w.to(dtype)
        codes = (_fp4_unpack_kernel(stored) if bits == 4 else
                 _fp6_unpack_kernel(stored, _fp6_name(self.fmt)) if bits == 6 else stored)
        if self.fmt == "nvfp4":
            return dequantize_nvfp4(codes, block_scales.view(torch.float8_e4m3fn), self.tensor_scale[0], dtype)
        elements = codes.view(torch.float8_e4m3fn) if self.fmt == "mxfp8" else codes
        return dequantize_mx(elements, block_scales, elem, 32, dtype)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        """Whether forward(x) runs the few-token CUDA kernel (see the module docstring)."""
        m = x.numel() // max(1, x.shape[-1])
        needs_grad = x.requires_grad and torch.is_grad_enabled()  # the kernel computes no gradient for x
        return (x.is_cuda and x.dtype == torch.bfloat16 and 1 <= m <= 16 and self.in_features % 256 == 0
                and self.out_features % 64 == 0 and not needs_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"WeightOnlyLinear: x's last dimension must be {self.in_features}, got {list(x.shape)}")
        if x.device != self.codes.device:
            raise ValueError(f"WeightOnlyLinear: x is on {x.device}, the weights on {self.codes.device}")
        if not self.uses_kernel(x):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantized_weight(x.dtype), bias)
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x2.data_ptr() % 16:  # the kernel copies x in aligned pieces
            x2 = x2.clone()
        m, n = x2.shape[0], self.out_features
        out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
        head, counters, splits = self._kernel_args(m)
        _C.weight_only(dl(x2), *head, counters, dl(out), _FORMATS[self.fmt][0], splits,
                       torch.cuda.current_stream(x.device).cuda_stream)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], n)

    def _kernel_args(self, m: int):
        """The kernel's per-layer arguments, kept between calls (the host work of a decode step is mostly this):
        DLPack capsules of the weight buffers and of a workspace for m tokens, and the split of K. Rebuilt when a
        buffer moves (.to(), load_state_dict)."""
        key = (m,) + tuple(t.data_ptr() for t in (self.codes, self.block_scales, self.channel_scale,
                                                   self.tensor_scale, self._counters) if t is not None)
        cached = self._kernel_cache.get(m)
        if cached is None or cached[0] != key:
            n, k = self.out_features, self.in_features
            dev = self.codes.device.index if self.codes.device.index is not None else torch.cuda.current_device()
            slots = _C.weight_only_blocks_per_sm(_FORMATS[self.fmt][0], m, dev) * _num_sms(dev)
            splits = _splits(k // 256, n // 64, slots)
            workspace = torch.empty(splits * m * n, dtype=torch.float32, device=self.codes.device)
            opt = lambda t: None if t is None else dl(t)  # noqa: E731
            weights = (dl(self.codes), opt(self.block_scales), opt(self.channel_scale), opt(self.tensor_scale))
            cached = (key, weights + (dl(workspace),), dl(self._counters), splits, workspace)
            self._kernel_cache[m] = cached
        _, head, counters, splits, _ = cached
        return head, counters, splits
