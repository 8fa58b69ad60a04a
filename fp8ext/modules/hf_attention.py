"""FP8 attention for Hugging Face transformers models: an attention function for transformers' registry.

    import fp8ext
    fp8ext.register_hf_attention()                       # once: registers the name "fp8ext"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="fp8ext")   # or
    model.set_attn_implementation("fp8ext")              # on a model already built

    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling(fp8_dpa=True)):
        loss = model(**batch).loss                       # attention in FP8 (and the FP8Linear layers, if converted)

The function is transformers' own SDPA attention (`sdpa_attention_forward`) except inside an fp8_autocast whose
recipe has fp8_dpa=True, where it runs fp8ext's FP8 attention (fp8ext.modules.attention.attention_engine: cuDNN on a
GPU, the emulation on the CPU) with the mask transformers makes for SDPA (a bool mask, True where a query attends;
none for a plain causal batch, which cuDNN's engine needs). Under activation checkpointing (gradient_checkpointing_
enable) a recomputed forward computes as the original did, as fp8ext's layers do (fp8ext/modules/checkpoint.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .attention import attention_engine, fp8_attention_recipe
from .checkpoint import forward_context

__all__ = ["register_hf_attention", "hf_fp8_attention", "HF_ATTENTION_NAME"]

HF_ATTENTION_NAME = "fp8ext"


class _Record:
    """What forward_context keeps for one Hugging Face attention module (its fp8_autocast, for a checkpointed
    rerun); FP8 attention keeps no scaling state."""

    def __init__(self):
        self._fp8_forward = None

    def scaling_manager(self, recipe):
        return None


def _record(module: torch.nn.Module) -> _Record:
    rec = module.__dict__.get("_fp8ext_attention")
    if rec is None:
        rec = module.__dict__["_fp8ext_attention"] = _Record()
    return rec


def hf_fp8_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     is_causal: Optional[bool] = None, **kwargs):
    """transformers' attention-function signature: query [batch, heads, seq_q, head_dim], key and value [batch,
    kv_heads, seq_kv, head_dim]; returns (output [batch, seq_q, heads, head_dim], None)."""
    recipe = fp8_attention_recipe(forward_context(_record(module)))
    if recipe is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if recipe.fp8_mha:
        raise NotImplementedError("fp8_mha=True hands attention's FP8 output to the output projection, which "
                                  "transformers calls itself: a Hugging Face model takes fp8_dpa=True with "
                                  "fp8_mha=False (fp8ext's own transformer, quantized, runs fp8_mha in inference)")
    if dropout:
        raise NotImplementedError(f"fp8ext's FP8 attention has no dropout, got attention dropout {dropout} (set the "
                                  f"model's attention_dropout to 0, or train with fp8_dpa=False)")
    for name in ("softcap", "sliding_window", "position_bias", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"fp8ext's FP8 attention does not take transformers' {name!r}; use "
                                      f"fp8_dpa=False for this model")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # an additive float mask: 0 where a query attends
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and query.shape[2] > 1 and attention_mask is None
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = attention_engine(query, key, value, attention_mask, is_causal=causal, scale=scale, recipe=recipe)
    return out.transpose(1, 2).contiguous(), None


def register_hf_attention(name: str = HF_ATTENTION_NAME) -> str:
    """Registers hf_fp8_attention with transformers under `name` (its attention function and, for the masks it is
    given, transformers' SDPA mask), so that `attn_implementation=name` selects it. Returns the name."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError("register_hf_attention(): needs transformers >= 4.48 (AttentionInterface and "
                          "AttentionMaskInterface)") from e
    AttentionInterface.register(name, hf_fp8_attention)
    AttentionMaskInterface.register(name, _causal_mask_as_none(ALL_MASK_ATTENTION_FUNCTIONS.get("sdpa", sdpa_mask)))
    return name


def _causal_mask_as_none(sdpa_mask):
    """transformers' SDPA mask function, except that a plain causal batch (no padding mask, no cache offset, as many
    queries as keys, the causal pattern alone) gets no mask, None: attention then runs with is_causal=True, the only
    causal mask cuDNN's FP8 attention takes. transformers skips that mask itself in eager code, but under torch.compile
    it builds it on torch < 2.14 (where it cannot tell compiling from exporting). The test reads arguments and shapes,
    never a tensor's values, so a compiled graph has no data-dependent branch. Everything else is sdpa_mask's."""
    from transformers.masking_utils import causal_mask_function

    def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
             attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
        if (allow_is_causal_skip and attention_mask is None and local_size is None and mask_function is
                causal_mask_function and q_length == kv_length and not isinstance(q_offset, torch.Tensor) and
                q_offset == 0 and kv_offset == 0):
            return None
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)

    return mask
