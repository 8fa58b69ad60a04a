"""A KV cache for generation with fp8ext's transformer, in bf16 or in FP8 (E4M3) with per-head scales.

FP8 storage halves the cache's memory: K and V are kept as E4M3 bytes, each KV head with its own scale
(k_scale / v_scale [n_kv_heads], which dequantize, as in compressed-tensors checkpoints). The scales are given
(from calibration) or set from the prompt: max|K| and max|V| of each head over the prefill, with a margin of
one binade for later tokens; values beyond saturate. Attention runs on the dequantized cache through SDPA on the
CPU; a decode-attention kernel that reads the FP8 bytes directly is not written yet, so the bytes are
dequantized per step here (the memory held between steps is the FP8 cache).

    cache = KVCache(model.cfg, batch=1, max_len=1024, dtype="fp8")
    logits = model(prompt, kv_cache=cache, start_pos=0)           # prefill
    logits = model(next_token, kv_cache=cache, start_pos=n)       # one decode step
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..formats import E4M3
from ..ops import dequantize, quantize

__all__ = ["KVCache"]


class KVCache:
    def __init__(self, cfg, batch: int, max_len: int, dtype: str = "fp8", device=None,
                 k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                 margin: float = 1.0):
        if dtype not in ("fp8", "bf16"):
            raise ValueError(f"KVCache: dtype must be 'fp8' or 'bf16', got {dtype!r}")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"KVCache: max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        self.cfg, self.dtype, self.max_len, self.margin = cfg, dtype, max_len, margin
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        store = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
        self.k = torch.empty(shape, dtype=store, device=device)
        self.v = torch.empty(shape, dtype=store, device=device)
        self._lengths = [0] * cfg.n_layers  # positions stored per layer
        self.k_scale = None if k_scale is None else k_scale.float().reshape(-1).to(device)
        self.v_scale = None if v_scale is None else v_scale.float().reshape(-1).to(device)
        self._k_scales = [self.k_scale] * cfg.n_layers  # per layer: [n_kv_heads] dequantizing scales
        self._v_scales = [self.v_scale] * cfg.n_layers

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's K and V storage."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def _scale_from(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head dequantizing scale from x [b, kv, s, hd]: max|x| * 2^margin / 448 (1 for a zero head)."""
        amax = x.float().abs().amax(dim=(0, 2, 3))
        return torch.where(amax > 0, amax * 2.0 ** self.margin / E4M3.max, torch.ones_like(amax))

    def _store(self, buf: torch.Tensor, x: torch.Tensor, scale: Optional[torch.Tensor], pos: int) -> None:
        s = x.shape[2]
        if self.dtype == "bf16":
            buf[:, :, pos:pos + s] = x.to(torch.bfloat16)
            return
        # q = fp8(x / scale): the division rounded to float32 first, then E4M3 (fp8ext.quantize's convention)
        scaled = (x.float() / scale[None, :, None, None]).contiguous()
        buf[:, :, pos:pos + s] = quantize(scaled, E4M3, 1.0)

    def _load(self, buf: torch.Tensor, scale: Optional[torch.Tensor], end: int, dtype: torch.dtype) -> torch.Tensor:
        part = buf[:, :, :end]
        if self.dtype == "bf16":
            return part.to(dtype)
        x = dequantize(part.contiguous(), 1.0, torch.float32)
        return (x * scale[None, :, None, None]).to(dtype)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v [b, n_kv_heads, s, head_dim] at positions start_pos .. start_pos + s of `layer` and returns
        the whole cached K and V up to there, dequantized, in k's dtype."""
        s = k.shape[2]
        if start_pos != self._lengths[layer]:
            raise ValueError(f"KVCache.update: layer {layer} holds {self._lengths[layer]} positions; "
                             f"start_pos {start_pos} must continue it")
        if start_pos + s > self.max_len:
            raise ValueError(f"KVCache: {start_pos + s} positions exceed max_len {self.max_len}")
        if self.dtype == "fp8" and self._k_scales[layer] is None:  # from the prompt, once
            self._k_scales[layer], self._v_scales[layer] = self._scale_from(k), self._scale_from(v)
        self._store(self.k[layer], k, self._k_scales[layer], start_pos)
        self._store(self.v[layer], v, self._v_scales[layer], start_pos)
        self._lengths[layer] = start_pos + s
        end = start_pos + s
        return (self._load(self.k[layer], self._k_scales[layer], end, k.dtype),
                self._load(self.v[layer], self._v_scales[layer], end, v.dtype))

    def scales(self, layer: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(k_scale, v_scale) [n_kv_heads] of `layer` (None before the prefill sets them, or for bf16)."""
        return self._k_scales[layer], self._v_scales[layer]
