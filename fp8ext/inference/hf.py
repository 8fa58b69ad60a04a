"""Hugging Face transformers causal LMs (Llama-, Mistral-, Qwen2-style) in fp8ext.inference's pipeline.

    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    inference.calibrate(model, batches)                 # linear inputs and per-KV-head K (after RoPE) / V amaxes
    inference.quantize_model(model, "channel", "static")
    inference.save_quantized(model, "out/")             # loads in transformers' from_pretrained
    model.generate(ids, max_new_tokens=16)             # transformers' own generation
    model = inference.load_quantized("out/", inference.hf.from_config, device="cpu")

transformers' attention modules (the ones with a `layer_idx` and k/v projections) call
`cache.update(key_states, value_states, layer_idx)` right after RoPE; calibrate wraps the cache each of them is
given (None too) in a recorder that takes the per-KV-head max|K| and max|V| there, so any forward works.
quantize_model gives these modules `k_scale` / `v_scale` buffers, [n_kv_heads, 1, 1] float32, dequantizing
(amax / 448), saved as `model.layers.N.self_attn.k_scale`: compressed-tensors' attn_head shape, which its attention
broadcasts over K/V and llmcompressor writes. Where the attention's forward takes `past_key_values` (transformers
5.17, for one), compressed-tensors places them and from_pretrained's model rounds K/V to E4M3 with them, as
fp8_kv_cache does; where it takes `cache` (transformers 5.24), compressed-tensors 0.20 does not, from_pretrained
reports these keys as unexpected and computes without KV rounding. A skeleton given to load_quantized needs
add_kv_scale_buffers (from_config, the factory here, adds them).

fp8_kv_cache(model) is a transformers Cache that rounds K and V to E4M3 with those scales (or, without calibrated
scales, scales from the prefill): the numbers an FP8 KV cache gives, for model.generate(ids, ...) or a
decode loss, passed by the keyword cache_argument(model) gives.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch import nn

from ..core.formats import E4M3

__all__ = ["is_transformers_model", "attention_modules", "record_kv", "add_kv_scale_buffers", "from_config",
           "fp8_kv_cache", "cache_argument"]

_CACHE_ARGS = ("cache", "past_key_values", "past_key_value")  # the cache keyword, newest name first


def is_transformers_model(model: Any) -> bool:
    """Whether `model` is a transformers PreTrainedModel (without importing transformers when it is not loaded)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, tf.PreTrainedModel)


def attention_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """{name: module} of a transformers model's attention layers: the modules with an integer `layer_idx` and
    K/V projections (k_proj and v_proj, or qkv_proj), e.g. model.layers.N.self_attn. Empty for other models."""
    if not is_transformers_model(model):
        return {}
    return {n: m for n, m in model.named_modules() if isinstance(getattr(m, "layer_idx", None), int) and
            (hasattr(m, "qkv_proj") or (hasattr(m, "k_proj") and hasattr(m, "v_proj")))}


class _Recorder:
    """Stands in for the cache an attention module is given: update() passes K/V [batch, n_kv, seq, head_dim]
    to `observe` and on to the real cache (or back unchanged when there is none)."""

    def __init__(self, inner, observe: Callable[[torch.Tensor, torch.Tensor], None]):
        self._inner, self._observe = inner, observe

    def update(self, key_states, value_states, *args, **kwargs):
        self._observe(key_states, value_states)
        if self._inner is None:
            return key_states, value_states
        return self._inner.update(key_states, value_states, *args, **kwargs)

    def __getattr__(self, name):
        if self._inner is None:
            raise AttributeError(name)
        return getattr(self._inner, name)


def cache_argument(model: nn.Module) -> str:
    """The keyword by which a transformers model's forward (and generate) takes a KV cache: "cache" where its
    forward names it so (transformers 5.24), else "past_key_values" (transformers 5.17 and earlier)."""
    return _cache_arg(model) or "past_key_values"


def _cache_arg(module: nn.Module) -> Optional[str]:
    params = inspect.signature(module.forward).parameters
    return next((a for a in _CACHE_ARGS if a in params), None)


@contextlib.contextmanager
def record_kv(modules: Dict[str, nn.Module], observer: Callable[[str], Callable]) -> Iterator[list]:
    """While active, each attention module in `modules` calls observer(name)(k, v) with its K (after RoPE) and V
    at every forward. Yields the names of the modules whose forward takes no cache argument (not recorded)."""
    handles, skipped = [], []
    for name, m in modules.items():
        arg = _cache_arg(m)
        if arg is None:
            skipped.append(name)
            continue

        def pre_hook(module, args, kwargs, arg=arg, observe=observer(name)):
            kwargs[arg] = _Recorder(kwargs.get(arg), observe)
            return args, kwargs
        handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
    try:
        yield skipped
    finally:
        for h in handles:
            h.remove()


def add_kv_scale_buffers(model: nn.Module) -> nn.Module:
    """Registers unset (None) `k_scale` / `v_scale` buffers on a transformers model's attention layers, so that
    load_quantized fills them from a checkpoint's KV-cache scales. Returns the model."""
    for m in attention_modules(model).values():
        for leaf in ("k_scale", "v_scale"):
            if not hasattr(m, leaf):
                m.register_buffer(leaf, None)
    return model


def from_config(config: Dict[str, Any]) -> nn.Module:
    """A load_quantized factory for a transformers model's directory: config.json's dict -> the causal LM
    (AutoModelForCausalLM.from_config, in the config's dtype) with unset KV-cache scale buffers."""
    import transformers
    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "fp8ext_source")}
    if "model_type" not in cfg:
        raise ValueError("fp8ext.inference.hf.from_config: config has no 'model_type'; it is not a transformers "
                         "model's config")
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=getattr(torch, dtype))
    _rebuild_computed_buffers(model)
    return add_kv_scale_buffers(model)


def _rebuild_computed_buffers(model: nn.Module) -> None:
    """Built under the meta device (load_quantized), the buffers a checkpoint does not hold (the rotary
    embedding's inv_freq) would have no values: their modules are built again on the CPU from the config."""
    for name, mod in list(model.named_modules()):
        saved = {k for k in mod.state_dict(keep_vars=True) if "." not in k}
        if any(b.is_meta and n not in saved for n, b in mod.named_buffers(recurse=False)) and hasattr(mod, "config"):
            with torch.device("cpu"):
                fresh = type(mod)(mod.config)
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, fresh)


def _e4m3_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [b, n_kv, s, hd] rounded to E4M3 with per-head dequantizing scales (n_kv of them; saturating), back in x's dtype:
    fp8(x / scale) * scale, the division in float32."""
    s = scale.to(device=x.device, dtype=torch.float32).reshape(1, -1, 1, 1)
    q = (x.float() / s).clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


def _kv_scales(model: nn.Module):
    """[(k_scale, v_scale)] by layer_idx from the attention modules' buffers; None when they carry none."""
    mods = sorted(attention_modules(model).values(), key=lambda m: m.layer_idx)
    if not mods or any(getattr(m, "k_scale", None) is None or getattr(m, "v_scale", None) is None for m in mods):
        return None
    return {m.layer_idx: (m.k_scale.detach().float().reshape(-1), m.v_scale.detach().float().reshape(-1))
            for m in mods}


def fp8_kv_cache(model: nn.Module, *, scales: str = "auto", margin: float = 1.0):
    """A transformers cache (a DynamicCache) whose K and V are rounded to E4M3, per KV head, before they are
    stored: the numbers of an FP8 KV cache, for `model.generate(ids, **{cache_argument(model): fp8_kv_cache(model)})`
    or a step-by-step decode. Scales: the model's calibrated `k_scale` / `v_scale` (set by quantize_model;
    scales="auto" or "calibrated"), or max|K| and max|V| of each head over the first update (the prefill) times
    2^margin / 448 (scales="prefill", or "auto" without calibrated ones); the cache's `scale_source` says which.
    The values are kept in the model's dtype, as DynamicCache holds them (what transformers does for a
    checkpoint's kv_cache_scheme), so memory is not halved: this measures what FP8 K/V cost in accuracy."""
    if not is_transformers_model(model):
        raise TypeError(f"fp8_kv_cache: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if scales not in ("auto", "calibrated", "prefill"):
        raise ValueError(f"fp8_kv_cache: scales must be 'auto', 'calibrated' or 'prefill', got {scales!r}")
    found = _kv_scales(model) if scales != "prefill" else None
    if scales == "calibrated" and found is None:
        raise ValueError("fp8_kv_cache: scales='calibrated' but the model carries no KV-cache scales: run "
                         "fp8ext.inference.calibrate and quantize_model (or load such a checkpoint)")
    return _fp8_cache_class()(model.config, found or {}, margin)


@functools.lru_cache(maxsize=None)
def _fp8_cache_class():
    import transformers

    class FP8DynamicCache(transformers.DynamicCache):
        """DynamicCache storing K/V rounded to E4M3 with per-head scales {layer_idx: (k_scale, v_scale)}."""

        def __init__(self, config, scales: Dict[int, tuple], margin: float):
            super().__init__(config=config)
            self.fp8_scales, self.margin = dict(scales), margin
            self.scale_source = "calibrated" if scales else "prefill"

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layer_idx not in self.fp8_scales:  # no calibrated scales: from this (the prefill's) K/V, once
                amax = [t.detach().float().abs().amax(dim=(0, 2, 3)) for t in (key_states, value_states)]
                self.fp8_scales[layer_idx] = tuple(torch.where(a > 0, a * 2.0 ** self.margin / E4M3.max,
                                                               torch.ones_like(a)) for a in amax)
            ks, vs = self.fp8_scales[layer_idx]
            return super().update(_e4m3_round(key_states, ks), _e4m3_round(value_states, vs), layer_idx,
                                  *args, **kwargs)

    return FP8DynamicCache
