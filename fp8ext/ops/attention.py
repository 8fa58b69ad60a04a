"""Decode attention over a KV cache: one new query token per sequence attends to every cached position.

    out = decode_attention(q, k_cache, v_cache, length, k_scale, v_scale)

q is [batch, n_heads, head_dim]; k_cache and v_cache are [batch, n_kv_heads, max_len, head_dim], either
float8_e4m3fn bytes with dequantizing per-head scales k_scale / v_scale [n_kv_heads] (K = k_byte * k_scale), or
bfloat16/float16 with no scales. Grouped-query attention: query head i reads K/V head i // (n_heads / n_kv_heads).
Positions [0, length) are attended; the softmax uses softmax_scale (1 / sqrt(head_dim) by default).

On a GPU with an FP8 cache, a CUDA kernel reads the FP8 bytes directly (no dequantized copy of the cache is made),
splits the cached positions over thread blocks and merges the partial softmaxes (flash-decoding). With head_dim 64,
128 or 256 and a bfloat16 or float16 query it multiplies on tensor cores (f16 operands: the cache bytes exactly, the
query scaled by a power of two per head so that it is exact too but for components below 2^-24 of the head's
largest, the softmax weights rounded to f16; float32 sums); otherwise, and for a float32 query, in float32
throughout. Elsewhere the reference below runs: dequantize the used part of the cache to float32 and compute
softmax(q K^T) V in float32 (also on a GPU when q needs a gradient: the kernel computes none).
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Optional

import torch

from .. import _C
from ..core.boundary import dl, dl_fp8, number, stream_of

__all__ = ["decode_attention", "decode_attention_reference"]


def _check(q, k_cache, v_cache, length, k_scale, v_scale, fn="decode_attention"):
    if q.dim() != 3:
        raise ValueError(f"{fn}(): q must be [batch, n_heads, head_dim], got shape {list(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}(): k_cache and v_cache must both be [batch, n_kv_heads, max_len, head_dim], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    b, h, hd = q.shape
    bk, kv, max_len, hdk = k_cache.shape
    if bk != b or hdk != hd:
        raise ValueError(f"{fn}(): q {list(q.shape)} and k_cache {list(k_cache.shape)} disagree on batch or head_dim")
    if kv == 0 or h % kv:
        raise ValueError(f"{fn}(): n_heads {h} must be a multiple of n_kv_heads {kv}")
    if not isinstance(length, int) or not 0 < length <= max_len:
        raise ValueError(f"{fn}(): length must be an int in [1, {max_len}], got {length!r}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{fn}(): q must be bfloat16, float16 or float32, got {q.dtype}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{fn}(): k_cache and v_cache must have one dtype, got {k_cache.dtype} and {v_cache.dtype}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != kv:
                raise TypeError(f"{fn}(): {name} must be a float32 tensor of {kv} per-head scales for an FP8 cache, "
                                f"got {s if not isinstance(s, torch.Tensor) else (s.dtype, list(s.shape))}")
            if s.device != q.device:
                raise ValueError(f"{fn}(): {name} is on {s.device}, q on {q.device}")
    elif k_cache.dtype in (torch.bfloat16, torch.float16, torch.float32):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{fn}(): k_scale/v_scale apply to an FP8 cache only; the cache is {k_cache.dtype}")
    else:
        raise TypeError(f"{fn}(): the cache must be float8_e4m3fn, bfloat16, float16 or float32, got {k_cache.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            raise ValueError(f"{fn}(): {name} is on {t.device}, q on {q.device}")
    return fp8


def _softmax_scale(softmax_scale, hd: int, fn: str) -> float:
    """softmax_scale as a float (1 / sqrt(head_dim) for None): finite and positive once rounded to float32, the
    rule the CUDA kernel's binding applies, so that the reference refuses what the kernel refuses."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(hd)
    s = number(softmax_scale, fn, "softmax_scale", "must be finite and positive in float32")
    try:
        s32 = struct.unpack("f", struct.pack("f", s))[0]
    except OverflowError:
        s32 = math.inf
    if not (math.isfinite(s32) and s32 > 0.0):
        raise ValueError(f"{fn}(): softmax_scale must be finite and positive in float32, got {s!r}")
    return s


def decode_attention_reference(q, k_cache, v_cache, length: int, k_scale=None, v_scale=None,
                               softmax_scale: Optional[float] = None) -> torch.Tensor:
    """float32 reference: dequantize K/V [0, length) and compute softmax(q K^T * softmax_scale) V."""
    fp8 = _check(q, k_cache, v_cache, length, k_scale, v_scale, "decode_attention_reference")
    b, h, hd = q.shape
    scale = _softmax_scale(softmax_scale, hd, "decode_attention_reference")
    kv = k_cache.shape[1]
    k = k_cache[:, :, :length].float()
    v = v_cache[:, :, :length].float()
    if fp8:
        k = k * k_scale.view(1, kv, 1, 1)
        v = v * v_scale.view(1, kv, 1, 1)
    qg = q.float().view(b, kv, h // kv, hd)                          # query heads grouped by their K/V head
    scores = torch.einsum("bgqd,bgld->bgql", qg, k) * scale          # [b, kv, h/kv, length]
    p = torch.softmax(scores, dim=-1)
    out = torch.einsum("bgql,bgld->bgqd", p, v)
    return out.reshape(b, h, hd).to(q.dtype)


def decode_attention(q, k_cache, v_cache, length, k_scale=None, v_scale=None,
                     softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Attention of one query token per sequence over positions [0, length) of the cache (see the module
    docstring). Returns [batch, n_heads, head_dim] in q's dtype.

    length is an int, or (for a decode step captured in a CUDA graph) a one-element int64 tensor on q's GPU
    that the kernel reads when it runs: the work is then split as for the whole cache (max_len positions), a
    value above max_len counts as max_len, and one below 1 leaves nothing to attend (NaN out); nothing on the
    host can check it without a sync."""
    if isinstance(length, torch.Tensor):
        return _decode_attention_dev(q, k_cache, v_cache, length, k_scale, v_scale, softmax_scale)
    fp8 = _check(q, k_cache, v_cache, length, k_scale, v_scale)
    softmax_scale = _softmax_scale(softmax_scale, q.shape[-1], "decode_attention")
    if q.is_cuda and fp8 and not (q.requires_grad and torch.is_grad_enabled()):  # the kernel has no backward
        return _kernel(q, k_cache, v_cache, length, k_scale, v_scale, softmax_scale, None)
    return decode_attention_reference(q, k_cache, v_cache, length, k_scale, v_scale, softmax_scale)


def _decode_attention_dev(q, k_cache, v_cache, length, k_scale, v_scale, softmax_scale):
    max_len = k_cache.shape[2] if k_cache.dim() == 4 else 0
    fp8 = _check(q, k_cache, v_cache, max(max_len, 1), k_scale, v_scale)
    if not (q.is_cuda and fp8 and _C_has_cuda()):
        raise ValueError("decode_attention(): a tensor length (CUDA graphs) needs an FP8 cache on a GPU; give an "
                         "int otherwise")
    if length.dtype != torch.int64 or length.numel() != 1 or length.device != q.device:
        raise ValueError(f"decode_attention(): a tensor length must be one int64 element on {q.device}, got "
                         f"{length.dtype} {list(length.shape)} on {length.device}")
    if q.requires_grad and torch.is_grad_enabled():
        raise ValueError("decode_attention(): a tensor length runs the CUDA kernel, which computes no gradient")
    return _kernel(q, k_cache, v_cache, max_len, k_scale, v_scale, softmax_scale, length)


def _kernel(q, k_cache, v_cache, length: int, k_scale, v_scale, softmax_scale, length_dev):
    """The CUDA kernel over positions [0, length), or [0, min(length_dev, length)) when length_dev is a tensor."""
    b, h, hd = q.shape
    kv = k_cache.shape[1]
    if not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("decode_attention(): k_cache and v_cache must be contiguous on a GPU")
    scale = _softmax_scale(softmax_scale, hd, "decode_attention")
    splits = _splits(b, h, kv, length, q.device, _tensor_cores(hd, q.dtype))
    q = q.contiguous()
    out = torch.empty_like(q)
    workspace = torch.empty(b * h * splits * (hd + 2), dtype=torch.float32, device=q.device)
    _C.decode_attention(dl(q), dl_fp8(k_cache), dl_fp8(v_cache), dl(k_scale.contiguous()), dl(v_scale.contiguous()),
                        dl(out), dl(workspace), length, scale, splits, stream_of(q.device),
                        length_dev=None if length_dev is None else dl(length_dev))
    return out


def _C_has_cuda() -> bool:
    return bool(_C.WITH_CUDA)


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tensor_cores(hd: int, dtype) -> bool:
    """Whether the kernel takes its tensor-core path (csrc/kernels/decode_attention.cu): head_dim 64, 128 or 256
    and a bfloat16 or float16 query. A float32 query keeps float32 products throughout."""
    return hd in (64, 128, 256) and dtype in (torch.bfloat16, torch.float16)


def _splits(b: int, h: int, kv: int, length: int, device, tensor_cores: bool = False) -> int:
    """How many thread blocks share one K/V head's positions; each split costs a round trip through the
    workspace and a merge.

    Tensor-core path (no scores kept in shared memory; three blocks fit on a multiprocessor at head_dim 128,
    two at 256): at most two blocks
    per multiprocessor, all in one wave, and at least 256 positions per block. H100, 32k positions, 8 K/V heads:
    batch 8 193 us in 4 splits, 217 us in 8 (two waves), 236 us in 96; batch 1 48 us in 16-32 splits, 64 us in
    96; batch 32 722 us unsplit, 797 us in 96.

    Float path: at least length / (12288 / (h / kv)) (a block's scores sit in shared memory). With fewer
    (batch x K/V head) pairs than two per multiprocessor: enough blocks for 16 per multiprocessor (several
    waves, so the last one is a small part of the time), at least 768 positions per block (H100, 32k positions,
    8 K/V heads, batch 1: 59 us in 44 splits, 110 us in 264). With more, no further split (H100, batch 128,
    4 K/V heads, 1025 positions: 76 us unsplit, 96 us in 5 splits)."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if tensor_cores:
        return max(1, min(2 * sms // (b * kv), length // 256))
    least = -(-length // (12288 // (h // kv)))
    if b * kv >= 2 * sms:
        return least
    want = -(-16 * sms // (b * kv))
    splits = max(1, min(want, -(-length // 768)))
    return max(splits, least)
