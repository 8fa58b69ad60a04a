"""FP8 casts: quantize, dequantize, amax, cast_transpose and cast_transpose_dbias.

Each function allocates its outputs with torch and runs fp8ext._C on the inputs' device: the bit-exact
C reference on the CPU, a CUDA kernel on the caller's current stream on a GPU. Conventions (the same as
Transformer Engine's): `scale` multiplies, q = fp8(x * scale); `scale_inv` = 1/scale dequantizes,
x ~ float(q) * scale_inv. A scale is a Python number or a one-element float32 tensor on x's device,
read where it lives (no host synchronisation). Under torch.compile the same calls go through the torch
ops registered in fp8ext._library, so they trace without graph breaks.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from .. import _C
from ..core import debug
from ..core._boundary import FP8_DLPACK, describe, dl, dl_fp8, dl_opt, number, scale_arg, stream_of
from ..core.formats import E4M3, FP8Format, SmallFormat, format_of_dtype, resolve_format
from ..core.profiling import profiled

__all__ = ["quantize", "dequantize", "amax", "cast_transpose", "cast_transpose_dbias", "quantize_rowwise",
           "quantize_blockwise", "scale_from_amax"]

Scale = Union[float, torch.Tensor]
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def _check_seed(seed: Any, fn: str) -> int:
    if seed is None:
        # Drawn from torch's CPU generator: torch.manual_seed makes it reproducible. No device sync.
        return int(torch.randint(0, 2**62, (), dtype=torch.int64))
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{fn}(): seed must be an int in [0, 2**63), got {seed!r}")
    return seed


def _scale_parts(scale: Scale, fn: str, arg: str = "scale") -> Tuple[Optional[torch.Tensor], float]:
    if isinstance(scale, torch.Tensor):
        return scale, 1.0
    return None, number(scale, fn, arg, "must be finite and positive in float32")


@profiled("fp8ext.quantize")
def quantize(x: Any, fmt: Any = E4M3, scale: Scale = 1.0, *, saturate: bool = True, stochastic: bool = False,
             seed: Optional[int] = None, amax_out: Optional[torch.Tensor] = None,
             scale_inv_out: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q = fp8(x * scale), as a torch.float8_e4m3fn or torch.float8_e5m2 tensor of x's shape.

    x: float32, bfloat16 or float16, contiguous, on the CPU or a CUDA device (a numpy array works on
    the CPU). The product x * scale is rounded to float32, then to FP8: to nearest even, or
    stochastically with `stochastic=True` (unbiased; the same `seed` gives the same bytes on CPU and
    GPU; seed=None draws one from torch's CPU generator). saturate=True clamps to +-fmt.max (Inf too);
    saturate=False gives the format's own overflow: Inf for E5M2, NaN for E4M3. NaN stays NaN.
    amax_out: a one-element float32 tensor on x's device that becomes max(amax_out, max|x|) (|x| before
    scaling) in the same pass; NaN in x makes it NaN. scale_inv_out: a one-element float32 tensor set to
    1 / scale in the same launch (so a saved FP8 tensor keeps the exact factor that dequantizes it).

    out: a preallocated result (x's shape and device, the format's float8 dtype, or uint8 for the small
    formats, contiguous) written in place and returned, so a training loop can cast into the same buffer every
    step (Transformer Engine's update_quantized); it must not overlap x.

    fmt may also be one of the small formats (fp8ext.E2M1, E2M3, E3M2, E8M0, E4M3FNUZ, E5M2FNUZ; see
    fp8ext.SmallFormat): the result is then uint8 codes, one per byte (pack them with fp8ext.pack_fp4 /
    pack_fp6), computed with round to nearest even (the same bytes on the CPU and on a GPU).
    """
    if isinstance(fmt, SmallFormat):
        return _quantize_small(x, fmt, scale, saturate, stochastic, amax_out, scale_inv_out, out)
    f = resolve_format(fmt, "quantize")
    seed = _check_seed(seed, "quantize") if stochastic else 0
    if torch.compiler.is_compiling():
        scale_t, scale_v = _scale_parts(scale, "quantize")
        q, new_amax = torch.ops.fp8ext.quantize(x, f.code, scale_t, scale_v, saturate, stochastic, seed, amax_out)
        _write_back(amax_out, new_amax, scale_inv_out, scale)
        return q if out is None else out.copy_(q)
    return quantize_eager(x, f, scale, saturate, stochastic, seed, amax_out, scale_inv_out, out)


def _check_out(out: Any, shape, device, dtype: torch.dtype, fn: str, arg: str = "out") -> torch.Tensor:
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


def _quantize_small(x, f: SmallFormat, scale, saturate, stochastic, amax_out, scale_inv_out, out=None
                    ) -> torch.Tensor:
    """quantize() into one of the small formats: uint8 codes (see SmallFormat)."""
    shape, device = describe(x, "quantize")
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8, device=device)
    else:
        _check_out(out, shape, device, torch.uint8, "quantize")
    _C.quantize(dl(x), _to_dl(out), f.code, scale_arg(scale, "quantize"),
                amax_out=dl_opt(amax_out, "quantize", "amax_out"), saturate=saturate, stochastic=stochastic, seed=0,
                stream=stream_of(device), scale_inv_out=dl_opt(scale_inv_out, "quantize", "scale_inv_out"))
    return out


def _write_back(amax_out, new_amax, scale_inv_out, scale) -> None:
    """Under torch.compile: the in-place results of the functional torch ops, as ordinary tensor ops."""
    if amax_out is not None:
        amax_out.copy_(new_amax.reshape(amax_out.shape))
    if scale_inv_out is not None:
        if isinstance(scale, torch.Tensor):
            scale_inv_out.copy_(scale.reciprocal().reshape(scale_inv_out.shape))
        else:
            scale_inv_out.fill_(1.0 / float(scale))


def quantize_eager(x: Any, f: FP8Format, scale: Any, saturate: bool, stochastic: bool, seed: int,
                   amax_out: Optional[torch.Tensor], scale_inv_out: Optional[torch.Tensor] = None,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    shape, device = describe(x, "quantize")
    if debug.enabled():
        _debug_check("quantize", x, scale, "scale")
    out = fp8_empty(shape, f, device) if out is None else _check_out(out, shape, device, f.torch_dtype, "quantize")
    _C.quantize(dl(x), dl_fp8(out), f.code, scale_arg(scale, "quantize"),
                amax_out=dl_opt(amax_out, "quantize", "amax_out"), saturate=saturate, stochastic=stochastic,
                seed=seed, stream=stream_of(device), scale_inv_out=dl_opt(scale_inv_out, "quantize", "scale_inv_out"))
    return out


@profiled("fp8ext.dequantize")
def dequantize(q: Any, scale_inv: Scale = 1.0, dtype: torch.dtype = torch.float32, *,
               fmt: Any = None) -> torch.Tensor:
    """x = float(q) * scale_inv, rounded (to nearest even) to `dtype` (float32, bfloat16 or float16).

    q: a torch.float8_e4m3fn / float8_e5m2 tensor (its dtype gives the format), or uint8 bytes with
    `fmt` given (E4M3, E5M2 or one of the small formats, whose codes are one per byte).
    scale_inv: a Python number or a one-element float32 tensor on q's device.
    """
    fn = "dequantize"
    if dtype not in _HIGH_PRECISION:
        raise TypeError(f"{fn}(): dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    if isinstance(fmt, SmallFormat):
        describe(q, fn, "q")  # before q's values are read: a meta q has none
        if fmt.bits < 8 and isinstance(q, torch.Tensor) and q.dtype == torch.uint8 and q.numel() and \
                int(q.max()) >= 1 << fmt.bits:
            raise ValueError(f"{fn}(): q holds {fmt.name} codes, which are below {1 << fmt.bits}; got "
                             f"{int(q.max())} (packed bytes? unpack them with unpack_fp4 / unpack_fp6)")
        return dequantize_eager(q, fmt, scale_inv, dtype)
    f = _format_of_q(q, fmt, fn)
    if torch.compiler.is_compiling():
        scale_t, scale_v = _scale_parts(scale_inv, fn, "scale_inv")
        return torch.ops.fp8ext.dequantize(q, f.code, scale_t, scale_v, dtype)
    return dequantize_eager(q, f, scale_inv, dtype)


def dequantize_eager(q: Any, f: FP8Format, scale_inv: Any, dtype: torch.dtype) -> torch.Tensor:
    shape, device = describe(q, "dequantize", "q")
    if debug.enabled():
        _debug_check("dequantize", None, scale_inv, "scale_inv")
    out = torch.empty(shape, dtype=dtype, device=device)
    _C.dequantize(dl(q), _to_dl(out), f.code, scale_arg(scale_inv, "dequantize", "scale_inv"),
                  stream=stream_of(device))
    return out


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
        scale_t, scale_v = _scale_parts(scale, "cast_transpose")
        q, qt, new_amax = torch.ops.fp8ext.cast_transpose(x, f.code, scale_t, scale_v, saturate, amax_out)
        _write_back(amax_out, new_amax, scale_inv_out, scale)
        return (q, qt) if out is None else (out[0].copy_(q), out[1].copy_(qt))
    return cast_transpose_eager(x, f, scale, saturate, amax_out, scale_inv_out, out)


def cast_transpose_eager(x: Any, f: FP8Format, scale: Any, saturate: bool, amax_out: Optional[torch.Tensor],
                         scale_inv_out: Optional[torch.Tensor] = None, out=None) -> Tuple[torch.Tensor, torch.Tensor]:
    fn = "cast_transpose"
    shape, device = _describe_2d(x, fn)
    if debug.enabled():
        _debug_check(fn, x, scale, "scale")
    q, qt = _q_and_qt(out, shape, device, f, fn)
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
        scale_t, scale_v = _scale_parts(scale, fn)
        db32 = out is not None and isinstance(out[2], torch.Tensor) and out[2].dtype == torch.float32
        q, qt, db, new_amax = torch.ops.fp8ext.cast_transpose_dbias(x, f.code, scale_t, scale_v, saturate, amax_out,
                                                                    db32)
        _write_back(amax_out, new_amax, scale_inv_out, scale)
        return (q, qt, db) if out is None else (out[0].copy_(q), out[1].copy_(qt), out[2].copy_(db))
    return cast_transpose_dbias_eager(x, f, scale, saturate, amax_out, scale_inv_out, out)


def cast_transpose_dbias_eager(x: Any, f: FP8Format, scale: Any, saturate: bool, amax_out: Optional[torch.Tensor],
                               scale_inv_out: Optional[torch.Tensor] = None, out=None
                               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fn = "cast_transpose_dbias"
    shape, device = _describe_2d(x, fn)
    dtype = _dtype_of(x, fn)
    if debug.enabled():
        _debug_check(fn, x, scale, "scale")
    rows, cols = shape
    q, qt = _q_and_qt(out, shape, device, f, fn)
    if out is None:
        db = torch.empty((cols,), dtype=dtype, device=device)
    else:
        want = torch.float32 if isinstance(out[2], torch.Tensor) and out[2].dtype == torch.float32 else dtype
        db = _check_out(out[2], (cols,), device, want, fn, "out[2]")
    ws = torch.empty(_C.cast_transpose_dbias_workspace(rows, cols), dtype=torch.float32, device=device)
    _C.cast_transpose_dbias(dl(x), dl_fp8(q), dl_fp8(qt), _to_dl(db), _to_dl(ws), f.code, scale_arg(scale, fn),
                            amax_out=dl_opt(amax_out, fn, "amax_out"), saturate=saturate, stream=stream_of(device),
                            scale_inv_out=dl_opt(scale_inv_out, fn, "scale_inv_out"))
    return q, qt, db


def _describe_2d(x: Any, fn: str):
    """(shape, device) of a 2-D x (describe), or the ValueError that says it is not 2-D."""
    shape, device = describe(x, fn)
    if len(shape) != 2:
        raise ValueError(f"{fn}(): x must be 2-D, got shape {list(shape)}")
    return shape, device


def _q_and_qt(out, shape, device, f: FP8Format, fn: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (q [M, N], q_t [N, M]) outputs of a cast-transpose over x [M, N]: new, or out[0] and out[1] checked."""
    shape_t = (shape[1], shape[0])
    if out is None:
        return fp8_empty(shape, f, device), fp8_empty(shape_t, f, device)
    return (_check_out(out[0], shape, device, f.torch_dtype, fn, "out[0]"),
            _check_out(out[1], shape_t, device, f.torch_dtype, fn, "out[1]"))


def _dtype_of(x: Any, fn: str) -> torch.dtype:
    """x's torch dtype (dbias's); for a non-torch array the C layer checks the dtype, so any float is a guess it
    confirms or refuses."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in _HIGH_PRECISION:
            raise TypeError(f"{fn}(): x must be float32, bfloat16 or float16, got {x.dtype} on {x.device}")
        return x.dtype
    name = str(getattr(x, "dtype", ""))
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(name, torch.float32)


def _debug_check(fn: str, x: Any, scale: Any, arg: str) -> None:
    """fp8ext.debug's checks of an input and a device scale (the C layer checks numbers and CPU tensors)."""
    debug.check_finite(x, fn, "x")
    debug.check_scale(scale, fn, arg)


def fp8_empty(shape, f: FP8Format, device) -> torch.Tensor:
    """An uninitialised FP8 tensor: allocated in its float8 dtype where torch exports float8 over DLPack (no view
    needed to hand it to C), else as uint8 viewed as float8."""
    if FP8_DLPACK:
        return torch.empty(shape, dtype=f.torch_dtype, device=device)
    return torch.empty(shape, dtype=torch.uint8, device=device).view(f.torch_dtype)


def _format_of_q(q: Any, fmt: Any, fn: str) -> FP8Format:
    if fmt is not None:
        f = resolve_format(fmt, fn)
        qf = format_of_dtype(q.dtype) if isinstance(q, torch.Tensor) else None
        if qf is not None and qf is not f:
            raise ValueError(f"{fn}(): q is {q.dtype} but fmt={f!r}; leave fmt out or make them agree")
        return f
    if isinstance(q, torch.Tensor):
        f = format_of_dtype(q.dtype)
        if f is not None:
            return f
        raise TypeError(f"{fn}(): q must be a torch.float8_e4m3fn or torch.float8_e5m2 tensor (or uint8 with "
                        f"fmt=...), got {q.dtype}")
    raise TypeError(f"{fn}(): q must be a torch float8 tensor, or give fmt= for uint8 bytes; got {type(q).__name__}")


_to_dl = torch._C._to_dlpack  # fp8ext's own freshly allocated outputs: plain dtypes, always torch


@profiled("fp8ext.quantize_rowwise")
def quantize_rowwise(x: torch.Tensor, fmt: Any = E4M3, *, power_2_scale: bool = False,
                     amax_epsilon: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv): each row of a 2-D x [M, K] quantized with its own scale = fmt.max / max|row| (1 for an
    all-zero row), saturating; scale_inv [M] = 1 / scale, float32, as fp8ext.gemm takes it for per-row
    scaling. One pass over x (K % 8 == 0). power_2_scale=True rounds each scale down to a power of two
    (2^floor(log2(scale)): scale_inv is then exact; torchao's round_scales_to_power_of_2, TE's power_2_scale);
    amax_epsilon raises each row's amax to at least that value first (Transformer Engine's amax_epsilon).
    A row holding NaN or Inf has nothing finite to fit: its scale is 1 and its codes are the saturating cast's
    (NaN stays NaN with x's sign, +-Inf becomes +-fmt.max, as fp8ext.quantize), scale_inv 1; the other rows are
    unaffected (fp8ext.mx, "Non-finite values"). Check inputs that may hold Inf (fp8ext.set_debug_checks)."""
    f = resolve_format(fmt, "quantize_rowwise")
    return _quantize_blocks(x, f, "row", "quantize_rowwise", power_2_scale, amax_epsilon)


@profiled("fp8ext.quantize_blockwise")
def quantize_blockwise(x: torch.Tensor, fmt: Any = E4M3, block: Tuple[int, int] = (1, 128), *,
                       power_2_scale: bool = False, amax_epsilon: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv): a 2-D x [R, C] quantized per block of 1 x 128 (activations) or 128 x 128 (weights),
    DeepSeek-V3's recipe: per block scale = fmt.max / max|block|, saturating; scale_inv = 1 / scale.

    scale_inv comes in the shape and memory layout fp8ext.gemm (cuBLASLt) reads: for 1 x 128 blocks
    [R, ceil(C/128)] stored R-fastest (strides (1, R); R % 4 == 0), for 128 x 128 blocks
    [ceil(R/128), ceil(C/128)] with rows padded to a multiple of 4 floats. One pass over x (C % 8 == 0).
    power_2_scale and amax_epsilon: as in quantize_rowwise (Transformer Engine's Float8BlockScaling uses power-of-two
    scales by default).

    A block holding NaN or Inf has nothing finite to fit: its scale is 1 and its codes are the saturating cast's
    (NaN stays NaN with x's sign, +-Inf becomes +-fmt.max, as fp8ext.quantize), scale_inv 1; the other blocks are
    unaffected (fp8ext.mx, "Non-finite values"). Check inputs that may hold Inf (fp8ext.set_debug_checks).
    """
    f = resolve_format(fmt, "quantize_blockwise")
    if tuple(block) not in ((1, 128), (128, 128)):
        raise ValueError(f"quantize_blockwise(): block must be (1, 128) or (128, 128), got {block}")
    return _quantize_blocks(x, f, "1x128" if block[0] == 1 else "128x128", "quantize_blockwise", power_2_scale,
                            amax_epsilon)


def _quantize_blocks(x, f: FP8Format, kind: str, fn: str, pow2: bool = False, eps: float = 0.0):
    shape, device = _describe_2d(x, fn)
    eps = number(eps, fn, "amax_epsilon")
    if not 0.0 <= eps < float("inf"):
        raise ValueError(f"{fn}(): amax_epsilon must be a finite number >= 0, got {eps}")
    if kind == "1x128" and shape[0] % 4:
        raise ValueError(f"{fn}(): 1x128 blocks need a row count that is a multiple of 4 (cuBLASLt), got {shape[0]}")
    if torch.compiler.is_compiling():
        return torch.ops.fp8ext.quantize_blocks(x, f.code, kind, bool(pow2), eps)
    return quantize_blocks_eager(x, f, kind, bool(pow2), eps, device)


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


def quantize_blocks_t_eager(x: torch.Tensor, f: FP8Format, kind: str, pow2: bool, eps: float, prologue: int = 0,
                            rstd: Optional[torch.Tensor] = None, gamma: Optional[torch.Tensor] = None):
    """quantize_blocks_t eagerly; with a prologue (GPU, "1x128", bf16/float16 x; csrc/cast.h) the casts are those of
    RMSNorm(x) with rstd and gamma (prologue 1) or of SwiGLU(x), x holding gate then up (prologue 2)."""
    rows, cols = x.shape[0], x.shape[1] // (2 if prologue == 2 else 1)
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


def quantize_blocks_eager(x, f: FP8Format, kind: str, pow2: bool, eps: float, device: torch.device
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv) of quantize_rowwise / quantize_blockwise, eagerly, x any DLPack array on `device` (fp8ext._C
    checks x)."""
    rows, cols = x.shape
    br, bc = {"row": (1, cols), "1x128": (1, 128), "128x128": (128, 128)}[kind]
    if kind == "row":  # every row gets its scale (C refuses cols == 0): no fill kernel
        buf, sr, sc = torch.empty((rows,), dtype=torch.float32, device=device), 1, 0
    else:
        buf, sr, sc = scale_buffer(kind, rows, cols, device)
    q = torch.empty((rows, cols), dtype=f.torch_dtype, device=device)
    _C.quantize_blocks(dl(x), _to_dl(q.view(torch.uint8)), _to_dl(buf), f.code, br, bc, sr, sc,
                       stream=stream_of(device), pow2_scale=pow2, amax_epsilon=eps)
    return q, scale_inv_view(buf, kind, cols)


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
