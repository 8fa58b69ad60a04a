"""fp8ext's operations as torch ops (torch.library), with fake implementations for tracing.

torch.ops.fp8ext.{quantize, dequantize, amax, cast_transpose, cast_transpose_dbias, quantize_blocks, gemm} run the
same code as the eager functions in fp8ext.ops (torch.ops.fp8ext.{linear_fwd, linear_bwd} FP8Linear's one-call passes
of fp8ext.ops.linear_pass, and torch.ops.fp8ext.{swiglu, rms_norm_train, rope_qkv} with their backward ops,
the training kernels of fp8ext.fused, with autograd formulas); the fake implementations give torch.compile / torch.export the outputs'
shapes and dtypes without running anything, so compiled code calls fp8ext's kernels without graph breaks.
The public functions in fp8ext.ops switch to these ops while torch.compile traces; eager calls skip the
dispatcher.

The ops are functional: instead of updating amax_out in place they take the running amax and return
the updated one, and the public function copies it back (an ordinary in-place op that the compilers
handle everywhere; custom ops with optional mutated arguments trip inductor in torch 2.11). A scale
crosses as (tensor or None, float) since a torch op takes one type per argument.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import matmul as _gemm_mod
from . import fused as _fused
from . import linear_pass as _linear_pass
from .. import ops
from ..core.formats import format_of_code


def _scale(scale: Optional[torch.Tensor], scale_value: float):
    return scale if scale is not None else scale_value


def _running_amax(x: torch.Tensor, amax_in: Optional[torch.Tensor]) -> torch.Tensor:
    return amax_in.clone() if amax_in is not None else torch.zeros((), dtype=torch.float32, device=x.device)


def _fake_amax(x: torch.Tensor, amax_in: Optional[torch.Tensor]) -> torch.Tensor:
    return amax_in.new_empty(amax_in.shape) if amax_in is not None else x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fp8ext::quantize", mutates_args=())
def _quantize(x: torch.Tensor, fmt: int, scale: Optional[torch.Tensor], scale_value: float, saturate: bool,
              stochastic: bool, seed: int, amax_in: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    amax = _running_amax(x, amax_in)
    q = ops.quantize_eager(x, format_of_code(fmt), _scale(scale, scale_value), saturate, stochastic, seed, amax)
    return q, amax


@_quantize.register_fake
def _(x, fmt, scale, scale_value, saturate, stochastic, seed, amax_in):
    return x.new_empty(x.shape, dtype=format_of_code(fmt).torch_dtype), _fake_amax(x, amax_in)


@torch.library.custom_op("fp8ext::dequantize", mutates_args=())
def _dequantize(q: torch.Tensor, fmt: int, scale_inv: Optional[torch.Tensor], scale_inv_value: float,
                dtype: torch.dtype) -> torch.Tensor:
    return ops.dequantize_eager(q, format_of_code(fmt), _scale(scale_inv, scale_inv_value), dtype)


@_dequantize.register_fake
def _(q, fmt, scale_inv, scale_inv_value, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.custom_op("fp8ext::amax", mutates_args=())
def _amax(x: torch.Tensor) -> torch.Tensor:
    return ops.amax_eager(x)


@_amax.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fp8ext::cast_transpose", mutates_args=())
def _cast_transpose(x: torch.Tensor, fmt: int, scale: Optional[torch.Tensor], scale_value: float, saturate: bool,
                    amax_in: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    amax = _running_amax(x, amax_in)
    q, qt = ops.cast_transpose_eager(x, format_of_code(fmt), _scale(scale, scale_value), saturate, amax)
    return q, qt, amax


def _fake_q_and_qt(x: torch.Tensor, fmt: int, fn: str) -> Tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise ValueError(f"{fn}(): x must be 2-D, got shape {list(x.shape)}")
    dtype = format_of_code(fmt).torch_dtype
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((x.shape[1], x.shape[0]), dtype=dtype)


@_cast_transpose.register_fake
def _(x, fmt, scale, scale_value, saturate, amax_in):
    return (*_fake_q_and_qt(x, fmt, "cast_transpose"), _fake_amax(x, amax_in))


@torch.library.custom_op("fp8ext::cast_transpose_dbias", mutates_args=())
def _cast_transpose_dbias(x: torch.Tensor, fmt: int, scale: Optional[torch.Tensor], scale_value: float,
                          saturate: bool, amax_in: Optional[torch.Tensor], dbias_float32: bool
                          ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    amax = _running_amax(x, amax_in)
    f = format_of_code(fmt)
    q, qt = ops.fp8_empty(x.shape, f, x.device), ops.fp8_empty((x.shape[1], x.shape[0]), f, x.device)
    db = torch.empty((x.shape[1],), dtype=torch.float32 if dbias_float32 else x.dtype, device=x.device)
    ops.cast_transpose_dbias_eager(x, f, _scale(scale, scale_value), saturate, amax, out=(q, qt, db))
    return q, qt, db, amax


@_cast_transpose_dbias.register_fake
def _(x, fmt, scale, scale_value, saturate, amax_in, dbias_float32):
    return (*_fake_q_and_qt(x, fmt, "cast_transpose_dbias"),
            x.new_empty((x.shape[1],), dtype=torch.float32 if dbias_float32 else x.dtype), _fake_amax(x, amax_in))


@torch.library.custom_op("fp8ext::quantize_blocks", mutates_args=())
def _quantize_blocks(x: torch.Tensor, fmt: int, kind: str, pow2: bool, eps: float
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scale_inv) of quantize_rowwise / quantize_blockwise (scale_inv a view of fp8ext.ops.scale_buffer's buffer,
    in the layout gemm reads)."""
    return ops.quantize_blocks_eager(x, format_of_code(fmt), kind, pow2, eps, x.device)


def _fake_blocks(x: torch.Tensor, fmt: int, kind: str, rows: int, cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, cols], scale_inv) with the shapes and strides ops.quantize_blocks_eager gives them."""
    buf, _, _ = ops.scale_buffer(kind, rows, cols, "meta")
    s = ops.scale_inv_view(buf, kind, cols)
    return (x.new_empty((rows, cols), dtype=format_of_code(fmt).torch_dtype),
            torch.empty_strided(s.shape, s.stride(), dtype=torch.float32, device=x.device))


@_quantize_blocks.register_fake
def _(x, fmt, kind, pow2, eps):
    rows, cols = x.shape
    return _fake_blocks(x, fmt, kind, rows, cols)


@torch.library.custom_op("fp8ext::quantize_blocks_t", mutates_args=())
def _quantize_blocks_t(x: torch.Tensor, fmt: int, kind: str, pow2: bool, eps: float
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale_inv, qt, scale_inv_t) of fp8ext.ops.quantize_blocks_t."""
    return ops.quantize_blocks_t_eager(x, format_of_code(fmt), kind, pow2, eps)


@_quantize_blocks_t.register_fake
def _(x, fmt, kind, pow2, eps):
    rows, cols = x.shape
    return (*_fake_blocks(x, fmt, kind, rows, cols), *_fake_blocks(x, fmt, kind, cols, rows))


@torch.library.custom_op("fp8ext::gemm", mutates_args=())
def _gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
          out_dtype: torch.dtype, bias: Optional[torch.Tensor], use_fast_accum: bool, acc_in: Optional[torch.Tensor],
          out_scale: Optional[torch.Tensor], want_amax: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    out = acc_in.clone() if acc_in is not None else None
    amax = torch.zeros((), dtype=torch.float32, device=a.device)
    out = _gemm_mod.gemm_eager(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype, bias=bias,
                               use_fast_accum=use_fast_accum, out=out, accumulate=acc_in is not None,
                               out_scale=out_scale, amax_out=amax if want_amax else None)
    return out, amax


@_gemm.register_fake
def _(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, use_fast_accum, acc_in, out_scale, want_amax):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype), a.new_empty((), dtype=torch.float32)


# FP8Linear's one-call passes (fp8ext.ops.linear_pass) under torch.compile: ONE_CALL_OP in
# fp8ext.modules.linear_autograd calls these. The slots' scales and amaxes cross as tensors, and an updated amax comes
# back as an output that the caller copies into its slot (as for the ops above).
@torch.library.custom_op("fp8ext::linear_fwd", mutates_args=())
def _linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], x_scale: Optional[torch.Tensor],
                x_amax: Optional[torch.Tensor], w_scale: Optional[torch.Tensor], w_amax: Optional[torch.Tensor],
                fmt: int, margin: float, out_dtype: torch.dtype, keep: bool = True, prologue: int = 0
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, the saved buffer (its header only with keep=False), the input's amax, the weight's amax): see
    fp8ext.ops.linear_pass.linear_fwd_eager."""
    return _linear_pass.linear_fwd_eager(x, weight, bias, x_scale, x_amax, w_scale, w_amax, format_of_code(fmt),
                                         margin, out_dtype, keep, prologue)


@_linear_fwd.register_fake
def _(x, weight, bias, x_scale, x_amax, w_scale, w_amax, fmt, margin, out_dtype, keep=True, prologue=0):
    (m, k), n = (x.shape[0], weight.shape[1]), weight.shape[0]
    amax = [a.new_empty(a.shape) if a is not None else x.new_empty((), dtype=torch.float32) for a in (x_amax, w_amax)]
    return (x.new_empty((m, n), dtype=out_dtype),
            x.new_empty((_linear_pass.forward_bytes(m, k, n, keep)[1],), dtype=torch.uint8), *amax)


# Declared pure although the C call writes dy's scale_inv (with current scaling also its amax and scale) into the
# saved buffer's header, as the eager call does: those bytes are written before they are read within this one call,
# and nothing else reads them (the forward's bytes, x8^T, W8^T and their scale_invs, are left as they were), so a
# repeated backward or any reuse of the buffer sees what it would see without the write. torch.library.opcheck's
# schema test reports the write; declaring it (mutates_args=("saved",)) passed the CPU tests but was not measured on
# a GPU, where functionalization could copy the buffer.
@torch.library.custom_op("fp8ext::linear_bwd", mutates_args=())
def _linear_bwd(dy: torch.Tensor, saved: torch.Tensor, m: int, k: int, n: int, ffmt: int, bfmt: int,
                g_scale: Optional[torch.Tensor], g_amax: Optional[torch.Tensor], margin: float, need_dx: bool,
                need_dw: bool, want_db: bool, db_dtype: torch.dtype, x_dtype: torch.dtype, w_dtype: torch.dtype,
                x_t: Optional[torch.Tensor] = None, w_t: Optional[torch.Tensor] = None,
                swiglu_da: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db, the gradient's amax), a gradient not wanted empty: see fp8ext.ops.linear_pass.linear_bwd_eager."""
    return _linear_pass.linear_bwd_eager(dy, saved, m, k, n, format_of_code(ffmt), format_of_code(bfmt), g_scale,
                                         g_amax, margin, need_dx, need_dw, want_db, db_dtype, x_dtype, w_dtype, x_t,
                                         w_t, swiglu_da)


@_linear_bwd.register_fake
def _(dy, saved, m, k, n, ffmt, bfmt, g_scale, g_amax, margin, need_dx, need_dw, want_db, db_dtype, x_dtype, w_dtype,
      x_t=None, w_t=None, swiglu_da=None):
    ga = g_amax.new_empty(g_amax.shape) if g_amax is not None else dy.new_empty((), dtype=torch.float32)
    return (dy.new_empty((m, k) if need_dx else (0,), dtype=x_dtype if need_dx else dy.dtype),
            dy.new_empty((n, k) if need_dw else (0,), dtype=w_dtype if need_dw else dy.dtype),
            dy.new_empty((n,) if want_db else (0,), dtype=db_dtype if want_db else dy.dtype), ga)


# The training kernels of fp8ext.fused (SwiGLU and RMSNorm, forward and backward) as torch ops with autograd
# formulas, so that torch.compile calls them instead of tracing torch's composition: fp8ext.fused.swiglu and
# rms_norm_train switch to these while it traces. On a CPU tensor the ops compute the same definitions with torch
# ops (the eager functions never send a CPU tensor here; the CPU tests check the registrations with it).
@torch.library.custom_op("fp8ext::swiglu", mutates_args=())
def _swiglu(h: torch.Tensor) -> torch.Tensor:
    if not h.is_cuda:
        return _fused.swiglu_reference(h).contiguous()
    h2 = _fused.kernel_rows(h, h.shape[-1], "swiglu", "h")
    out = _fused.swiglu_rows(h2)
    return out.reshape(*h.shape[:-1], h.shape[-1] // 2)


@_swiglu.register_fake
def _(h):
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2))


@torch.library.custom_op("fp8ext::swiglu_backward", mutates_args=())
def _swiglu_backward(h: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    if not h.is_cuda:
        return _fused.swiglu_backward_reference(h, dy).contiguous()
    return _fused.swiglu_backward_gpu(_fused.kernel_rows(h, h.shape[-1], "swiglu_backward", "h"), dy).reshape(h.shape)


@_swiglu_backward.register_fake
def _(h, dy):
    return h.new_empty(h.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, dy):
    (h,) = ctx.saved_tensors
    return torch.ops.fp8ext.swiglu_backward(h, dy)


_swiglu.register_autograd(_swiglu_grad, setup_context=_swiglu_setup)


@torch.library.custom_op("fp8ext::rms_norm_train", mutates_args=())
def _rms_norm_train(x: torch.Tensor, gamma: torch.Tensor, eps: float, out_dtype: torch.dtype
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    g = _fused.contiguous_aligned(gamma, torch.float32)
    if not x.is_cuda:
        y, rstd = _fused.rms_norm_train_reference(x, g, eps, out_dtype)
        return y.contiguous(), rstd.contiguous()
    y, rstd = _fused.rms_norm_train_gpu(_fused.kernel_rows(x, x.shape[-1], "rms_norm_train"), g, eps, out_dtype)
    return y.reshape(x.shape), rstd


@_rms_norm_train.register_fake
def _(x, gamma, eps, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((math.prod(x.shape[:-1]),), dtype=torch.float32)


@torch.library.custom_op("fp8ext::rms_norm_train_backward", mutates_args=())
def _rms_norm_train_backward(x: torch.Tensor, dy: torch.Tensor, gamma: torch.Tensor, rstd: torch.Tensor
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dgamma float32)."""
    g = _fused.contiguous_aligned(gamma, torch.float32)
    if not x.is_cuda:
        dx, dgamma = _fused.rms_norm_train_backward_reference(x, dy, g, rstd)
        return dx.contiguous(), dgamma
    x2 = _fused.kernel_rows(x, x.shape[-1], "rms_norm_train_backward")
    dx, dgamma = _fused.rms_norm_train_backward_gpu(x2, dy, g, rstd)
    return dx.reshape(x.shape), dgamma


@_rms_norm_train_backward.register_fake
def _(x, dy, gamma, rstd):
    return x.new_empty(x.shape), x.new_empty((x.shape[-1],), dtype=torch.float32)


def _rms_norm_train_setup(ctx, inputs, output):
    x, gamma, _, _ = inputs
    ctx.save_for_backward(x, gamma, output[1])
    ctx.mark_non_differentiable(output[1])  # rstd: a by-product, not a differentiable output


def _rms_norm_train_grad(ctx, dy, _drstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = torch.ops.fp8ext.rms_norm_train_backward(x, dy, gamma, rstd)
    return dx, dgamma.to(gamma.dtype), None, None


_rms_norm_train.register_autograd(_rms_norm_train_grad, setup_context=_rms_norm_train_setup)


# RoPE of a fused QKV projection (fp8ext.fused.rope_qkv), forward and backward one kernel each, as torch ops with an
# autograd formula: fp8ext.fused.rope_qkv switches to it while torch.compile traces.
@torch.library.custom_op("fp8ext::rope_qkv", mutates_args=())
def _rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, n_kv: int, start_pos: int
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not qkv.is_cuda:  # the reference; copies, so that no output shares qkv's storage (v may be a view of it)
        with torch.no_grad():
            return tuple(t.clone(memory_format=torch.contiguous_format)
                         for t in _fused.rope_qkv(qkv, cos, sin, n_heads, n_kv, start_pos))
    return _fused.rope_qkv_gpu(qkv, cos, sin, n_heads, n_kv, start_pos)


def _rope_heads(qkv: torch.Tensor, n_heads: int, n_kv: int):
    b, s, width = qkv.shape
    hd = width // (n_heads + 2 * n_kv)
    return [(b, heads, s, hd) for heads in (n_heads, n_kv, n_kv)]


@_rope_qkv.register_fake
def _(qkv, cos, sin, n_heads, n_kv, start_pos):
    return tuple(qkv.new_empty(shape) for shape in _rope_heads(qkv, n_heads, n_kv))


@torch.library.custom_op("fp8ext::rope_qkv_backward", mutates_args=())
def _rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       n_heads: int, n_kv: int, start_pos: int) -> torch.Tensor:
    """dqkv [batch, seq, (n_heads + 2 n_kv) * head_dim] in dq's dtype."""
    b, _, s, hd = dq.shape
    if not dq.is_cuda:  # the reference: autograd's gradient of the float32 composition, each sum of two products once
        c, n = cos[start_pos:start_pos + s].float(), sin[start_pos:start_pos + s].float()

        def unrotate(g):
            g1, g2 = g.float().chunk(2, dim=-1)
            return torch.cat([g1 * c + g2 * n, g2 * c - g1 * n], dim=-1).to(g.dtype)

        heads = [unrotate(dq), unrotate(dk), dv]  # [b, heads, s, hd] each
        return torch.cat([t.transpose(1, 2).reshape(b, s, -1) for t in heads], dim=-1)
    return _fused.rope_qkv_backward_gpu(dq, dk, dv, cos, sin, (b, s, (n_heads + 2 * n_kv) * hd), dq.dtype, n_heads,
                                        n_kv, start_pos)


@_rope_qkv_backward.register_fake
def _(dq, dk, dv, cos, sin, n_heads, n_kv, start_pos):
    b, _, s, hd = dq.shape
    return dq.new_empty((b, s, (n_heads + 2 * n_kv) * hd))


def _rope_qkv_setup(ctx, inputs, output):
    qkv, cos, sin, n_heads, n_kv, start_pos = inputs
    ctx.save_for_backward(cos, sin)
    ctx.meta = (n_heads, n_kv, start_pos)
    ctx.shapes = _rope_heads(qkv, n_heads, n_kv)


def _rope_qkv_grad(ctx, dq, dk, dv):
    cos, sin = ctx.saved_tensors
    ref = next(g for g in (dq, dk, dv) if g is not None)
    dq, dk, dv = (ref.new_zeros(shape) if g is None else g for g, shape in zip((dq, dk, dv), ctx.shapes))
    return torch.ops.fp8ext.rope_qkv_backward(dq, dk, dv, cos, sin, *ctx.meta), None, None, None, None, None


_rope_qkv.register_autograd(_rope_qkv_grad, setup_context=_rope_qkv_setup)
