"""FP8 casts: quantize, dequantize, amax, cast_transpose and cast_transpose_dbias.

Each function allocates its outputs with torch and runs fp8ext._C on the inputs' device: the bit-exact
C reference on the CPU, a CUDA kernel on the caller's current stream on a GPU. Conventions (the same as
Transformer Engine's): `scale` multiplies, q = fp8(x * scale); `scale_inv` = 1/scale dequantizes,
x ~ float(q) * scale_inv. A scale is a Python number or a one-element float32 tensor on x's device,
read where it lives (no host synchronisation). Under torch.compile the same calls go through the torch
ops registered in fp8ext._library, so they trace without graph breaks.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .. import _C
from ..core import debug
from ..core.boundary import describe, dl, dl_fp8, dl_opt, number, scale_arg, stream_of
from ..core.formats import E4M3, FP8Format, SmallFormat, format_of_dtype, resolve_format
from ..core.profiling import profiled
from ..core.casts import (HIGH_PRECISION as _HIGH_PRECISION, Scale, amax, amax_eager, cast_transpose,
                          cast_transpose_dbias, cast_transpose_dbias_eager, cast_transpose_eager, fp8_empty,
                          quantize_blocks_t, quantize_blocks_t_eager, scale_buffer, scale_from_amax, scale_inv_view)
from ..core.casts import check_out as _check_out, debug_check as _debug_check, describe_2d as _describe_2d
from ..core.casts import scale_parts as _scale_parts, write_back as _write_back

__all__ = ["quantize", "dequantize", "amax", "cast_transpose", "cast_transpose_dbias", "quantize_rowwise",
           "quantize_blockwise", "scale_from_amax"]



def _check_seed(seed: Any, fn: str) -> int:
    if seed is None:
        # Drawn from torch's CPU generator: torch.manual_seed makes it reproducible. No device sync.
        return int(torch.randint(0, 2**62, (), dtype=torch.int64))
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"{fn}(): seed must be an int in [0, 2**63), got {seed!r}")
    return seed


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


