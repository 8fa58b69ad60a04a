"""A KV cache for generation with fp8ext's transformer, in bf16 or in FP8 (E4M3) with per-head scales.

FP8 storage halves the cache's memory: K and V are kept as E4M3 bytes, each KV head of each layer with its own
scale (k_scale / v_scale, which dequantize: K ~= k_byte * k_scale, as in compressed-tensors checkpoints). The
scales come, in this order of preference:
  - from calibration: `KVCache.from_model(model, ...)` takes the model's calibrated scales (amax / 448 of each
    head's K after RoPE and V over the calibration passes; set by fp8ext.inference.calibrate + quantize_model,
    saved in the checkpoint); values beyond the calibrated range saturate at +-448 * scale;
  - given: k_scale / v_scale of shape [n_kv_heads] (every layer) or [n_layers, n_kv_heads];
  - from the prompt: max|K| and max|V| of each head over the prefill, with a margin of one binade for later
    tokens (margin=1.0); values beyond saturate.
`scale_source` says which ("calibrated", "given", "prefill"; None for a bf16 cache).

Prefill (several positions at once) goes through `update`, which stores the step's K/V and returns the cached
K/V dequantized for SDPA. A decode step over an FP8 cache goes through `append`, which stores the step's K/V and
returns the raw E4M3 storage with the layer's scales for fp8ext.inference.attention.decode_attention (on a GPU a
kernel that reads the bytes directly; no dequantized copy of the cache is made).

    cache = KVCache.from_model(model, batch=1, max_len=1024, dtype="fp8")
    logits = model(prompt, kv_cache=cache, start_pos=0)           # prefill
    logits = model(next_token, kv_cache=cache, start_pos=n)       # one decode step
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import _C
from ..core._boundary import dl, dl_fp8, stream_of
from ..core.formats import E4M3
from ..ops import dequantize, quantize

__all__ = ["KVCache", "model_kv_scales"]


def model_kv_scales(model) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The calibrated KV-cache scales a model carries, (k_scale, v_scale) each [n_layers, n_kv_heads] float32,
    from its attention modules' `k_scale` / `v_scale` buffers (ordered by their `layer_idx`); None when the model
    carries none. Some layers with scales and some without is an error."""
    attns = sorted(((m.layer_idx, n, m) for n, m in model.named_modules()
                    if hasattr(m, "layer_idx") and hasattr(m, "k_scale") and hasattr(m, "v_scale")),
                   key=lambda t: t[0])
    have = [(n, m) for _, n, m in attns if m.k_scale is not None and m.v_scale is not None]
    if not have:
        return None
    if len(have) != len(attns):
        missing = [n for _, n, m in attns if m.k_scale is None or m.v_scale is None]
        raise ValueError(f"model_kv_scales: the attention layers {missing} carry no KV-cache scales while others do")
    return (torch.stack([m.k_scale.detach().float().reshape(-1) for _, m in have]),
            torch.stack([m.v_scale.detach().float().reshape(-1) for _, m in have]))


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
        if (k_scale is None) != (v_scale is None):
            raise ValueError("KVCache: give both k_scale and v_scale, or neither (then the prefill sets them)")
        if k_scale is not None and dtype != "fp8":
            raise ValueError(f"KVCache: k_scale/v_scale apply to an FP8 cache only; dtype is {dtype!r}")
        device = self.k.device
        self._k_scales: List[Optional[torch.Tensor]] = self._per_layer(k_scale, "k_scale", device)
        self._v_scales: List[Optional[torch.Tensor]] = self._per_layer(v_scale, "v_scale", device)
        self.scale_source = None if dtype != "fp8" else "prefill" if k_scale is None else "given"

    @classmethod
    def from_model(cls, model, batch: int, max_len: int, dtype: str = "fp8", device=None, *,
                   scales: str = "auto", margin: float = 1.0) -> "KVCache":
        """A cache for `model`. With dtype "fp8", scales="auto" takes the model's calibrated scales when it
        carries them (model_kv_scales) and sets them from the prefill otherwise; "calibrated" requires them;
        "prefill" ignores them."""
        if scales not in ("auto", "calibrated", "prefill"):
            raise ValueError(f"KVCache.from_model: scales must be 'auto', 'calibrated' or 'prefill', got {scales!r}")
        found = model_kv_scales(model) if dtype == "fp8" and scales != "prefill" else None
        if scales == "calibrated" and found is None:
            raise ValueError("KVCache.from_model: scales='calibrated' but the model carries no KV-cache scales: "
                             "run fp8ext.inference.calibrate and quantize_model (or load such a checkpoint)")
        if device is None:
            device = next(iter(model.parameters()), torch.empty(0)).device
        cache = cls(model.cfg, batch, max_len, dtype, device, *(found or (None, None)), margin=margin)
        if found is not None:
            cache.scale_source = "calibrated"
        return cache

    def _per_layer(self, scale, name, device) -> List[Optional[torch.Tensor]]:
        n_layers, kv = self.cfg.n_layers, self.cfg.n_kv_heads
        if scale is None:
            return [None] * n_layers
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"KVCache: {name} must be a tensor, got {type(scale).__name__}")
        s = scale.detach().to(device=device, dtype=torch.float32)
        if s.numel() == kv:
            s = s.reshape(1, kv).expand(n_layers, kv)
        elif tuple(s.shape) != (n_layers, kv):
            raise ValueError(f"KVCache: {name} must be [n_kv_heads] = [{kv}] or [n_layers, n_kv_heads] = "
                             f"[{n_layers}, {kv}], got {list(scale.shape)}")
        if not (torch.isfinite(s).all() and (s > 0).all()):
            raise ValueError(f"KVCache: {name} must be finite and positive, got {scale}")
        return [s[i].contiguous() for i in range(n_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's K and V storage."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def lengths(self) -> List[int]:
        """Positions stored, per layer."""
        return list(self._lengths)

    def truncate(self, length: int) -> None:
        """Forgets positions [length, ...) of every layer (the next step stores at `length`): a rollback, e.g.
        for rejected speculative tokens, or to time one decode step repeatedly. Scales are kept."""
        if not 0 <= length <= min(self._lengths):
            raise ValueError(f"KVCache.truncate: length must be in [0, {min(self._lengths)}], got {length}")
        self._lengths = [length] * len(self._lengths)

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
        if x.is_cuda and _C.WITH_CUDA and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and \
                x.shape[-1] % 8 == 0 and not torch.compiler.is_compiling():
            xc = x.contiguous() if not x.is_contiguous() else x if x.data_ptr() % 16 == 0 else x.clone()
            _C.kv_store(dl(xc), dl(scale), dl_fp8(buf), pos, stream_of(x.device))  # one pass, straight into buf
            return
        scaled = (x.float() / scale[None, :, None, None]).contiguous()
        buf[:, :, pos:pos + s] = quantize(scaled, E4M3, 1.0)

    def _load(self, buf: torch.Tensor, scale: Optional[torch.Tensor], end: int, dtype: torch.dtype) -> torch.Tensor:
        part = buf[:, :, :end]
        if self.dtype == "bf16":
            return part.to(dtype)
        x = dequantize(part.contiguous(), 1.0, torch.float32)
        return (x * scale[None, :, None, None]).to(dtype)

    def _put(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int, fn: str) -> int:
        if not 0 <= layer < len(self._lengths):
            raise ValueError(f"KVCache.{fn}: layer must be in [0, {len(self._lengths)}), got {layer}")
        if k.dim() != 4 or v.shape != k.shape or k.shape[1] != self.cfg.n_kv_heads or \
                k.shape[3] != self.cfg.head_dim or k.shape[0] != self.k.shape[1]:
            raise ValueError(f"KVCache.{fn}: k and v must be [batch {self.k.shape[1]}, n_kv_heads "
                             f"{self.cfg.n_kv_heads}, s, head_dim {self.cfg.head_dim}], got {list(k.shape)} "
                             f"and {list(v.shape)}")
        s = k.shape[2]
        if start_pos != self._lengths[layer]:
            raise ValueError(f"KVCache.{fn}: layer {layer} holds {self._lengths[layer]} positions; "
                             f"start_pos {start_pos} must continue it")
        if start_pos + s > self.max_len:
            raise ValueError(f"KVCache: {start_pos + s} positions exceed max_len {self.max_len}")
        if self.dtype == "fp8" and self._k_scales[layer] is None:  # from the prompt, once
            self._k_scales[layer], self._v_scales[layer] = self._scale_from(k), self._scale_from(v)
        self._store(self.k[layer], k, self._k_scales[layer], start_pos)
        self._store(self.v[layer], v, self._v_scales[layer], start_pos)
        self._lengths[layer] = start_pos + s
        return start_pos + s

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v [b, n_kv_heads, s, head_dim] at positions start_pos .. start_pos + s of `layer` and returns
        the whole cached K and V up to there, dequantized, in k's dtype (the prefill's path, into SDPA)."""
        end = self._put(layer, k, v, start_pos, "update")
        return (self._load(self.k[layer], self._k_scales[layer], end, k.dtype),
                self._load(self.v[layer], self._v_scales[layer], end, v.dtype))

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos):
        """Stores k, v [b, n_kv_heads, s, head_dim] (s = 1 for a decode step) at start_pos of `layer` and returns
        what fp8ext.inference.attention.decode_attention reads: (k_cache, v_cache, length, k_scale, v_scale),
        the layer's raw storage [b, n_kv_heads, max_len, head_dim] (E4M3 bytes, or bf16), the positions now
        stored, and the layer's dequantizing scales [n_kv_heads] float32 (None for a bf16 cache).

        start_pos may also be a one-element int64 tensor on the GPU (a decode step captured in a CUDA graph: the
        kernels read the position, so one capture serves every step). Then s must be 1, the cache FP8 with its
        scales set (by a prefill or calibration), and `length` is returned as the tensor start_pos + 1; nothing
        is checked on the host and `lengths` is not advanced: the caller keeps it with `advance_to`."""
        if isinstance(start_pos, torch.Tensor):
            return self._append_graphed(layer, k, v, start_pos)
        end = self._put(layer, k, v, start_pos, "append")
        return self.k[layer], self.v[layer], end, self._k_scales[layer], self._v_scales[layer]

    def _append_graphed(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        if self.dtype != "fp8" or not k.is_cuda or not _C.WITH_CUDA:
            raise ValueError("KVCache.append: a tensor start_pos (CUDA graphs) needs an FP8 cache on a GPU")
        if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != k.device:
            raise ValueError(f"KVCache.append: a tensor start_pos must be one int64 element on {k.device}, got "
                             f"{pos.dtype} {list(pos.shape)} on {pos.device}")
        if k.dim() != 4 or v.shape != k.shape or k.shape[2] != 1 or k.shape[0] != self.k.shape[1] or \
                k.shape[1] != self.cfg.n_kv_heads or k.shape[3] != self.cfg.head_dim or k.shape[3] % 8:
            raise ValueError(f"KVCache.append: with a tensor start_pos, k and v must be one position, [batch "
                             f"{self.k.shape[1]}, {self.cfg.n_kv_heads}, 1, {self.cfg.head_dim}] (head_dim a "
                             f"multiple of 8), got {list(k.shape)} and {list(v.shape)}")
        ks, vs = self._k_scales[layer], self._v_scales[layer]
        if ks is None:
            raise ValueError("KVCache.append: the FP8 cache's scales are not set yet; run the prefill (or give "
                             "calibrated scales) before a tensor start_pos")
        stream = stream_of(k.device)
        for x, buf, scale in ((k, self.k[layer], ks), (v, self.v[layer], vs)):
            xc = x.contiguous() if not x.is_contiguous() else x if x.data_ptr() % 16 == 0 else x.clone()
            _C.kv_store(dl(xc), dl(scale), dl_fp8(buf), 0, stream, pos_dev=dl(pos))
        return self.k[layer], self.v[layer], pos + 1, ks, vs

    def advance_to(self, length: int) -> None:
        """Records that every layer holds positions [0, length): after decode steps that stored through a tensor
        start_pos (see append), whose positions the host does not see."""
        if not min(self._lengths) <= length <= self.max_len:
            raise ValueError(f"KVCache.advance_to: length must be in [{min(self._lengths)}, {self.max_len}], got "
                             f"{length}")
        self._lengths = [length] * len(self._lengths)

    def scales(self, layer: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(k_scale, v_scale) [n_kv_heads] of `layer` (None before the prefill sets them, or for bf16)."""
        return self._k_scales[layer], self._v_scales[layer]
