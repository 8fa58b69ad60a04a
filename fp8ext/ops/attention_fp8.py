"""FP8 scaled dot-product attention as cuDNN's FP8 fused attention computes it on Hopper (what Transformer Engine
runs for a recipe with fp8_dpa=True), emulated with torch: the CPU engine of fp8ext.DotProductAttention, and the
definition the GPU engine (fp8ext.ops.attention_cudnn) is tested against.

    out = fp8_scaled_dot_product_attention(q, k, v, is_causal=True)      # q, k, v: [batch, heads, seq, head_dim]

Every FP8 value is the cast of fp8ext's C core (round to nearest even, saturating to the format's largest value):

    forward   Q8, K8, V8 = E4M3 casts of Q, K, V, each with its own per-tensor scale (fmt.max / amax, current scaling)
              S  = Q8 K8^T dequantized * softmax_scale, float32; masked entries -inf
              M  = rowmax(S), ZInv = 1 / rowsum(exp(S - M)), float32 (the softmax statistics kept for backward)
              P  = exp(S - M) * ZInv, float32; P8 = E4M3 cast of P with the fixed scale 448 (P is in [0, 1])
              O8 = E4M3 cast of P8 V8 (float32) with scale_o; the output is O8 dequantized, in the input's dtype
    backward  dO8 = E5M2 cast of dO (per-tensor current scale)
              dV = P8^T dO8; dP = dO8 V8^T                                  (float32)
              D  = rowsum(dO8 * O8), both dequantized
              dS = P * (dP - D), float32, with P recomputed from S, M and ZInv; dS8 = E5M2 cast with scale_ds
              dQ = dS8 K8 * softmax_scale; dK = dS8^T Q8 * softmax_scale   (float32)
              dQ8, dK8, dV8 = E5M2 casts with scale_dq, scale_dk, scale_dv; the gradients are them dequantized

Why O, dS, dQ, dK and dV have scales of their own that are not their amaxes: cuDNN computes them inside one fused
kernel, which must know each scale before it runs (on Hopper it writes O and dQ/dK/dV only in FP8). fp8ext derives
each from bounds that hold for any inputs, given the amaxes of Q, K, V and dO (attention_scales): |O| <= c * amax(V)
(a row of P8 sums to at most c = 1.0625 + seq_kv / 2^19), |dP|, |D| <= head_dim * amax(dO) * amax(V) * (1, c), and
dQ, dK, dV follow from those with sums over keys (dQ: sum_j P_ij <= 1) or queries (dK, dV: at most seq_q, times the
query heads sharing a KV head). A bound can sit far above the values (dK's by up to seq_q), which costs exponent
range, not precision: E4M3 keeps 3 mantissa bits from 2^-6 of its maximum down, E5M2 2 bits across 2^30.

Every product of two FP8 values is exact in float32; the sums run in float32. cuDNN differs in two ways that keep its
bytes from being these: it sums in another order, and (flash attention) it rounds the unnormalised exp(S - running
max) to E4M3 block by block and divides by the row sum at the end, where this rounds the normalised P. Its P8
roundings are therefore independent of these, and the two results differ by about their own FP8 errors (measured
by tests/modules/test_attention_cudnn.py). Precision is lost where values
become FP8: Q, K, V, P and O in E4M3 (3 mantissa bits), dO, dS and dQ/dK/dV in E5M2 (2 mantissa bits). With
fp8_format=Format.E4M3 (a recipe's choice) the backward's casts are E4M3 too. Grouped-query attention: query head i
reads K/V head i // (heads / kv_heads); dK and dV sum over each group.

This is a reference: it holds the [seq_q, seq_kv] scores of every head in memory.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from ..core.casts import HIGH_PRECISION, amax, scale_from_amax
from ..core.formats import E4M3, E5M2, FP8Format, Format
from ..core.tensor import FP8Tensor
from . import quantize

__all__ = ["fp8_scaled_dot_product_attention", "FP8AttentionOptions", "FP8AttentionState", "FP8AttentionGrads",
           "attention_forward", "attention_probs", "attention_backward", "attention_scales", "check_attention",
           "high_precision_backward", "sdpa_backward", "fp8_backward_from", "check_fp8_output"]

_FN = "fp8_scaled_dot_product_attention"


@dataclass(frozen=True)
class FP8AttentionOptions:
    """What an FP8 attention call computes besides its tensors: softmax_scale multiplies Q K^T; is_causal masks
    key j > query i (top-left aligned, as torch's scaled_dot_product_attention); fwd is the format of Q, K, V and
    P, bwd that of dO and dS; margin lowers the current scales by 2**margin (scale = fmt.max / amax / 2**margin);
    fp8_backward=False runs the backward in high precision (high_precision_backward), what Transformer Engine's
    NVTE_FP8_DPA_BWD=0 asks for (TE then reuses the FP8 forward's output and statistics; fp8ext recomputes them,
    which halves dQ's and dK's errors: docs/training.md)."""

    softmax_scale: float
    is_causal: bool = False
    fwd: FP8Format = E4M3
    bwd: FP8Format = E5M2
    margin: float = 0.0
    fp8_backward: bool = True  # False: the backward in high precision (high_precision_backward)


class FP8AttentionState(NamedTuple):
    """What the forward keeps for the backward (cuDNN's saved tensors): the FP8 operands and output, the amaxes
    of Q, K and V ([3] float32) and the softmax statistics. row_max and zinv are [batch, heads, seq_q, 1] float32 (0
    for a row with every key masked, whose P and output are then 0)."""

    q8: FP8Tensor
    k8: FP8Tensor
    v8: FP8Tensor
    o8: FP8Tensor
    amaxes: torch.Tensor
    row_max: torch.Tensor
    zinv: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    opts: FP8AttentionOptions


class FP8AttentionGrads(NamedTuple):
    """The backward's results: dq, dk, dv (their FP8 casts dequantized, float32), the FP8 casts themselves, and
    the FP8 casts of dO and dS they were computed from."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    do8: FP8Tensor
    ds8: FP8Tensor
    dq8: FP8Tensor
    dk8: FP8Tensor
    dv8: FP8Tensor


def _cast(x: torch.Tensor, fmt: FP8Format, margin: float) -> Tuple[FP8Tensor, torch.Tensor]:
    """(x cast to fmt with a per-tensor current scale, fmt.max / amax(x) / 2**margin (1 when amax is 0 or not
    finite), amax(x)): fp8ext's own cast and scale rule (fp8ext.quantize, fp8ext.scale_from_amax)."""
    x = x.contiguous()
    a = amax(x)
    scale, scale_inv = scale_from_amax(a, fmt, margin)
    return FP8Tensor(quantize(x, fmt, scale), None, scale_inv, fmt, scale=scale), a


def _cast_by(x: torch.Tensor, fmt: FP8Format, scale: torch.Tensor) -> FP8Tensor:
    """x cast to fmt with a given scale (a 0-d float32 tensor; attention_scales')."""
    return FP8Tensor(quantize(x.contiguous(), fmt, scale), None, scale.reciprocal(), fmt, scale=scale)


_F32_TINY, _F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


@functools.lru_cache(maxsize=256)
def _rule_tensors(rules: tuple, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """attention_scales' rules as float64 tensors on `device`, made once per shape (a tensor made from Python
    numbers on a GPU is a copy the host waits for)."""
    exps = torch.tensor([r[1] for r in rules], dtype=torch.float64, device=device)
    return exps, torch.tensor([[r[0], r[2]] for r in rules], dtype=torch.float64, device=device)


def attention_scales(amaxes: torch.Tensor, amax_do: Optional[torch.Tensor], q_shape, k_shape,
                     opts: "FP8AttentionOptions") -> dict:
    """The scales of the tensors a fused kernel writes in FP8, from bounds over any inputs (the module docstring):
    {'o': ...} from amaxes = [amax(Q), amax(K), amax(V)], and with amax_do also 'ds', 'dq', 'dk', 'dv'. q_shape:
    [batch, heads, seq_q, head_dim], k_shape: [batch, kv_heads, seq_kv, head_dim]. Each a 0-d float32 tensor on
    amaxes' device: fmt.max / bound, or 1 where the bound is 0 or not finite. Each bound is a constant times a
    product of amaxes, computed in float64 by a handful of vector operations (this runs on every call)."""
    _, h, sq, d = q_shape
    # a row of P8 sums to at most c: 1 + E4M3's relative rounding (2^-4), plus half the smallest step (2^-10 / 448)
    # for each key whose probability rounds in the subnormal range
    c = 1.0625 + k_shape[2] / (1024 * 448)
    ds = (1 + c) * d  # |dS| <= P |dP - D| <= (1 + c) d amax(dO) amax(V)
    g, sm = h // k_shape[1], opts.softmax_scale
    #        name  constant                  exponents of amax(Q), amax(K), amax(V), amax(dO)   format
    rules = [("o", c, (0, 0, 1, 0), opts.fwd)]
    if amax_do is not None:
        rules += [("ds", ds, (0, 0, 1, 1), opts.bwd), ("dq", 1.25 * sm * ds, (0, 1, 1, 1), opts.bwd),
                  ("dk", 1.25 * sm * g * sq * ds, (1, 0, 1, 1), opts.bwd), ("dv", 1.25 * g * sq * c, (0, 0, 0, 1),
                                                                            opts.bwd)]
    a = amaxes.double() if amax_do is None else torch.cat([amaxes.double(), amax_do.double().reshape(1)])
    exps, consts = _rule_tensors(tuple((r[1], r[2][:a.numel()], r[3].max) for r in rules), amaxes.device)
    bound = a.pow(exps).prod(-1) * consts[:, 0]  # 0 ** 0 is 1: an amax not in a rule drops out
    ok = (bound > 0) & (bound < float("inf"))
    scale = (consts[:, 1] / torch.where(ok, bound, 1.0)).clamp(_F32_TINY, _F32_MAX)
    scale = torch.where(ok, scale, 1.0).float()
    return {r[0]: scale[i] for i, r in enumerate(rules)}


def _dequantize(t: FP8Tensor) -> torch.Tensor:
    return t.data.float() * t.scale_inv


def _heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """K or V [b, kv_heads, s, d] repeated to one per query head (query head i reads kv head i // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _group_sum(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of _heads: [b, heads, s, d] summed over each group of `groups` query heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def _scores(q8: FP8Tensor, k8: FP8Tensor, attn_mask, opts: FP8AttentionOptions) -> torch.Tensor:
    """S = Q8 K8^T dequantized * softmax_scale in float32, masked entries -inf."""
    groups = q8.shape[1] // k8.shape[1]
    s = q8.data.float() @ _heads(k8.data.float(), groups).transpose(-2, -1)
    s = s * (q8.scale_inv * k8.scale_inv * opts.softmax_scale)
    if opts.is_causal:
        sq, sk = s.shape[-2:]
        attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return s


def _softmax_stats(s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(M, ZInv) of the scores: the row maximum (0 where every entry is -inf) and 1 / rowsum(exp(S - M)) (0 there)."""
    row_max = s.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    total = torch.exp(s - row_max).sum(-1, keepdim=True)
    zinv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    return row_max, zinv


def attention_probs(state: FP8AttentionState) -> Tuple[torch.Tensor, FP8Tensor]:
    """(P, P8): the float32 softmax recomputed from the FP8 operands and the statistics (the same bits in the
    forward and the backward), and its cast with the fixed scale fwd.max (P <= 1)."""
    s = _scores(state.q8, state.k8, state.attn_mask, state.opts)
    p = torch.exp(s - state.row_max) * state.zinv
    fmt = state.opts.fwd
    scale_inv = torch.tensor(1.0 / fmt.max, dtype=torch.float32, device=p.device)
    return p, FP8Tensor(quantize(p, fmt, fmt.max), None, scale_inv, fmt)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                      opts: FP8AttentionOptions) -> FP8AttentionState:
    """The forward pass (see the module docstring) on checked [b, h, s, d] tensors; the output is state.o8
    dequantized (_dequantize)."""
    (q8, a_q), (k8, a_k), (v8, a_v) = (_cast(x, opts.fwd, opts.margin) for x in (q, k, v))
    amaxes = torch.stack([a_q.reshape(()), a_k.reshape(()), a_v.reshape(())])
    s = _scores(q8, k8, attn_mask, opts)
    row_max, zinv = _softmax_stats(s)
    state = FP8AttentionState(q8, k8, v8, None, amaxes, row_max, zinv, attn_mask, opts)
    _, p8 = attention_probs(state)
    groups = q.shape[1] // k.shape[1]
    out = (p8.data.float() @ _heads(v8.data.float(), groups)) * (p8.scale_inv * v8.scale_inv)
    scale_o = attention_scales(amaxes, None, q.shape, k.shape, opts)["o"]
    return state._replace(o8=_cast_by(out, opts.fwd, scale_o))


def high_precision_backward(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, attn_mask: Optional[torch.Tensor],
                            grad_out: torch.Tensor, opts: FP8AttentionOptions):
    """(dQ, dK, dV) in grad_out's dtype: attention's backward in high precision at Q8, K8 and V8 dequantized, dO not
    cast (the forward's FP8 casts pass gradients straight through). On the CPU (this emulation) it is computed here
    in float32; a GPU engine runs torch's SDPA backward in grad_out's dtype (sdpa_backward). What an FP8 forward with
    a high-precision backward computes: the gradients' error is then the forward's (Q and K in E4M3 move the
    scores), without E5M2's 2 mantissa bits in dO and dS, which the softmax backward's cancellation in dP - D
    amplifies (benchmarks/attention_accuracy.py measures both)."""
    groups = q8.shape[1] // k8.shape[1]
    q, k, v = (_dequantize(t) for t in (q8, k8, v8))
    do = grad_out.float()
    s = q @ _heads(k, groups).transpose(-2, -1) * opts.softmax_scale
    if opts.is_causal:
        attn_mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    row_max, zinv = _softmax_stats(s)
    p = torch.exp(s - row_max) * zinv
    dv = p.transpose(-2, -1) @ do
    dp = do @ _heads(v, groups).transpose(-2, -1)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = ds @ _heads(k, groups) * opts.softmax_scale
    dk = ds.transpose(-2, -1) @ q * opts.softmax_scale
    return tuple(g.to(grad_out.dtype) for g in (dq, _group_sum(dk, groups), _group_sum(dv, groups)))


def sdpa_backward(q8: FP8Tensor, k8: FP8Tensor, v8: FP8Tensor, grad_out: torch.Tensor, opts: FP8AttentionOptions):
    """high_precision_backward's gradients by torch's scaled_dot_product_attention backward (its fastest engine on a
    GPU) in grad_out's dtype, at Q8, K8 and V8 dequantized into it; causal or no mask."""
    dtype = grad_out.dtype
    q, k, v = ((t.data.to(dtype) * t.scale_inv.to(dtype)).requires_grad_() for t in (q8, k8, v8))
    with torch.enable_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=opts.is_causal,
                                                               scale=opts.softmax_scale,
                                                               enable_gqa=q.shape[1] != k.shape[1])
        return torch.autograd.grad(out, (q, k, v), grad_out)


def attention_backward(state: FP8AttentionState, grad_out: torch.Tensor) -> FP8AttentionGrads:
    """The backward pass (see the module docstring): the gradients of Q, K and V for grad_out = dO."""
    opts, q8, k8, v8 = state.opts, state.q8, state.k8, state.v8
    groups = q8.shape[1] // k8.shape[1]
    p, p8 = attention_probs(state)
    do8, a_do = _cast(grad_out, opts.bwd, opts.margin)
    sc = attention_scales(state.amaxes, a_do, q8.shape, k8.shape, opts)
    do = _dequantize(do8)
    dv = (p8.data.float().transpose(-2, -1) @ do8.data.float()) * (p8.scale_inv * do8.scale_inv)
    dp = (do8.data.float() @ _heads(v8.data.float(), groups).transpose(-2, -1)) * (do8.scale_inv * v8.scale_inv)
    delta = (do * _dequantize(state.o8)).sum(-1, keepdim=True)
    ds8 = _cast_by(p * (dp - delta), opts.bwd, sc["ds"])
    ds = ds8.data.float()
    dq = (ds @ _heads(k8.data.float(), groups)) * (ds8.scale_inv * k8.scale_inv * opts.softmax_scale)
    dk = (ds.transpose(-2, -1) @ q8.data.float()) * (ds8.scale_inv * q8.scale_inv * opts.softmax_scale)
    dq8, dk8, dv8 = (_cast_by(x, opts.bwd, sc[n]) for x, n in ((dq, "dq"), (_group_sum(dk, groups), "dk"),
                                                               (_group_sum(dv, groups), "dv")))
    return FP8AttentionGrads(_dequantize(dq8), _dequantize(dk8), _dequantize(dv8), do8, ds8, dq8, dk8, dv8)


class FP8AttentionFunction(torch.autograd.Function):
    """Autograd for the emulation: the forward keeps the FP8 operands and output and the statistics, not P."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, opts: FP8AttentionOptions):
        st = attention_forward(q, k, v, attn_mask, opts)
        ctx.opts, ctx.dtype, ctx.has_mask = opts, q.dtype, attn_mask is not None
        ctx.save_for_backward(*(t for x in (st.q8, st.k8, st.v8, st.o8) for t in (x.data, x.scale_inv)), st.amaxes,
                              st.row_max, st.zinv, attn_mask if attn_mask is not None else torch.empty(0))
        return _dequantize(st.o8).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        *fp8, amaxes, row_max, zinv, mask = ctx.saved_tensors
        opts = ctx.opts
        q8, k8, v8, o8 = (FP8Tensor(fp8[2 * i], None, fp8[2 * i + 1], opts.fwd) for i in range(4))
        mask = mask if ctx.has_mask else None
        if not opts.fp8_backward:
            return (*(g.to(ctx.dtype) for g in high_precision_backward(q8, k8, v8, mask, grad_out.to(ctx.dtype),
                                                                        opts)), None, None)
        state = FP8AttentionState(q8, k8, v8, o8, amaxes, row_max, zinv, mask, opts)
        g = attention_backward(state, grad_out)
        return g.dq.to(ctx.dtype), g.dk.to(ctx.dtype), g.dv.to(ctx.dtype), None, None


def fp8_scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     attn_mask: Optional[torch.Tensor] = None, *, is_causal: bool = False,
                                     scale: Optional[float] = None, enable_gqa: bool = False,
                                     fp8_format: Format = Format.HYBRID, margin: float = 0.0,
                                     fp8_backward: Optional[bool] = None, fp8_output: bool = False):
    """torch.nn.functional.scaled_dot_product_attention computed in FP8 as cuDNN's FP8 fused attention computes it
    (the module docstring lists the steps), with autograd.

    query [batch, heads, seq_q, head_dim], key and value [batch, kv_heads, seq_kv, head_dim]: float32, bfloat16 or
    float16, one dtype and device. attn_mask: a bool tensor broadcastable to [batch, heads, seq_q, seq_kv], True
    where a query attends to a key (torch's convention; Transformer Engine's padding masks are the opposite), or
    None. is_causal: key j > query i masked (top-left aligned); not with attn_mask. scale: softmax_scale, default
    1 / sqrt(head_dim). enable_gqa: kv_heads may divide heads (grouped-query attention). fp8_format: Format.HYBRID
    (E4M3 forward, E5M2 backward) or Format.E4M3; margin: as a recipe's. fp8_backward: False runs the backward in
    high precision (high_precision_backward); None reads Transformer Engine's switch, the environment variable
    NVTE_FP8_DPA_BWD ("0": high precision; unset or "1": FP8). Returns [batch, heads, seq_q, head_dim] in
    query's dtype; a query whose keys are all masked gives 0 (as torch's SDPA does). fp8_output=True (inference
    only, no gradient) returns O8 itself instead: an FP8Tensor whose data are the E4M3 bytes [batch, heads, seq_q,
    head_dim] and scale_inv their per-tensor dequantizing scale (Transformer Engine's fp8_output, which fp8_mha
    uses to hand attention's output to the output projection without a bf16 round trip).
    """
    check_attention(query, key, value, attn_mask, is_causal, enable_gqa)
    check_fp8_output(fp8_output, (query, key, value), _FN)
    if not isinstance(fp8_format, Format):
        raise TypeError(f"{_FN}(): fp8_format must be a fp8ext.Format, got {fp8_format!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    for name, x in (("scale", scale), ("margin", margin)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise TypeError(f"{_FN}(): {name} must be a finite number, got {x!r}")
    opts = FP8AttentionOptions(float(scale), bool(is_causal), fp8_format.fwd, fp8_format.bwd, float(margin),
                               fp8_backward_from(fp8_backward, _FN))
    if fp8_output:
        return attention_forward(query, key, value, attn_mask, opts).o8
    return FP8AttentionFunction.apply(query, key, value, attn_mask, opts)


def fp8_backward_from(value: Optional[bool], where: str) -> bool:
    """fp8_backward as given, or where None, from Transformer Engine's environment variable NVTE_FP8_DPA_BWD ("1", the
    default: FP8; "0": high precision); anything else raises naming the variable."""
    if value is not None:
        if not isinstance(value, bool):
            raise TypeError(f"{where}(): fp8_backward must be True, False or None, got {value!r}")
        return value
    env = os.environ.get("NVTE_FP8_DPA_BWD", "1").strip()
    if env not in ("0", "1"):
        raise ValueError(f"{where}(): the environment variable NVTE_FP8_DPA_BWD must be 0 (FP8 attention's backward "
                         f"in high precision) or 1 (in FP8), got {env!r}")
    return env == "1"


def check_fp8_output(fp8_output, tensors, where: str) -> None:
    """fp8_output must be a bool, and True only where no gradient is wanted: an FP8Tensor result carries none."""
    if not isinstance(fp8_output, bool):
        raise TypeError(f"{where}(): fp8_output must be True or False, got {fp8_output!r}")
    if fp8_output and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{where}(): fp8_output=True returns the output's FP8 bytes and scale (an FP8Tensor), "
                           f"which carry no gradient, but query, key or value requires grad; run it under "
                           f"torch.no_grad() (inference), or with fp8_output=False to train")


def check_attention(q, k, v, attn_mask, is_causal: bool, enable_gqa: bool) -> None:
    """The checks of fp8_scaled_dot_product_attention's tensors and mask (every engine's), raising with the argument
    named."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{_FN}(): {name} must be a 4-D tensor [batch, heads, seq, head_dim], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in HIGH_PRECISION or t.dtype != q.dtype or t.device != q.device:
            raise TypeError(f"{_FN}(): query, key and value must share one dtype (float32, bfloat16 or float16) "
                            f"and device, got {name} {t.dtype} on {t.device} and query {q.dtype} on {q.device}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1] or k.shape[2] == 0:
        raise ValueError(f"{_FN}(): key and value must be [batch, kv_heads, seq_kv >= 1, head_dim] with query's "
                         f"batch and head_dim, got query {list(q.shape)}, key {list(k.shape)}, value "
                         f"{list(v.shape)}")
    h, hk = q.shape[1], k.shape[1]
    if hk == 0 or h % hk or (h != hk and not enable_gqa):
        raise ValueError(f"{_FN}(): key has {hk} heads and query {h}: they must be equal, or divide them with "
                         f"enable_gqa=True")
    if attn_mask is not None:
        if is_causal:
            raise ValueError(f"{_FN}(): give attn_mask or is_causal=True, not both")
        want = (q.shape[0], h, q.shape[2], k.shape[2])
        ok = isinstance(attn_mask, torch.Tensor) and attn_mask.dtype == torch.bool and attn_mask.device == q.device
        try:
            ok = ok and torch.broadcast_shapes(attn_mask.shape, want) == want
        except RuntimeError:
            ok = False
        if not ok:
            got = (f"{attn_mask.dtype} {list(attn_mask.shape)} on {attn_mask.device}"
                   if isinstance(attn_mask, torch.Tensor) else type(attn_mask).__name__)
            raise ValueError(f"{_FN}(): attn_mask must be a bool tensor on {q.device} broadcastable to {list(want)}, "
                             f"got {got}")
