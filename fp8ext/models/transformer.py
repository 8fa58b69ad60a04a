"""A dense decoder-only transformer with FP8 linear layers: RMSNorm, grouped-query attention with one fused
QKV projection and rotary position embeddings, a SwiGLU MLP, a final norm.

Built from the layers Transformer Engine code names te.Linear, te.RMSNorm and te.fp8_autocast (under `import
fp8ext as te`; imported here from the modules that define them). Layer policy for FP8 (the usual one for FP8 training and inference): the linear layers
of the blocks compute in FP8 inside `fp8_autocast`; the token embedding, the norms, attention's softmax and
the output projection (the logits) stay in high precision. The linear layers are `fp8ext.Linear` whether or
not FP8 is on, so FP8 and bf16 checkpoints are the same state dict and load into each other.

    python -m fp8ext.models.transformer [--fp8] [--preset tiny|small|1b|llama8b-2l|llama8b-4l] [--device D]

prints the self test: parameter counts, one forward pass, its loss, the device and whether FP8 is on.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import asdict, dataclass, replace
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core.build import build_info, cuda_available
from ..core.context import current_context, fp8_autocast
from ..core.recipe import DelayedScaling, Format
from ..modules.attention import DotProductAttention, fp8_attention_recipe
from ..modules.checkpoint import forward_context
from ..modules.fused_linear import SWIGLU, fused_input_linear, swiglu_mlp
from ..modules.linear import Linear
from ..modules.normalization import RMSNorm
from ..ops import attention, fused

__all__ = ["TransformerConfig", "Transformer", "PRESETS", "preset"]


# Upper bounds of the integer sizes, far above the largest published dense models (about 126 layers, d_model
# 16384, 128 heads, d_ff 53248, vocabularies of about 256k, contexts of 128k to 1M): no real config meets them;
# a corrupt one (e.g. n_layers 10**6 in a checkpoint's config.json) is refused before it allocates anything.
SIZE_LIMITS = {"vocab_size": 1 << 21, "d_model": 1 << 16, "n_layers": 1024, "n_heads": 1024, "n_kv_heads": 1024,
                "d_ff": 1 << 18, "max_seq_len": 1 << 21}


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the model. Every linear layer's dimensions are multiples of 16 (FP8 GEMMs need it)."""

    vocab_size: int = 256  # byte-level: fp8ext.train's corpora are raw bytes
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 192
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    fused_qkv: bool = True  # one QKV projection (False: three, to measure what fusing buys)

    def __post_init__(self):
        self._check_fields()
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"TransformerConfig: d_model ({self.d_model}) must be a multiple of n_heads "
                             f"({self.n_heads}), and n_heads of n_kv_heads ({self.n_kv_heads})")
        for name in ("d_model", "d_ff"):
            if getattr(self, name) % 16:
                raise ValueError(f"TransformerConfig: {name} must be a multiple of 16 for FP8 GEMMs, "
                                 f"got {getattr(self, name)}")
        if self.head_dim % 2 or (self.n_kv_heads * self.head_dim) % 16:
            raise ValueError("TransformerConfig: head_dim must be even and n_kv_heads * head_dim a multiple of 16")

    def _check_fields(self) -> None:
        """Each field's type and range, before any arithmetic on them (a config read from a checkpoint's
        config.json may hold anything)."""
        for name, limit in SIZE_LIMITS.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"TransformerConfig: {name} must be an int, got {type(v).__name__} {v!r}")
            if not 1 <= v <= limit:
                raise ValueError(f"TransformerConfig: {name} must be in [1, {limit}], got {v}")
        for name, high in (("rope_theta", math.inf), ("norm_eps", 1.0)):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise TypeError(f"TransformerConfig: {name} must be a float, got {type(v).__name__} {v!r}")
            if not (0 < v < high and math.isfinite(v)):
                below = "" if high == math.inf else f" and below {high}"
                raise ValueError(f"TransformerConfig: {name} must be finite, positive{below}, got {v}")
        if not isinstance(self.fused_qkv, bool):
            raise TypeError(f"TransformerConfig: fused_qkv must be a bool, got {type(self.fused_qkv).__name__} "
                            f"{self.fused_qkv!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: Dict[str, TransformerConfig] = {
    # seconds on a CPU
    "tiny": TransformerConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=256),
    # about 120M parameters (GPT-2 small's width and depth)
    "small": TransformerConfig(d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=3584, max_seq_len=1024),
    # about 1B parameters (TinyLlama-1.1B's widths, 128-wide heads)
    "1b": TransformerConfig(d_model=2048, n_layers=22, n_heads=16, n_kv_heads=4, d_ff=5632, max_seq_len=2048),
    # two layers of Llama-3-8B's sizes
    "llama8b-2l": TransformerConfig(d_model=4096, n_layers=2, n_heads=32, n_kv_heads=8, d_ff=14336,
                                    max_seq_len=4096, rope_theta=500000.0),
    # four layers of Llama-3-8B's sizes (0.87B parameters): its layers' shapes for activation checkpointing and
    # multi-node runs
    "llama8b-4l": TransformerConfig(d_model=4096, n_layers=4, n_heads=32, n_kv_heads=8, d_ff=14336,
                                    max_seq_len=4096, rope_theta=500000.0),
}


def preset(name: str, **overrides) -> TransformerConfig:
    """A preset's config, with fields replaced by `overrides` (e.g. fused_qkv=False)."""
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **overrides)


def rope_tables(cfg: TransformerConfig, device=None):
    """cos and sin of the rotary embedding, [max_seq_len, head_dim / 2], float32."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32)
                                        / cfg.head_dim)
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (x[..., :h/2], x[..., h/2:]) of x [batch, heads, seq, head_dim] (the "rotate half" form),
    in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    s = x.shape[-2]
    c, n = cos[:s], sin[:s]
    return torch.cat([x1 * c - x2 * n, x1 * n + x2 * c], dim=-1).to(x.dtype)


# scaled_dot_product_attention(..., enable_gqa=True) (torch >= 2.5): grouped-query attention without repeating K/V
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def _decode_sdpa_backends():
    """SDPA backends for a decode step over a bf16 cache: every step has a new context length, and torch's cuDNN
    backend builds an execution plan per new shape (H100, torch 2.11, preset 1b, batch 128 at ~1k positions:
    generate() took 89-99 ms per step where the same steps over lengths already seen took 14.6 ms; with the
    others 13.3-14.3 ms). None where torch has no sdpa_kernel."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


_DECODE_SDPA = _decode_sdpa_backends()


def _capturing() -> bool:
    """A CUDA graph replays one shape, so the cuDNN backend's plan is built once there (and was the fastest in
    the graphed decode step measured: 3.71 ms against 4.14 ms with the others, same H100, batch 128)."""
    if torch.compiler.is_compiling():  # compiled code keeps torch's choice (and traces no stream query)
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _continuation_mask(s: int, length: int, device) -> torch.Tensor:
    """[s, length] bool, True where attention may look: the s queries sit at positions length - s .. length - 1
    and each sees the cached positions and itself."""
    return torch.ones(s, length, dtype=torch.bool, device=device).tril(diagonal=length - s)


def _init_out(std: float):
    return lambda w: nn.init.normal_(w, std=std)


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig, device=None):
        super().__init__()
        self.cfg = cfg
        h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        init = _init_out(0.02)
        if cfg.fused_qkv:
            self.qkv_proj = Linear(cfg.d_model, (h + 2 * kv) * hd, bias=False, device=device, init_method=init)
        else:
            self.q_proj = Linear(cfg.d_model, h * hd, bias=False, device=device, init_method=init)
            self.k_proj = Linear(cfg.d_model, kv * hd, bias=False, device=device, init_method=init)
            self.v_proj = Linear(cfg.d_model, kv * hd, bias=False, device=device, init_method=init)
        self.o_proj = Linear(h * hd, cfg.d_model, bias=False, device=device,
                                init_method=_init_out(0.02 / math.sqrt(2 * cfg.n_layers)))
        # FP8 attention (no parameters): taken in training and prefill when the fp8_autocast's recipe has fp8_dpa=True
        self.core_attention = DotProductAttention(h, hd, num_gqa_groups=kv, qkv_format="bshd")
        # An FP8 KV cache's calibrated scales, [n_kv_heads] float32, dequantizing (K ~= k_byte * k_scale): None
        # unless fp8ext.inference.quantize_model set them from calibration; then in the state dict as
        # blocks.N.attn.k_scale / v_scale, which KVCache.from_model and generate use.
        self.register_buffer("k_scale", None)
        self.register_buffer("v_scale", None)

    layer_idx = 0  # set by Transformer: which layer of a KV cache is this attention's
    # Calibration hook: when set (fp8ext.inference.calibrate installs it for its passes and removes it after),
    # called as kv_observer(k, v) with this layer's K (after RoPE) and V, each [batch, n_kv_heads, seq, head_dim].
    # None otherwise: one attribute test per forward.
    kv_observer = None

    def forward(self, x, cos, sin, is_first_microbatch=None, kv_cache=None, start_pos: int = 0):
        b, s, _ = x.shape
        h, kv, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        mb = {"is_first_microbatch": is_first_microbatch}
        no_grad = not torch.is_grad_enabled()
        if self.cfg.fused_qkv:
            qkv = self.qkv_proj(x, **mb)
            if kv_cache is not None and s == 1 and no_grad and self.kv_observer is None and \
                    hasattr(kv_cache, "rope_append") and fused.available(qkv, 16 if hd % 16 == 0 else 1):
                # decode step over an FP8 cache on a GPU: RoPE and the K/V stores in one kernel
                step = kv_cache.rope_append(self.layer_idx, qkv, cos, sin, h, start_pos)
                if step is not None:
                    q, k_cache, v_cache, length, k_scale, v_scale = step
                    return self._decode(q, k_cache, v_cache, length, k_scale, v_scale, mb)
            if (no_grad or fused.TRAINING) and fused.train_available(qkv, 16 if hd % 16 == 0 else 1):
                # one pass: split, rotate, lay out (and one pass back in the backward); a torch op under torch.compile
                q, k, v = fused.rope_qkv(qkv, cos, sin, h, kv)
            else:
                q, k, v = qkv.split([h * hd, kv * hd, kv * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x, **mb), self.k_proj(x, **mb), self.v_proj(x, **mb)
        if q.dim() == 3:
            q = apply_rope(q.view(b, s, h, hd).transpose(1, 2), cos, sin)
            k = apply_rope(k.view(b, s, kv, hd).transpose(1, 2), cos, sin)
            v = v.view(b, s, kv, hd).transpose(1, 2)
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        if kv_cache is not None:  # generation: store this step's K/V, attend over everything cached
            if s == 1 and kv_cache.dtype == "fp8":
                # decode step over an FP8 cache: attention reads the E4M3 bytes with the per-head scales (a CUDA
                # kernel on a GPU, no dequantized copy of the cache; a float32 reference elsewhere)
                k_cache, v_cache, length, k_scale, v_scale = kv_cache.append(self.layer_idx, k, v, start_pos)
                return self._decode(q, k_cache, v_cache, length, k_scale, v_scale, mb)
            k, v = kv_cache.update(self.layer_idx, k, v, start_pos)
            pick = s == 1 and _DECODE_SDPA is not None and not _capturing()
            # several positions after cached ones (speculative decoding's verification): SDPA's is_causal aligns
            # its mask at the top left, right only for queries that start at position 0
            mask = _continuation_mask(s, k.shape[2], q.device) if s > 1 and start_pos > 0 else None
            causal = s > 1 and mask is None
            with _DECODE_SDPA() if pick else contextlib.nullcontext():
                if kv != h and _SDPA_GQA:  # the cache's K/V heads are read in place, not repeated
                    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
                else:
                    if kv != h:
                        k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
                    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
            return self.o_proj(y.transpose(1, 2).reshape(b, s, h * hd), **mb)
        recipe = fp8_attention_recipe(forward_context(self.core_attention))
        if recipe is not None:  # the recipe's fp8_dpa=True
            mask_type = "causal" if s > 1 else "no_mask"
            if recipe.fp8_mha:  # attention's FP8 output straight into the FP8 output projection
                self._check_fp8_mha(q)
                o8 = self.core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask_type=mask_type, fp8_output=True)
                return self.o_proj(self.o_proj.fp8_input(o8, q.dtype), **mb)
            y = self.core_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask_type=mask_type)
            return self.o_proj(y, **mb)
        if kv != h and _SDPA_GQA and (no_grad or fused.TRAINING and fused.train_available(q)):  # K/V read in place
            y = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1, enable_gqa=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, s, h * hd), **mb)
        if kv != h:  # grouped-query attention: each K/V head serves h / kv query heads
            k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)  # one new token attends to all before it
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h * hd), **mb)

    def _check_fp8_mha(self, q: torch.Tensor) -> None:
        """Raises where fp8_mha cannot run; it runs in eager inference, with an o_proj that takes an FP8 input."""
        if torch.compiler.is_compiling():
            raise NotImplementedError("fp8_mha=True does not run under torch.compile (its FP8 output is not a tensor "
                                      "the compiled graph can carry); compile with fp8_dpa=True and fp8_mha=False")
        if torch.is_grad_enabled() and q.requires_grad:
            raise NotImplementedError("fp8_mha=True hands attention's FP8 output to the output projection, which "
                                      "carries no gradient in fp8ext: it runs in inference (torch.no_grad()); "
                                      "to train with FP8 attention use fp8_dpa=True with fp8_mha=False")
        if not (hasattr(self.o_proj, "fp8_input") and self.o_proj.takes_fp8_input()):
            raise NotImplementedError(f"fp8_mha=True hands attention's FP8 output to an FP8 output projection: "
                                      f"quantize the model first (fp8ext.inference.quantize_model, weights "
                                      f"'tensor' or 'channel'); this o_proj is {self.o_proj!r}")

    def _decode(self, q, k_cache, v_cache, length, k_scale, v_scale, mb):
        """o_proj of decode attention of q [b, n_heads, 1, head_dim] over the cache's positions [0, length)."""
        b, h, _, hd = q.shape
        y = attention.decode_attention(q[:, :, 0], k_cache, v_cache, length, k_scale, v_scale)
        return self.o_proj(y.reshape(b, 1, h * hd), **mb)


class SwiGLU(nn.Module):
    """w2(silu(x w1^T) * (x w3^T)); w1 and w3 are one linear layer of 2 * d_ff outputs (one GEMM)."""

    def __init__(self, cfg: TransformerConfig, device=None):
        super().__init__()
        self.w13 = Linear(cfg.d_model, 2 * cfg.d_ff, bias=False, device=device, init_method=_init_out(0.02))
        self.w2 = Linear(cfg.d_ff, cfg.d_model, bias=False, device=device,
                            init_method=_init_out(0.02 / math.sqrt(2 * cfg.n_layers)))

    def forward(self, x, is_first_microbatch=None):
        if fused.TRAINING and torch.is_grad_enabled():  # FP8 training: one node, SwiGLU and its gradient in the casts
            y = swiglu_mlp(self.w13, self.w2, x, is_first_microbatch)
            if y is not None:
                return y
        h = self.w13(x, is_first_microbatch=is_first_microbatch)
        if not torch.is_grad_enabled() and fused.available(h, h.shape[-1] // 2):
            # inference on a GPU: silu(gate) * up in one pass, written as w2's FP8 input when w2 takes one
            into = getattr(self.w2, "quantize_input", None)
            a = into(h, "swiglu") if into is not None else None
            return self.w2(a if a is not None else fused.swiglu(h), is_first_microbatch=is_first_microbatch)
        if fused.TRAINING and fused.train_available(h, h.shape[-1] // 2):  # with gradients: one kernel each way
            # in eager FP8 training with delayed scaling, SwiGLU is computed inside the cast of w2's FP8 input
            y = fused_input_linear(self.w2, SWIGLU, h, is_first_microbatch=is_first_microbatch)
            if y is not None:
                return y
            return self.w2(fused.swiglu(h), is_first_microbatch=is_first_microbatch)
        gate, up = h.chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up, is_first_microbatch=is_first_microbatch)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig, device=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, device=device)
        self.attn = GroupedQueryAttention(cfg, device)
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, device=device)
        self.ffn = SwiGLU(cfg, device)

    def forward(self, x, cos, sin, is_first_microbatch=None, kv_cache=None, start_pos: int = 0):
        x = x + self.attn(self.attn_norm(x), cos, sin, is_first_microbatch, kv_cache, start_pos)
        return x + self.ffn(self.ffn_norm(x), is_first_microbatch)


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]; with `targets`, (logits, mean cross-entropy).
    For generation, `kv_cache` (fp8ext.inference.KVCache) and `start_pos` (the position of ids[:, 0]; for a
    one-token step over an FP8 cache also a one-element int64 tensor on the GPU, read by the kernels, so that
    one CUDA graph serves every step: see fp8ext.inference.generate).

    FP8 is switched on per call: `model(ids, fp8=True, fp8_recipe=...)` runs the blocks' linear layers inside
    `fp8_autocast` (fp8_group max-reduces amaxes across ranks); the embedding and the output projection always
    run in high precision. Parameters are created in the default dtype (float32 master weights); train under
    torch.autocast(dtype=torch.bfloat16) for bf16 compute.
    """

    def __init__(self, cfg: TransformerConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(TransformerBlock(cfg, device) for _ in range(cfg.n_layers))
        for i, block in enumerate(self.blocks):
            block.attn.layer_idx = i
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, device=device)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device)  # high precision
        nn.init.normal_(self.lm_head.weight, std=0.02)
        cos, sin = rope_tables(cfg, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor, targets: Optional[torch.Tensor] = None, *, fp8: bool = False,
                fp8_recipe=None, fp8_group=None, is_first_microbatch: Optional[bool] = None, kv_cache=None,
                start_pos: int = 0):
        if ids.dim() != 2:
            raise ValueError(f"Transformer: ids must be [batch, seq], got shape {list(ids.shape)}")
        graphed = isinstance(start_pos, torch.Tensor)
        if graphed:  # a decode step whose position the kernels read (CUDA graphs; KVCache.append)
            if ids.shape[1] != 1 or kv_cache is None or kv_cache.dtype != "fp8":
                raise ValueError("Transformer: a tensor start_pos is for one-token decode steps over an FP8 KV cache "
                                 "(CUDA graphs); give an int otherwise")
        elif start_pos + ids.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"Transformer: sequence length {start_pos + ids.shape[1]} exceeds max_seq_len "
                             f"{self.cfg.max_seq_len}")
        if self.rope_cos.dtype != torch.float32:  # model.to(bfloat16) rounded the tables: RoPE stays float32
            self.rope_cos, self.rope_sin = rope_tables(self.cfg, self.rope_cos.device)
        x = self.embed(ids)
        with self._fp8_context(fp8, fp8_recipe, fp8_group):
            if graphed:
                cos, sin = self.rope_cos.index_select(0, start_pos), self.rope_sin.index_select(0, start_pos)
            else:
                cos, sin = self.rope_cos[start_pos:], self.rope_sin[start_pos:]
            for block in self.blocks:
                x = block(x, cos, sin, is_first_microbatch, kv_cache, start_pos)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    @staticmethod
    def _fp8_context(fp8, fp8_recipe, fp8_group):
        """fp8_autocast for the blocks, or nothing when the caller already entered the same one (fp8ext.train does,
        outside torch.compile, so that the scale update at the outermost entry is not traced)."""
        outer = current_context()
        if outer is not None and outer.enabled == bool(fp8) and not outer.calibrating and outer.group is fp8_group \
                and (fp8_recipe is None or outer.recipe is fp8_recipe):
            return contextlib.nullcontext()
        return fp8_autocast(enabled=fp8, fp8_recipe=fp8_recipe, fp8_group=fp8_group)

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3x forward): 6 per weight of every matrix
        multiplication, plus attention's scores and weighted sum, 12 * layers * d_model * seq_len (counted in
        full, the causal mask not subtracted, as the usual MFU formula does)."""
        matmul_params = self.num_parameters() - self.embed.weight.numel() - sum(
            p.numel() for n, p in self.named_parameters() if "norm" in n)
        return 6.0 * matmul_params + 12.0 * self.cfg.n_layers * self.cfg.d_model * seq_len


def default_recipe(amax_history_len: int = 16) -> DelayedScaling:
    """The recipe of the FP8 training notes this model comes from: HYBRID, history 16, "max"."""
    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=amax_history_len, amax_compute_algo="max")


def parser() -> argparse.ArgumentParser:
    """The self test's command-line parser (tests/project/test_docs.py parses the documented commands with it)."""
    p = argparse.ArgumentParser(prog="python -m fp8ext.models.transformer",
                                description="Self test: parameter counts, a forward pass and its loss.")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--fp8", action="store_true", help="run the blocks' linear layers in FP8")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=2)
    return p


def _self_test(argv=None) -> None:
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    if args.fp8 and device.type == "cuda" and not cuda_available():
        raise RuntimeError("--fp8 on a GPU needs fp8ext's CUDA kernels; this build has none "
                           f"({build_info()['no_cuda_reason']})")
    torch.manual_seed(0)
    cfg = PRESETS[args.preset]
    model = Transformer(cfg, device=device)
    ids = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        _, loss = model(ids[:, :-1], ids[:, 1:], fp8=args.fp8, fp8_recipe=default_recipe())
    print(f"preset {args.preset}: {asdict(cfg)}")
    print(f"parameters: {model.num_parameters() / 1e6:.2f}M "
          f"({model.num_parameters(exclude_embedding=True) / 1e6:.2f}M without the embedding)")
    print(f"device: {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    print(f"FP8: {'on' if args.fp8 else 'off'}" + (
        " (emulated on the CPU: exact FP8 casts, float32 products)" if args.fp8 and device.type == "cpu" else ""))
    print(f"forward of {args.batch_size} x {args.seq_len} random tokens: loss {loss.item():.4f} "
          f"(uniform guess: ln {cfg.vocab_size} = {math.log(cfg.vocab_size):.4f})")


if __name__ == "__main__":
    _self_test()
