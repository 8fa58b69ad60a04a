"""Fused steps of a transformer block: RMSNorm, SwiGLU and RoPE in one pass each, for inference (the first two
optionally writing the E4M3 input of the next FP8 GEMM directly) and for training (with backward kernels).

    y = fp8ext.fused.rms_norm(x, gamma, eps)                 # x's dtype
    y = fp8ext.fused.rms_norm_train(x, gamma, eps, torch.bfloat16)  # differentiable; any output dtype
    q, scale_inv = fp8ext.fused.rms_norm_fp8(x, gamma, eps)  # E4M3, one scale per row (scale_inv [rows])
    q, _ = fp8ext.fused.rms_norm_fp8(x, gamma, eps, scale)   # E4M3 with a static scale ([1] float32 tensor)
    h = fp8ext.fused.swiglu(gate_up)                         # silu(gate) * up; gate_up [..., 2 * d_ff]
    q, k, v = fp8ext.fused.rope_qkv(qkv, cos, sin, n_heads, n_kv, start_pos)

Definitions (the CPU computes exactly these with torch ops; a CUDA kernel computes them on a GPU):
  rms_norm  y = (x * rsqrt(mean(x^2) + eps)) * gamma in float32, rounded to x's dtype. The sum of squares is
            a reduction, so GPU and CPU may differ in its last bit and y by one unit in the last place.
  swiglu    y = gate / (1 + exp(-gate)) * up in float32, rounded to x's dtype (within one unit in the last
            place of the CPU's, exp being the device's).
  *_fp8     the same y, then exactly fp8ext.quantize(y, E4M3, scale) (static) or fp8ext.quantize_rowwise(y)
            (per row: scale = 448 / max|row|): bit for bit the unfused composition on the same device.
  rope_qkv  splits qkv [batch, seq, (n_heads + 2 n_kv) * head_dim] into q [batch, n_heads, seq, head_dim] and
            k, v [batch, n_kv, seq, head_dim], contiguous; rotates q and k ("rotate half") by cos, sin
            [positions, head_dim / 2] float32 from row start_pos: x1 * c - x2 * s, x1 * s + x2 * c in float32,
            each product and sum rounded, then to qkv's dtype. Bit for bit the same on CPU and GPU.
Gradients: swiglu and rope_qkv are differentiable. On a GPU their backward is one kernel each: for rope_qkv the
exact gradient of its float32 composition (bit for bit autograd's), for swiglu, in float32 with sig = 1 / (1 +
exp(-gate)), d_gate = dy * up * (sig * (1 + gate * (1 - sig))) and d_up = dy * gate / (1 + exp(-gate)), each
rounded once to h's dtype (within one unit in the last place of the CPU's). The GPU's swiglu saves only h for
its backward (torch's composition saves silu(gate) as well). rms_norm_train is RMSNorm for training: its output
in any float dtype, and a backward kernel (see its docstring). On a CPU, autograd differentiates the torch
composition. rms_norm and the *_fp8 functions are for forward passes without gradients. TRAINING (below)
switches fp8ext's layers and model between these kernels and torch's composition when gradients are wanted.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .. import _C
from ..core.boundary import dl, dl_fp8, refuse_broadcast, stream_of
from ..core.formats import E4M3
from . import quantize, quantize_rowwise

__all__ = ["rms_norm", "rms_norm_fp8", "rms_norm_train", "swiglu", "swiglu_fp8", "rope_qkv", "available",
           "train_available", "version_key", "TRAINING"]

# Whether fp8ext's layers and model run these kernels with gradients too (training on a GPU): RMSNorm (the
# modules' forward and backward), SwiGLU, RoPE, and the transformer's grouped-query attention reading K/V in
# place. Under torch.compile, RMSNorm, SwiGLU and RoPE run as torch ops (torch.ops.fp8ext.rms_norm_train, swiglu,
# rope_qkv) and the attention reads K/V in place as in eager mode. False: torch's composition, as on a CPU (for comparisons and
# debugging).
TRAINING = True

_RMSNORM, _SWIGLU = _C.FUSED_RMSNORM, _C.FUSED_SWIGLU  # the row kernel's ops and outputs (csrc/norm.h)
_OUT_HP, _OUT_FP8, _OUT_FP8_ROWS = _C.FUSED_OUT_HP, _C.FUSED_OUT_FP8, _C.FUSED_OUT_FP8_ROWS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA = bool(_C.WITH_CUDA)  # a CUDA tensor implies a visible device


def available(x: torch.Tensor, cols: int = 8) -> bool:
    """Whether the CUDA kernels run for x: a CUDA tensor, fp8ext built with CUDA, outside torch.compile's
    tracing, a float32, bfloat16 or float16 dtype, and an output width `cols` that is a multiple of 8 (16-byte
    vectors). Otherwise the functions compute the same definitions with torch ops."""
    return (x.is_cuda and x.dtype in _DTYPES and cols > 0 and cols % 8 == 0 and _CUDA
            and not torch.compiler.is_compiling())


def train_available(x: torch.Tensor, cols: int = 8) -> bool:
    """Whether the training kernels (swiglu and rms_norm_train, forward and backward) run for x: as available(),
    and also while torch.compile traces, where they run as torch ops (torch.ops.fp8ext.swiglu and
    torch.ops.fp8ext.rms_norm_train, opaque to the compiler: the same kernels and bytes as in eager mode)."""
    return x.is_cuda and x.dtype in _DTYPES and cols > 0 and cols % 8 == 0 and _CUDA


def version_key(t: torch.Tensor):
    """(data_ptr, version) of t, for caches of values derived from it; None for an inference tensor (made under
    torch.inference_mode), which has no version counter: derived values are then recomputed each call."""
    if t.is_inference():
        return None
    return (t.data_ptr(), t._version)


def _check(x: torch.Tensor, fn: str, arg: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}(): {arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{fn}(): {arg} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{fn}(): {arg} must have at least one dimension")


def kernel_rows(x: torch.Tensor, width: int, fn: str, arg: str = "x") -> torch.Tensor:
    """x as contiguous, 16-byte aligned rows of `width` for the kernels: a strided x is copied, a broadcast view
    refused (naming fn and arg) before its copy or reshape materialises every element it describes."""
    refuse_broadcast(x, fn, arg)
    x2 = x.reshape(-1, width)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous() if not x2.is_contiguous() else x2.clone()
    return x2


def _gamma(gamma: torch.Tensor, cols: int, x: torch.Tensor, fn: str) -> torch.Tensor:
    if not isinstance(gamma, torch.Tensor) or gamma.numel() != cols:
        raise ValueError(f"{fn}(): gamma must be a tensor of {cols} values (x's last dimension), got "
                         f"{list(gamma.shape) if isinstance(gamma, torch.Tensor) else type(gamma).__name__}")
    if gamma.device != x.device:
        raise ValueError(f"{fn}(): gamma is on {gamma.device}, x on {x.device}")
    g = gamma.reshape(-1)
    if g.dtype != torch.float32 or not g.is_contiguous():
        return g.float().contiguous()
    return g if g.data_ptr() % 16 == 0 else g.clone()  # the kernel reads gamma in 16-byte vectors


def _scale(scale: torch.Tensor, x: torch.Tensor, fn: str) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"{fn}(): scale must be a one-element float32 tensor (q = fp8(y * scale)), got "
                         f"{scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__}")
    if scale.device != x.device:
        raise ValueError(f"{fn}(): scale is on {scale.device}, x on {x.device}")
    return scale.reshape(1)


def run_rows(x2, gamma, eps, op, mode, scale, fn):
    """(out, per-row scale_inv or None) of the row kernel (fp8ext._C.fused_rows): op _RMSNORM or _SWIGLU over x2
    (from kernel_rows), written as `mode` says: x2's dtype (_OUT_HP), E4M3 with `scale` (_OUT_FP8) or E4M3 with
    per-row scales (_OUT_FP8_ROWS)."""
    rows, cols = x2.shape[0], x2.shape[1] // (2 if op == _SWIGLU else 1)
    if mode == _OUT_HP:
        out = torch.empty(rows, cols, dtype=x2.dtype, device=x2.device)
    else:
        out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x2.device)
    scale_inv = torch.empty(rows, dtype=torch.float32, device=x2.device) if mode == _OUT_FP8_ROWS else None
    _C.fused_rows(dl(x2), None if gamma is None else dl(gamma), dl(out) if mode == _OUT_HP else dl_fp8(out),
                  None if scale is None else dl(scale), None if scale_inv is None else dl(scale_inv), float(eps), op,
                  mode, stream_of(x2.device))
    return out, scale_inv


def swiglu_rows(h2: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h2 = [gate, up] ([rows, 2 cols], from kernel_rows) by the kernel, in h2's dtype."""
    return run_rows(h2, None, 0.0, _SWIGLU, _OUT_HP, None, "swiglu")[0]


def _rms_norm_reference(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return ((xf * rstd) * gamma.float()).to(x.dtype)


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h = [gate, up] with torch ops (float32), in h's dtype: the kernel's definition."""
    g, u = h.float().chunk(2, dim=-1)
    return (g / (1.0 + torch.exp(-g)) * u).to(h.dtype)


def swiglu_backward_reference(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The backward kernel's definition (module docstring) with torch ops: dh = [d_gate, d_up] in h's dtype."""
    g, u = h.float().chunk(2, dim=-1)
    d = dy.float()
    sig = 1.0 / (1.0 + torch.exp(-g))
    return torch.cat([d * u * (sig * (1.0 + g * (1.0 - sig))), d * (g / (1.0 + torch.exp(-g)))], -1).to(h.dtype)


def rms_norm_train_reference(x: torch.Tensor, g32: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """(y, rstd [rows]) of rms_norm_train's definition with torch ops (float32)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return ((xf * rstd) * g32).to(out_dtype), rstd.reshape(-1)


def rms_norm_train_backward_reference(x, dy, g32, rstd):
    """(dx in x's dtype, dgamma float32) of the backward kernel's definition with torch ops."""
    cols = x.shape[-1]
    xh = x.float().reshape(-1, cols) * rstd[:, None]
    d = dy.float().reshape(-1, cols)
    dot = ((d * g32) * xh).sum(-1, keepdim=True) / cols
    dx = rstd[:, None] * ((d * g32) - xh * dot)
    return dx.to(x.dtype).reshape(x.shape), (d * xh).sum(0)


def _fp8_of(y: torch.Tensor, scale: Optional[torch.Tensor]):
    y2 = y.reshape(-1, y.shape[-1]).contiguous()
    if scale is None:
        q, scale_inv = quantize_rowwise(y2, E4M3)
        return q.reshape(y.shape), scale_inv
    return quantize(y2, E4M3, scale.reshape(())).reshape(y.shape), None


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension, in x's dtype (see the module docstring)."""
    _check(x, "rms_norm")
    if not available(x, x.shape[-1]):
        return _rms_norm_reference(x, gamma, eps)
    cols = x.shape[-1]
    out, _ = run_rows(kernel_rows(x, cols, "rms_norm"), _gamma(gamma, cols, x, "rms_norm"), eps, _RMSNORM, _OUT_HP,
                      None, "rms_norm")
    return out.reshape(x.shape)


_SMS = {}


def _sms(device: torch.device) -> int:
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


def rms_norm_train_gpu(x2: torch.Tensor, g: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """(y [rows, cols] in out_dtype, rstd [rows]) by the forward kernel; x2 from kernel_rows, g float32 and aligned."""
    y = torch.empty(x2.shape, dtype=out_dtype, device=x2.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device)
    if x2.shape[0]:
        _C.rms_norm_fwd(dl(x2), dl(g), dl(y), dl(rstd), float(eps), stream_of(x2.device))
    return y, rstd


def rms_norm_train_backward_gpu(x2: torch.Tensor, dy: torch.Tensor, g: torch.Tensor, rstd: torch.Tensor):
    """(dx [rows, cols] in x2's dtype, dgamma float32 [cols]) by the backward kernels."""
    rows, cols = x2.shape
    if rows == 0:
        return torch.zeros_like(x2), torch.zeros_like(g)
    dy2 = contiguous_aligned(dy.reshape(rows, cols), dy.dtype)
    dx = torch.empty_like(x2)
    blocks = min(rows, 4 * _sms(x2.device), 65535)
    partial = torch.empty(blocks, cols, dtype=torch.float32, device=x2.device)
    dgamma = torch.empty(cols, dtype=torch.float32, device=x2.device)
    _C.rms_norm_bwd(dl(x2), dl(dy2), dl(g), dl(rstd), dl(dx), dl(partial), dl(dgamma), stream_of(x2.device))
    return dx, dgamma


class _RMSNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gamma, eps, out_dtype):
        x2 = kernel_rows(x, x.shape[-1], "rms_norm_train")
        g = contiguous_aligned(gamma.detach(), torch.float32)
        y, rstd = rms_norm_train_gpu(x2, g, eps, out_dtype)
        ctx.save_for_backward(x2, g, rstd)
        ctx.shape, ctx.gamma_dtype = x.shape, gamma.dtype
        return y.reshape(x.shape)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming out silently wrong
    def backward(ctx, dy):
        x2, g, rstd = ctx.saved_tensors
        dx, dgamma = rms_norm_train_backward_gpu(x2, dy, g, rstd)
        return dx.reshape(ctx.shape), dgamma.to(ctx.gamma_dtype), None, None


def rms_norm_train(x: torch.Tensor, gamma: torch.Tensor, eps: float,
                   out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """RMSNorm over x's last dimension, differentiable in x and gamma, written in out_dtype (default x's: a
    float32 residual stream normalised under autocast gives its bf16 output directly). On a GPU one kernel each
    way (rows up to 8192 wide): y = (x * rstd) * gamma in float32 rounded once; dx and dgamma in float32, dgamma
    summed in a fixed order (deterministic). On a CPU, and for wider rows, torch's F.rms_norm computes the same
    definition. While torch.compile traces, the kernels run as torch.ops.fp8ext.rms_norm_train.
    """
    _check(x, "rms_norm_train")
    out_dtype = out_dtype or x.dtype
    cols = x.shape[-1]
    if not isinstance(gamma, torch.Tensor) or gamma.numel() != cols or gamma.device != x.device:
        raise ValueError(f"rms_norm_train(): gamma must be a tensor of {cols} values (x's last dimension) on "
                         f"{x.device}")
    if out_dtype not in _DTYPES:
        raise TypeError(f"rms_norm_train(): out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if cols <= 8192 and not available(x, cols) and train_available(x, cols):
        return torch.ops.fp8ext.rms_norm_train(x, gamma.reshape(cols), float(eps), out_dtype)[0]  # torch.compile
    if not available(x, cols) or cols > 8192:
        return F.rms_norm(x.float(), (cols,), gamma.reshape(cols).float(), eps).to(out_dtype)
    return _RMSNormTrain.apply(x, gamma.reshape(cols), eps, out_dtype)


def rms_norm_fp8(x: torch.Tensor, gamma: torch.Tensor, eps: float,
                 scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RMSNorm written as E4M3: (q, scale_inv [rows]) with per-row scales when scale is None, (q, None) with
    the static `scale` (q = fp8(y * scale)). q has x's shape."""
    _check(x, "rms_norm_fp8")
    if scale is not None:
        scale = _scale(scale, x, "rms_norm_fp8")
    if not available(x, x.shape[-1]):
        return _fp8_of(_rms_norm_reference(x, gamma, eps), scale)
    cols = x.shape[-1]
    q, scale_inv = run_rows(kernel_rows(x, cols, "rms_norm_fp8"), _gamma(gamma, cols, x, "rms_norm_fp8"), eps, _RMSNORM,
                             _OUT_FP8_ROWS if scale is None else _OUT_FP8, scale, "rms_norm_fp8")
    return q.reshape(x.shape), scale_inv


def _half_shape(h: torch.Tensor, fn: str):
    if h.shape[-1] % 2:
        raise ValueError(f"{fn}(): the last dimension holds gate then up: it must be even, got {h.shape[-1]}")
    return (*h.shape[:-1], h.shape[-1] // 2)


def _grad_wanted(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def contiguous_aligned(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t as a contiguous, 16-byte aligned tensor of dtype (the kernels read and write 16-byte vectors)."""
    t = t.to(dtype).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def swiglu_backward_gpu(h2: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dh [rows, 2 * cols] by the backward kernel; h2 from kernel_rows."""
    dy2 = contiguous_aligned(dy.reshape(h2.shape[0], h2.shape[1] // 2), h2.dtype)
    dh = torch.empty_like(h2)
    _C.swiglu_backward(dl(h2), dl(dy2), dl(dh), stream_of(h2.device))
    return dh


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        h2 = kernel_rows(h, h.shape[-1], "swiglu", "h")
        out = swiglu_rows(h2)
        ctx.save_for_backward(h2)
        ctx.shape = h.shape
        return out.reshape(*h.shape[:-1], h.shape[-1] // 2)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming out silently wrong
    def backward(ctx, dy):
        (h2,) = ctx.saved_tensors
        return swiglu_backward_gpu(h2, dy).reshape(ctx.shape)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for h = [gate, up] along the last dimension, in h's dtype; differentiable. While
    torch.compile traces, the kernels run as torch.ops.fp8ext.swiglu."""
    _check(h, "swiglu", "h")
    shape = _half_shape(h, "swiglu")
    if not available(h, shape[-1]) and train_available(h, shape[-1]):
        return torch.ops.fp8ext.swiglu(h)  # while torch.compile traces: the same kernels, as a torch op
    if not available(h, shape[-1]):
        return swiglu_reference(h)
    if _grad_wanted(h):
        return _SwiGLU.apply(h)
    out = swiglu_rows(kernel_rows(h, h.shape[-1], "swiglu", "h"))
    return out.reshape(shape)


def swiglu_fp8(h: torch.Tensor, scale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """silu(gate) * up written as E4M3, scaled as rms_norm_fp8's output."""
    _check(h, "swiglu_fp8", "h")
    shape = _half_shape(h, "swiglu_fp8")
    if scale is not None:
        scale = _scale(scale, h, "swiglu_fp8")
    if not available(h, shape[-1]):
        return _fp8_of(swiglu_reference(h), scale)
    q, scale_inv = run_rows(kernel_rows(h, h.shape[-1], "swiglu_fp8", "h"), None, 0.0, _SWIGLU,
                             _OUT_FP8_ROWS if scale is None else _OUT_FP8, scale, "swiglu_fp8")
    return q.reshape(shape), scale_inv


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int,
             start_pos: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) from a fused QKV projection's output, q and k rotated (see the module docstring)."""
    _check(qkv, "rope_qkv", "qkv")
    if qkv.dim() != 3:
        raise ValueError(f"rope_qkv(): qkv must be [batch, seq, (n_heads + 2 n_kv) * head_dim], got "
                         f"{list(qkv.shape)}")
    b, s, width = qkv.shape
    if n_heads < 1 or n_kv < 1 or width % (n_heads + 2 * n_kv):
        raise ValueError(f"rope_qkv(): qkv's last dimension {width} is not (n_heads + 2 n_kv) * head_dim for "
                         f"n_heads={n_heads}, n_kv={n_kv}")
    hd = width // (n_heads + 2 * n_kv)
    for t, arg in ((cos, "cos"), (sin, "sin")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != hd // 2:
            raise ValueError(f"rope_qkv(): {arg} must be float32 [positions, head_dim / 2 = {hd // 2}]")
        if t.device != qkv.device:
            raise ValueError(f"rope_qkv(): {arg} is on {t.device}, qkv on {qkv.device}")
    if not 0 <= start_pos or start_pos + s > cos.shape[0]:
        raise ValueError(f"rope_qkv(): positions {start_pos}..{start_pos + s} exceed the {cos.shape[0]} rows of cos")
    if torch.compiler.is_compiling() and train_available(qkv, 16 if hd % 16 == 0 else 1) and not _grad_wanted(cos, sin):
        return torch.ops.fp8ext.rope_qkv(qkv, cos, sin, n_heads, n_kv, start_pos)  # the same kernels, as a torch op
    if not available(qkv, 16 if hd % 16 == 0 else 1) or _grad_wanted(cos, sin):  # learned tables: torch's ops
        q, k, v = qkv.split([n_heads * hd, n_kv * hd, n_kv * hd], dim=-1)
        c, n = cos[start_pos:start_pos + s], sin[start_pos:start_pos + s]
        return (_rope_reference(q.view(b, s, n_heads, hd).transpose(1, 2), c, n),
                _rope_reference(k.view(b, s, n_kv, hd).transpose(1, 2), c, n),
                v.view(b, s, n_kv, hd).transpose(1, 2).contiguous())
    if _grad_wanted(qkv):
        return _RopeQKV.apply(qkv, cos, sin, n_heads, n_kv, start_pos)
    return rope_qkv_gpu(qkv, cos, sin, n_heads, n_kv, start_pos)


def rope_qkv_gpu(qkv, cos, sin, n_heads, n_kv, start_pos):
    b, s, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv)
    x = contiguous_aligned(qkv, qkv.dtype)
    q = torch.empty(b, n_heads, s, hd, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(b, n_kv, s, hd, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty(b, n_kv, s, hd, dtype=qkv.dtype, device=qkv.device)
    _C.rope_qkv(dl(x), dl(cos.contiguous()), dl(sin.contiguous()), dl(q), dl(k), dl(v), n_heads, n_kv, start_pos,
                stream_of(qkv.device))
    return q, k, v


class _RopeQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, n_heads, n_kv, start_pos):
        ctx.save_for_backward(cos, sin)
        ctx.meta = (qkv.shape, qkv.dtype, n_heads, n_kv, start_pos)
        return rope_qkv_gpu(qkv, cos, sin, n_heads, n_kv, start_pos)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of coming out silently wrong
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        return rope_qkv_backward_gpu(dq, dk, dv, cos, sin, *ctx.meta), None, None, None, None, None


def rope_qkv_backward_gpu(dq, dk, dv, cos, sin, shape, dtype, n_heads, n_kv, start_pos):
    """rope_qkv's gradient dqkv [batch, seq, width] from the gradients of q, k, v (None: zeros), one kernel."""
    b, s, width = shape
    hd = width // (n_heads + 2 * n_kv)
    grads = []
    for g, heads in ((dq, n_heads), (dk, n_kv), (dv, n_kv)):
        grads.append(cos.new_zeros(b, heads, s, hd, dtype=dtype) if g is None else contiguous_aligned(g, dtype))
    dqkv = torch.empty(b, s, width, dtype=dtype, device=cos.device)
    _C.rope_qkv(dl(dqkv), dl(cos.contiguous()), dl(sin.contiguous()), *(dl(g) for g in grads), n_heads, n_kv,
                start_pos, stream_of(cos.device), True)
    return dqkv
