"""FP8 GEMM outputs against a float64 product of the same FP8 inputs, inside a derived error bound.

The reference. For out = fp8ext.gemm(a8, b8, a_scale_inv=sa, b_scale_inv=sb, bias=bias), a8 [M, K] and
b8 [N, K]: A = a8 * sa and B = b8 * sb, dequantized exactly in float64 with the scales expanded as
fp8ext.gemm reads them (by shape), x_k = A_ik B_jk, r = sum_k x_k + bias_j, and S = sum_k |x_k| =
(|A| @ |B|^T)_ij, the absolute-value product.

The model of the GEMM, per output element:
 (1) A product of two FP8 values is exact (at most 4 x 4 significant bits): only the additions and the fp32
     steps round. The scales are applied in fp32 outside the products (alpha, row or block factors).
 (2) The tensor core adds mma_k products at a time to its accumulator c. One such step returns the exact
     sum of c and its products B_t = sum |x| with an error below u (|c| + B_t), u = 2**(1 - accum_bits): the
     accumulator keeps accum_bits fraction bits and may truncate twice, when it aligns the addends to the
     largest and when it normalises the sum, each time by less than 2**-accum_bits of the largest
     magnitude. Hopper's FP8 tensor cores keep 13 (an e8m13 accumulator; DeepSeek-V3's report: "around 14
     bits"), where fp32 keeps 23. An FP8 wgmma instruction takes K = 32 products (mma_k).
 (3) Without fast accumulation the partial sum is promoted (added into an fp32 register, then restarted)
     every promote_interval products of K: 128, four wgmma instructions, as in CUTLASS's FP8 kernels and
     DeepSeek-V3, and what block scales need (one scale per 128 of K). With use_fast_accum=True it is never
     promoted: the whole K runs in the tensor core (P = K below).
 (4) Every fp32 step (promotion additions, scale products, bias addition; on the CPU emulation the
     dequantization and products) rounds to nearest, relative error u32 = 2**-24; along the path from a
     product to the output there are at most C + 4 of them, C = ceil(K / P) promotions.
 (5) The result is rounded once to out_dtype: relative error u_out (2**-8 bfloat16, 2**-11 float16, 2**-24
     float32) plus eta, half the out_dtype's smallest subnormal.

Derivation. A chunk of n = min(P, K) products takes J = ceil(n / mma_k) steps. Let E_t bound the
accumulator's error after t steps and S_t the sum of |x| over their products. Step t adds at most
u (|c_{t-1}| + B_t) <= u (S_{t-1} + E_{t-1} + B_t) = u (S_t + E_{t-1}), so E_t <= (1 + u) E_{t-1} + u S_n and
E_J <= ((1 + u)^J - 1) S_n <= gamma_J(u) S_n, with gamma_n(u) = n u / (1 - n u) and S_n the chunk's sum of |x|.
Summed over the chunks: gamma_J(u) S. The fp32 steps (4) act on values at most (1 + gamma_J(u)) (S + |bias|)
in magnitude: gamma_{C+4}(u32) (1 + gamma_J(u)) (S + |bias|). Call the sum of the two E_acc; rounding (5)
adds u_out (|r| + E_acc) + eta. So, elementwise,

    |out - r| <= E_acc + u_out (|r| + E_acc) + eta,
    E_acc = gamma_J(u) S + gamma_{C+4}(u32) (1 + gamma_J(u)) (S + |bias|),
    u = 2**(1 - accum_bits),  J = ceil(min(P, K) / mma_k),  C = ceil(K / P),  P = K if fast else promote_interval.

accum_bits=None models plain fp32 accumulation, every addition rounded to nearest (the CPU emulation's
float32 matmul): u = u32, J = K, C = 0. The default, accum_bits="device", takes the model from the device of
a8, b8 (and out): CPU tensors get fp32 accumulation (accum_bits=None), CUDA tensors Hopper's
(H100_ACCUM_BITS); tensors on different devices, or on another device, must name accum_bits. With Hopper's
model the factor on S is gamma_4(2**-12) ~ 9.8e-4 without fast accumulation (any K), and
gamma_{K/32}(FAST_ACCUM_FACTOR * 2**-12) = gamma_{K/32}(2**-10) with it (0.143 at K = 4096, 0.0323 at
K = 1024; FAST_ACCUM_FACTOR is measured, see below). With fp32 accumulation it is gamma_K(2**-24)
(2.4e-4 at K = 4096). tests/testing/test_gemm_bound.py checks these figures against the code. The bound is a worst
case over the signs of the x_k: an output whose terms cancel is typically far inside it. NaN or Inf in r
(from NaN, Inf in the inputs) must appear unchanged in out. FP8 outputs (out_scale) are not modelled.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch

from ..core.formats import format_of_dtype
from ._values import check_shapes, fail, index_of, value_table

__all__ = ["gemm_reference", "gemm_error_bound", "assert_gemm_close", "accum_bits_for", "H100_ACCUM_BITS",
           "H100_MMA_K", "PROMOTE_INTERVAL", "FAST_ACCUM_FACTOR"]

AccumBits = Union[int, None, str]

H100_ACCUM_BITS = 13  # fraction bits of Hopper's FP8 tensor-core accumulator (e8m13)
H100_MMA_K = 32  # products per FP8 wgmma instruction
PROMOTE_INTERVAL = 128  # products of K between promotions to fp32 without fast accumulation
# Measured, not derived: with fast accumulation, cuBLASLt on an H100 (2026-11-23) erred by up to 2.5x the
# 13-bit model above on sums of same-sign terms (K = 1024 and 4096): each step loses more than the model's
# two truncations. The fast-accumulation bound is therefore widened by this factor (u -> 4 u).
FAST_ACCUM_FACTOR = 4.0
DEVICE = "device"  # accum_bits's default: the accumulator of the tensors' device (see the docstring)
_U32 = 2.0 ** -24
_OUT = {torch.float32: (2.0 ** -24, 2.0 ** -150), torch.bfloat16: (2.0 ** -8, 2.0 ** -134),
        torch.float16: (2.0 ** -11, 2.0 ** -25)}  # (u_out, eta)


def _fp8_operand(q: Any, fn: str, arg: str) -> torch.Tensor:
    f = format_of_dtype(getattr(q, "dtype", None)) if isinstance(q, torch.Tensor) else None
    if f is None or q.dim() != 2:
        got = f"{q.dtype} of shape {list(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
        raise TypeError(f"{fn}(): {arg} must be a 2-D torch.float8_e4m3fn or float8_e5m2 tensor, got {got}")
    return value_table(f).to(q.device)[q.view(torch.uint8).long()]


def _expand_scale(s: Any, rows: int, k: int, device: torch.device, fn: str, arg: str) -> torch.Tensor:
    """A scale_inv as a float64 factor broadcastable to an operand [rows, k], by its shape as fp8ext.gemm
    reads it: one element (per tensor), [rows] (per row), [rows, ceil(k/128)] (1x128 blocks) or
    [ceil(rows/128), ceil(k/128)] (128x128 blocks); also torch._scaled_mm's row-wise shapes, [rows, 1]
    (scale_a [M, 1]) and [1, rows] (scale_b [1, N]). A [1, rows] that is also the 128x128 block shape is
    read as blocks, as fp8ext.gemm reads it: pass such a row-wise scale as [rows]."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return torch.tensor(float(s), dtype=torch.float64, device=device)
    if not isinstance(s, torch.Tensor) or not s.is_floating_point():
        raise TypeError(f"{fn}(): {arg} must be a float tensor or a number, got "
                        f"{s.dtype if isinstance(s, torch.Tensor) else type(s).__name__}")
    s = s.detach().to(device=device, dtype=torch.float64)
    kb, rb = -(-k // 128), -(-rows // 128)
    if s.numel() == 1:
        return s.reshape(())
    if s.dim() == 1 and s.shape[0] == rows:
        return s.reshape(rows, 1)
    if s.dim() == 2 and s.shape[1] == kb and s.shape[0] == rows:
        return s.repeat_interleave(128, 1)[:, :k]
    if s.dim() == 2 and s.shape[1] == kb and s.shape[0] == rb:
        return s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :k]
    if s.dim() == 2 and tuple(s.shape) in ((rows, 1), (1, rows)):  # torch._scaled_mm's row-wise scales
        return s.reshape(rows, 1)
    raise ValueError(f"{fn}(): {arg} has shape {list(s.shape)}; for a [{rows}, {k}] operand expected one "
                     f"element, [{rows}] (per row), [{rows}, {kb}] (1x128 blocks), [{rb}, {kb}] (128x128 blocks), "
                     f"or torch._scaled_mm's row-wise [{rows}, 1] (scale_a) or [1, {rows}] (scale_b)")


def _products(a8, b8, a_scale_inv, b_scale_inv, bias, fn: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r, S, |bias|) in float64 on a8's device: the reference with bias, the absolute-value product."""
    a, b = _fp8_operand(a8, fn, "a8"), _fp8_operand(b8, fn, "b8")
    (m, k), (n, kb_) = a.shape, b.shape
    if k != kb_:
        raise ValueError(f"{fn}(): a8 is [M, K] = {list(a.shape)} and b8 is [N, K] = {list(b.shape)}: K differs")
    dev = a.device
    a = a * _expand_scale(a_scale_inv, m, k, dev, fn, "a_scale_inv")
    b = b.to(dev) * _expand_scale(b_scale_inv, n, k, dev, fn, "b_scale_inv")
    r, s = a @ b.t(), a.abs() @ b.abs().t()
    if bias is None:
        return r, s, torch.zeros((), dtype=torch.float64, device=dev)
    beta = bias.detach().to(device=dev, dtype=torch.float64)
    if beta.shape != (n,):
        raise ValueError(f"{fn}(): bias must have shape [{n}] (N), got {list(beta.shape)}")
    return r + beta, s, beta.abs()


def accum_bits_for(*tensors: Optional[torch.Tensor], fn: str = "accum_bits_for") -> Optional[int]:
    """The accumulator model accum_bits="device" picks for tensors (None entries skipped): None (fp32
    accumulation, the CPU emulation) when all are on the CPU, H100_ACCUM_BITS when all are on CUDA devices.
    A ValueError asks for accum_bits when they are on different device types or on another device."""
    types = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if types == {"cpu"}:
        return None
    if types == {"cuda"}:
        return H100_ACCUM_BITS
    raise ValueError(f"{fn}(): cannot choose the accumulator model from tensors on {sorted(types)}: pass "
                     f"accum_bits=None (fp32 accumulation, as on the CPU) or accum_bits={H100_ACCUM_BITS} "
                     "(Hopper's FP8 tensor cores)")


def _resolve_accum_bits(accum_bits: AccumBits, fn: str, *tensors: Optional[torch.Tensor]) -> Optional[int]:
    if isinstance(accum_bits, str):
        if accum_bits != DEVICE:
            raise ValueError(f'{fn}(): accum_bits must be an int, None or "device", got {accum_bits!r}')
        return accum_bits_for(*tensors, fn=fn)
    return accum_bits


def _gamma(n: int, u: float, what: str) -> float:
    if n * u >= 1:
        raise ValueError(f"gemm_error_bound(): {what}: {n} steps with unit error {u:.3g} give no bound (n u >= 1)")
    return n * u / (1 - n * u)


def _model(k: int, use_fast_accum: bool, accum_bits: Optional[int], mma_k: int, promote_interval: int
           ) -> Tuple[float, float]:
    """(gamma_J(u), gamma_{C+4}(u32)) of the module docstring's bound for reductions of length k."""
    if mma_k < 1 or promote_interval < 1 or (accum_bits is not None and accum_bits < 1):
        raise ValueError(f"gemm_error_bound(): accum_bits, mma_k and promote_interval must be positive, got "
                         f"{accum_bits}, {mma_k}, {promote_interval}")
    if accum_bits is None:
        return _gamma(k, _U32, "fp32 accumulation"), _gamma(4, _U32, "fp32 steps")
    p = k if use_fast_accum else min(promote_interval, k)
    steps, chunks = -(-p // mma_k), -(-k // p)
    u = 2.0 ** (1 - accum_bits) * (FAST_ACCUM_FACTOR if use_fast_accum else 1.0)
    return (_gamma(steps, u, f"accum_bits={accum_bits}"),
            _gamma(chunks + 4, _U32, "fp32 steps"))


def _bound(r, s, bias_abs, k, out_dtype, use_fast_accum, accum_bits, mma_k, promote_interval) -> torch.Tensor:
    if out_dtype not in _OUT:
        raise TypeError(f"gemm_error_bound(): out_dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                        f"got {out_dtype}")
    g_acc, g_32 = _model(k, use_fast_accum, accum_bits, mma_k, promote_interval)
    u_out, eta = _OUT[out_dtype]
    e_acc = g_acc * s + g_32 * (1 + g_acc) * (s + bias_abs)
    return e_acc + u_out * (r.abs() + e_acc) + eta


def gemm_reference(a8: torch.Tensor, b8: torch.Tensor, a_scale_inv: Any, b_scale_inv: Any, *,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 [M, N] = (a8 * a_scale_inv) @ (b8 * b_scale_inv)^T (+ bias), exactly what fp8ext.gemm
    computes, in float64 on a8's device: a8 [M, K] and b8 [N, K] FP8; scale_invs (the factors that
    dequantize) shaped as fp8ext.gemm takes them, or numbers; bias [N] of any float dtype."""
    return _products(a8, b8, a_scale_inv, b_scale_inv, bias, "gemm_reference")[0]


def gemm_error_bound(a8: torch.Tensor, b8: torch.Tensor, a_scale_inv: Any, b_scale_inv: Any, *,
                     out_dtype: torch.dtype = torch.float32, bias: Optional[torch.Tensor] = None,
                     use_fast_accum: bool = False, accum_bits: AccumBits = DEVICE,
                     mma_k: int = H100_MMA_K, promote_interval: int = PROMOTE_INTERVAL) -> torch.Tensor:
    """float64 [M, N] bounds on |out - gemm_reference(...)| for out = fp8ext.gemm(a8, b8, ...) with these
    arguments, K = a8.shape[1]:

        |out - r| <= E_acc + u_out (|r| + E_acc) + eta,
        E_acc = gamma_J(u) S + gamma_{C+4}(2**-24) (1 + gamma_J(u)) (S + |bias|),

    S = sum_k |a_k||b_k| with the scales, u = 2**(1 - accum_bits), J = ceil(min(P, K) / mma_k),
    C = ceil(K / P), P = K with use_fast_accum else promote_interval; u_out and eta by out_dtype.
    The model and the derivation are in fp8ext.testing._gemm's docstring. accum_bits="device" (the default)
    models the accumulator of a8's and b8's device: plain fp32 accumulation on the CPU (accum_bits=None, the
    CPU emulation), an H100/H200 on CUDA (H100_ACCUM_BITS; cuBLASLt, either accumulation mode); tensors on
    different devices must name it.
    """
    fn = "gemm_error_bound"
    bits = _resolve_accum_bits(accum_bits, fn, a8, b8)
    r, s, bias_abs = _products(a8, b8, a_scale_inv, b_scale_inv, bias, fn)
    return _bound(r, s, bias_abs, a8.shape[1], out_dtype, use_fast_accum, bits, mma_k, promote_interval)


def assert_gemm_close(out: torch.Tensor, a8: torch.Tensor, b8: torch.Tensor, a_scale_inv: Any, b_scale_inv: Any, *,
                      bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False,
                      accum_bits: AccumBits = DEVICE, mma_k: int = H100_MMA_K,
                      promote_interval: int = PROMOTE_INTERVAL, max_report: int = 8, msg: Optional[str] = None) -> None:
    """Every element of a GEMM output within gemm_error_bound of the float64 reference; AssertionError
    listing the elements outside it otherwise. out: float32, bfloat16 or float16 [M, N] (its dtype is the
    out_dtype of the bound); the other arguments as fp8ext.gemm took them, plus the model's parameters (see
    gemm_error_bound; accum_bits="device" takes the model from the device of out, a8 and b8: fp32
    accumulation on the CPU, Hopper's on CUDA). Non-finite reference values must appear unchanged in out."""
    __tracebackhide__ = True
    fn = "assert_gemm_close"
    if not isinstance(out, torch.Tensor) or out.dtype not in _OUT:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise TypeError(f"{fn}(): out must be a float32, bfloat16 or float16 tensor, got {got}")
    by_device = accum_bits == DEVICE
    accum_bits = _resolve_accum_bits(accum_bits, fn, out, a8, b8)
    r, s, bias_abs = _products(a8, b8, a_scale_inv, b_scale_inv, bias, fn)
    check_shapes(fn, [("out", out.shape), ("the product [M, N]", r.shape)])
    bound = _bound(r, s, bias_abs, a8.shape[1], out.dtype, use_fast_accum, accum_bits, mma_k, promote_interval)
    o = out.detach().to(device=r.device, dtype=torch.float64)
    err = (o - r).abs()
    finite = torch.isfinite(r)
    ok = torch.where(finite, err <= bound, (torch.isnan(o) & torch.isnan(r)) | (o == r))
    bad = (~ok).reshape(-1).nonzero().reshape(-1).cpu()
    if bad.numel() == 0:
        return
    err, bound, o, r, s = (t.reshape(-1).cpu() for t in (err, bound, o, r, s))
    ratio = torch.where(torch.isnan(err), float("inf"), err / bound)
    worst = int(ratio.argmax())
    chosen = (f" (fp32 accumulation, chosen for {a8.device.type} tensors)" if accum_bits is None else
              f" (Hopper's accumulator, chosen for {a8.device.type} tensors)") if by_device else ""
    model = (f"out_dtype={out.dtype}, use_fast_accum={use_fast_accum}, accum_bits={accum_bits}{chosen}, "
             f"mma_k={mma_k}, promote_interval={promote_interval}, K={a8.shape[1]}")
    lines = [f"Greatest |error| / bound: {ratio[worst].item():.4g} at index {index_of(worst, out.shape)}",
             "First outside (index: out, float64 reference, |error|, bound, sum |a||b|):"]
    for i in bad[:max_report].tolist():
        lines.append(f"  {index_of(i, out.shape)}: {o[i].item()!r}, {r[i].item()!r}, {err[i].item():.4g}, "
                     f"{bound[i].item():.4g}, {s[i].item():.6g}")
    if bad.numel() > max_report:
        lines.append(f"  ... and {bad.numel() - max_report} more")
    fail(fn, msg, f"{bad.numel()} of {o.numel()} outputs are outside the error bound ({model})", lines)
