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

Memory pressure: an FP8 cache with overflow="nvfp4" and budget_bytes=N keeps its storage within N bytes by holding
only the newest positions in FP8 and the older ones in NVFP4 (E2M1 codes packed two per byte, an E4M3 scale per 16
values and a float32 tensor scale per moved position: 4.5 bits a value, against 8 for FP8). The budget fixes, at
construction, how many positions the FP8 part holds (fp8_capacity: as many as fit once the NVFP4 part has room for
all older ones up to max_len); when a store would go beyond it, the oldest overflow_chunk FP8 positions of that
layer are re-quantized to NVFP4: their FP8 values, dequantized, go through fp8ext.quantize_nvfp4 as one tensor (one
tensor scale per chunk and layer, for K and V each, kept for each of its positions so that a rollback may cut a
chunk). Reads dequantize the NVFP4 part and the FP8 part and concatenate them (a decode step's attention then runs
the float32 reference, on a GPU too: the FP8 kernel reads FP8 bytes only; no CUDA graphs).
tests/inference/test_kv_overflow.py measures what attention loses.

    cache = KVCache.from_model(model, batch=1, max_len=1024, overflow="nvfp4", budget_bytes=4 * 2**20)
    # the small preset: 6 MiB all in FP8; here the newest 194 positions in FP8, the older ones in NVFP4
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import _C
from ..core.boundary import dl, dl_fp8, stream_of
from ..core.formats import E4M3
from ..ops import dequantize, fused, quantize
from ..ops.mx import dequantize_nvfp4, quantize_nvfp4
from ..ops.packing import pack_fp4, unpack_fp4

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
    """K and V of every layer for `batch` sequences of up to max_len positions (see the module docstring).

    dtype: "fp8" (E4M3 with per-head scales) or "bf16". k_scale / v_scale: given FP8 scales; margin: binades of
    headroom over the prefill's max|K| / max|V| when the prefill sets them.
    overflow: None, or "nvfp4" (FP8 caches only) to keep the storage (nbytes) within budget_bytes bytes (an int
    > 0) by moving the oldest positions to NVFP4, overflow_chunk (at most max_len) positions at a time; head_dim
    must be a multiple of 16 (NVFP4's block). A budget below what max_len positions need with all but the newest
    chunk in NVFP4 is refused; one at or above the all-FP8 size moves nothing."""

    def __init__(self, cfg, batch: int, max_len: int, dtype: str = "fp8", device=None,
                 k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None,
                 margin: float = 1.0, *, overflow: Optional[str] = None, budget_bytes: Optional[int] = None,
                 overflow_chunk: int = 16):
        if dtype not in ("fp8", "bf16"):
            raise ValueError(f"KVCache: dtype must be 'fp8' or 'bf16', got {dtype!r}")
        if max_len > cfg.max_seq_len:
            raise ValueError(f"KVCache: max_len {max_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
        if budget_bytes is not None and overflow is None:
            raise ValueError("KVCache: budget_bytes applies with overflow='nvfp4' only; overflow is None")
        self.cfg, self.dtype, self.max_len, self.margin = cfg, dtype, max_len, margin
        self.overflow, self.budget_bytes, self.overflow_chunk = overflow, budget_bytes, overflow_chunk
        self.fp8_capacity = self._plan_overflow(batch) if overflow is not None else max_len
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, self.fp8_capacity, cfg.head_dim)
        store = torch.float8_e4m3fn if dtype == "fp8" else torch.bfloat16
        self.k = torch.empty(shape, dtype=store, device=device)  # with overflow, position p at p - overflowed
        self.v = torch.empty(shape, dtype=store, device=device)
        self._lengths = [0] * cfg.n_layers  # positions stored per layer
        self._moved = [0] * cfg.n_layers  # of which the first ones are in NVFP4
        self._k4 = self._v4 = None  # NVFP4 part: packed codes, block scales, tensor scale per position
        n4 = self._nvfp4_capacity()
        if n4:
            lead, hd = shape[:3], cfg.head_dim
            self._k4, self._v4 = ((torch.empty(*lead, n4, hd // 2, dtype=torch.uint8, device=device),
                                   torch.empty(*lead, n4, hd // 16, dtype=torch.float8_e4m3fn, device=device),
                                   torch.empty(cfg.n_layers, n4, dtype=torch.float32, device=device))
                                  for _ in range(2))
        if (k_scale is None) != (v_scale is None):
            raise ValueError("KVCache: give both k_scale and v_scale, or neither (then the prefill sets them)")
        if k_scale is not None and dtype != "fp8":
            raise ValueError(f"KVCache: k_scale/v_scale apply to an FP8 cache only; dtype is {dtype!r}")
        device = self.k.device
        self._k_scales: List[Optional[torch.Tensor]] = self._per_layer(k_scale, "k_scale", device)
        self._v_scales: List[Optional[torch.Tensor]] = self._per_layer(v_scale, "v_scale", device)
        self.scale_source = None if dtype != "fp8" else "prefill" if k_scale is None else "given"
        # rope_append's kernel writes the cache's length there (graphed steps): decode attention's length_dev
        self._length_dev = torch.empty(1, dtype=torch.int64, device=device) if device.type == "cuda" else None

    @classmethod
    def from_model(cls, model, batch: int, max_len: int, dtype: str = "fp8", device=None, *,
                   scales: str = "auto", margin: float = 1.0, overflow: Optional[str] = None,
                   budget_bytes: Optional[int] = None, overflow_chunk: int = 16) -> "KVCache":
        """A cache for `model`. With dtype "fp8", scales="auto" takes the model's calibrated scales when it
        carries them (model_kv_scales) and sets them from the prefill otherwise; "calibrated" requires them;
        "prefill" ignores them. overflow, budget_bytes, overflow_chunk: as for the constructor."""
        if scales not in ("auto", "calibrated", "prefill"):
            raise ValueError(f"KVCache.from_model: scales must be 'auto', 'calibrated' or 'prefill', got {scales!r}")
        found = model_kv_scales(model) if dtype == "fp8" and scales != "prefill" else None
        if scales == "calibrated" and found is None:
            raise ValueError("KVCache.from_model: scales='calibrated' but the model carries no KV-cache scales: "
                             "run fp8ext.inference.calibrate and quantize_model (or load such a checkpoint)")
        if device is None:
            device = next(iter(model.parameters()), torch.empty(0)).device
        cache = cls(model.cfg, batch, max_len, dtype, device, *(found or (None, None)), margin=margin,
                    overflow=overflow, budget_bytes=budget_bytes, overflow_chunk=overflow_chunk)
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

    def _plan_overflow(self, batch: int) -> int:
        """Checks the overflow arguments; returns how many positions the FP8 part holds: the most that fit in
        budget_bytes beside an NVFP4 part with room for the older positions (max_len when all fit in FP8)."""
        cfg, budget, chunk = self.cfg, self.budget_bytes, self.overflow_chunk
        if self.overflow != "nvfp4":
            raise ValueError(f"KVCache: overflow must be None or 'nvfp4', got {self.overflow!r}")
        if self.dtype != "fp8":
            raise ValueError(f"KVCache: overflow='nvfp4' moves FP8 positions: it needs dtype='fp8', got "
                             f"{self.dtype!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(f"KVCache: budget_bytes must be an int > 0 with overflow='nvfp4', got {budget!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"KVCache: overflow_chunk must be an int > 0, got {chunk!r}")
        self.overflow_chunk = chunk = min(chunk, self.max_len)
        if cfg.head_dim % 16:
            raise ValueError(f"KVCache: overflow='nvfp4' needs head_dim to be a multiple of 16 (NVFP4's block), "
                             f"got head_dim {cfg.head_dim}")
        row = 2 * cfg.n_layers * batch * cfg.n_kv_heads * cfg.head_dim  # K and V values of one position
        fp8_pos, nvfp4_pos = row, row // 2 + row // 16 + 2 * cfg.n_layers * 4  # bytes one position takes
        if self.max_len * fp8_pos <= budget:
            return self.max_len
        # the FP8 part holds cap positions, the NVFP4 part max_len - cap + chunk - 1 (see _nvfp4_capacity)
        cap = (budget - (self.max_len + chunk - 1) * nvfp4_pos) // (fp8_pos - nvfp4_pos)
        if cap < chunk:
            least = chunk * fp8_pos + (self.max_len - 1) * nvfp4_pos
            raise ValueError(f"KVCache: budget_bytes {budget} is below the {least} bytes that max_len "
                             f"{self.max_len} positions need with all but the newest overflow_chunk ({chunk}) in "
                             f"NVFP4")
        return min(cap, self.max_len - 1)

    def _nvfp4_capacity(self) -> int:
        """Positions the NVFP4 part can hold: a chunk moves only when the FP8 part is full, so at most
        max_len - fp8_capacity + overflow_chunk - 1 of them (none without overflow)."""
        if self.fp8_capacity >= self.max_len:
            return 0
        return min(self.max_len, self.max_len - self.fp8_capacity + self.overflow_chunk - 1)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's K and V storage (with overflow, the FP8 and the NVFP4 parts, tensor scales
        included: at most budget_bytes)."""
        parts = [self.k, self.v] + [t for part in (self._k4, self._v4) if part for t in part]
        return sum(t.numel() * t.element_size() for t in parts)

    @property
    def overflowed(self) -> List[int]:
        """Positions held in NVFP4, per layer: the oldest ones (0 without overflow)."""
        return list(self._moved)

    @property
    def lengths(self) -> List[int]:
        """Positions stored, per layer."""
        return list(self._lengths)

    def truncate(self, length: int) -> None:
        """Forgets positions [length, ...) of every layer (the next step stores at `length`): a rollback, e.g.
        for rejected speculative tokens, or to time one decode step repeatedly. Scales are kept. With overflow,
        the positions kept stay where they are (those moved to NVFP4 during the rolled-back steps stay NVFP4), and
        a length inside the NVFP4 part empties the FP8 part."""
        if not 0 <= length <= min(self._lengths):
            raise ValueError(f"KVCache.truncate: length must be in [0, {min(self._lengths)}], got {length}")
        self._lengths = [length] * len(self._lengths)
        self._moved = [min(m, length) for m in self._moved]

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

    def _load_all(self, layer: int, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, length) of `layer` in `dtype`, with overflow: the NVFP4 part's, then the FP8
        part's."""
        n4, fp8 = self._moved[layer], self._lengths[layer] - self._moved[layer]
        out = []
        for buf, scales, part in ((self.k, self._k_scales, self._k4), (self.v, self._v_scales, self._v4)):
            x = self._load(buf[layer], scales[layer], fp8, dtype)
            if n4:
                codes, block_scales, tensor_scales = part[0][layer], part[1][layer], part[2][layer]
                old = dequantize_nvfp4(unpack_fp4(codes[:, :, :n4]), block_scales[:, :, :n4].contiguous(),
                                       tensor_scales[:n4, None], dtype, check=False)  # no host read
                x = torch.cat([old, x], dim=2)
            out.append(x)
        return out[0], out[1]

    def _move_oldest(self, layer: int) -> None:
        """Re-quantizes the oldest overflow_chunk FP8 positions of `layer` to NVFP4 (one tensor scale for the
        chunk's K, one for its V) and shifts the rest of the FP8 part down over them."""
        n4, c, fp8 = self._moved[layer], self.overflow_chunk, self._lengths[layer] - self._moved[layer]
        for buf, scale, (codes, block_scales, tensor_scales) in ((self.k[layer], self._k_scales[layer], self._k4),
                                                                 (self.v[layer], self._v_scales[layer], self._v4)):
            e, bs, ts = quantize_nvfp4(self._load(buf, scale, c, torch.float32))
            codes[layer, :, :, n4:n4 + c] = pack_fp4(e, check=False)  # E2M1 codes by construction: no host read
            block_scales[layer, :, :, n4:n4 + c] = bs
            tensor_scales[layer, n4:n4 + c].copy_(ts)  # a device copy: the scale stays on the GPU
            buf[:, :, :fp8 - c] = buf[:, :, c:fp8].clone()
        self._moved[layer] = n4 + c

    def _store_overflowing(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> None:
        """Stores k, v at start_pos of `layer` in pieces that fit the FP8 part, moving its oldest chunk to NVFP4
        while the next piece would not fit (decided from the host-side lengths: nothing read from the device)."""
        s, cap = k.shape[2], self.fp8_capacity
        piece = s if cap >= self.max_len else cap - self.overflow_chunk + 1  # fits once the chunks before moved
        for i in range(0, s, piece):
            pos, n = start_pos + i, min(piece, s - i)
            while pos + n - self._moved[layer] > cap:
                self._move_oldest(layer)
            at = pos - self._moved[layer]
            self._store(self.k[layer], k[:, :, i:i + n], self._k_scales[layer], at)
            self._store(self.v[layer], v[:, :, i:i + n], self._v_scales[layer], at)
            self._lengths[layer] = pos + n

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
        if self.overflow is not None:
            self._store_overflowing(layer, k, v, start_pos)
            return start_pos + s
        self._store(self.k[layer], k, self._k_scales[layer], start_pos)
        self._store(self.v[layer], v, self._v_scales[layer], start_pos)
        self._lengths[layer] = start_pos + s
        return start_pos + s

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stores k, v [b, n_kv_heads, s, head_dim] at positions start_pos .. start_pos + s of `layer` and returns
        the whole cached K and V up to there, dequantized, in k's dtype (the prefill's path, into SDPA)."""
        end = self._put(layer, k, v, start_pos, "update")
        if self.overflow is not None:
            return self._load_all(layer, k.dtype)
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
        is checked on the host and `lengths` is not advanced: the caller keeps it with `advance_to`.

        With overflow, (k_cache, v_cache) are the layer's positions [0, length) dequantized to float32, [b,
        n_kv_heads, length, head_dim], and the scales None: decode_attention then runs its float32 reference over
        the NVFP4 and the FP8 part alike. A tensor start_pos is refused."""
        if isinstance(start_pos, torch.Tensor):
            return self._append_graphed(layer, k, v, start_pos)
        end = self._put(layer, k, v, start_pos, "append")
        if self.overflow is not None:
            return (*self._load_all(layer, torch.float32), end, None, None)
        return self.k[layer], self.v[layer], end, self._k_scales[layer], self._v_scales[layer]

    def _check_pos_dev(self, pos: torch.Tensor, device: torch.device, fn: str) -> None:
        if self.dtype != "fp8" or device.type != "cuda" or not _C.WITH_CUDA or self.overflow is not None:
            raise ValueError(f"KVCache.{fn}: a tensor start_pos (CUDA graphs) needs an FP8 cache on a GPU, without "
                             f"overflow (got overflow={self.overflow!r})")
        if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != device:
            raise ValueError(f"KVCache.{fn}: a tensor start_pos must be one int64 element on {device}, got "
                             f"{pos.dtype} {list(pos.shape)} on {pos.device}")

    def rope_append(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                    start_pos):
        """A decode step's RoPE with its K and V stored straight into this FP8 cache: one kernel where
        fp8ext.fused.rope_qkv and append take three, the same bytes (the rotation rounded to qkv's dtype, then
        fp8(x / scale)). qkv [batch, 1, (n_heads + 2 n_kv_heads) * head_dim] on a GPU; cos, sin [positions,
        head_dim / 2] float32 whose first row is the step's position. start_pos as append takes it (an int, or a
        one-element int64 tensor on the GPU for CUDA graphs).

        Returns (q [batch, n_heads, 1, head_dim], k_cache, v_cache, length, k_scale, v_scale) as append returns the
        last five, or None where this cache cannot take the step that way (a bf16 cache, overflow, scales not
        set yet, a CPU tensor, no CUDA kernel, torch.compile tracing, a qkv that wants a gradient): then rope_qkv
        and append. With a tensor start_pos, `length` is one int64 tensor of the cache's that the kernel writes
        (start_pos + 1) on every such call, for the decode attention that follows it: read it before the next
        call, and do not pass it back as a start_pos."""
        hd, kv = self.cfg.head_dim, self.cfg.n_kv_heads
        if (self.dtype != "fp8" or self.overflow is not None or not 0 <= layer < len(self._lengths)
                or self._k_scales[layer] is None or not qkv.is_cuda or not _C.WITH_CUDA or hd % 16
                or qkv.dim() != 3 or qkv.shape[1] != 1 or qkv.shape[2] != (n_heads + 2 * kv) * hd
                or qkv.shape[0] != self.k.shape[1] or qkv.dtype not in (torch.bfloat16, torch.float16, torch.float32)
                or torch.compiler.is_compiling() or (qkv.requires_grad and torch.is_grad_enabled())):
            return None
        graphed = isinstance(start_pos, torch.Tensor)
        if graphed:
            self._check_pos_dev(start_pos, qkv.device, "rope_append")
        else:
            if start_pos != self._lengths[layer]:
                raise ValueError(f"KVCache.rope_append: layer {layer} holds {self._lengths[layer]} positions; "
                                 f"start_pos {start_pos} must continue it")
            if start_pos + 1 > self.max_len:
                raise ValueError(f"KVCache: {start_pos + 1} positions exceed max_len {self.max_len}")
        x = fused.contiguous_aligned(qkv, qkv.dtype)
        q = torch.empty(qkv.shape[0], n_heads, 1, hd, dtype=qkv.dtype, device=qkv.device)
        ks, vs = self._k_scales[layer], self._v_scales[layer]
        kc, vc = self.k[layer], self.v[layer]
        _C.rope_qkv(dl(x), dl(cos.contiguous()), dl(sin.contiguous()), dl(q), dl_fp8(kc), dl_fp8(vc), n_heads, kv, 0,
                    stream_of(qkv.device), k_scale=dl(ks), v_scale=dl(vs), cache_pos=0 if graphed else start_pos,
                    pos_dev=dl(start_pos) if graphed else None,
                    length_out=dl(self._length_dev) if graphed else None)
        if graphed:  # the kernel wrote start_pos + 1 there: no launch of its own for the length
            return q, kc, vc, self._length_dev, ks, vs
        self._lengths[layer] = start_pos + 1
        return q, kc, vc, start_pos + 1, ks, vs

    def _append_graphed(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):
        self._check_pos_dev(pos, k.device, "append")
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
        start_pos (see append), whose positions the host does not see. Not with overflow, whose moves follow the
        host-side lengths."""
        if self.overflow is not None:
            raise ValueError(f"KVCache.advance_to: not with overflow={self.overflow!r} (its moves follow the lengths "
                             "that an int start_pos advances)")
        if not min(self._lengths) <= length <= self.max_len:
            raise ValueError(f"KVCache.advance_to: length must be in [{min(self._lengths)}, {self.max_len}], got "
                             f"{length}")
        self._lengths = [length] * len(self._lengths)

    def scales(self, layer: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(k_scale, v_scale) [n_kv_heads] of `layer` (None before the prefill sets them, or for bf16)."""
        return self._k_scales[layer], self._v_scales[layer]
