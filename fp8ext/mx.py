"""Block-scaled formats: OCP Microscaling (MX) and NVIDIA's NVFP4, on the CPU and (one-pass kernel) on a GPU.

MX (OCP MX v1.0): every block of 32 consecutive values along the last dimension shares one power-of-two scale
X = 2^e, stored as E8M0; each element is V / X in the element format (E4M3 or E5M2 for MXFP8, E3M2 or E2M3 for
MXFP6, E2M1 for MXFP4), rounded to nearest even and saturated.
    scale_rule="floor" (the specification's, torchao's FLOOR):  e = floor(log2(amax)) - emax(element format)
    scale_rule="rceil" (cuBLAS's):                               e = ceil(log2(amax / max(element format)))
e is clamped to [-127, 127]; a block of zeros gets e = -127; a block holding NaN gets the NaN scale 0xFF.
FLOOR keeps the block's largest value within the element format's top binade (it may saturate at the very top);
RCEIL never saturates and may leave the top binade unused.

NVFP4: blocks of 16 E2M1 values with an E4M3 block scale and one float32 scale for the tensor:
    tensor_scale = amax(x) / (448 * 6), block scale s = fp8_E4M3(amax(block) / 6 / tensor_scale),
    elements = E2M1(x / (s * tensor_scale)),   x ~= element * s * tensor_scale.

On the CPU the roundings are fp8ext's (fp8ext.quantize) and this module arranges blocks and scales with torch
operations; that code is the reference, and it runs on a GPU too. On a GPU, quantize_mx with block=32 and
quantize_nvfp4 run fp8ext's own kernel instead (csrc/kernels/quantize_mx.cu): one pass over x for MX; for NVFP4 one
pass for the tensor's amax, then one that quantizes. The kernel repeats the reference's float32 operations in its
order (divisions stay divisions) and gives its bytes. Other block sizes, and calls under torch.compile (the kernel
is not a registered torch op), take the torch code on a GPU too. A non-contiguous x is copied first on a GPU.
Codes come one per byte (fp8ext.pack_fp4 / pack_fp6 pack them).
A NaN's sign: a NaN element keeps x's sign; an NVFP4 block whose scale quotient is NaN (a NaN in the block, or
0/0 and inf/inf: an Inf in x, or a tensor amax so small that tensor_scale is 0) gets the positive NaN code 0x7F on
every platform (x86 would make 0/0 and inf/inf a negative NaN, a GPU a positive one).
"""

from __future__ import annotations

from typing import Tuple

import torch

from . import _C
from ._boundary import dl, dl_fp8, stream_of
from .formats import E2M1, E2M3, E3M2, E4M3, E5M2, E8M0
from .ops import _fp8_empty, _to_dl, dequantize, quantize

__all__ = ["quantize_mx", "dequantize_mx", "quantize_nvfp4", "dequantize_nvfp4", "MX_ELEMENT_FORMATS"]

MX_ELEMENT_FORMATS = (E4M3, E5M2, E3M2, E2M3, E2M1)
# exponent of the largest normal power of two of each element format (OCP MX table 1)
_EMAX = {E4M3.name: 8, E5M2.name: 15, E3M2.name: 4, E2M3.name: 2, E2M1.name: 2}


def _check_x(x: torch.Tensor, block: int, fn: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}(): x must be a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"{fn}(): the last dimension of x must be a multiple of block={block}, got shape "
                         f"{list(x.shape)}")


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
    On a GPU, block=32 runs in one pass of fp8ext's kernel; other block sizes run the torch code (same bytes)."""
    fn = "quantize_mx"
    f = _elem_format(elem, fn)
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"{fn}(): scale_rule must be 'floor' or 'rceil', got {scale_rule!r}")
    _check_x(x, block, fn)
    if block == 32 and _use_kernel(x):
        return _quantize_mx_kernel(x.contiguous(), f, scale_rule == "rceil")
    xb = _blocks(x, block)
    amax = xb.abs().amax(dim=-1)
    mant, exp = torch.frexp(amax.double())  # amax = mant * 2^exp, mant in [0.5, 1)
    if scale_rule == "floor":
        e = exp - 1 - _EMAX[f.name]
    else:  # ceil(log2(amax / max)): the quotient is exact when it is a power of two (see the module docstring)
        qm, qe = torch.frexp(amax.double() / f.max)
        e = torch.where(qm == 0.5, qe - 1, qe)
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    scales = (e + 127).to(torch.uint8)
    scales = torch.where(amax.isnan(), torch.full_like(scales, 0xFF), scales)
    scaled = xb * _pow2(-e)[..., None]  # one rounding of x * 2^-e, the same on the CPU and a GPU
    scaled = torch.where(scaled.isnan(), xb, scaled)  # a NaN keeps x's sign (arithmetic's NaN sign is not portable)
    elements = quantize(scaled.reshape(x.shape).contiguous(), f, 1.0, saturate=True)
    return elements, scales


def _quantize_mx_kernel(x: torch.Tensor, f, rceil: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    fp8 = f in (E4M3, E5M2)
    elements = _fp8_empty(x.shape, f, x.device) if fp8 else torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // 32), dtype=torch.uint8, device=x.device)
    _C.quantize_mx(dl(x), dl_fp8(elements) if fp8 else _to_dl(elements), _to_dl(scales), f.code, rceil,
                   stream=stream_of(x.device))
    return elements, scales


def dequantize_mx(elements: torch.Tensor, scales: torch.Tensor, elem=E4M3, block: int = 32,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ~= element * 2^(scale - 127) (NaN where the scale is 0xFF), rounded to `dtype`."""
    fn = "dequantize_mx"
    f = _elem_format(elem, fn)
    if scales.dtype != torch.uint8:
        raise TypeError(f"{fn}(): scales must be uint8 E8M0 codes, got {scales.dtype}")
    if elements.shape[:-1] != scales.shape[:-1] or elements.shape[-1] != scales.shape[-1] * block:
        raise ValueError(f"{fn}(): elements {list(elements.shape)} and scales {list(scales.shape)} do not match "
                         f"blocks of {block}")
    values = dequantize(elements, 1.0, torch.float32, fmt=None if f in (E4M3, E5M2) else f)
    factor = dequantize(scales, 1.0, torch.float32, fmt=E8M0)  # 2^(code - 127), NaN for 0xFF
    out = values.reshape(*scales.shape, block) * factor[..., None]
    return out.reshape(elements.shape).to(dtype)


def quantize_nvfp4(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(elements, block_scales, tensor_scale): E2M1 codes (uint8, x's shape), E4M3 block scales
    [..., K / 16] (torch.float8_e4m3fn) and a float32 0-d tensor scale (see the module docstring).
    On a GPU: fp8ext's amax kernel, then one pass of its quantize kernel. x must not be empty."""
    fn = "quantize_nvfp4"
    _check_x(x, 16, fn)
    if x.numel() == 0:
        raise ValueError(f"{fn}(): x must not be empty (the tensor scale is made from its amax), got shape "
                         f"{list(x.shape)}")
    if _use_kernel(x):
        return _quantize_nvfp4_kernel(x.contiguous())
    xb = _blocks(x, 16)
    amax = xb.abs().amax()
    tensor_scale = torch.where(amax > 0, amax / (E4M3.max * E2M1.max), torch.ones_like(amax))
    block_amax = xb.abs().amax(dim=-1)
    ratio = block_amax / E2M1.max / tensor_scale
    ratio = torch.where(ratio.isnan(), torch.full_like(ratio, float("nan")), ratio)  # the positive NaN (docstring)
    block_scales = quantize(ratio, E4M3, 1.0, saturate=True)
    s = dequantize(block_scales, 1.0, torch.float32) * tensor_scale
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero block: any scale gives zeros
    scaled = xb / s[..., None]
    scaled = torch.where(scaled.isnan(), xb, scaled)  # a NaN keeps x's sign, as in quantize_mx
    elements = quantize(scaled.reshape(x.shape).contiguous(), E2M1, 1.0, saturate=True)
    return elements, block_scales, tensor_scale


def _quantize_nvfp4_kernel(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    elements = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    block_scales = _fp8_empty((*x.shape[:-1], x.shape[-1] // 16), E4M3, x.device)
    tensor_scale = torch.empty((), dtype=torch.float32, device=x.device)
    amax = torch.empty((), dtype=torch.float32, device=x.device)  # workspace, zeroed by the launcher
    _C.quantize_nvfp4(dl(x), _to_dl(elements), dl_fp8(block_scales), _to_dl(tensor_scale), _to_dl(amax),
                      stream=stream_of(x.device))
    return elements, block_scales, tensor_scale


def dequantize_nvfp4(elements: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ~= element * block_scale * tensor_scale, rounded to `dtype`."""
    values = dequantize(elements, 1.0, torch.float32, fmt=E2M1)
    s = dequantize(block_scales, 1.0, torch.float32) * tensor_scale.float()
    out = values.reshape(*block_scales.shape, 16) * s[..., None]
    return out.reshape(elements.shape).to(dtype)
