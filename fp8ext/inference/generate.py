"""Greedy or sampled generation with fp8ext's transformer and a KV cache (bf16 or FP8), with timings (with a draft
model, speculative decoding: fp8ext/inference/speculative.py); and the loss of a teacher-forced decode through a KV
cache (what the cache costs in perplexity)."""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from .hf import is_transformers_model
from .kv_cache import KVCache
from ._graphs import GraphedStep as _GraphedStep, graph_wanted as _graph_wanted  # noqa: F401 (tests use _GraphedStep)
from .speculative import _HFCache, _HFRunner, _hf_causal_lm, speculative_generate

__all__ = ["generate", "decode_loss"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_model(model, fn: str) -> None:
    """fp8ext's generation drives fp8ext's Transformer (its KV cache follows model.cfg); decode_loss only that,
    generate also transformers causal LMs; others are refused."""
    if fn == "generate" and _hf_causal_lm(model):
        return
    if is_transformers_model(model) or not hasattr(model, "cfg"):
        hint = " (a transformers model: decode_loss takes fp8ext's Transformer only)" \
            if is_transformers_model(model) and fn != "generate" else ""
        what = "fp8ext's Transformer (fp8ext.models.transformer)" + \
            (" or a transformers causal LM" if fn == "generate" else "")
        raise TypeError(f"{fn}: model must be {what}, got {type(model).__name__}{hint}")


def _hf_generate_args(kv_cache, kv_overflow, cuda_graph) -> None:
    """What generate refuses with a transformers model (its steps run eagerly through transformers' caches)."""
    if kv_overflow is not None:
        raise ValueError(f"generate: kv_overflow={kv_overflow!r} is not available with transformers models")
    if cuda_graph:
        raise ValueError("generate: cuda_graph=True is not available with transformers models (their steps run "
                         "eagerly); leave it None")
    if kv_cache not in ("fp8", "bf16", None):
        raise ValueError(f"generate: kv_cache must be 'fp8', 'bf16' or None, got {kv_cache!r}")


def _picker(temperature: float, generator: torch.Generator):
    """The next-token choice from logits [batch, vocab]: argmax (temperature 0) or a sample at `temperature`."""
    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(-1, keepdim=True)
        return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)
    return pick


def _decode(model, ids: torch.Tensor, logits: torch.Tensor, total: int, pick, *, cache, graph) -> torch.Tensor:
    """ids extended one token per step to `total` positions, from the prefill's last logits: through the cache
    (eagerly or as the captured graph), or without one by recomputing the whole sequence each step."""
    for pos in range(ids.shape[1], total):
        nxt = pick(logits)
        ids = torch.cat([ids, nxt], dim=1)
        if pos + 1 == total:
            break
        if graph is not None:
            logits = graph(nxt, pos)
        else:
            logits = (model(nxt, kv_cache=cache, start_pos=pos) if cache is not None else model(ids))[:, -1]
    return ids


def _check_overflow(kv_cache: Optional[str], kv_overflow: Optional[str], kv_budget_bytes: Optional[int],
                    fn: str) -> None:
    """kv_overflow and kv_budget_bytes go together, and with a KV cache (KVCache checks their values)."""
    if (kv_overflow is None) != (kv_budget_bytes is None):
        raise ValueError(f"{fn}: kv_overflow and kv_budget_bytes go together, got kv_overflow={kv_overflow!r}, "
                         f"kv_budget_bytes={kv_budget_bytes!r}")
    if kv_overflow is not None and kv_cache is None:
        raise ValueError(f"{fn}: kv_overflow={kv_overflow!r} needs a KV cache (kv_cache='fp8'), got kv_cache=None")


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, kv_cache: Optional[str] = "fp8",
             kv_scales: str = "auto", temperature: float = 0.0, seed: int = 0,
             cuda_graph: Optional[bool] = None, draft=None, speculate: Optional[int] = None,
             kv_overflow: Optional[str] = None, kv_budget_bytes: Optional[int] = None) -> Tuple[torch.Tensor, dict]:
    """(ids [batch, prompt + new], stats): prefill the prompt once, then one token per step (greedy when
    temperature == 0). kv_cache: "fp8", "bf16", or None (no cache: the whole sequence recomputed every step,
    the reference the cached paths are tested against). kv_scales, for an FP8 cache: "auto" (the model's
    calibrated K/V scales when it carries them, else from the prefill), "calibrated" (required) or "prefill".
    cuda_graph: run the decode steps as one captured CUDA graph, replayed per token (no host work per layer,
    which otherwise bounds a decode step's speed); None: whenever possible, i.e. an FP8 cache on a GPU (a bf16
    cache's attention has shapes that grow with the context; it runs eagerly); True where impossible raises.
    stats: prefill and decode tokens/s (the graph's warm-up and capture counted in the decode time), cache
    bytes, kv_scales (where the FP8 cache's scales came from: "calibrated" or "prefill"; None without an FP8
    cache) and cuda_graph (whether decode steps ran as a graph).

    draft: speculative decoding (fp8ext.inference.speculative): the draft model (make_draft(model, "mxfp4"), or
    any fp8ext Transformer with the same vocabulary) proposes `speculate` tokens per round (default 4), the model
    checks them in one forward; greedy output is the model's own, sampling keeps its distribution. stats then also
    hold the acceptance rate (see speculative_generate).

    kv_overflow="nvfp4" with kv_budget_bytes: an FP8 cache whose oldest positions move to NVFP4 to stay within the
    budget (KVCache's overflow and budget_bytes; decode steps run eagerly; not with a draft).

    A transformers causal LM (LlamaForCausalLM and the like) decodes the same way through transformers' own KV
    caches: kv_cache "bf16" is its DynamicCache (K/V in the model's dtype), "fp8" fp8ext.inference.hf.fp8_kv_cache
    (K/V rounded to E4M3, kv_scales as above), None none; its steps run eagerly (no cuda_graph, no kv_overflow), and,
    as with fp8ext's model, exactly max_new_tokens tokens come out (an end-of-sequence token stops nothing). With a
    draft (make_draft(model, fmt) of it) it decodes speculatively."""
    _check_model(model, "generate")
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: prompt must be [batch, length > 0] token ids, got shape {list(prompt.shape)}")
    _check_overflow(kv_cache, kv_overflow, kv_budget_bytes, "generate")
    if draft is not None or speculate is not None:
        if draft is None:
            raise ValueError(f"generate: speculate={speculate!r} needs a draft model (draft=make_draft(model))")
        if kv_overflow is not None:
            raise ValueError(f"generate: kv_overflow={kv_overflow!r} is not available with a draft model")
        return speculative_generate(model, draft, prompt, max_new_tokens, speculate=4 if speculate is None else
                                    speculate, kv_cache=kv_cache, kv_scales=kv_scales, temperature=temperature,
                                    seed=seed, cuda_graph=cuda_graph)
    b, n = prompt.shape
    model, cache, graph = _decoder(model, b, n + max_new_tokens, prompt.device, kv_cache=kv_cache,
                                   kv_scales=kv_scales, cuda_graph=cuda_graph, kv_overflow=kv_overflow,
                                   kv_budget_bytes=kv_budget_bytes)
    pick = _picker(temperature, torch.Generator(device=prompt.device).manual_seed(seed))
    ids, (t_prefill, t_decode) = _timed_generation(model, prompt, max_new_tokens, pick, cache, graph)
    stats = {"prefill_tokens_per_s": b * n / t_prefill, "decode_tokens_per_s": b * (max_new_tokens - 1) / t_decode
             if max_new_tokens > 1 else None, "kv_cache": kv_cache, "cache_bytes": cache.nbytes if cache else 0,
             "kv_scales": cache.scale_source if cache else None,
             "cuda_graph": graph is not None and graph.graph is not None}
    return ids, stats


def _decoder(model, b: int, total: int, device: torch.device, *, kv_cache, kv_scales, cuda_graph, kv_overflow,
             kv_budget_bytes):
    """(what to call, the KV cache or None, the captured decode step or None) for generate: a transformers model
    runs through _HFRunner and its own caches (eagerly); fp8ext's Transformer through a KVCache of `total`
    positions, its decode steps as one CUDA graph where generate's cuda_graph asks for it."""
    if is_transformers_model(model):
        _hf_generate_args(kv_cache, kv_overflow, cuda_graph)
        cache = None if kv_cache is None else _HFCache(model, kv_cache, kv_scales, rollback=False)
        return _HFRunner(model), cache, None
    cache = None if kv_cache is None else KVCache.from_model(model, b, total, kv_cache, device=device,
                                                             scales=kv_scales, overflow=kv_overflow,
                                                             budget_bytes=kv_budget_bytes)
    graph = _GraphedStep(model, cache, b, device) \
        if _graph_wanted(cuda_graph, kv_cache, device, "generate", kv_overflow) else None
    return model, cache, graph


def _timed_generation(model, prompt: torch.Tensor, max_new_tokens: int, pick, cache, graph):
    """(ids, (prefill seconds, decode seconds)): the prompt's prefill, then the decode steps to max_new_tokens
    new tokens, each phase timed between device synchronisations."""
    device = prompt.device
    _sync(device)
    t0 = time.perf_counter()
    logits = model(prompt, kv_cache=cache, start_pos=0)[:, -1]
    _sync(device)
    t1 = time.perf_counter()
    ids = _decode(model, prompt, logits, prompt.shape[1] + max_new_tokens, pick, cache=cache, graph=graph)
    _sync(device)
    return ids, (t1 - t0, time.perf_counter() - t1)


@torch.no_grad()
def decode_loss(model, ids: torch.Tensor, targets: torch.Tensor, *, kv_cache: Optional[str] = "fp8",
                prompt_len: int = 1, kv_scales: str = "auto", cuda_graph: Optional[bool] = None,
                kv_overflow: Optional[str] = None, kv_budget_bytes: Optional[int] = None) -> float:
    """Mean cross-entropy of `targets` [batch, n] given `ids` [batch, n], computed the way generation reads the
    cache: the first prompt_len tokens in one prefill, then one true token per decode step through a KV cache
    ("fp8" or "bf16"; kv_scales as in generate). kv_cache=None: one forward over the whole sequence (equal to
    model(ids, targets)[1] up to rounding). Positions of the prefill count too, so the figure compares with the
    model's ordinary loss; a short prompt makes almost every position a decode step. cuda_graph, kv_overflow and
    kv_budget_bytes as in generate (the cache holds n positions)."""
    _check_model(model, "decode_loss")
    if ids.dim() != 2 or targets.shape != ids.shape:
        raise ValueError(f"decode_loss: ids and targets must both be [batch, n], got {list(ids.shape)} and "
                         f"{list(targets.shape)}")
    b, n = ids.shape
    if not 1 <= prompt_len <= n:
        raise ValueError(f"decode_loss: prompt_len must be in [1, {n}], got {prompt_len}")
    _check_overflow(kv_cache, kv_overflow, kv_budget_bytes, "decode_loss")
    if kv_cache is None:
        logits = model(ids)
    else:
        cache = KVCache.from_model(model, b, n, kv_cache, device=ids.device, scales=kv_scales,
                                   overflow=kv_overflow, budget_bytes=kv_budget_bytes)
        steps = [model(ids[:, :prompt_len], kv_cache=cache, start_pos=0)]
        if _graph_wanted(cuda_graph, kv_cache, ids.device, "decode_loss", kv_overflow):
            graph = _GraphedStep(model, cache, b, ids.device)
            steps += [graph(ids[:, t:t + 1], t)[:, None].clone() for t in range(prompt_len, n)]
        else:
            steps += [model(ids[:, t:t + 1], kv_cache=cache, start_pos=t) for t in range(prompt_len, n)]
        logits = torch.cat(steps, dim=1)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()
