"""FP8 attention on Hopper GPUs: cuDNN's FP8 fused attention (the engine Transformer Engine uses for fp8_dpa),
through NVIDIA's cudnn frontend, with the numerics of fp8ext.ops.attention_fp8 (which is its definition and its CPU
engine).

    out = cudnn_fp8_attention(q, k, v, None, is_causal=True, scale=None, enable_gqa=True)   # [b, h, s, d] CUDA

fp8ext casts Q, K and V to E4M3 (and, in backward, dO to E5M2) with its own kernels and per-tensor current scales;
cuDNN runs the forward (S, the softmax, P8 with the fixed scale 448, O8 = P8 V8) and the backward (dP, dS8, dQ8,
dK8, dV8) each as one fused kernel; fp8ext dequantizes O8 and dQ8 / dK8 / dV8 into the inputs' dtype, or, with
fp8_output=True (inference: Transformer Engine's fp8_mha), returns O8 itself as an FP8Tensor. O8 and the output are
laid out with the sequence before the heads in memory ([batch, seq, heads, head_dim], or [seq, batch, heads,
head_dim] where the query is laid out so; a [b, h, s, d] view), so that the output projection reads them as rows
without a copy. The scales
of what cuDNN writes in FP8 come from attention_fp8.attention_scales (bounds from the inputs' amaxes, computed on
the device: no host synchronisation). Graphs are built once per shape, layout, mask and format and kept.

The cudnn frontend is an optional dependency (`pip install nvidia-cudnn-frontend`); without it FP8 attention on a
GPU raises ImportError saying so. It takes no mask but causal (top-left aligned) or none: a padding, window or
arbitrary mask raises NotImplementedError, never a silent high-precision run.
"""

from __future__ import annotations

import math
import threading
from typing import List, Optional, Tuple

import torch

from ..core.casts import amax, scale_from_amax
from ..core.formats import E4M3, FP8Format, Format, format_of_code
from ..core.tensor import FP8Tensor
from . import dequantize, quantize
from .attention_fp8 import (FP8AttentionOptions, attention_scales, check_attention, check_fp8_output,
                            fp8_backward_from, sdpa_backward)

__all__ = ["cudnn_fp8_attention", "cudnn_available"]

_FN = "FP8 attention on a GPU"
_graphs: dict = {}
_handles: dict = {}
_consts: dict = {}
_lock = threading.Lock()


def _cudnn():
    """NVIDIA's cudnn frontend module, or the ImportError that says how to get it."""
    try:
        import cudnn
    except ImportError as e:
        raise ImportError(f"{_FN} (fp8_dpa=True) runs on cuDNN's FP8 fused attention through NVIDIA's cudnn "
                          f"frontend, which is not installed: pip install nvidia-cudnn-frontend (or fp8ext's "
                          f"'attention' extra). Without it, run attention outside fp8_autocast or with "
                          f"fp8_dpa=False") from e
    return cudnn


def cudnn_available() -> bool:
    """Whether the cudnn frontend imports (FP8 attention's GPU engine can run)."""
    try:
        _cudnn()
        return True
    except ImportError:
        return False


def _storage_order(x: torch.Tensor) -> Tuple[int, ...]:
    """The permutation p of x's dimensions such that x.permute(p) is contiguous (x's memory order), or () when x is
    not a permutation of a contiguous tensor."""
    p = tuple(sorted(range(x.dim()), key=lambda i: (-x.stride(i), -x.shape[i])))
    return p if x.permute(p).is_contiguous() else ()


def _inverse(p: Tuple[int, ...]) -> Tuple[int, ...]:
    return tuple(sorted(range(len(p)), key=lambda i: p[i]))


def _in_memory_order(x: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """(x in its memory order, contiguous: x.permute(p), or a copy where x is not a permuted contiguous tensor;
    the permutation that turns it back into x's dimension order)."""
    p = _storage_order(x)
    if not p:
        return x.contiguous(), tuple(range(x.dim()))
    return x.permute(p), _inverse(p)


def _cast(x: torch.Tensor, fmt: FP8Format, margin: float) -> Tuple[FP8Tensor, torch.Tensor]:
    """(x cast to fmt with its current scale, with x's strides; amax(x)): attention_fp8._cast's bytes."""
    xp, back = _in_memory_order(x)
    a = amax(xp)
    scale, scale_inv = scale_from_amax(a, fmt, margin)
    return FP8Tensor(quantize(xp, fmt, scale).permute(back), None, scale_inv, fmt, scale=scale), a


def _dequantize(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 data dequantized into dtype, with data's strides."""
    dp, back = _in_memory_order(data)
    return dequantize(dp, scale_inv, dtype).permute(back)


def _const(device: torch.device, value: float) -> torch.Tensor:
    key = (device, value)
    t = _consts.get(key)
    if t is None:
        t = _consts[key] = torch.full((1, 1, 1, 1), value, dtype=torch.float32, device=device)
    return t


def _cell(t: torch.Tensor) -> torch.Tensor:
    """A one-element float32 tensor as cuDNN's [1, 1, 1, 1] scalar."""
    return t.reshape(1, 1, 1, 1)


def _handle(cudnn, device: torch.device):
    """The cuDNN handle of `device`, set to torch's current stream there."""
    h = _handles.get(device.index)
    if h is None:
        with _lock, torch.cuda.device(device):
            h = _handles.get(device.index)
            if h is None:
                h = _handles[device.index] = cudnn.create_handle()
    cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(device).cuda_stream)
    return h


def _types(cudnn, fmt: FP8Format):
    return cudnn.data_type.FP8_E4M3 if fmt is E4M3 else cudnn.data_type.FP8_E5M2


def _tensor(graph, cudnn, name: str, t: torch.Tensor, dtype):
    return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dtype)


def _scalars(graph, cudnn, names):
    return [graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
            for n in names]


def _build(graph, cudnn, what: str):
    """Validates and plans a graph; cuDNN's refusal becomes NotImplementedError naming what was asked."""
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as e:  # cudnn's errors have no common base class beyond Exception
        raise NotImplementedError(f"{_FN}: cuDNN {cudnn.backend_version()} has no FP8 fused attention for {what}: "
                                  f"{e}") from e
    return graph


def _graph(kind: str, build, cudnn, handle, *tensors_and_opts):
    """The cached graph of (kind, the tensors' shapes and strides, the options, the device), built on first use."""
    *tensors, opts = tensors_and_opts
    key = (kind, tuple((t.shape, t.stride()) for t in tensors), opts, tensors[0].device)
    g = _graphs.get(key)
    if g is None:
        with _lock:  # a forward and the autograd thread's backward may build at once
            g = _graphs.get(key)
            if g is None:
                g = _graphs[key] = build(cudnn, handle, *tensors, opts)
    return g


def _fwd_graph(cudnn, handle, q8, k8, v8, o8, opts: FP8AttentionOptions):
    e4 = _types(cudnn, opts.fwd)
    graph = cudnn.pygraph(io_data_type=e4, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq, tk, tv = (_tensor(graph, cudnn, n, t, e4) for n, t in (("q", q8), ("k", k8), ("v", v8)))
    sc = _scalars(graph, cudnn, ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"))
    o, stats, amax_s, amax_o = graph.sdpa_fp8(tq, tk, tv, *sc, is_inference=False, attn_scale=opts.softmax_scale,
                                              use_causal_mask=opts.is_causal, name="fp8ext_attention")
    o.set_output(True).set_dim(list(o8.shape)).set_stride(list(o8.stride())).set_data_type(e4)
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    for a in (amax_s, amax_o):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    what = f"Q {list(q8.shape)}, K {list(k8.shape)} ([batch, heads, seq, head_dim]), causal={opts.is_causal}"
    return _build(graph, cudnn, what), (tq, tk, tv, *sc, o, stats, amax_s, amax_o)


def _bwd_graph(cudnn, handle, q8, k8, v8, o8, do8, opts: FP8AttentionOptions):
    e4, e5 = _types(cudnn, opts.fwd), _types(cudnn, opts.bwd)
    graph = cudnn.pygraph(io_data_type=e4, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq, tk, tv, to = (_tensor(graph, cudnn, n, t, e4) for n, t in (("q", q8), ("k", k8), ("v", v8), ("o", o8)))
    tdo = _tensor(graph, cudnn, "do", do8, e5)
    b, h, sq, _ = q8.shape
    tst = graph.tensor(name="stats", dim=[b, h, sq, 1], stride=[h * sq, sq, 1, 1], data_type=cudnn.data_type.FLOAT)
    names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_do", "descale_s", "descale_dp", "scale_s",
             "scale_dq", "scale_dk", "scale_dv", "scale_dp")
    sc = _scalars(graph, cudnn, names)
    outs = graph.sdpa_fp8_backward(tq, tk, tv, to, tdo, tst, *sc, attn_scale=opts.softmax_scale,
                                   use_causal_mask=opts.is_causal, name="fp8ext_attention_backward")
    for t, like in zip(outs[:3], (q8, k8, v8)):
        t.set_output(True).set_dim(list(like.shape)).set_stride(list(like.stride())).set_data_type(e5)
    for a in outs[3:]:
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    what = f"the backward of Q {list(q8.shape)}, K {list(k8.shape)}, causal={opts.is_causal}"
    return _build(graph, cudnn, what), (tq, tk, tv, to, tdo, tst, *sc, *outs)


def _run(cudnn, handle, graph, pack: dict, device) -> None:
    ws = torch.empty(max(graph.get_workspace_size(), 1), dtype=torch.uint8, device=device)
    graph.execute(pack, ws, handle=handle)


def _out_like(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty [b, h, s, d] tensor shaped like q, laid out as the output is: in q's memory order where that puts
    the sequence before the heads ([b, s, h, d] or [s, b, h, d]: DotProductAttention's layouts, whose views need no
    copy then), else [b, s, h, d] (what an output projection reads as rows)."""
    p = _storage_order(q)
    if not p or p.index(1) < p.index(2):
        p = (0, 2, 1, 3)
    return torch.empty([q.shape[i] for i in p], dtype=dtype, device=q.device).permute(_inverse(p))


def _forward(q, k, v, opts: FP8AttentionOptions, dequantize_out: bool = True):
    """(the output in q's dtype, laid out by _out_like (None when not dequantize_out), what the backward needs: Q8,
    K8, V8, O8 (FP8 data, O8 laid out as the output), their scale_invs, the amaxes of Q, K, V and the softmax
    statistics (cuDNN's log-sum-exp per row))."""
    cudnn = _cudnn()
    dev = q.device
    handle = _handle(cudnn, dev)
    (q8, a_q), (k8, a_k), (v8, a_v) = (_cast(x, opts.fwd, opts.margin) for x in (q, k, v))
    amaxes = torch.stack([a_q.reshape(()), a_k.reshape(()), a_v.reshape(())])
    scale_o = attention_scales(amaxes, None, q.shape, k.shape, opts)["o"]
    o8 = _out_like(q8.data, q8.data.dtype)
    b, h, sq, _ = q.shape
    stats = torch.empty(b, h, sq, 1, dtype=torch.float32, device=dev)
    graph, (tq, tk, tv, *sc, to, tst, tas, tao) = _graph("fwd", _fwd_graph, cudnn, handle, q8.data, k8.data,
                                                               v8.data, o8, opts)
    scalars = (q8.scale_inv, k8.scale_inv, v8.scale_inv, _const(dev, 1 / opts.fwd.max), _const(dev, opts.fwd.max),
               scale_o)
    pack = {tq: q8.data, tk: k8.data, tv: v8.data, to: o8, tst: stats,
            tas: torch.empty(1, 1, 1, 1, device=dev), tao: torch.empty(1, 1, 1, 1, device=dev)}
    pack.update((t, _cell(x)) for t, x in zip(sc, scalars))
    _run(cudnn, handle, graph, pack, dev)
    o_inv = scale_o.reciprocal()
    saved = (q8.data, k8.data, v8.data, o8, q8.scale_inv, k8.scale_inv, v8.scale_inv, o_inv, amaxes, stats)
    return (_dequantize(o8, o_inv, q.dtype) if dequantize_out else None), saved


def _flash_backward(q8, k8, v8, q_inv, k_inv, v_inv, grad_out, opts: FP8AttentionOptions):
    """sdpa_backward's gradients through torch's flash attention ops called directly (inside a torch op, below
    autograd, where torch.autograd.grad records nothing): its forward recomputed for the log-sum-exp, then its
    backward, K and V repeated for grouped-query attention and their gradients summed back."""
    dtype = grad_out.dtype
    q, k, v = (t.to(dtype) * inv.to(dtype) for t, inv in ((q8, q_inv), (k8, k_inv), (v8, v_inv)))
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, opts.is_causal, False, scale=opts.softmax_scale)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad_out, q, k, v, out, lse, cq, ck, mq, mk, 0.0, opts.is_causal, seed, offset, scale=opts.softmax_scale)
    if g > 1:
        b, h, s, d = dk.shape
        dk, dv = (t.reshape(b, h // g, g, s, d).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _backward(grad_out, saved, opts: FP8AttentionOptions, in_op: bool = False):
    """(dQ, dK, dV) in grad_out's dtype, each with the strides of its FP8 operand, from _forward's saved tensors."""
    q8, k8, v8, o8, q_inv, k_inv, v_inv, o_inv, amaxes, stats = saved
    dev, dtype = q8.device, grad_out.dtype
    if not opts.fp8_backward:  # torch's SDPA backward (its fastest engine) at the dequantized Q8, K8, V8
        fp8 = (FP8Tensor(t, None, inv, opts.fwd) for t, inv in ((q8, q_inv), (k8, k_inv), (v8, v_inv)))
        grads = _flash_backward(q8, k8, v8, q_inv, k_inv, v_inv, grad_out, opts) if in_op else \
            sdpa_backward(*fp8, grad_out, opts)
        return tuple(g if g.stride() == t.stride() else torch.empty_like(t, dtype=dtype).copy_(g)
                     for g, t in zip(grads, (q8, k8, v8)))
    cudnn = _cudnn()
    handle = _handle(cudnn, dev)
    do8, a_do = _cast(grad_out, opts.bwd, opts.margin)
    sc_ = attention_scales(amaxes, a_do, q8.shape, k8.shape, opts)
    dq8, dk8, dv8 = (torch.empty_like(t, dtype=opts.bwd.torch_dtype) for t in (q8, k8, v8))
    graph, handles = _graph("bwd", _bwd_graph, cudnn, handle, q8, k8, v8, o8, do8.data, opts)
    tq, tk, tv, to, tdo, tst, *rest = handles
    sc, outs = rest[:12], rest[12:]
    scalars = (q_inv, k_inv, v_inv, o_inv, do8.scale_inv, _const(dev, 1 / opts.fwd.max),
               sc_["ds"].reciprocal(), _const(dev, opts.fwd.max), sc_["dq"], sc_["dk"], sc_["dv"], sc_["ds"])
    pack = {tq: q8, tk: k8, tv: v8, to: o8, tdo: do8.data, tst: stats, outs[0]: dq8, outs[1]: dk8, outs[2]: dv8}
    pack.update((t, _cell(x)) for t, x in zip(sc, scalars))
    pack.update((t, torch.empty(1, 1, 1, 1, device=dev)) for t in outs[3:])
    _run(cudnn, handle, graph, pack, dev)
    return tuple(_dequantize(t, sc_[n].reciprocal(), dtype) for t, n in ((dq8, "dq"), (dk8, "dk"), (dv8, "dv")))


class CudnnFP8Attention(torch.autograd.Function):
    """Autograd over cuDNN's FP8 forward and backward (eager calls; torch.compile traces the torch ops below)."""

    @staticmethod
    def forward(ctx, q, k, v, opts: FP8AttentionOptions):
        out, saved = _forward(q, k, v, opts)
        ctx.opts = opts
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return (*_backward(grad_out, ctx.saved_tensors, ctx.opts), None)


# torch.compile: the same two passes as torch ops (torch.ops.fp8ext.cudnn_fp8_attention and its backward), with
# fake implementations giving the outputs' shapes, dtypes and strides, so that compiled code calls cuDNN without a
# graph break. The options cross as numbers (a format as its code).
def _opts(softmax_scale: float, is_causal: bool, fwd: int, bwd: int, margin: float, fp8_backward: bool):
    return FP8AttentionOptions(softmax_scale, is_causal, format_of_code(fwd), format_of_code(bwd), margin,
                               fp8_backward)


# each Format's (forward, backward) format codes, looked up while torch.compile traces (it does not trace FP8Format)
_CODES = {f: (f.fwd.code, f.bwd.code) for f in Format}


@torch.library.custom_op("fp8ext::cudnn_fp8_attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, is_causal: bool, fwd: int,
                  bwd: int, margin: float, fp8_backward: bool) -> List[torch.Tensor]:
    out, saved = _forward(q, k, v, _opts(softmax_scale, is_causal, fwd, bwd, margin, fp8_backward))
    return [out, *saved]


@_attention_op.register_fake
def _(q, k, v, softmax_scale, is_causal, fwd, bwd, margin, fp8_backward):
    f8 = format_of_code(fwd).torch_dtype
    q8, k8, v8 = (torch.empty_like(t, dtype=f8) for t in (q, k, v))
    b, h, sq, _ = q.shape
    scalar = [q.new_empty((), dtype=torch.float32) for _ in range(4)]
    return [_out_like(q, q.dtype), q8, k8, v8, _out_like(q8, f8), *scalar, q.new_empty(3, dtype=torch.float32),
            q.new_empty((b, h, sq, 1), dtype=torch.float32)]


@torch.library.custom_op("fp8ext::cudnn_fp8_attention_backward", mutates_args=())
def _attention_backward_op(grad_out: torch.Tensor, saved: List[torch.Tensor], softmax_scale: float, is_causal: bool,
                           fwd: int, bwd: int, margin: float, fp8_backward: bool) -> List[torch.Tensor]:
    return list(_backward(grad_out, saved, _opts(softmax_scale, is_causal, fwd, bwd, margin, fp8_backward), True))


@_attention_backward_op.register_fake
def _(grad_out, saved, softmax_scale, is_causal, fwd, bwd, margin, fp8_backward):
    return [torch.empty_like(t, dtype=grad_out.dtype) for t in saved[:3]]


def _attention_setup(ctx, inputs, output):
    ctx.op_args = inputs[3:]
    ctx.save_for_backward(*output[1:])


def _attention_grad(ctx, grads):
    """grads: one per output of the op; only the attention output's (the first) is used (the others are saved
    tensors, not results)."""
    dq, dk, dv = torch.ops.fp8ext.cudnn_fp8_attention_backward(grads[0], list(ctx.saved_tensors), *ctx.op_args)
    return dq, dk, dv, None, None, None, None, None, None


_attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)


def cudnn_fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: Optional[torch.Tensor] = None, *, is_causal: bool = False,
                        scale: Optional[float] = None, enable_gqa: bool = False, fp8_format: Format = Format.HYBRID,
                        margin: float = 0.0, fp8_backward: Optional[bool] = None, fp8_output: bool = False):
    """fp8ext.ops.attention_fp8.fp8_scaled_dot_product_attention's arguments and numerics, on a CUDA device through
    cuDNN's FP8 fused attention (see the module docstring): [batch, heads, seq, head_dim] tensors of any strides,
    returned in query's dtype, laid out with the sequence before the heads in memory (_out_like). attn_mask must be None (is_causal
    gives the causal mask). fp8_output=True returns O8 itself, an FP8Tensor (no gradient: inference only)."""
    check_attention(query, key, value, attn_mask, is_causal, enable_gqa)
    check_fp8_output(fp8_output, (query, key, value), "cudnn_fp8_attention")
    if attn_mask is not None:
        raise NotImplementedError(f"{_FN}: cuDNN's FP8 fused attention takes the causal mask or none; a padding, "
                                  f"sliding-window or arbitrary mask is not supported yet (attn_mask_type 'causal' "
                                  f"or 'no_mask', no window_size)")
    if not query.is_cuda:
        raise ValueError(f"{_FN}: query, key and value must be CUDA tensors, got {query.device}")
    d = query.shape[-1]
    if d % 16 or d > 256:
        raise NotImplementedError(f"{_FN}: head_dim must be a multiple of 16 up to 256 for cuDNN's FP8 attention, "
                                  f"got {d}")
    fp8_backward = fp8_backward_from(fp8_backward, "cudnn_fp8_attention")
    if d != 128 and fp8_backward and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise NotImplementedError(f"{_FN}: cuDNN's FP8 attention backward on Hopper takes head_dim 128 only, got {d} "
                                  f"(the forward alone, under torch.no_grad(), and the forward with the backward in high precision, "
                                  f"NVTE_FP8_DPA_BWD=0, take other multiples of 16)")
    softmax_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if fp8_output:
        if torch.compiler.is_compiling():
            raise NotImplementedError(f"{_FN}: fp8_output=True (an FP8Tensor result) does not run under "
                                      f"torch.compile; compile with fp8_output=False")
        opts = FP8AttentionOptions(softmax_scale, bool(is_causal), fp8_format.fwd, fp8_format.bwd, float(margin),
                                   fp8_backward)
        _, saved = _forward(query, key, value, opts, dequantize_out=False)
        return FP8Tensor(saved[3], None, saved[7], opts.fwd)
    if torch.compiler.is_compiling():
        fwd, bwd = _CODES[fp8_format]
        return torch.ops.fp8ext.cudnn_fp8_attention(query, key, value, softmax_scale, bool(is_causal), fwd, bwd,
                                                    float(margin), fp8_backward)[0]
    opts = FP8AttentionOptions(softmax_scale, bool(is_causal), fp8_format.fwd, fp8_format.bwd, float(margin),
                               fp8_backward)
    return CudnnFP8Attention.apply(query, key, value, opts)
