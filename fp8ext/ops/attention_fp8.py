"""FP8 scaled dot-product attention, emulated with torch on the CPU: what Transformer Engine's fp8_dpa computes.

    out = fp8_scaled_dot_product_attention(q, k, v, is_causal=True)      # q, k, v: [batch, heads, seq, head_dim]

The steps are those of cuDNN's FP8 fused attention, which TE runs for a recipe with fp8_dpa=True, with every FP8
value the cast of fp8ext's C core gives (round to nearest even, saturating to the format's largest value):

    forward   Q8, K8, V8 = E4M3 casts of Q, K, V, each with its own per-tensor scale (fmt.max / amax, current scaling)
              S  = Q8 K8^T dequantized * softmax_scale, float32; masked entries -inf
              M  = rowmax(S), ZInv = 1 / rowsum(exp(S - M)), float32 (cuDNN's softmax statistics, kept for backward)
              P  = exp(S - M) * ZInv, float32; P8 = E4M3 cast of P with the fixed scale 448 (P is in [0, 1], so
                   scale = the E4M3 maximum uses the whole range; TE derives it from P's amax, which is about 1)
              O  = P8 V8 dequantized, float32, returned in the input's dtype
    backward  dO8 = E5M2 cast of dO (per-tensor current scale)
              dV = P8^T dO8; dP = dO8 V8^T                                  (float32)
              D  = rowsum(dO8 * O), with dO8 dequantized and the float32 O (not the output rounded to its dtype)
              dS = P * (dP - D), float32, with the unrounded P recomputed from S, M and ZInv (as cuDNN does)
              dS8 = E5M2 cast of dS (per-tensor current scale)
              dQ = dS8 K8 * softmax_scale; dK = dS8^T Q8 * softmax_scale   (float32, returned in the input's dtype)

Every product of two FP8 values is exact in float32; the sums run in float32 (a GPU's order of addition differs,
and with it the last bits). Precision is lost where values become FP8: Q, K, V and P in E4M3 (3 mantissa bits),
dO and dS in E5M2 (2 mantissa bits). With fp8_format=Format.E4M3 (a recipe's choice) dO and dS are E4M3 too.
Grouped-query attention: query head i reads K/V head i // (heads / kv_heads); dK and dV sum over each group.

This is a reference: it holds the [seq_q, seq_kv] scores of every head in memory. fp8ext.DotProductAttention runs
it for CPU tensors; the GPU engine (cuDNN's fused kernels) is not in fp8ext yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Tuple

import torch

from ..core.casts import HIGH_PRECISION, amax, scale_from_amax
from ..core.formats import E4M3, E5M2, FP8Format, Format
from ..core.tensor import FP8Tensor
from . import quantize

__all__ = ["fp8_scaled_dot_product_attention", "FP8AttentionOptions", "FP8AttentionState", "FP8AttentionGrads",
           "attention_forward", "attention_probs", "attention_backward"]

_FN = "fp8_scaled_dot_product_attention"


@dataclass(frozen=True)
class FP8AttentionOptions:
    """What an FP8 attention call computes besides its tensors: softmax_scale multiplies Q K^T; is_causal masks
    key j > query i (top-left aligned, as torch's scaled_dot_product_attention); fwd is the format of Q, K, V and
    P, bwd that of dO and dS; margin lowers the current scales by 2**margin (scale = fmt.max / amax / 2**margin)."""

    softmax_scale: float
    is_causal: bool = False
    fwd: FP8Format = E4M3
    bwd: FP8Format = E5M2
    margin: float = 0.0


class FP8AttentionState(NamedTuple):
    """What the forward keeps for the backward (cuDNN's saved tensors): the FP8 operands, the float32 output and
    the softmax statistics. row_max and zinv are [batch, heads, seq_q, 1] float32 (0 for a row with every key
    masked, whose P and output are then 0)."""

    q8: FP8Tensor
    k8: FP8Tensor
    v8: FP8Tensor
    out: torch.Tensor
    row_max: torch.Tensor
    zinv: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    opts: FP8AttentionOptions


class FP8AttentionGrads(NamedTuple):
    """The backward's results: dq, dk, dv in float32, and the FP8 casts of dO and dS they were computed from."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    do8: FP8Tensor
    ds8: FP8Tensor


def _cast(x: torch.Tensor, fmt: FP8Format, margin: float) -> FP8Tensor:
    """x cast to fmt with a per-tensor current scale, fmt.max / amax(x) / 2**margin (1 when amax is 0 or not
    finite): fp8ext's own cast and scale rule (fp8ext.quantize, fp8ext.scale_from_amax)."""
    x = x.contiguous()
    scale, scale_inv = scale_from_amax(amax(x), fmt, margin)
    return FP8Tensor(quantize(x, fmt, scale), None, scale_inv, fmt, scale=scale)


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
    """The forward pass (see the module docstring) on checked [b, h, s, d] tensors; state.out is O in float32."""
    q8, k8, v8 = (_cast(x, opts.fwd, opts.margin) for x in (q, k, v))
    s = _scores(q8, k8, attn_mask, opts)
    row_max, zinv = _softmax_stats(s)
    state = FP8AttentionState(q8, k8, v8, None, row_max, zinv, attn_mask, opts)
    _, p8 = attention_probs(state)
    groups = q.shape[1] // k.shape[1]
    out = (p8.data.float() @ _heads(v8.data.float(), groups)) * (p8.scale_inv * v8.scale_inv)
    return state._replace(out=out)


def attention_backward(state: FP8AttentionState, grad_out: torch.Tensor) -> FP8AttentionGrads:
    """The backward pass (see the module docstring): float32 gradients of Q, K and V for grad_out = dO."""
    opts, q8, k8, v8 = state.opts, state.q8, state.k8, state.v8
    groups = q8.shape[1] // k8.shape[1]
    p, p8 = attention_probs(state)
    do8 = _cast(grad_out, opts.bwd, opts.margin)
    do = _dequantize(do8)
    dv = (p8.data.float().transpose(-2, -1) @ do8.data.float()) * (p8.scale_inv * do8.scale_inv)
    dp = (do8.data.float() @ _heads(v8.data.float(), groups).transpose(-2, -1)) * (do8.scale_inv * v8.scale_inv)
    delta = (do * state.out).sum(-1, keepdim=True)
    ds8 = _cast(p * (dp - delta), opts.bwd, opts.margin)
    ds = ds8.data.float()
    dq = (ds @ _heads(k8.data.float(), groups)) * (ds8.scale_inv * k8.scale_inv * opts.softmax_scale)
    dk = (ds.transpose(-2, -1) @ q8.data.float()) * (ds8.scale_inv * q8.scale_inv * opts.softmax_scale)
    return FP8AttentionGrads(dq, _group_sum(dk, groups), _group_sum(dv, groups), do8, ds8)


class FP8AttentionFunction(torch.autograd.Function):
    """Autograd for the emulation: the forward keeps the FP8 operands, O and the statistics, not P."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, opts: FP8AttentionOptions):
        state = attention_forward(q, k, v, attn_mask, opts)
        ctx.opts, ctx.dtype, ctx.has_mask = opts, q.dtype, attn_mask is not None
        ctx.save_for_backward(state.q8.data, state.k8.data, state.v8.data, state.q8.scale_inv, state.k8.scale_inv,
                              state.v8.scale_inv, state.out, state.row_max, state.zinv,
                              attn_mask if attn_mask is not None else torch.empty(0))
        return state.out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_si, k_si, v_si, out, row_max, zinv, mask = ctx.saved_tensors
        opts = ctx.opts
        state = FP8AttentionState(FP8Tensor(q, None, q_si, opts.fwd), FP8Tensor(k, None, k_si, opts.fwd),
                                  FP8Tensor(v, None, v_si, opts.fwd), out, row_max, zinv,
                                  mask if ctx.has_mask else None, opts)
        g = attention_backward(state, grad_out)
        return g.dq.to(ctx.dtype), g.dk.to(ctx.dtype), g.dv.to(ctx.dtype), None, None


def fp8_scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                     attn_mask: Optional[torch.Tensor] = None, *, is_causal: bool = False,
                                     scale: Optional[float] = None, enable_gqa: bool = False,
                                     fp8_format: Format = Format.HYBRID, margin: float = 0.0) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention computed in FP8 as cuDNN's FP8 fused attention computes it
    (the module docstring lists the steps), with autograd.

    query [batch, heads, seq_q, head_dim], key and value [batch, kv_heads, seq_kv, head_dim]: float32, bfloat16 or
    float16, one dtype and device. attn_mask: a bool tensor broadcastable to [batch, heads, seq_q, seq_kv], True
    where a query attends to a key (torch's convention; Transformer Engine's padding masks are the opposite), or
    None. is_causal: key j > query i masked (top-left aligned); not with attn_mask. scale: softmax_scale, default
    1 / sqrt(head_dim). enable_gqa: kv_heads may divide heads (grouped-query attention). fp8_format: Format.HYBRID
    (E4M3 forward, E5M2 backward) or Format.E4M3; margin: as a recipe's. Returns [batch, heads, seq_q, head_dim] in
    query's dtype; a query whose keys are all masked gives 0 (as torch's SDPA does).
    """
    _check(query, key, value, attn_mask, is_causal, enable_gqa)
    if not isinstance(fp8_format, Format):
        raise TypeError(f"{_FN}(): fp8_format must be a fp8ext.Format, got {fp8_format!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    for name, x in (("scale", scale), ("margin", margin)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise TypeError(f"{_FN}(): {name} must be a finite number, got {x!r}")
    opts = FP8AttentionOptions(float(scale), bool(is_causal), fp8_format.fwd, fp8_format.bwd, float(margin))
    return FP8AttentionFunction.apply(query, key, value, attn_mask, opts)


def _check(q, k, v, attn_mask, is_causal: bool, enable_gqa: bool) -> None:
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
