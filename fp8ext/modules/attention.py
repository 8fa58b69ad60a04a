"""DotProductAttention: Transformer Engine's te.DotProductAttention (scaled dot-product attention over [seq, batch,
heads, head_dim] or [batch, seq, heads, head_dim] tensors), in FP8 where a recipe asks for it.

    attn = fp8ext.DotProductAttention(num_attention_heads=8, kv_channels=64, num_gqa_groups=2)
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.DelayedScaling(fp8_dpa=True)):
        out = attn(q, k, v)                     # [seq, batch, 8 * 64]

Inside an fp8_autocast whose recipe has fp8_dpa=True the attention computes in FP8: on the CPU by
fp8ext.ops.attention_fp8 (an exact emulation of cuDNN's FP8 fused attention, which TE runs), on a GPU by cuDNN's FP8
fused attention itself (fp8ext.ops.attention_cudnn; needs `pip install nvidia-cudnn-frontend`, and takes the causal
mask or none). Everywhere else it is
torch.nn.functional.scaled_dot_product_attention with the same mask. This file holds the module, its arguments and
its masks; the numerics are in fp8ext/ops/attention_fp8.py.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..core.tensor import FP8Tensor
from ..ops.attention_cudnn import cudnn_fp8_attention
from ..ops.attention_fp8 import fp8_scaled_dot_product_attention
from .checkpoint import forward_context

__all__ = ["DotProductAttention", "FP8_ATTENTION_ENGINES", "attention_engine", "fp8_attention_recipe"]

MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal", "causal_bottom_right", "padding_causal_bottom_right",
              "arbitrary")
QKV_FORMATS = ("sbhd", "bshd")

# The FP8 attention of each device type, each called as fp8_scaled_dot_product_attention is.
FP8_ATTENTION_ENGINES = {"cpu": fp8_scaled_dot_product_attention, "cuda": cudnn_fp8_attention}

# Transformer Engine's arguments that fp8ext takes only at their defaults: what each would need.
_TE_INIT_DEFAULTS = {
    "sequence_parallel": (False, "sequence parallelism"),
    "tp_size": (1, "tensor parallelism"),
    "tp_group": (None, "tensor parallelism"),
    "get_rng_state_tracker": (None, "tensor-parallel RNG tracking"),
    "cp_group": (None, "context parallelism"),
    "cp_global_ranks": (None, "context parallelism"),
    "cp_stream": (None, "context parallelism"),
    "cp_comm_type": ("p2p", "context parallelism"),
    "softmax_type": ("vanilla", "attention sinks (softmax_type 'off-by-one' or 'learnable')"),
    "return_max_logit": (False, "the maximum logit output"),
}
_TE_FORWARD_DEFAULTS = {
    "cu_seqlens_q_padded": (None, "padding between sequences"),
    "cu_seqlens_kv_padded": (None, "padding between sequences"),
    "pad_between_seqs": (None, "padding between sequences"),
    "checkpoint_core_attention": (False, "recomputing attention in backward (use fp8ext.checkpoint)"),
    "core_attention_bias_type": ("no_bias", "attention bias"),
    "core_attention_bias": (None, "attention bias"),
    "alibi_slopes": (None, "ALiBi"),
    "inference_params": (None, "KV caching (see fp8ext.inference)"),
    "num_splits": (1, "split-KV decoding"),
}


def _check_defaults(kwargs: dict, table: dict, where: str) -> None:
    for key, value in kwargs.items():
        if key not in table:
            raise TypeError(f"{where} got an unexpected keyword argument {key!r}")
        default, what = table[key]
        if value is not None if default is None else value != default:
            raise NotImplementedError(f"{where}: {key}={value!r} asks for {what}, which fp8ext does not have; leave "
                                      f"{key} at its default ({default!r})")


def attention_engine(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], *,
                     is_causal: bool, scale: float, recipe, fp8_backward: Optional[bool] = None,
                     fp8_output: bool = False):
    """The one place that chooses how attention computes: [b, h, s, d] tensors, mask True where a query attends.
    recipe None: torch's scaled_dot_product_attention; else FP8 attention by the engine of the tensors' device, or
    NotImplementedError where there is none (never a silent high-precision run). fp8_backward: the FP8 engines'
    (False: the backward in high precision; None: Transformer Engine's NVTE_FP8_DPA_BWD decides). fp8_output: the
    FP8 engines return O8 as an FP8Tensor (inference only); it needs a recipe."""
    gqa = q.shape[1] != k.shape[1]
    if fp8_output and recipe is None:
        raise ValueError("DotProductAttention: fp8_output=True (the output in FP8) needs FP8 attention: call it inside "
                         "fp8_autocast with a recipe whose fp8_dpa (or fp8_mha) is True")
    if recipe is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    engine = FP8_ATTENTION_ENGINES.get(q.device.type)
    if engine is None:
        raise NotImplementedError(
            f"DotProductAttention: FP8 attention (fp8_dpa=True) has no engine for {q.device.type} tensors in fp8ext; "
            f"it runs on the CPU (an emulation) and on CUDA GPUs (cuDNN). For high-precision attention on "
            f"{q.device}, run it outside fp8_autocast or with a recipe whose fp8_dpa is False")
    extra = {} if fp8_backward is None else {"fp8_backward": fp8_backward}  # None: the engine's default
    if fp8_output:
        extra["fp8_output"] = True
    return engine(q, k, v, mask, is_causal=is_causal, scale=scale, enable_gqa=gqa, fp8_format=recipe.fp8_format,
                  margin=getattr(recipe, "margin", 0), **extra)


def fp8_attention_recipe(ctx):
    """The recipe of an fp8_autocast context (or None) when it computes in FP8 and asks for FP8 attention, else
    None."""
    if ctx is None or not ctx.enabled or ctx.calibrating or not getattr(ctx.recipe, "fp8_dpa", False):
        return None
    return ctx.recipe


def _mask_type(value, where: str) -> str:
    """TE's spelling of a mask type: 'causal,padding' and 'padding,causal' are 'padding_causal'."""
    if not isinstance(value, str):
        raise TypeError(f"{where}: attn_mask_type must be a str, one of {list(MASK_TYPES)}, got {value!r}")
    name = value.replace(",", "_")
    name = "padding_causal" if name == "causal_padding" else name
    if name not in MASK_TYPES:
        raise ValueError(f"{where}: attn_mask_type must be one of {list(MASK_TYPES)}, got {value!r}")
    return name


def _qkv_format(value, where: str) -> str:
    if value == "thd":
        raise NotImplementedError(f"{where}: qkv_format='thd' (packed variable-length sequences) is not supported by "
                                  f"fp8ext; use 'sbhd' or 'bshd' with a padding mask")
    if value not in QKV_FORMATS:
        raise ValueError(f"{where}: qkv_format must be 'sbhd' or 'bshd', got {value!r}")
    return value


def _window(mask_type: str, window, where: str) -> Tuple[int, int]:
    """TE's check_set_window_size: (left, right) with -1 unbounded; causal types need right 0, others not (-1, 0)."""
    if window is not None:
        ok = isinstance(window, (tuple, list)) and len(window) == 2 and \
            all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
        if not ok:
            raise ValueError(f"{where}: window_size must be None or a pair (left, right) of ints >= -1, got {window!r}")
        window = tuple(window)
    if "causal" in mask_type:
        if window is None or window == (-1, 0) or (window[0] >= 0 and window[1] == 0):
            return window or (-1, 0)
        if window == (-1, -1) or window[0] >= 0:
            warnings.warn(f"{where}: window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={mask_type!r}; "
                          f"using ({window[0]}, 0), as Transformer Engine does", stacklevel=3)
            return (window[0], 0)
        raise ValueError(f"{where}: window_size should be (-1, 0) or (>=0, 0) for attn_mask_type={mask_type!r}, got "
                         f"{window}")
    if window is None or window == (-1, -1):
        return (-1, -1)
    if window == (-1, 0):
        warnings.warn(f"{where}: window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={mask_type!r}; "
                      f"using (-1, -1), as Transformer Engine does (ask for attn_mask_type='causal' instead)",
                      stacklevel=3)
        return (-1, -1)
    if min(window) < 0:
        raise ValueError(f"{where}: window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type={mask_type!r}, "
                         f"got {window}")
    return window


def _bottom_right(mask_type: str, value: Optional[bool]) -> bool:
    """TE's diagonal alignment: top left for 'causal' and 'padding_causal', bottom right for the '_bottom_right'
    types, else `value` (default: bottom right)."""
    if mask_type in ("causal", "padding_causal"):
        return False
    if mask_type.endswith("bottom_right"):
        return True
    return True if value is None else bool(value)


def _padding_positions(attention_mask, cu_seqlens_q, cu_seqlens_kv, b: int, sq: int, sk: int, device,
                       where: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q_valid [b, sq], kv_valid [b, sk]) bool, True at a sequence's tokens: from TE's padding mask ([b, 1, 1, s],
    True = padding; one for self-attention, a pair (query's, key's) otherwise) or from cu_seqlens_q / cu_seqlens_kv
    ([b + 1] cumulative lengths, each sequence's tokens first, then its padding)."""
    if (attention_mask is None) == (cu_seqlens_q is None and cu_seqlens_kv is None):
        raise ValueError(f"{where}: a padding mask type needs attention_mask ([batch, 1, 1, seq], True = padding) "
                         "or cu_seqlens_q and cu_seqlens_kv, one of the two")
    if attention_mask is not None:
        pair = attention_mask if isinstance(attention_mask, (tuple, list)) else (attention_mask, attention_mask)
        if len(pair) != 2 or (not isinstance(attention_mask, (tuple, list)) and sq != sk):
            raise ValueError(f"{where}: attention_mask must be one tensor for self-attention, or a pair of tensors "
                             f"(query's, key's) when the query and key lengths differ ({sq} and {sk})")
        names = ("attention_mask", "attention_mask") if pair[0] is attention_mask else \
            ("attention_mask[0]", "attention_mask[1]")
        return tuple(_padding_rows(m, b, s, device, where, n) for m, s, n in zip(pair, (sq, sk), names))
    if cu_seqlens_kv is None and sq == sk:
        cu_seqlens_kv = cu_seqlens_q
    out = []
    for name, cu, s in (("cu_seqlens_q", cu_seqlens_q, sq), ("cu_seqlens_kv", cu_seqlens_kv, sk)):
        if not isinstance(cu, torch.Tensor) or cu.shape != (b + 1,) or cu.dtype not in (torch.int32, torch.int64) \
                or cu.device != device:
            raise ValueError(f"{where}: {name} must be an int32 tensor of shape [{b + 1}] on {device}, got "
                             f"{_describe(cu)}")
        out.append(torch.arange(s, device=device) < (cu[1:] - cu[:-1])[:, None])
    return tuple(out)


def _padding_rows(mask, b: int, s: int, device, where: str, name: str) -> torch.Tensor:
    """TE's padding mask [b, 1, 1, s] (True = padding) as [b, s], True at the tokens."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (b, 1, 1, s) or \
            mask.device != device:
        raise ValueError(f"{where}: {name} must be a bool tensor [{b}, 1, 1, {s}] on {device} (True = padding), got "
                         f"{_describe(mask)}")
    return ~mask.view(b, s)


def _describe(x) -> str:
    return f"{x.dtype} {list(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else repr(x)


def _allowed(mask_type: str, window: Tuple[int, int], bottom_right: bool, padding, arbitrary, shape
             ) -> Tuple[Optional[torch.Tensor], bool]:
    """(mask, is_causal) for torch's SDPA convention (mask True where a query attends to a key; None for none):
    query i sees keys [i + off - left, i + off + right] (-1: unbounded), off = seq_kv - seq_q aligned bottom right
    (per sequence with padding), else 0; and, with padding, only the tokens of its own sequence."""
    (_, sq, sk), device = shape[:3], shape[3]
    left, right = window
    if padding is None and arbitrary is None and left < 0:
        if right < 0:
            return None, False
        if right == 0 and not bottom_right:
            return None, True  # torch's own causal mask
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    off = 0
    if bottom_right:
        off = sk - sq if padding is None else (padding[1].sum(-1) - padding[0].sum(-1)).view(-1, 1, 1)
    allowed = torch.ones(1, sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        allowed = allowed & (j <= i + off + right)
    if left >= 0:
        allowed = allowed & (j >= i + off - left)
    if padding is not None:
        allowed = allowed & padding[0][:, :, None] & padding[1][:, None, :]
    allowed = allowed.unsqueeze(1)
    if arbitrary is not None:
        allowed = allowed & ~arbitrary
    return allowed, False


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with Transformer Engine's arguments and tensor layouts (te.DotProductAttention).

    num_attention_heads; kv_channels: the head dimension (an int, or TE's pair of two equal ints); num_gqa_groups:
    the K/V heads (grouped-query attention; None = num_attention_heads); attention_dropout: 0.0 only; qkv_format:
    "sbhd" ([seq, batch, heads, head_dim], the default) or "bshd"; attn_mask_type: "causal" (the default),
    "no_mask", "padding", "padding_causal" ("causal,padding" and "padding,causal" too), "causal_bottom_right",
    "padding_causal_bottom_right" or "arbitrary"; window_size: (left, right) sliding window, -1 unbounded (TE's
    rules: causal types need right 0); bottom_right_diagonal: where the window's diagonal sits (TE's rule: top left
    for "causal" and "padding_causal", else bottom right); softmax_scale: default 1 / sqrt(kv_channels);
    layer_number, attention_type ("self" or "cross") and name: accepted, as TE's bookkeeping. TE's parallelism
    arguments are accepted at their defaults only. The module has no parameters.

    Inside fp8_autocast with a recipe whose fp8_dpa is True (DelayedScaling or Float8CurrentScaling) attention
    computes in FP8: Q, K, V, the softmax output P and O in E4M3, dO, dS and dQ/dK/dV in E5M2, as
    fp8ext.ops.attention_fp8 describes: on the CPU that emulation, on a GPU cuDNN's FP8 fused attention (causal or no
    mask; other masks raise NotImplementedError). Otherwise it is torch.nn.functional.scaled_dot_product_attention.
    fp8_backward=False (fp8ext's argument) keeps the forward in FP8 and runs the backward in high precision (torch's
    SDPA backward at the dequantized FP8 Q, K, V, its forward recomputed; Transformer Engine's NVTE_FP8_DPA_BWD=0
    asks for the same, though TE reuses the FP8 forward's output instead); None, the default, leaves it to
    NVTE_FP8_DPA_BWD (unset: FP8). On fp8ext.train's 1b preset the FP8 backward diverged and
    this one trained (docs/training.md, "FP8 attention").
    Under activation
    checkpointing a recomputed forward computes as the original did (fp8ext/modules/checkpoint.py).
    """

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size: Optional[Tuple[int, int]] = None, *,
                 bottom_right_diagonal: Optional[bool] = None, layer_number: Optional[int] = None,
                 attention_type: str = "self", softmax_scale: Optional[float] = None, name: Optional[str] = None,
                 fp8_backward: Optional[bool] = None, **kwargs):
        super().__init__()
        where = "DotProductAttention"
        _check_defaults(kwargs, _TE_INIT_DEFAULTS, where)
        if isinstance(kv_channels, (tuple, list)) and len(kv_channels) == 2 and kv_channels[0] == kv_channels[1]:
            kv_channels = kv_channels[0]
        elif isinstance(kv_channels, (tuple, list)):
            raise NotImplementedError(f"{where}: kv_channels={kv_channels!r}: different head dimensions for K and V "
                                      f"are not supported by fp8ext; give one int")
        num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
        for arg, value in (("num_attention_heads", num_attention_heads), ("kv_channels", kv_channels),
                           ("num_gqa_groups", num_gqa_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {arg} must be a positive int, got {value!r}")
        if num_attention_heads % num_gqa_groups:
            raise ValueError(f"{where}: num_attention_heads ({num_attention_heads}) must be a multiple of "
                             f"num_gqa_groups ({num_gqa_groups})")
        if attention_dropout != 0.0:
            raise NotImplementedError(f"{where}: attention_dropout={attention_dropout!r} is not supported by fp8ext; "
                                      "only 0.0 (no dropout)")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{where}: attention_type must be 'self' or 'cross', got {attention_type!r}")
        self.num_attention_heads, self.kv_channels, self.num_gqa_groups = num_attention_heads, kv_channels, \
            num_gqa_groups
        self.qkv_format = _qkv_format(qkv_format, where)
        self.attn_mask_type = _mask_type(attn_mask_type, where)
        self.window_size = _window(self.attn_mask_type, window_size, where)
        self._window_arg = window_size  # as given: a call's attn_mask_type applies TE's rules to it afresh
        self.bottom_right_diagonal = bottom_right_diagonal
        self.softmax_scale = 1.0 / math.sqrt(kv_channels) if softmax_scale is None else float(softmax_scale)
        self.attention_dropout, self.attention_type = attention_dropout, attention_type
        self.layer_number, self.name = layer_number, name
        if fp8_backward is not None and not isinstance(fp8_backward, bool):
            raise TypeError(f"{where}: fp8_backward must be True, False or None, got {fp8_backward!r}")
        self.fp8_backward = fp8_backward
        self._fp8_forward = None  # the fp8_autocast of the last forward, where a checkpointed rerun computes

    def scaling_manager(self, recipe):
        """None: FP8 attention keeps no scaling state (its scales are each tensor's own amax's)."""
        return None

    def extra_repr(self) -> str:
        return (f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
                f"num_gqa_groups={self.num_gqa_groups}, qkv_format={self.qkv_format!r}, "
                f"attn_mask_type={self.attn_mask_type!r}, window_size={self.window_size}")

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, *,
                qkv_format: Optional[str] = None, cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None, attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                fast_zero_fill: bool = True, fp8_output: bool = False, **kwargs):
        """Attention of query_layer over key_layer / value_layer, as te.DotProductAttention.forward.

        Layouts (qkv_format, default the module's): "sbhd" [seq, batch, heads, head_dim], "bshd" [batch, seq,
        heads, head_dim]; the query has num_attention_heads heads, key and value num_gqa_groups, all kv_channels
        wide. Returns [seq_q, batch, heads * head_dim] ("sbhd") or [batch, seq_q, heads * head_dim] ("bshd") in the
        query's dtype. attention_mask (TE's convention, True = masked out): for the padding types a bool tensor
        [batch, 1, 1, seq] (self-attention) or a pair (query's [batch, 1, 1, seq_q], key's [batch, 1, 1, seq_kv]);
        or cu_seqlens_q / cu_seqlens_kv ([batch + 1] cumulative lengths, each sequence padded at its end) instead;
        for "arbitrary" a bool tensor broadcastable to [batch, heads, seq_q, seq_kv]; None for the other types.
        A padded query position gives zeros (fast_zero_fill is accepted and changes nothing). attn_mask_type,
        window_size and bottom_right_diagonal override the module's for this call; max_seqlen_q / max_seqlen_kv, when
        given, must be the sequence lengths. fp8_output=True (Transformer Engine's argument; what fp8_mha uses):
        inside fp8_autocast with fp8_dpa, under torch.no_grad(), returns the output as an fp8ext.FP8Tensor, its
        E4M3 bytes (`data`, in the layout above) and their per-tensor dequantizing scale (`scale_inv`), for an FP8
        output projection to read without a bf16 round trip; it carries no gradient. TE's other arguments are
        accepted at their defaults only.
        """
        where = "DotProductAttention.forward()"
        _check_defaults(kwargs, _TE_FORWARD_DEFAULTS, where)
        if not isinstance(fp8_output, bool):
            raise TypeError(f"{where}: fp8_output must be True or False, got {fp8_output!r}")
        fmt = self.qkv_format if qkv_format is None else _qkv_format(qkv_format, where)
        mask_type = self.attn_mask_type if attn_mask_type is None else _mask_type(attn_mask_type, where)
        window = self.window_size
        if window_size is not None or attn_mask_type is not None:  # TE's rules again, on this call's pair
            window = _window(mask_type, self._window_arg if window_size is None else window_size, where)
        br = _bottom_right(mask_type, self.bottom_right_diagonal if bottom_right_diagonal is None
                           else bottom_right_diagonal)
        q, k, v = self._heads_first(query_layer, key_layer, value_layer, fmt, where)
        (b, _, sq, _), sk = q.shape, k.shape[2]
        for arg, value, s in (("max_seqlen_q", max_seqlen_q, sq), ("max_seqlen_kv", max_seqlen_kv, sk)):
            if value is not None and value != s:
                raise ValueError(f"{where}: {arg}={value!r}, but the {fmt!r} tensors hold sequences of {s}")
        mask, is_causal = self._mask(mask_type, window, br, attention_mask, cu_seqlens_q, cu_seqlens_kv,
                                     (b, sq, sk, q.device), where)
        out = attention_engine(q, k, v, mask, is_causal=is_causal, scale=self.softmax_scale,
                               recipe=fp8_attention_recipe(forward_context(self)), fp8_backward=self.fp8_backward,
                               fp8_output=fp8_output)
        # [b, h, s, d] to the module's layout with the heads merged: a view where the engine laid the output out so
        merged = (lambda t: t.permute(2, 0, 1, 3).reshape(sq, b, -1)) if fmt == "sbhd" else \
            (lambda t: t.permute(0, 2, 1, 3).reshape(b, sq, -1))
        if fp8_output:  # O8's bytes and scale
            return FP8Tensor(merged(out.data), None, out.scale_inv, out.fmt)
        return merged(out)

    def _heads_first(self, query_layer, key_layer, value_layer, fmt: str, where: str):
        """query, key, value checked against the module and viewed as [batch, heads, seq, head_dim]."""
        layers = (query_layer, key_layer, value_layer)
        for name, t in zip(("query_layer", "key_layer", "value_layer"), layers):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{where}: {name} must be a 4-D tensor in {fmt!r} layout, got {_describe(t)}")
            if t.dtype not in (torch.float32, torch.bfloat16, torch.float16) or t.dtype != query_layer.dtype or \
                    t.device != query_layer.device:
                raise TypeError(f"{where}: query_layer, key_layer and value_layer must share one dtype (float32, "
                                f"bfloat16 or float16) and device, got {name} {_describe(t)}, query_layer "
                                f"{_describe(query_layer)}")
        q, k, v = (t.permute(1, 2, 0, 3) if fmt == "sbhd" else t.permute(0, 2, 1, 3) for t in layers)
        if (q.shape[1], q.shape[3]) != (self.num_attention_heads, self.kv_channels) or k.shape != v.shape or \
                (k.shape[1], k.shape[3]) != (self.num_gqa_groups, self.kv_channels) or k.shape[0] != q.shape[0] or \
                k.shape[2] == 0:
            got = ", ".join(f"{n} {list(t.shape)}" for n, t in zip(("query_layer", "key_layer", "value_layer"), layers))
            raise ValueError(
                f"{where}: in {fmt!r} layout query_layer must have {self.num_attention_heads} heads "
                f"(num_attention_heads) of {self.kv_channels} (kv_channels), key_layer and value_layer one shape with "
                f"{self.num_gqa_groups} heads (num_gqa_groups), the query's batch and at least one position; got {got}")
        return q, k, v

    def _mask(self, mask_type, window, bottom_right, attention_mask, cu_seqlens_q, cu_seqlens_kv, shape, where):
        """(mask, is_causal) of this call in torch's SDPA convention, from TE's mask arguments."""
        b, sq, sk, device = shape
        padding = arbitrary = None
        if "padding" in mask_type:
            padding = _padding_positions(attention_mask, cu_seqlens_q, cu_seqlens_kv, b, sq, sk, device, where)
        elif cu_seqlens_q is not None or cu_seqlens_kv is not None:
            raise ValueError(f"{where}: cu_seqlens_q / cu_seqlens_kv need a padding mask type, got "
                             f"attn_mask_type={mask_type!r}")
        elif mask_type == "arbitrary":
            want = (b, self.num_attention_heads, sq, sk)
            if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool or \
                    attention_mask.device != device or attention_mask.dim() != 4 or \
                    any(m not in (1, w) for m, w in zip(attention_mask.shape, want)):
                raise ValueError(f"{where}: attn_mask_type='arbitrary' needs attention_mask, a bool tensor on "
                                 f"{device} broadcastable to {list(want)} (True = masked out), got "
                                 f"{_describe(attention_mask)}")
            arbitrary = attention_mask
        elif attention_mask is not None:
            raise ValueError(f"{where}: attention_mask is given, but attn_mask_type={mask_type!r} takes none; use a "
                             "padding type ('padding', 'padding_causal') or 'arbitrary'")
        return _allowed(mask_type, window, bottom_right, padding, arbitrary, shape)

