"""Speculative decoding with a low-precision draft of the same model: make_draft, and the decode loop that
fp8ext.inference.generate runs when it is given a draft. Not here: the prefill-only and plain decoding paths
(generate.py), the KV cache (kv_cache.py), the weight-only layers (fp8ext/lowp/weight_only.py).

A round: the draft proposes k tokens, one forward each over its own KV cache; the target scores the k tokens (and
the last accepted token before them) in one forward over its KV cache; the longest prefix of the proposal the
target accepts is kept, followed by one token of the target's own (the correction at the first rejection, or a
bonus token when all k are accepted); both caches forget the positions after what was kept (KVCache.truncate).

- Greedy (temperature 0): a draft token is accepted when it is the target's argmax, so the output is the target's
  greedy output (up to floating-point ties: the verification computes k + 1 positions in one forward, whose
  logits may differ from one-token steps in the last bits).
- temperature > 0: speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x, drawn from the
  draft's q, is accepted with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from
  norm(max(0, p - q)); each emitted token is then distributed as the target's p given the tokens before it.

A batch shares one cache length (KVCache keeps one length per layer, not per sequence), so a round keeps the
smallest accepted count j over the batch: every sequence keeps its first j draft tokens, then at position j a
sequence that accepted more keeps its (accepted) draft token, the others their correction or bonus token. Each
sequence's tokens stay distributed as the target's: a round stops at a position chosen from the past (and from
other sequences' independent draws), and the next round draws that position's successor from p again.

The draft's one-token steps run as a CUDA graph where generate's decode steps would (an FP8 cache on a GPU; see
fp8ext.inference._graphs): on a small model a step's launches, not its weight bytes, bound its time. The target's
verification (k + 1 positions) and the draft's catch-up (one or two) run eagerly.

transformers causal LMs (LlamaForCausalLM and the like) take the same rounds: make_draft copies one with its
decoder's linear layers held in the draft format, and generate drives both models through transformers' own KV
caches (a DynamicCache, or fp8ext.inference.hf.fp8_kv_cache's E4M3-rounded one), rolled back with their crop().
Their steps run eagerly.
"""

from __future__ import annotations

import copy
import itertools
import time
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..modules.linear import FP8Linear
from ..lowp.weight_only import WEIGHT_ONLY_FORMATS, WeightOnlyLinear
from .hf import cache_argument, fp8_kv_cache, is_transformers_model
from ._graphs import GraphedStep, graph_wanted
from .kv_cache import KVCache
from .layers import FP8InferenceLinear

__all__ = ["make_draft", "accept_sampled", "residual", "next_tokens", "speculative_generate"]

_LINEARS = (nn.Linear, FP8Linear, FP8InferenceLinear)


class _DraftLinear(WeightOnlyLinear):
    """A WeightOnlyLinear that takes the transformer's is_first_microbatch keyword (and ignores it), as
    FP8InferenceLinear does, so it stands in for the blocks' fp8ext.Linear layers."""

    def forward(self, x: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        return super().forward(x)


def _fp8_inference_weight(layer: FP8InferenceLinear) -> torch.Tensor:
    """The float32 weight an FP8InferenceLinear stands for: E4M3 bytes times its dequantizing weight_scale (one,
    per output row [out, 1], or per 128 x 128 block)."""
    scale = layer.weight_scale
    if layer.weights == "block128":
        scale = scale.repeat_interleave(128, 0)[:layer.out_features].repeat_interleave(128, 1)[:, :layer.in_features]
    return layer.weight.float() * scale


def _weight_only(layer: nn.Module, fmt: str, name: str) -> WeightOnlyLinear:
    src = layer
    if isinstance(layer, FP8InferenceLinear):  # an FP8 checkpoint's layer: its dequantized weight is the source
        src = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        src.weight = nn.Parameter(_fp8_inference_weight(layer), requires_grad=False)
        if layer.bias is not None:
            src.bias = nn.Parameter(layer.bias.float(), requires_grad=False)
    w = getattr(src, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.element_size() < 2:
        raise ValueError(f"make_draft: {name} ({type(layer).__name__}) holds {getattr(w, 'dtype', None)} weights, "
                         f"not a high-precision weight to pack (a checkpoint quantized by another library: draft "
                         f"from the high-precision model, or load the checkpoint with fp8ext.inference)")
    try:
        return _DraftLinear.from_linear(src, fmt)
    except ValueError as e:
        raise ValueError(f"make_draft: {name} cannot be held as {fmt}: {e}") from e


def _block_linears(model: nn.Module) -> Dict[str, nn.Module]:
    """{qualified name: layer} of the linear layers inside model.blocks (the projections; not the embedding or
    the output head)."""
    return {f"blocks.{n}": m for n, m in model.blocks.named_modules() if isinstance(m, _LINEARS)}


def _hf_linears(model: nn.Module) -> Dict[str, nn.Module]:
    """{qualified name: layer} of a transformers causal LM's linear layers but its output head."""
    head = model.get_output_embeddings()
    return {n: m for n, m in model.named_modules() if isinstance(m, _LINEARS) and m is not head}


def _hf_causal_lm(model) -> bool:
    """Whether `model` is a transformers model with an output head (a causal LM's logits)."""
    return is_transformers_model(model) and callable(getattr(model, "get_output_embeddings", None)) and \
        model.get_output_embeddings() is not None


def _refuse_stateful(model, fn: str) -> None:
    """Models with recurrent state (Mamba, hybrids) cannot roll their caches back by positions."""
    if getattr(model, "_is_stateful", False):
        raise TypeError(f"{fn}: {type(model).__name__} keeps a recurrent state, which speculative decoding cannot "
                        "roll back; attention-only causal LMs are supported")


@torch.no_grad()
def make_draft(model: nn.Module, fmt: str = "mxfp4") -> nn.Module:
    """A draft model for speculative decoding: a copy of fp8ext's Transformer `model` whose blocks' linear layers
    (fp8ext.Linear, nn.Linear, or FP8InferenceLinear after quantize_model) are WeightOnlyLinear layers in `fmt`
    ("mxfp4", "nvfp4", "mxfp6", "fp8", or another of fp8ext.weight_only.WEIGHT_ONLY_FORMATS), packed from the
    target's weights. Everything else (the embedding, the norms, the output head, the rotary tables, the KV-cache
    scales) is the target's own tensors, shared, not copied: the draft adds only its packed weights
    (WeightOnlyLinear.nbytes each). The target is left unchanged.
    A transformers causal LM (LlamaForCausalLM and the like) gives a copy of its class in the same way: every
    linear layer but the output head (get_output_embeddings()) held in `fmt`, the rest shared."""
    hf = is_transformers_model(model)
    if hf and not _hf_causal_lm(model):
        kind = getattr(getattr(model, "config", None), "model_type", None)
        raise TypeError(f"make_draft: {type(model).__name__} (model_type {kind!r}) is a transformers model without "
                        "an output head (get_output_embeddings()); drafts are made of causal LMs")
    if not hf and (not hasattr(model, "cfg") or not isinstance(getattr(model, "blocks", None), nn.ModuleList)):
        raise TypeError(f"make_draft: model must be fp8ext's Transformer (fp8ext.models.transformer) or a "
                        f"transformers causal LM, got {type(model).__name__}")
    if hf:
        _refuse_stateful(model, "make_draft")
    if fmt not in WEIGHT_ONLY_FORMATS:
        raise ValueError(f"make_draft: fmt must be one of {list(WEIGHT_ONLY_FORMATS)}, got {fmt!r}")
    linears = _hf_linears(model) if hf else _block_linears(model)
    if not linears:
        raise ValueError("make_draft: the model holds no linear layer to quantize" + ("" if hf else
                         " in model.blocks"))
    # deepcopy's memo maps an object to its copy: every tensor and every layer to be replaced maps to itself, so
    # the copy shares the tensors and copies no weight that is then thrown away
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    memo.update({id(m): m for m in linears.values()})
    draft = copy.deepcopy(model, memo)
    for name, layer in linears.items():
        parent, _, leaf = name.rpartition(".")
        setattr(draft.get_submodule(parent), leaf, _weight_only(layer, fmt, name))
    draft.draft_format = fmt
    return draft


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) along the last dimension: where a token is drawn after a rejection. Where p <= q
    everywhere (a rejection then has probability 0; it can happen only by rounding) p itself."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


def accept_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                   generator: Optional[torch.Generator]) -> torch.Tensor:
    """How many of each sequence's draft tokens the target accepts, [batch] int64: token i (drafts [batch, k],
    drawn from q [batch, k, vocab]) is accepted with probability min(1, p_i(x) / q_i(x)) (p [batch, >= k, vocab]
    the target's probabilities), and the count stops at the first rejection."""
    pd = p[:, :drafts.shape[1]].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    u = torch.rand(drafts.shape, generator=generator, device=drafts.device, dtype=p.dtype)
    ok = u * qd < pd  # u < p / q without dividing; q > 0 where the draft drew
    return ok.long().cumprod(1).sum(1)


def next_tokens(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, accepted: torch.Tensor, *, j: int,
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """The token each sequence emits at position j of the round, [batch, 1], given its accepted count (>= j): its
    draft token where it accepted more than j, else a bonus token from p_j (j == k) or a draw from
    residual(p_j, q_j) (rejected at j). p [batch, k + 1, vocab], q [batch, k, vocab] probabilities."""
    k = drafts.shape[1]
    dist = p[:, j] if j == k else residual(p[:, j], q[:, j])
    drawn = torch.multinomial(dist, 1, generator=generator)
    return drawn if j == k else torch.where(accepted[:, None] > j, drafts[:, j:j + 1], drawn)


def _cached(cache: KVCache) -> int:
    return min(cache.lengths)


def _return_visible_only(layer) -> None:
    """Makes a past-recording DynamicSlidingWindowLayer's update return only the last sliding_window - 1 + q
    positions (q: the new ones), the K/V its get_mask_sizes tells the attention mask of. transformers 5.24 slices
    so itself; 5.17 returns every position recorded since the last crop, which is more than the mask covers (and
    sdpa fails on the shapes) once two forwards run without a crop between them, as the draft's steps do."""
    inner = layer.update

    def update(key_states, value_states, *args, **kwargs):
        k, v = inner(key_states, value_states, *args, **kwargs)
        n = layer.sliding_window - 1 + key_states.shape[-2]
        return k[..., -n:, :], v[..., -n:, :]
    layer.update = update


class _HFCache:
    """A transformers cache as the rounds use a KVCache: lengths, truncate (crop), nbytes, scale_source.
    kv_cache "bf16": transformers' DynamicCache (K/V in the model's dtype); "fp8": fp8_kv_cache(model, scales=...)
    (K/V rounded to E4M3, held in the model's dtype). rollback: the cache is cropped back (speculative rounds), so
    its sliding-window layers record the positions past their window until a crop; without it (plain decoding)
    they drop them at once, as in transformers' own generate."""

    def __init__(self, model, kv_cache: str, scales: str, *, rollback: bool = True):
        import transformers
        from transformers.cache_utils import DynamicSlidingWindowLayer
        self.cache = fp8_kv_cache(model, scales=scales) if kv_cache == "fp8" else \
            transformers.DynamicCache(config=model.config)
        sliding = [layer for layer in getattr(self.cache, "layers", ()) if isinstance(layer, DynamicSlidingWindowLayer)]
        if rollback and sliding:
            if not hasattr(self.cache, "activate_past_recording"):
                raise RuntimeError(f"generate: transformers {transformers.__version__}'s DynamicCache cannot record "
                                   f"the positions its sliding-window layers drop (no activate_past_recording), so "
                                   f"speculative decoding cannot roll {type(model).__name__}'s cache back")
            self.cache.activate_past_recording()  # sliding-window layers keep what a roll-back needs
            for layer in sliding:
                _return_visible_only(layer)
        self.scale_source = getattr(self.cache, "scale_source", None)

    @property
    def lengths(self):
        return [self.cache.get_seq_length()]

    def truncate(self, n: int) -> None:
        # a negative count: the number of positions to remove (transformers 5.24 takes no other form); called with
        # 0 too, which trims what sliding-window layers recorded past their window
        self.cache.crop(-max(self.cache.get_seq_length() - n, 0))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in getattr(self.cache, "layers", ())
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                   if isinstance(t, torch.Tensor))


class _HFRunner:
    """A transformers causal LM called as the rounds call fp8ext's Transformer: (ids, kv_cache=, start_pos=) ->
    logits [batch, len(ids), vocab]. Positions follow the cache's length, which the rounds keep at start_pos."""

    def __init__(self, model):
        self.model, self.arg = model, cache_argument(model)

    def __call__(self, ids: torch.Tensor, *, kv_cache: Optional[_HFCache] = None, start_pos: int = 0) -> torch.Tensor:
        if kv_cache is None:  # the whole sequence, no cache
            return self.model(input_ids=ids, use_cache=False).logits
        return self.model(input_ids=ids, use_cache=True, **{self.arg: kv_cache.cache}).logits


def _vocab(model) -> int:
    return model.get_output_embeddings().weight.shape[0] if is_transformers_model(model) else model.cfg.vocab_size


def _propose(draft, cache: KVCache, ids: torch.Tensor, pending: Optional[torch.Tensor], *, k: int,
             pick, step: Optional[GraphedStep]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(k draft tokens [b, k], the draft's logits they were picked from [b, k, vocab]). The draft first reads the
    tokens of ids its cache lacks (one or two), or uses `pending` (its logits for the next position) when it
    lacks none; then one token per step, through `step` (the draft's captured decode step) when given."""
    start = _cached(cache)
    logits = pending if start == ids.shape[1] else draft(ids[:, start:], kv_cache=cache, start_pos=start)[:, -1]
    tokens, seen = [], []
    for i in range(k):
        if i and step is not None:
            logits = step(tokens[-1], ids.shape[1] + i - 1).clone()  # the graph's output is overwritten next step
        elif i:
            logits = draft(tokens[-1], kv_cache=cache, start_pos=ids.shape[1] + i - 1)[:, -1]
        seen.append(logits)
        tokens.append(pick(logits))
    return torch.cat(tokens, 1), torch.stack(seen, 1)


def _score(model, cache: KVCache, ids: torch.Tensor, drafts: torch.Tensor, *,
           pending: Optional[torch.Tensor]) -> torch.Tensor:
    """The target's logits [b, k + 1, vocab] for positions L .. L + k (L = ids' length): one forward over the
    last accepted token (when the cache lacks it) and the k draft tokens; `pending` is its logits for position L
    when the cache already holds all of ids."""
    start = _cached(cache)
    chunk = torch.cat([ids[:, start:], drafts], 1)
    if chunk.shape[1] == 0:
        return pending[:, None]
    out = model(chunk, kv_cache=cache, start_pos=start)
    if pending is not None:
        out = torch.cat([pending[:, None], out], 1)
    return out[:, -(drafts.shape[1] + 1):]


def _check(model, draft, *, speculate: int, kv_cache: Optional[str], cuda_graph: Optional[bool]) -> None:
    if is_transformers_model(model):
        if not _hf_causal_lm(model):
            raise TypeError(f"generate: model {type(model).__name__} is a transformers model without an output head "
                            "(get_output_embeddings()); speculative decoding needs a causal LM")
        if not _hf_causal_lm(draft):
            raise TypeError(f"generate: with a transformers model the draft must be a transformers causal LM too "
                            f"(make_draft(model, fmt) makes one), got {type(draft).__name__}")
        _refuse_stateful(model, "generate")
        _refuse_stateful(draft, "generate")
        if kv_cache is not None and kv_cache not in ("fp8", "bf16"):
            raise ValueError(f"generate: kv_cache must be 'fp8' or 'bf16', got {kv_cache!r}")
        if cuda_graph:
            raise ValueError("generate: cuda_graph=True is not available with transformers models (their steps run "
                             "eagerly); leave it None")
    elif is_transformers_model(draft) or not hasattr(draft, "cfg"):
        raise TypeError(f"generate: draft must be fp8ext's Transformer (make_draft(model, fmt) makes one), got "
                        f"{type(draft).__name__}")
    if _vocab(draft) != _vocab(model):
        raise ValueError(f"generate: the draft's vocabulary ({_vocab(draft)} tokens) must be the model's "
                         f"({_vocab(model)})")
    if isinstance(speculate, bool) or not isinstance(speculate, int) or speculate < 1:
        raise ValueError(f"generate: speculate (draft tokens per round) must be an int >= 1, got {speculate!r}")
    if kv_cache is None:
        raise ValueError("generate: speculative decoding (draft=) reads and rolls back KV caches: kv_cache must be "
                         "'fp8' or 'bf16', got None")


def _round(models, caches, ids: torch.Tensor, pending, *, k: int, temperature: float, g: torch.Generator,
           step: Optional[GraphedStep]) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """One round: (ids with the kept tokens appended, each sequence's accepted count [b], the count kept j)."""
    def pick(logits):  # the draft's token: as generate picks without a draft
        if temperature <= 0:
            return logits.argmax(-1, keepdim=True)
        return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=g)
    (model, draft), (b, n) = models, ids.shape
    if k:
        drafts, q_logits = _propose(draft, caches[1], ids, pending[1], k=k, pick=pick, step=step)
    else:
        drafts, q_logits = ids.new_empty(b, 0), None
    p_logits = _score(model, caches[0], ids, drafts, pending=pending[0])
    if temperature <= 0:
        best = p_logits.argmax(-1)
        accepted = (best[:, :k] == drafts).long().cumprod(1).sum(1)
        j = int(accepted.min())
        nxt = best[:, j:j + 1]
    else:
        p = torch.softmax(p_logits.float() / temperature, -1)
        q = torch.softmax(q_logits.float() / temperature, -1) if k else p[:, :0]
        accepted = accept_sampled(p, q, drafts, g)
        j = int(accepted.min())
        nxt = next_tokens(p, q, drafts, accepted, j=j, generator=g)
    caches[0].truncate(n + j)  # the last token kept is read by the next round
    caches[1].truncate(min(_cached(caches[1]), n + j))
    return torch.cat([ids, drafts[:, :j], nxt], 1), accepted, j


def _draft_graph_wanted(draft, cuda_graph: Optional[bool], kv_cache: Optional[str], prompt: torch.Tensor) -> bool:
    """Whether the draft's one-token steps run as a CUDA graph: as generate decides for its steps (None: an FP8
    cache on a GPU), and only where every weight-only layer of the draft runs fp8ext's kernel (bfloat16, in_features
    a multiple of 256, out_features of 64: the reference path of other layers cannot be captured); True where either
    is impossible raises."""
    if not graph_wanted(cuda_graph, kv_cache, prompt.device, "generate"):
        return False
    dtype = draft.embed.weight.dtype if hasattr(draft, "embed") else next(draft.parameters()).dtype
    x = torch.empty(prompt.shape[0], 1, 1, device=prompt.device, dtype=dtype)
    slow = [m for m in draft.modules()
            if isinstance(m, WeightOnlyLinear) and not m.uses_kernel(x.expand(-1, -1, m.in_features))]
    if slow and cuda_graph:
        raise ValueError(f"generate: cuda_graph=True with a draft needs each of its weight-only layers to run "
                         f"fp8ext's kernel (bfloat16, in_features % 256 == 0, out_features % 64 == 0, at most 16 "
                         f"sequences); {len(slow)} do not (the first: {slow[0].in_features} -> {slow[0].out_features}, "
                         f"{dtype})")
    return not slow


@torch.no_grad()
def speculative_generate(model, draft, prompt: torch.Tensor, max_new_tokens: int, *, speculate: int = 4,
                         kv_cache: str = "fp8", kv_scales: str = "auto", temperature: float = 0.0, seed: int = 0,
                         cuda_graph: Optional[bool] = None) -> Tuple[torch.Tensor, dict]:
    """generate(model, prompt, max_new_tokens, draft=draft, speculate=k, ...), which checks the model and the
    prompt first (see the module docstring): both models prefill the prompt into their own KV cache (kv_cache's
    dtype, kv_scales as in generate), then rounds of `speculate` draft tokens (fewer at the end) give
    max_new_tokens tokens. cuda_graph: the draft's one-token steps as a CUDA graph (None: where generate would
    graph its steps, an FP8 cache on a GPU; True elsewhere raises). stats: those of generate (the
    target's cache bytes; decode tokens/s counts max_new_tokens - 1 per sequence, as generate does), and
    draft_cache_bytes, speculate, rounds, proposed (draft tokens, over the batch), accepted (those kept),
    acceptance_rate (accepted / proposed) and acceptance_rate_per_sequence (what each sequence accepted before the
    batch's minimum was taken; equal to acceptance_rate at batch 1)."""
    _check(model, draft, speculate=speculate, kv_cache=kv_cache, cuda_graph=cuda_graph)
    b, n = prompt.shape
    total = n + max_new_tokens
    if is_transformers_model(model):  # transformers' own caches, eager steps (see the module docstring)
        caches = [_HFCache(m, kv_cache, kv_scales) for m in (model, draft)]
        model, draft, step = _HFRunner(model), _HFRunner(draft), None
    else:
        caches = [KVCache.from_model(m, b, total, kv_cache, device=prompt.device, scales=kv_scales)
                  for m in (model, draft)]
        step = GraphedStep(draft, caches[1], b, prompt.device) \
            if _draft_graph_wanted(draft, cuda_graph, kv_cache, prompt) else None
    g = torch.Generator(device=prompt.device).manual_seed(seed)
    sync = (lambda: torch.cuda.synchronize(prompt.device)) if prompt.is_cuda else (lambda: None)  # noqa: E731
    sync()
    t0 = time.perf_counter()
    pending = [m(prompt, kv_cache=c, start_pos=0)[:, -1] for m, c in zip((model, draft), caches)]
    sync()
    t1 = time.perf_counter()
    ids, rounds, proposed, accepted, each = prompt, 0, 0, 0, 0
    while ids.shape[1] < total:
        k = min(speculate, total - ids.shape[1] - 1)
        ids, got, j = _round((model, draft), caches, ids, pending, k=k, temperature=temperature, g=g, step=step)
        pending = [None, None]
        rounds, proposed, accepted, each = rounds + 1, proposed + b * k, accepted + b * j, each + int(got.sum())
    sync()
    t2 = time.perf_counter()
    rate = lambda x: x / proposed if proposed else None  # noqa: E731
    stats = {"prefill_tokens_per_s": b * n / (t1 - t0), "decode_tokens_per_s": b * (max_new_tokens - 1) / (t2 - t1)
             if max_new_tokens > 1 else None, "kv_cache": kv_cache, "cache_bytes": caches[0].nbytes,
             "kv_scales": caches[0].scale_source,
             "cuda_graph": step is not None and step.graph is not None, "draft_cache_bytes": caches[1].nbytes,
             "speculate": speculate, "rounds": rounds, "proposed": proposed, "accepted": accepted,
             "acceptance_rate": rate(accepted), "acceptance_rate_per_sequence": rate(each)}
    return ids, stats
