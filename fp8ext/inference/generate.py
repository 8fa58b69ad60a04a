"""Greedy or sampled generation with fp8ext's transformer and a KV cache (bf16 or FP8), with timings; and the
loss of a teacher-forced decode through a KV cache (what the cache costs in perplexity)."""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from .kv_cache import KVCache

__all__ = ["generate", "decode_loss"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, kv_cache: Optional[str] = "fp8",
             kv_scales: str = "auto", temperature: float = 0.0, seed: int = 0) -> Tuple[torch.Tensor, dict]:
    """(ids [batch, prompt + new], stats): prefill the prompt once, then one token per step (greedy when
    temperature == 0). kv_cache: "fp8", "bf16", or None (no cache: the whole sequence recomputed every step,
    the reference the cached paths are tested against). kv_scales, for an FP8 cache: "auto" (the model's
    calibrated K/V scales when it carries them, else from the prefill), "calibrated" (required) or "prefill".
    stats: prefill and decode tokens/s, cache bytes, and kv_scales: where the FP8 cache's scales came from
    ("calibrated" or "prefill"; None without an FP8 cache)."""
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: prompt must be [batch, length > 0] token ids, got shape {list(prompt.shape)}")
    device = prompt.device
    b, n = prompt.shape
    total = n + max_new_tokens
    cache = None if kv_cache is None else KVCache.from_model(model, b, total, kv_cache, device=device,
                                                             scales=kv_scales)
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
             if max_new_tokens > 1 else None, "kv_cache": kv_cache, "cache_bytes": cache.nbytes if cache else 0,
             "kv_scales": cache.scale_source if cache else None}
    return ids, stats


@torch.no_grad()
def decode_loss(model, ids: torch.Tensor, targets: torch.Tensor, *, kv_cache: Optional[str] = "fp8",
                prompt_len: int = 1, kv_scales: str = "auto") -> float:
    """Mean cross-entropy of `targets` [batch, n] given `ids` [batch, n], computed the way generation reads the
    cache: the first prompt_len tokens in one prefill, then one true token per decode step through a KV cache
    ("fp8" or "bf16"; kv_scales as in generate). kv_cache=None: one forward over the whole sequence (equal to
    model(ids, targets)[1] up to rounding). Positions of the prefill count too, so the figure compares with the
    model's ordinary loss; a short prompt makes almost every position a decode step."""
    if ids.dim() != 2 or targets.shape != ids.shape:
        raise ValueError(f"decode_loss: ids and targets must both be [batch, n], got {list(ids.shape)} and "
                         f"{list(targets.shape)}")
    b, n = ids.shape
    if not 1 <= prompt_len <= n:
        raise ValueError(f"decode_loss: prompt_len must be in [1, {n}], got {prompt_len}")
    if kv_cache is None:
        logits = model(ids)
    else:
        cache = KVCache.from_model(model, b, n, kv_cache, device=ids.device, scales=kv_scales)
        steps = [model(ids[:, :prompt_len], kv_cache=cache, start_pos=0)]
        steps += [model(ids[:, t:t + 1], kv_cache=cache, start_pos=t) for t in range(prompt_len, n)]
        logits = torch.cat(steps, dim=1)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()
