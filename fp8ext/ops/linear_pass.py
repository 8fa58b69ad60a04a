"""An FP8 linear layer's passes as one fp8ext._C call each (csrc/py_linear.c): FP8Linear's fast path.

In the common training case (eager, delayed or per-tensor current scaling, the weight recast every step, contiguous
input, a token count that is a multiple of 16, fp8ext.debug off) FP8Linear skips the composed path and runs each pass
as one C call: the forward's two cast_transposes and its GEMM (linear_fwd_call), the backward's cast_transpose
(cast_transpose_dbias with a bias) and its two GEMMs (linear_bwd_call). The FP8 tensors live in two byte buffers per
pass (one kept for backward: the scale_invs, x8^T and W8^T; one dropped: x8 and W8), laid out as csrc/py_linear.c
defines and exports (LINEAR_ALIGN, LINEAR_SINV_STRIDE, LINEAR_SINV_BYTES, LINEAR_CUR_AMAX, LINEAR_CUR_SCALE). Same
kernels, same cuBLASLt calls, same bytes as the composed path (tests compare the two bit for bit); the host work per
step is a fraction. On the CPU the C calls do the casts and the GEMMs are emulated here, from the same buffers.

Under torch.compile the two calls run as the torch ops fp8ext::linear_fwd and fp8ext::linear_bwd, registered with
fp8ext's other ops in fp8ext.ops._library. The autograd side (which plan takes this path, what is saved for backward)
is fp8ext.modules.linear_autograd's ONE_CALL and ONE_CALL_OP.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import _C
from ..core.casts import PROLOGUE_NONE, PROLOGUE_SWIGLU
from ..core.tensor import FP8Tensor
from . import fused
from .matmul import gemm_fp8 as _gemm
from .matmul import pass_stream

__all__ = ["linear_fwd_call", "linear_bwd_call", "linear_fwd_eager", "linear_bwd_eager", "forward_bytes",
           "saved_operand", "saved_sinv", "round_up", "ALIGN", "SINV_BYTES", "SINV_STEP", "CUR_AMAX", "CUR_SCALE"]

_to_dl = torch._C._to_dlpack

ALIGN = _C.LINEAR_ALIGN  # every sub-buffer starts at a multiple of this many bytes
SINV_BYTES = _C.LINEAR_SINV_BYTES  # the saved buffer's header: the slots of x, W and dy, then x8^T
SINV_STEP = _C.LINEAR_SINV_STRIDE // 4  # float32 elements from one slot to the next (slot i: scale_inv at i * STEP)
CUR_AMAX, CUR_SCALE = _C.LINEAR_CUR_AMAX, _C.LINEAR_CUR_SCALE  # float32 index of a tensor's amax and scale in its slot


def round_up(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def forward_bytes(m: int, k: int, n: int, keep: bool = True) -> Tuple[int, int, int]:
    """(round_up(m * k): where W8 starts in the scratch buffer and W8^T after x8^T in the saved one, the saved buffer's
    size (the header, then x8^T and W8^T with keep, else the header only), the scratch buffer's size)."""
    rmk = -(-m * k // ALIGN) * ALIGN  # round_up's, without the call: this is the fast path's host work
    return rmk, SINV_BYTES + rmk + n * k if keep else SINV_BYTES, rmk + n * k


def saved_sinv(saved: torch.Tensor, i: int) -> torch.Tensor:
    """The one-element float32 scale_inv i (0 x, 1 W, 2 dy) of a saved buffer."""
    return saved[i * SINV_STEP * 4:(i * SINV_STEP + 1) * 4].view(torch.float32)


def saved_operand(buf: torch.Tensor, offset: int, rows: int, cols: int, fmt, saved: torch.Tensor, i: int) -> FP8Tensor:
    """The FP8 matrix [rows, cols] at `offset` bytes into a byte buffer, with scale_inv i of the saved buffer."""
    data = buf[offset:offset + rows * cols].view(fmt.torch_dtype).view(rows, cols)
    return FP8Tensor(data, None, saved_sinv(saved, i), fmt)


def linear_fwd_call(x2, weight, b, xs, xa, wsc, wa, fmt, margin, out_dtype, keep=True, swiglu=False):
    """A forward pass as one C call: (y [m, n], the buffer kept for backward). xs, xa, wsc, wa: DLPack capsules of
    the input's and the weight's scale and amax slots (delayed scaling), or None with `margin` (current scaling:
    the call computes the scales). keep False: only the buffer's header is made (backward casts again).
    swiglu: x2 is [m, 2k] (gate, then up) and the layer's input is SwiGLU(x2), computed inside x's cast (on the CPU
    by fp8ext.fused's reference first: the same definition)."""
    if swiglu and (margin is not None or not keep):  # as the C call says on a GPU
        raise ValueError("linear_fwd(): the SwiGLU prologue takes delayed scaling (no margin) and keep=True: current "
                         "scaling needs SwiGLU's output before its cast")
    if swiglu and not x2.is_cuda:
        x2, swiglu = fused.swiglu_reference(x2), False
    (m, k), n, dev = (x2.shape[0], weight.shape[1]), weight.shape[0], x2.device
    rmk = -(-m * k // ALIGN) * ALIGN  # forward_bytes', without the calls: this is the fast path's host work
    saved = torch.empty(SINV_BYTES + rmk + n * k if keep else SINV_BYTES, dtype=torch.uint8, device=dev)
    scratch = torch.empty(rmk + n * k, dtype=torch.uint8, device=dev)
    y = torch.empty((m, n), dtype=out_dtype, device=dev)
    stream, ws = pass_stream(dev)
    if not _C.linear_fwd(_to_dl(x2), _to_dl(weight), _to_dl(saved), _to_dl(scratch), _to_dl(y), fmt.code,
                         x_scale=xs, x_amax=xa, w_scale=wsc, w_amax=wa, bias=None if b is None else _to_dl(b),
                         workspace=ws, stream=stream, margin=margin, keep=keep,
                         prologue=PROLOGUE_SWIGLU if swiglu else PROLOGUE_NONE):
        _gemm(saved_operand(scratch, 0, m, k, fmt, saved, 0), saved_operand(scratch, rmk, n, k, fmt, saved, 1),
              out_dtype, b, True, out=y)
    return y, saved


def linear_bwd_call(dy2, saved, dims, ffmt, bfmt, gs, ga, margin, need_dx, need_dw, db_dtype, x_dtype, w_dtype,
                    main_grad=None, operands=None, swiglu_da=None):
    """A backward pass as one C call: (dx or None, dW or None, db or None). gs, ga: capsules of the gradient's
    scale and amax slots, or None with `margin`; db_dtype: None (no bias gradient), the bias's dtype when it is
    dy's (the float32 column sums rounded once by the cast) or float32; main_grad: dW is added into it.
    operands: (x8^T, W8^T) as uint8 tensors of their own (recast in backward; the one not needed may be None),
    `saved` then only the header. swiglu_da: dy2 is h = [gate, up], the input of a SwiGLU whose output's gradient is
    swiglu_da, and the layer's output gradient is SwiGLU's gradient dh, computed inside its cast (on the CPU by
    fp8ext.fused's reference first)."""
    if swiglu_da is not None and (margin is not None or db_dtype is not None):  # as the C call says on a GPU
        raise ValueError("linear_bwd(): SwiGLU's gradient in the cast takes delayed scaling (no margin) and no db")
    if swiglu_da is not None and not dy2.is_cuda:
        dy2, swiglu_da = fused.swiglu_backward_reference(dy2, swiglu_da), None
    m, k, n = dims
    dev = dy2.device
    rmn = -(-m * n // ALIGN) * ALIGN  # round_up's, without the call
    want_db = db_dtype is not None
    if want_db:  # dy8 and dy8^T, then the float32 per-tile column sums of cast_transpose_dbias
        tiles, _ = _C.cast_transpose_dbias_workspace(m, n)
        scratch = torch.empty(2 * rmn + 4 * tiles * n, dtype=torch.uint8, device=dev)
    else:
        scratch = torch.empty(rmn + m * n, dtype=torch.uint8, device=dev)
    db = torch.empty((n,), dtype=db_dtype, device=dev) if want_db else None
    dx = torch.empty((m, k), dtype=x_dtype, device=dev) if need_dx else None
    dw = main_grad if main_grad is not None else torch.empty((n, k), dtype=w_dtype, device=dev) if need_dw else None
    stream, ws = pass_stream(dev)
    x_t, w_t = (None, None) if operands is None else (None if t is None else _to_dl(t) for t in operands)
    if not _C.linear_bwd(_to_dl(dy2), _to_dl(saved), _to_dl(scratch), m, k, n, ffmt.code, bfmt.code, g_scale=gs,
                         g_amax=ga, dx=None if dx is None else _to_dl(dx), dw=None if dw is None else _to_dl(dw),
                         db=None if db is None else _to_dl(db), accumulate=main_grad is not None, workspace=ws,
                         stream=stream, margin=margin, x_t=x_t, w_t=w_t,
                         d_a=None if swiglu_da is None else _to_dl(swiglu_da)):
        rmk = round_up(m * k)
        xbuf, xoff, wbuf, woff = (saved, SINV_BYTES, saved, SINV_BYTES + rmk) if operands is None else \
            (operands[0], 0, operands[1], 0)
        if dx is not None:
            w8t = saved_operand(wbuf, woff, k, n, ffmt, saved, 1)
            _gemm(saved_operand(scratch, 0, m, n, bfmt, saved, 2), w8t, dx.dtype, out=dx)
        if dw is not None:
            x8t = saved_operand(xbuf, xoff, k, m, ffmt, saved, 0)
            _gemm(saved_operand(scratch, rmn, n, m, bfmt, saved, 2), x8t, dw.dtype, out=dw,
                  accumulate=main_grad is not None)
    return dx, dw, db


def linear_fwd_eager(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  x_scale: Optional[torch.Tensor], x_amax: Optional[torch.Tensor], w_scale: Optional[torch.Tensor],
                  w_amax: Optional[torch.Tensor], fmt, margin: float, out_dtype: torch.dtype, keep: bool = True,
                  prologue: int = PROLOGUE_NONE) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch op fp8ext::linear_fwd (fp8ext.ops._library), eagerly: the forward call, functional: (y, the saved
    buffer, the input's amax, the weight's amax). With scales (delayed scaling) the amaxes are the slots' updated
    copies; without (current scaling, by `margin`) zeros. keep=False: instead of the saved buffer, its header only
    (SINV_BYTES: the scale_invs, and each tensor's scale at its slot's CUR_SCALE place, the slot's scale copied in
    with delayed scaling), for the backward's recast; x and W are cast without their transposed copies. prologue
    PROLOGUE_SWIGLU (delayed scaling, keep): x is [m, 2k] and the layer's input is SwiGLU(x), computed inside x's cast.
    fmt: an FP8Format."""
    delayed = x_scale is not None
    if prologue:
        x = fused.kernel_rows(x, x.shape[1], "FP8Linear", "input") if x.is_cuda else x
    xa, wa = (x_amax.clone(), w_amax.clone()) if delayed else (x.new_zeros((), dtype=torch.float32),) * 2
    caps = tuple(_to_dl(t) for t in (x_scale, xa, w_scale, wa)) if delayed else (None,) * 4
    y, saved = linear_fwd_call(x, weight, bias, *caps, fmt, None if delayed else margin, out_dtype, keep,
                               swiglu=prologue == PROLOGUE_SWIGLU)
    if not keep and delayed:
        hf = saved.view(torch.float32)
        hf[CUR_SCALE:CUR_SCALE + 1].copy_(x_scale.reshape(1))
        hf[SINV_STEP + CUR_SCALE:SINV_STEP + CUR_SCALE + 1].copy_(w_scale.reshape(1))
    return y, saved, xa, wa.clone() if not delayed else wa


def linear_bwd_eager(dy: torch.Tensor, saved: torch.Tensor, m: int, k: int, n: int, ffmt, bfmt,
                  g_scale: Optional[torch.Tensor], g_amax: Optional[torch.Tensor], margin: float, need_dx: bool,
                  need_dw: bool, want_db: bool, db_dtype: torch.dtype, x_dtype: torch.dtype, w_dtype: torch.dtype,
                  x_t: Optional[torch.Tensor] = None, w_t: Optional[torch.Tensor] = None,
                  swiglu_da: Optional[torch.Tensor] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch op fp8ext::linear_bwd, eagerly: the backward call, functional: (dx, dW, db, the gradient's amax);
    a gradient not wanted comes back empty. x_t, w_t: x8^T and W8^T cast again in backward (recast_in_backward; the
    one not needed may be None), `saved` then the forward's header only: copied, since the call writes dy's scale
    into it. swiglu_da: dy is h = [gate, up] and the layer's output gradient is SwiGLU's gradient for its output's
    gradient swiglu_da (linear_bwd_call). ffmt, bfmt: FP8Formats."""
    delayed = g_scale is not None
    ga = g_amax.clone() if delayed else dy.new_zeros((), dtype=torch.float32)
    gs_c, ga_c = (_to_dl(g_scale), _to_dl(ga)) if delayed else (None, None)
    operands = None
    if saved.numel() == SINV_BYTES:  # a header (a saved buffer is larger: m * k >= 256)
        saved, operands = saved.clone(), (x_t, w_t)
    dx, dw, db = linear_bwd_call(dy, saved, (m, k, n), ffmt, bfmt, gs_c, ga_c, None if delayed else margin, need_dx,
                                 need_dw, db_dtype if want_db else None, x_dtype, w_dtype, operands=operands,
                                 swiglu_da=None if swiglu_da is None else fused.contiguous_aligned(swiglu_da, dy.dtype))
    empty = lambda: dy.new_empty((0,))  # noqa: E731
    return (empty() if dx is None else dx, empty() if dw is None else dw, empty() if db is None else db, ga)
