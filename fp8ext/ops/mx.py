"""Block-scaled formats: OCP Microscaling (MX) and NVIDIA's NVFP4, on the CPU and (one-pass kernel) on a GPU.

MX (OCP MX v1.0): every block of 32 consecutive values along the last dimension shares one power-of-two scale
X = 2^e, stored as E8M0; each element is V / X in the element format (E4M3 or E5M2 for MXFP8, E3M2 or E2M3 for
MXFP6, E2M1 for MXFP4), rounded to nearest even and saturated.
    scale_rule="floor" (the specification's, torchao's FLOOR):  e = floor(log2(amax)) - emax(element format)
    scale_rule="rceil" (cuBLAS's):                               e = ceil(log2(amax / max(element format)))
e is clamped to [-127, 127]; a block of zeros gets e = -127; a block holding NaN or Inf gets the NaN scale 0xFF.
FLOOR keeps the block's largest value within the element format's top binade (it may saturate at the very top);
RCEIL never saturates and may leave the top binade unused.

NVFP4: blocks of 16 E2M1 values with an E4M3 block scale and one float32 scale for the tensor:
    tensor_scale = amax(x) / (448 * 6), block scale s = fp8_E4M3(amax(block) / 6 / tensor_scale),
    elements = E2M1(x / (s * tensor_scale)),   x ~= element * s * tensor_scale.
amax(x) is the maximum over the blocks that hold no NaN or Inf (see "Non-finite values").

Non-finite values stay non-finite, one block at a time (OCP MX v1.0: a NaN scale makes every element of its block
NaN), and the other blocks get exactly the bytes they get without the bad one:
    MX      a block holding NaN or Inf gets the E8M0 NaN code 0xFF; dequantize_mx gives NaN for all its elements.
            Its element codes are those of x * 2^127 (NaN keeps its code in E4M3/E5M2; the rest saturates).
    NVFP4   a block holding NaN or Inf gets the E4M3 NaN code 0x7F as its block scale (dequantize_nvfp4: NaN for
            all 16 elements) and is left out of the tensor's amax, so one Inf does not make tensor_scale Inf and
            every other block NaN. Its element codes are E2M1(x) (saturated; a NaN gives the zero of the opposite sign).
    FP8     fp8ext.quantize keeps NaN as NaN (x's sign) and, with saturate=True (the default, as Transformer
            Engine's and cuda_fp8's __NV_SATFINITE casts), maps +-Inf to +-max; saturate=False gives E5M2's Inf and
            E4M3's NaN. quantize_rowwise / quantize_blockwise (per-row / per-block "current" scaling) keep their
            established rule, shared with the fused RMSNorm/SwiGLU casts and tested as such: a row or block holding
            NaN or Inf gets scale 1 (csrc/fp8_numerics.h, fp8_scale_for_amax), then the saturating cast: NaN stays
            NaN, +-Inf becomes +-max; scale_inv is 1 and the other rows or blocks are unaffected.
    weights WeightOnlyLinear and FP8InferenceLinear refuse a weight holding NaN or Inf with a ValueError naming it.
On a GPU the kernel (csrc/kernels/quantize_mx.cu) applies the same rule inside its amax reduction (no extra pass) and
gives the same bytes.

On the CPU the roundings are fp8ext's (fp8ext.quantize) and this module arranges blocks and scales with torch
operations; that code is the reference, and it runs on a GPU too. On a GPU, quantize_mx with block=32 and
quantize_nvfp4 run fp8ext's own kernel instead (csrc/kernels/quantize_mx.cu): one pass over x for MX; for NVFP4 one
pass for the tensor's amax, then one that quantizes. The kernel repeats the reference's float32 operations in its
order (divisions stay divisions) and gives its bytes. Other block sizes, and calls under torch.compile (the kernel
is not a registered torch op), take the torch code on a GPU too. A non-contiguous x is copied first on a GPU; a
broadcast view (stride 0) is refused with a ValueError, as fp8ext.quantize refuses it.
Codes come one per byte (fp8ext.pack_fp4 / pack_fp6 pack them).
A NaN's sign: a NaN element keeps x's sign; an NVFP4 block scale that is NaN (a block holding NaN or Inf, or 0/0
in an all-zero block of a tensor whose amax is so small that tensor_scale is 0) is the positive NaN code 0x7F on
every platform (x86 would make 0/0 a negative NaN, a GPU a positive one).
"""

from __future__ import annotations

import operator
from typing import Tuple

import torch

from .. import _C
from ..core.boundary import check_device, dl, dl_fp8, refuse_broadcast, stream_of
from ..core.formats import E2M1, E2M3, E3M2, E4M3, E5M2, E8M0
from . import dequantize, dequantize_eager, fp8_empty, quantize

_to_dl = torch._C._to_dlpack  # fp8ext's own freshly allocated outputs: plain dtypes

__all__ = ["quantize_mx", "dequantize_mx", "quantize_nvfp4", "dequantize_nvfp4", "MX_ELEMENT_FORMATS"]

MX_ELEMENT_FORMATS = (E4M3, E5M2, E3M2, E2M3, E2M1)
# exponent of the largest normal power of two of each element format (OCP MX table 1)
_EMAX = {E4M3.name: 8, E5M2.name: 15, E3M2.name: 4, E2M3.name: 2, E2M1.name: 2}


def _check_block(block, fn: str) -> int:
    """block as a positive int; TypeError for a non-integer (a bool included), ValueError for 0 or less."""
    if isinstance(block, bool):
        raise TypeError(f"{fn}(): block must be a positive int (values per scaling block), got {block!r}")
    try:
        b = operator.index(block)
    except TypeError:
        raise TypeError(f"{fn}(): block must be a positive int (values per scaling block), got "
                        f"{type(block).__name__} {block!r}") from None
    if b <= 0:
        raise ValueError(f"{fn}(): block must be a positive int (values per scaling block; 32 is OCP MX's and the "
                         f"only size the GPU kernel runs, others take the torch code), got {b}")
    return b


def _check_dtype(dtype, fn: str) -> torch.dtype:
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"{fn}(): dtype must be one of {list(_OUT_DTYPES)}, got {dtype!r}")
    return dtype


_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_x(x: torch.Tensor, block: int, fn: str, what: str = "") -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}(): x must be a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"{fn}(): the last dimension of x must be a multiple of {what or f'block={block}'}, got "
                         f"shape {list(x.shape)}")
    refuse_broadcast(x, fn)  # before the copy (GPU) or the x-sized float32 temporaries (torch code) it would take


def refuse_non_finite(w: torch.Tensor, fn: str, arg: str, why: str) -> None:
    """ValueError naming `arg` when w holds NaN or Inf: how many, and where the first one is. For layers that pack
    a weight once (the weight-only and FP8 inference layers): a packed weight that stood for non-finite values would
    make every output it touches NaN, so it is refused at packing time rather than at the first forward."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{fn}: {arg} holds NaN or Inf ({int(bad.sum())} of {w.numel()} values, the first "
                         f"{w[tuple(first)].item()} at {first}); {why}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _use_kernel(x: torch.Tensor) -> bool:
    """Whether fp8ext's one-pass kernel takes this call: x on a GPU, outside torch.compile's tracing."""
    return x.is_cuda and not torch.compiler.is_compiling()


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for integer k in [-127, 127], built from its bits (exact; pow and ldexp on a GPU need not
    be): the exponent field for k >= -126, the subnormal 2^-127 below."""
    k = k.to(torch.int32)
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 0x00400000))
    return bits.view(torch.float32)


def _elem_format(elem, fn: str):
    if elem not in MX_ELEMENT_FORMATS:
        raise ValueError(f"{fn}(): elem must be one of {list(MX_ELEMENT_FORMATS)}, got {elem!r}")
    return elem


def quantize_mx(x: torch.Tensor, elem=E4M3, block: int = 32, scale_rule: str = "floor"
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(elements, scales): x [..., K] in MX blocks of `block` values along the last dimension. elements has x's
    shape (float8 for E4M3/E5M2, uint8 codes otherwise); scales [..., K / block] are E8M0 codes (uint8).
    On a GPU, block=32 runs in one pass of fp8ext's kernel; other block sizes run the torch code (same bytes).
    block: a positive int dividing K (ValueError otherwise; TypeError for a non-integer).
    Non-finite values: a block holding NaN or Inf gets the NaN scale 0xFF and dequantizes to NaN as a whole; the
    other blocks are unaffected (module docstring, "Non-finite values")."""
    fn = "quantize_mx"
    f = _elem_format(elem, fn)
    block = _check_block(block, fn)
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"{fn}(): scale_rule must be 'floor' or 'rceil', got {scale_rule!r}")
    _check_x(x, block, fn)
    if block == 32 and _use_kernel(x):
        return _quantize_mx_kernel(x.contiguous(), f, scale_rule == "rceil")
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1)  # NaN where the block holds a NaN
    finite = amax.isfinite()  # False for a block holding NaN or Inf: the NaN scale, e = -127 for its elements
    mant, exp = torch.frexp(amax.double())  # amax = mant * 2^exp, mant in [0.5, 1)
    if scale_rule == "floor":
        e = exp - 1 - _EMAX[f.name]
    else:  # ceil(log2(amax / max)): the quotient is exact when it is a power of two (see the module docstring)
        qm, qe = torch.frexp(amax.double() / f.max)
        e = torch.where(qm == 0.5, qe - 1, qe)
    e = torch.where((amax > 0) & finite, e, torch.full_like(e, -127)).clamp(-127, 127)
    scales = (e + 127).to(torch.uint8)
    scales = torch.where(finite, scales, torch.full_like(scales, 0xFF))
    scaled = xb * _pow2(-e)[..., None]  # one rounding of x * 2^-e, the same on the CPU and a GPU
    scaled = torch.where(scaled.isnan(), xb, scaled)  # a NaN keeps x's sign (arithmetic's NaN sign is not portable)
    elements = quantize(scaled.reshape(x.shape).contiguous(), f, 1.0, saturate=True)
    return elements, scales


def _quantize_mx_kernel(x: torch.Tensor, f, rceil: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    fp8 = f in (E4M3, E5M2)
    elements = fp8_empty(x.shape, f, x.device) if fp8 else torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // 32), dtype=torch.uint8, device=x.device)
    _C.quantize_mx(dl(x), dl_fp8(elements) if fp8 else _to_dl(elements), _to_dl(scales), f.code, rceil,
                   stream=stream_of(x.device))
    return elements, scales


def dequantize_mx(elements: torch.Tensor, scales: torch.Tensor, elem=E4M3, block: int = 32,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ~= element * 2^(scale - 127) (NaN where the scale is 0xFF: the whole block of a non-finite input), rounded
    to `dtype` (float32, bfloat16, float16 or float64). elements: what quantize_mx returned (float8 of elem's format
    for E4M3/E5M2, or its uint8 bytes; uint8 codes for the FP6/FP4 formats); scales: uint8 E8M0 codes
    [..., K / block] on elements' device; block: a positive int."""
    fn = "dequantize_mx"
    f = _elem_format(elem, fn)
    block = _check_block(block, fn)
    dtype = _check_dtype(dtype, fn)
    if not isinstance(elements, torch.Tensor) or elements.dtype not in (f.torch_dtype, torch.uint8):
        want = f"{f.torch_dtype} (or its uint8 bytes)" if f in (E4M3, E5M2) else "uint8 codes"
        raise TypeError(f"{fn}(): elements must be {want} for elem={f.name}, got "
                        f"{getattr(elements, 'dtype', type(elements).__name__)}")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8:
        raise TypeError(f"{fn}(): scales must be uint8 E8M0 codes, got "
                        f"{getattr(scales, 'dtype', type(scales).__name__)}")
    if elements.dim() == 0 or elements.shape[:-1] != scales.shape[:-1] or \
            elements.shape[-1] != scales.shape[-1] * block:
        raise ValueError(f"{fn}(): elements {list(elements.shape)} and scales {list(scales.shape)} do not match "
                         f"blocks of {block}")
    check_device(elements, fn, "elements")
    check_device(scales, fn, "scales")
    if elements.device != scales.device:
        raise ValueError(f"{fn}(): scales is on {scales.device}, elements on {elements.device}")
    values = dequantize(elements, 1.0, torch.float32, fmt=f)
    factor = dequantize(scales, 1.0, torch.float32, fmt=E8M0)  # 2^(code - 127), NaN for 0xFF
    out = values.reshape(*scales.shape, block) * factor[..., None]
    return out.reshape(elements.shape).to(dtype)


def quantize_nvfp4(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(elements, block_scales, tensor_scale): E2M1 codes (uint8, x's shape), E4M3 block scales
    [..., K / 16] (torch.float8_e4m3fn) and a float32 0-d tensor scale (see the module docstring).
    On a GPU: one pass for the amax, then one pass of the quantize kernel. x must not be empty, and its last
    dimension must be a multiple of 16 (the NVFP4 block; there is no block argument).
    Non-finite values: a block of 16 holding NaN or Inf gets the block scale 0x7F (E4M3 NaN) and dequantizes to
    NaN as a whole; it is left out of the tensor's amax, so the other blocks are what they are without it."""
    fn = "quantize_nvfp4"
    _check_x(x, 16, fn, "16 (NVFP4's block)")
    if x.numel() == 0:
        raise ValueError(f"{fn}(): x must not be empty (the tensor scale is made from its amax), got shape "
                         f"{list(x.shape)}")
    if _use_kernel(x):
        return _quantize_nvfp4_kernel(x.contiguous())
    xb = _blocks(x, 16)
    block_amax = xb.abs().amax(dim=-1)  # NaN where the block holds a NaN
    finite = block_amax.isfinite()
    amax = torch.where(finite, block_amax, torch.zeros_like(block_amax)).amax()  # over the finite blocks
    tensor_scale = torch.where(amax > 0, amax / (E4M3.max * E2M1.max), torch.ones_like(amax))
    ratio = block_amax / E2M1.max / tensor_scale
    # a non-finite block, and 0 / 0, give the positive NaN (module docstring), E4M3 0x7F
    ratio = torch.where(ratio.isnan() | ~finite, torch.full_like(ratio, float("nan")), ratio)
    block_scales = quantize(ratio, E4M3, 1.0, saturate=True)
    s = dequantize(block_scales, 1.0, torch.float32) * tensor_scale
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero block: any scale gives zeros
    scaled = xb / s[..., None]
    scaled = torch.where(scaled.isnan(), xb, scaled)  # a NaN keeps x's sign, as in quantize_mx
    elements = quantize(scaled.reshape(x.shape).contiguous(), E2M1, 1.0, saturate=True)
    return elements, block_scales, tensor_scale


def _quantize_nvfp4_kernel(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    elements = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    block_scales = fp8_empty((*x.shape[:-1], x.shape[-1] // 16), E4M3, x.device)
    tensor_scale = torch.empty((), dtype=torch.float32, device=x.device)
    amax = torch.empty((), dtype=torch.float32, device=x.device)  # workspace, zeroed by the launcher
    _C.quantize_nvfp4(dl(x), _to_dl(elements), dl_fp8(block_scales), _to_dl(tensor_scale), _to_dl(amax),
                      stream=stream_of(x.device))
    return elements, block_scales, tensor_scale


def _broadcasts(shape, target) -> bool:
    """Whether a tensor of `shape` broadcasts against `target` without changing target's shape."""
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


def dequantize_nvfp4(elements: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32, *, check: bool = True) -> torch.Tensor:
    """x ~= element * block_scale * tensor_scale, rounded to `dtype` (float32, bfloat16, float16 or float64); NaN for
    every element of a block whose scale is the NaN code 0x7F. elements: uint8 E2M1 codes [..., K]; block_scales:
    torch.float8_e4m3fn [..., K / 16]; tensor_scale: a one-element float tensor, or several that broadcast against
    block_scales (e.g. [..., n, 1] for rows quantized separately, as the KV cache's NVFP4 part keeps them); each
    block's scale is block_scale * tensor_scale in float32 either way. check=False skips the test that every code is
    below 16 (it reads the codes on the host: a synchronisation inside a decode step; unpack_fp4's codes pass it)."""
    fn = "dequantize_nvfp4"
    dtype = _check_dtype(dtype, fn)
    if not isinstance(elements, torch.Tensor) or elements.dtype != torch.uint8:
        raise TypeError(f"{fn}(): elements must be uint8 E2M1 codes, got "
                        f"{getattr(elements, 'dtype', type(elements).__name__)}")
    if not isinstance(block_scales, torch.Tensor) or block_scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{fn}(): block_scales must be torch.float8_e4m3fn, got "
                        f"{getattr(block_scales, 'dtype', type(block_scales).__name__)}")
    if not isinstance(tensor_scale, torch.Tensor) or not tensor_scale.dtype.is_floating_point or \
            tensor_scale.numel() != 1 and not _broadcasts(tensor_scale.shape, block_scales.shape):
        raise TypeError(f"{fn}(): tensor_scale must be a one-element float tensor (or scales that broadcast against "
                        f"block_scales {list(getattr(block_scales, 'shape', []))}), got "
                        f"{getattr(tensor_scale, 'shape', type(tensor_scale).__name__)}")
    if elements.dim() == 0 or elements.shape[:-1] != block_scales.shape[:-1] or \
            elements.shape[-1] != block_scales.shape[-1] * 16:
        raise ValueError(f"{fn}(): elements {list(elements.shape)} and block_scales {list(block_scales.shape)} do "
                         f"not match blocks of 16")
    for t, arg in ((elements, "elements"), (block_scales, "block_scales"), (tensor_scale, "tensor_scale")):
        check_device(t, fn, arg)
    values = dequantize(elements, 1.0, torch.float32, fmt=E2M1) if check else \
        dequantize_eager(elements, E2M1, 1.0, torch.float32)
    ts = tensor_scale.float().reshape(()) if tensor_scale.numel() == 1 else tensor_scale.float()
    s = dequantize(block_scales, 1.0, torch.float32) * ts
    out = values.reshape(*block_scales.shape, 16) * s[..., None]
    return out.reshape(elements.shape).to(dtype)
