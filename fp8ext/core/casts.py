"""The casts a Quantizer makes (fp8ext.core.tensor), and the helpers fp8ext.ops shares with them: amax,
cast_transpose, cast_transpose_dbias, the block casts with their transposed copies, scale_from_amax.

They sit in core because a quantizer is the cast of one tensor role: the quantizers call these, and fp8ext.ops
(which builds on core) re-exports them with its other casts as the public API. Each allocates its outputs with torch
and runs fp8ext._C on the input's device: the bit-exact C reference on the CPU, a CUDA kernel on the caller's current
stream on a GPU. Under torch.compile they call the torch ops that fp8ext.ops registers (torch.ops.fp8ext.*), which
are in place once fp8ext is imported. Conventions: see fp8ext.ops.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from .. import _C
from . import debug
from .boundary import FP8_DLPACK, describe, dl, dl_fp8, dl_opt, number, scale_arg, stream_of
from .formats import E4M3, FP8Format, resolve_format
from .profiling import profiled

__all__ = ["amax", "cast_transpose", "cast_transpose_dbias", "quantize_blocks_t", "scale_from_amax", "fp8_empty",
           "scale_buffer", "scale_inv_view", "PROLOGUE_NONE", "PROLOGUE_RMSNORM", "PROLOGUE_SWIGLU",
           "PROLOGUE_DSWIGLU"]

# The steps a cast can compute on its way (csrc/cast.h's FP8EXT_PROLOGUE_*), as the C module exports them: fp8ext's
# Python code reads them here (fp8ext.modules.fused_linear's RMSNORM, SWIGLU and DSWIGLU are these).
PROLOGUE_NONE, PROLOGUE_RMSNORM = _C.PROLOGUE_NONE, _C.PROLOGUE_RMSNORM
PROLOGUE_SWIGLU, PROLOGUE_DSWIGLU = _C.PROLOGUE_SWIGLU, _C.PROLOGUE_DSWIGLU

Scale = Union[float, torch.Tensor]
HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_to_dl = torch._C._to_dlpack  # fp8ext's own freshly allocated outputs: plain dtypes, always torch


def scale_parts(scale: Scale, fn: str, arg: str = "scale") -> Tuple[Optional[torch.Tensor], float]:
    if isinstance(scale, torch.Tensor):
        return scale, 1.0
    return None, number(scale, fn, arg, "must be finite and positive in float32")


def check_out(out: Any, shape, device, dtype: torch.dtype, fn: str, arg: str = "out") -> torch.Tensor:
    """A caller's output buffer: a torch tensor of `dtype`, `shape`, on `device` (the C layer checks the rest:
    contiguity, writability, no overlap with the inputs)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{fn}(): {arg} must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"{fn}(): {arg} must be {dtype}, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{fn}(): {arg} must have shape {list(shape)}, got {list(out.shape)}")
    if out.device != torch.device(device):
        if out.device.type == "meta":
            raise ValueError(f"{fn}(): {arg} is on meta; fp8ext runs on cpu and cuda (a meta tensor has no data)")
        raise ValueError(f"{fn}(): {arg} is on {out.device}, x on {device}")
    return out


def write_back(amax_out, new_amax, scale_inv_out, scale) -> None:
    """Under torch.compile: the in-place results of the functional torch ops, as ordinary tensor ops."""
    if amax_out is not None:
        amax_out.copy_(new_amax.reshape(amax_out.shape))
    if scale_inv_out is not None:
        if isinstance(scale, torch.Tensor):
            scale_inv_out.copy_(scale.reciprocal().reshape(scale_inv_out.shape))
        else:
            scale_inv_out.fill_(1.0 / float(scale))


@profiled("fp8ext.amax")
def amax(x: Any) -> torch.Tensor:
    """max|x| as a 0-d float32 tensor on x's device (0 for an empty x; NaN if x holds a NaN)."""
    if torch.compiler.is_compiling():
        return torch.ops.fp8ext.amax(x)
    return amax_eager(x)


def amax_eager(x: Any) -> torch.Tensor:
    _, device = describe(x, "amax")
    out = torch.zeros((), dtype=torch.float32, device=device)
    _C.amax(dl(x), _to_dl(out), stream=stream_of(device))
    return out


@profiled("fp8ext.cast_transpose")
def cast_transpose(x: Any, fmt: Any = E4M3, scale: Scale = 1.0, amax_out: Optional[torch.Tensor] = None, *,
                   saturate: bool = True, scale_inv_out: Optional[torch.Tensor] = None,
                   out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, q_t): q = fp8(x * scale) of a 2-D x [M, N] and its transpose q_t [N, M], in one pass over x.

    Rounding, saturation, scale, amax_out and scale_inv_out as in quantize (round to nearest even only).
    The transposed copy is what a GEMM needs when the FP8 operand must be K-major the other way
    (FP8Linear's weight gradient). out: a preallocated pair (q [M, N], q_t [N, M]) written in place and returned
    (see quantize's `out`).
    """
    f = resolve_format(fmt, "cast_transpose")
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise TypeError(f"cast_transpose(): out must be a pair (q, q_t) of tensors, got {type(out).__name__}")
    if torch.compiler.is_compiling():
        scale_t, scale_v = scale_parts(scale, "cast_transpose")
        q, qt, new_amax = torch.ops.fp8ext.cast_transpose(x, f.code, scale_t, scale_v, saturate, amax_out)
        write_back(amax_out, new_amax, scale_inv_out, scale)
        return (q, qt) if out is None else (out[0].copy_(q), out[1].copy_(qt))
    return cast_transpose_eager(x, f, scale, saturate, amax_out, scale_inv_out, out)


def cast_transpose_eager(x: Any, f: FP8Format, scale: Any, saturate: bool, amax_out: Optional[torch.Tensor],
                         scale_inv_out: Optional[torch.Tensor] = None, out=None) -> Tuple[torch.Tensor, torch.Tensor]:
    fn = "cast_transpose"
    shape, device = describe_2d(x, fn)
    if debug.enabled():
        debug_check(fn, x, scale, "scale")
    q, qt = q_and_qt(out, shape, device, f, fn)
    _C.cast_transpose(dl(x), dl_fp8(q), dl_fp8(qt), f.code, scale_arg(scale, fn),
                      amax_out=dl_opt(amax_out, fn, "amax_out"), saturate=saturate, stream=stream_of(device),
                      scale_inv_out=dl_opt(scale_inv_out, fn, "scale_inv_out"))
    return q, qt


@profiled("fp8ext.cast_transpose_dbias")
def cast_transpose_dbias(x: Any, fmt: Any = E4M3, scale: Scale = 1.0, amax_out: Optional[torch.Tensor] = None, *,
                         saturate: bool = True, scale_inv_out: Optional[torch.Tensor] = None,
                         out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, q_t, dbias) of a 2-D gradient x = dy [M, N] in one pass over it (Transformer Engine's
    cast_transpose_dbias): q and q_t exactly as cast_transpose gives them (same bytes, amax_out, scale_inv_out),
    and dbias [N] = dy summed over its M rows, the bias gradient of y = x W^T + b.

    dbias is accumulated in float32 and rounded once to dy's dtype, which is what TE returns (bfloat16 for a
    bfloat16 dy); dy itself is summed, not dy * scale. The additions go in a fixed order (csrc/cast.h: per
    64-row tile, then over tiles), the same on the CPU and on a GPU, so both give the same bits (except a NaN
    result's payload and sign). M == 0 gives zeros. out: a preallocated (q [M, N], q_t [N, M], dbias [N]) written
    in place and returned; dbias may be dy's dtype or float32 (the float32 sum before rounding).
    """
    fn = "cast_transpose_dbias"
    f = resolve_format(fmt, fn)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 3):
        raise TypeError(f"{fn}(): out must be a triple (q, q_t, dbias) of tensors, got {type(out).__name__}")
    if torch.compiler.is_compiling():
        scale_t, scale_v = scale_parts(scale, fn)
        db32 = out is not None and isinstance(out[2], torch.Tensor) and out[2].dtype == torch.float32
        q, qt, db, new_amax = torch.ops.fp8ext.cast_transpose_dbias(x, f.code, scale_t, scale_v, saturate, amax_out,
                                                                    db32)
        write_back(amax_out, new_amax, scale_inv_out, scale)
        return (q, qt, db) if out is None else (out[0].copy_(q), out[1].copy_(qt), out[2].copy_(db))
    return cast_transpose_dbias_eager(x, f, scale, saturate, amax_out, scale_inv_out, out)


def cast_transpose_dbias_eager(x: Any, f: FP8Format, scale: Any, saturate: bool, amax_out: Optional[torch.Tensor],
                               scale_inv_out: Optional[torch.Tensor] = None, out=None
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fn = "cast_transpose_dbias"
    shape, device = describe_2d(x, fn)
    dtype = dtype_of(x, fn)
    if debug.enabled():
        debug_check(fn, x, scale, "scale")
    rows, cols = shape
    q, qt = q_and_qt(out, shape, device, f, fn)
    if out is None:
        db = torch.empty((cols,), dtype=dtype, device=device)
    else:
        want = torch.float32 if isinstance(out[2], torch.Tensor) and out[2].dtype == torch.float32 else dtype
        db = check_out(out[2], (cols,), device, want, fn, "out[2]")
    ws = torch.empty(_C.cast_transpose_dbias_workspace(rows, cols), dtype=torch.float32, device=device)
    _C.cast_transpose_dbias(dl(x), dl_fp8(q), dl_fp8(qt), _to_dl(db), _to_dl(ws), f.code, scale_arg(scale, fn),
                            amax_out=dl_opt(amax_out, fn, "amax_out"), saturate=saturate, stream=stream_of(device),
                            scale_inv_out=dl_opt(scale_inv_out, fn, "scale_inv_out"))
    return q, qt, db


def describe_2d(x: Any, fn: str):
    """(shape, device) of a 2-D x (describe), or the ValueError that says it is not 2-D."""
    shape, device = describe(x, fn)
    if len(shape) != 2:
        raise ValueError(f"{fn}(): x must be 2-D, got shape {list(shape)}")
    return shape, device


def q_and_qt(out, shape, device, f: FP8Format, fn: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (q [M, N], q_t [N, M]) outputs of a cast-transpose over x [M, N]: new, or out[0] and out[1] checked."""
    shape_t = (shape[1], shape[0])
    if out is None:
        return fp8_empty(shape, f, device), fp8_empty(shape_t, f, device)
    return (check_out(out[0], shape, device, f.torch_dtype, fn, "out[0]"),
            check_out(out[1], shape_t, device, f.torch_dtype, fn, "out[1]"))


def dtype_of(x: Any, fn: str) -> torch.dtype:
    """x's torch dtype (dbias's); for a non-torch array the C layer checks the dtype, so any float is a guess it
    confirms or refuses."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in HIGH_PRECISION:
            raise TypeError(f"{fn}(): x must be float32, bfloat16 or float16, got {x.dtype} on {x.device}")
        return x.dtype
    name = str(getattr(x, "dtype", ""))
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name, torch.float32)


def debug_check(fn: str, x: Any, scale: Any, arg: str) -> None:
    """fp8ext.debug's checks of an input and a device scale (the C layer checks numbers and CPU tensors)."""
    debug.check_finite(x, fn, "x")
    debug.check_scale(scale, fn, arg)


def fp8_empty(shape, f: FP8Format, device) -> torch.Tensor:
    """An uninitialised FP8 tensor: allocated in its float8 dtype where torch exports float8 over DLPack (no view
    needed to hand it to C), else as uint8 viewed as float8."""
    if FP8_DLPACK:
        return torch.empty(shape, dtype=f.torch_dtype, device=device)
    return torch.empty(shape, dtype=torch.uint8, device=device).view(f.torch_dtype)


def scale_buffer(kind: str, rows: int, cols: int, device) -> Tuple[torch.Tensor, int, int]:
    """(buffer, stride_r, stride_c) of the float32 scale_inv buffer of `kind` blocks ("row", "1x128", "128x128") over
    a [rows, cols] tensor, in the memory layout cuBLASLt reads (see quantize_blockwise)."""
    if kind == "1x128":
        return torch.zeros((-(-cols // 128), rows), dtype=torch.float32, device=device), 1, rows  # rows fastest
    if kind == "128x128":
        ld = -(-cols // 128 // 4) * 4  # one float per 128 columns, rows padded to a multiple of 4 floats
        return torch.zeros((-(-rows // 128), ld), dtype=torch.float32, device=device), ld, 1
    return torch.ones((rows,), dtype=torch.float32, device=device), 1, 0  # (rows of no values keep scale_inv 1)


def scale_inv_view(buf: torch.Tensor, kind: str, cols: int) -> torch.Tensor:
    """The scale_inv tensor gemm() takes, as a view of scale_buffer's buffer for a tensor of `cols` columns."""
    if kind == "1x128":
        return buf.t()
    if kind == "128x128":
        return buf[:, :-(-cols // 128)]
    return buf


def quantize_blocks_t(x: torch.Tensor, f: FP8Format, kind: str, pow2: bool, eps: float):
    """(q, scale_inv, qt, scale_inv_t): x in "row", "1x128" or "128x128" blocks and its transposed cast (x^T with a
    scale per row, in 1 x 128 tiles of its own, or the same 128 x 128 blocks transposed; csrc/cast.h); x contiguous,
    2-D, its row count a multiple of 16 on a GPU. Under torch.compile the torch op."""
    if torch.compiler.is_compiling():
        return torch.ops.fp8ext.quantize_blocks_t(x, f.code, kind, pow2, eps)
    return quantize_blocks_t_eager(x, f, kind, pow2, eps)


def quantize_blocks_t_eager(x: torch.Tensor, f: FP8Format, kind: str, pow2: bool, eps: float,
                            prologue: int = PROLOGUE_NONE, rstd: Optional[torch.Tensor] = None,
                            gamma: Optional[torch.Tensor] = None):
    """quantize_blocks_t eagerly; with a prologue (GPU, "1x128", bf16/float16 x; csrc/cast.h) the casts are those of
    RMSNorm(x) with rstd and gamma (PROLOGUE_RMSNORM) or of SwiGLU(x), x holding gate then up (PROLOGUE_SWIGLU)."""
    rows, cols = x.shape[0], x.shape[1] // (2 if prologue == PROLOGUE_SWIGLU else 1)
    dev = x.device
    buf, sr, sc = scale_buffer(kind, rows, cols, dev)
    buf_t, srt, sct = scale_buffer(kind, cols, rows, dev)
    q = torch.empty((rows, cols), dtype=f.torch_dtype, device=dev)
    qt = torch.empty((cols, rows), dtype=f.torch_dtype, device=dev)
    br, bc = {"row": (1, cols), "1x128": (1, 128), "128x128": (128, 128)}[kind]
    _C.quantize_blocks(dl(x), _to_dl(q.view(torch.uint8)), _to_dl(buf), f.code, br, bc, sr, sc,
                       stream=stream_of(dev), pow2_scale=pow2, amax_epsilon=eps,
                       qt=_to_dl(qt.view(torch.uint8)), scale_inv_t=_to_dl(buf_t), stride_rt=srt, stride_ct=sct,
                       prologue=prologue, rstd=None if rstd is None else _to_dl(rstd),
                       gamma=None if gamma is None else _to_dl(gamma))
    return q, scale_inv_view(buf, kind, cols), qt, scale_inv_view(buf_t, kind, rows)


def scale_from_amax(amax: torch.Tensor, fmt: Any = E4M3, margin: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) for current scaling from a one-element amax tensor, on its device: scale =
    fmt.max / amax / 2**margin, or 1 when amax is 0 or not finite (capped at the float32 maximum)."""
    f = resolve_format(fmt, "scale_from_amax")
    margin = number(margin, "scale_from_amax", "margin")
    if torch.compiler.is_compiling():
        a = amax.reshape(()).float()
        ok = (a > 0) & torch.isfinite(a)
        # fmt.max / a as a tensor division, as the C rule divides: a Python number over a tensor is
        # a.reciprocal() * fmt.max (Tensor.__rtruediv__), which is 1 ulp off for some amaxes
        scale = torch.full_like(a, f.max) / a / 2.0 ** margin
        scale = torch.where(ok, scale.clamp(max=torch.finfo(torch.float32).max), 1.0)
        return scale, scale.reciprocal()
    _, device = describe(amax, "scale_from_amax", "amax")
    scale = torch.empty((), dtype=torch.float32, device=device)
    scale_inv = torch.empty((), dtype=torch.float32, device=device)
    _C.scale_from_amax(dl(amax), _to_dl(scale), _to_dl(scale_inv), f.code, margin, stream=stream_of(device))
    return scale, scale_inv
