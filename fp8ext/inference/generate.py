"""Greedy or sampled generation with fp8ext's transformer and a KV cache (bf16 or FP8), with timings."""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from .kv_cache import KVCache

__all__ = ["generate"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, kv_cache: Optional[str] = "fp8",
             temperature: float = 0.0, seed: int = 0) -> Tuple[torch.Tensor, dict]:
    """(ids [batch, prompt + new], stats): prefill the prompt once, then one token per step (greedy when
    temperature == 0). kv_cache: "fp8", "bf16", or None (no cache: the whole sequence recomputed every step,
    the reference the cached paths are tested against). stats: prefill and decode tokens/s, cache bytes."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: prompt must be [batch, length > 0] token ids, got shape {list(prompt.shape)}")
    device = prompt.device
    b, n = prompt.shape
    total = n + max_new_tokens
    cache = None if kv_cache is None else KVCache(model.cfg, b, total, kv_cache, device=device)
    g = torch.Generator(device=device).manual_seed(seed)

    def pick(logits):
        if temperature <= 0:
            return logits.argmax(-1, keepdim=True)
        return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=g)

    ids = prompt
    _sync(device)
    t0 = time.perf_counter()
    logits = model(ids, kv_cache=cache, start_pos=0)[:, -1]
    _sync(device)
    t1 = time.perf_counter()
    for pos in range(n, total):
        nxt = pick(logits)
        ids = torch.cat([ids, nxt], dim=1)
        if pos + 1 == total:
            break
        logits = (model(nxt, kv_cache=cache, start_pos=pos) if cache is not None else model(ids))[:, -1]
    _sync(device)
    t2 = time.perf_counter()
    stats = {"prefill_tokens_per_s": b * n / (t1 - t0), "decode_tokens_per_s": b * (max_new_tokens - 1) / (t2 - t1)
             if max_new_tokens > 1 else None, "kv_cache": kv_cache, "cache_bytes": cache.nbytes if cache else 0}
    return ids, stats
