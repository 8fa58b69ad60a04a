"""FP8 matrix products: fp8ext.gemm, through cuBLASLt on the GPU, emulated with torch on the CPU.

out = (a * a_scale_inv) @ (b * b_scale_inv)^T (+ bias) (+ out with accumulate=True), the F.linear
convention: a is [M, K], b is [N, K], both FP8. The scales' shapes say how they apply (see gemm()).
On the GPU fp8ext._C checks the call and runs cuBLASLt with a cached plan (heuristic algorithm, or the
fastest of the heuristic's candidates with autotune) on the caller's stream, with torch's cuBLASLt workspace
of that stream: the one torch._scaled_mm uses, so fp8ext adds none to a model's memory (FP8EXT_GEMM_WORKSPACE_MIB
gives fp8ext's GEMMs a workspace of their own instead, per device and stream, from torch's allocator). On the
CPU the same checks run in C and the product is emulated: dequantize, then a float32 matmul, so CPU tests cover
the API and its semantics.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, Optional, Tuple

import torch

from .. import _C
from ..core import debug
from ..core.boundary import dl, dl_fp8, raw_stream, stream_of
from ..core.formats import E4M3, E5M2, FP8Format
from . import amax as _amax
from . import dequantize, quantize
from ..core.profiling import profiled, profiling_enabled
from ..core.tensor import FP8Tensor

__all__ = ["gemm", "set_gemm_autotune", "gemm_cache_info", "gemm_workspace_info", "WORKSPACE_BYTES"]



def _workspace_bytes() -> int:
    """The size of fp8ext's own cuBLASLt workspace, per device and stream: FP8EXT_GEMM_WORKSPACE_MIB, or 32 MiB
    (cuBLAS's recommendation for Hopper) where torch's workspace cannot be borrowed. Setting the variable is how
    to ask for one: the default borrows torch's (see workspace())."""
    raw = os.environ.get("FP8EXT_GEMM_WORKSPACE_MIB")
    if raw is None:
        return 32 * 1024 * 1024
    try:
        mib = int(raw)
    except ValueError:
        mib = -1
    if not 1 <= mib <= 1024:
        raise ValueError(f"FP8EXT_GEMM_WORKSPACE_MIB must be a whole number of MiB from 1 to 1024, got {raw!r}")
    return mib * 1024 * 1024


WORKSPACE_BYTES = _workspace_bytes()
_OWN_WORKSPACE = "FP8EXT_GEMM_WORKSPACE_MIB" in os.environ
_borrow: Optional[bool] = None  # whether GEMMs borrow torch's workspace: decided on the first GPU call
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
_workspaces: Dict[Tuple[int, int], tuple] = {}  # (device, stream) -> (buffer, capsule), or _BORROWED
_FP8 = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}
_autotune = os.environ.get("FP8EXT_GEMM_AUTOTUNE", "0") == "1"
_to_dl = torch._C._to_dlpack
_MODE_TENSOR, _MODE_ROW, _MODE_1x128, _MODE_128x128 = (_C.SCALE_TENSOR, _C.SCALE_ROW, _C.SCALE_BLOCK_1x128,
                                                       _C.SCALE_BLOCK_128x128)  # csrc/fp8_tensor.h's scale layouts


def set_gemm_autotune(enabled: bool) -> None:
    """Default for gemm(autotune=None): time cuBLASLt's top candidates once per problem and keep the fastest.
    The timing synchronises with the GPU once per new shape (never during CUDA graph capture). Also set by
    the environment variable FP8EXT_GEMM_AUTOTUNE=1."""
    global _autotune
    _autotune = bool(enabled)


def gemm_cache_info() -> dict:
    """{'plans', 'max_plans', 'hits', 'misses', 'evictions', 'tuned', 'cublaslt_version'} of the GEMM plan
    cache; past max_plans the least recently used plan is evicted."""
    return dict(_C.gemm_cache_info())


def _borrow_torch_workspace() -> bool:
    """Whether fp8ext's GEMMs borrow torch's cuBLASLt workspace: yes unless FP8EXT_GEMM_WORKSPACE_MIB asks for one of
    their own, or torch's could not be found (then a warning says so: the peak memory grows by WORKSPACE_BYTES per
    device and stream). torch's library is looked for beside torch, then by name among those already loaded."""
    if _OWN_WORKSPACE:
        return False
    errors = []
    for lib in (os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so"), "libtorch_cuda.so"):
        try:
            _C.bind_torch_workspace(lib)
            return True
        except RuntimeError as e:
            errors.append(str(e))
    warnings.warn(f"fp8ext's GEMMs use a cuBLASLt workspace of their own ({WORKSPACE_BYTES >> 20} MiB per device and "
                  f"stream, besides torch's) because torch's could not be borrowed: {'; '.join(errors)}",
                  RuntimeWarning, stacklevel=3)
    return False


_BORROWED = (None, None)  # the workspace entry of a (device, stream) whose GEMMs borrow torch's
_torch_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _own_workspace(device: torch.device) -> Tuple[torch.Tensor, object]:
    with torch.inference_mode(False):  # long-lived state: never an inference tensor
        buf = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return buf, _to_dl(buf)


def workspace(device: torch.device, stream: int):
    """The workspace argument of fp8ext's GPU calls on (device, stream): None, and the C call borrows torch's
    cuBLASLt workspace of that stream (torch's current one: fp8ext's calls run there), or a DLPack capsule of
    fp8ext's own buffer, made on first use and kept (fp8ext's C code borrows capsules and never consumes them):
    with FP8EXT_GEMM_WORKSPACE_MIB, or for a call on a device that is not torch's current one (torch makes its
    workspace on its current device)."""
    key = (device.index, stream)
    ws = _workspaces.get(key)
    if ws is None:
        global _borrow
        if _borrow is None:
            _borrow = _borrow_torch_workspace()
        ws = _workspaces[key] = _BORROWED if _borrow else _own_workspace(device)
    if ws is _BORROWED:
        if device.index is None or device.index == _torch_device():
            return None
        ws = _workspaces[key] = _own_workspace(device)
    return ws[1]


def gemm_workspace_info(device: Optional[torch.device] = None) -> dict:
    """{'owner': 'torch' or 'fp8ext', 'bytes': size} of the cuBLASLt workspace fp8ext's GEMMs use on `device` (the
    current CUDA device by default) and its current stream."""
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"gemm_workspace_info(): device must be a CUDA device, got {device}"
                         f"{'' if torch.cuda.is_available() else ' (this machine has none)'}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = raw_stream(device.index)
    if workspace(device, stream) is None:
        return {"owner": "torch", "bytes": _C.torch_workspace(device.index)[1]}
    return {"owner": "fp8ext", "bytes": WORKSPACE_BYTES}


def pass_stream(device: torch.device):
    """(stream, workspace capsule) of a call on `device`: the caller's current CUDA stream and its cuBLASLt
    workspace, or (0, None) on the CPU."""
    if device.type != "cuda":
        return 0, None
    stream = raw_stream(device.index)
    return stream, workspace(device, stream)


def _fp8_format(t, arg: str) -> FP8Format:
    f = _FP8.get(getattr(t, "dtype", None))
    if f is None or not isinstance(t, torch.Tensor):
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"gemm(): {arg} must be a torch.float8_e4m3fn or torch.float8_e5m2 tensor, got {got}")
    return f


@profiled("fp8ext.gemm")
def gemm(a, b, *, a_scale_inv: Optional[torch.Tensor] = None, b_scale_inv: Optional[torch.Tensor] = None,
         out_dtype: Optional[torch.dtype] = None, bias: Optional[torch.Tensor] = None, use_fast_accum: bool = False,
         out: Optional[torch.Tensor] = None, accumulate: bool = False, out_scale: Optional[torch.Tensor] = None,
         amax_out: Optional[torch.Tensor] = None, autotune: Optional[bool] = None) -> torch.Tensor:
    """out[M, N] = (a * a_scale_inv) @ (b * b_scale_inv)^T (+ bias[N]) for FP8 a [M, K] and b [N, K].

    Formats: E4M3 x E4M3, E4M3 x E5M2, E5M2 x E4M3 (cuBLASLt has no E5M2 x E5M2). K and N must be
    multiples of 16. Scales are float32 tensors on a's device, read there (no host synchronisation);
    like Transformer Engine's, they are scale_inv = 1 / scale, the factor that dequantizes:
      - one element each: per-tensor;
      - a_scale_inv [M] and b_scale_inv [N]: per row (fp8ext.quantize_rowwise makes them);
      - a_scale_inv [M, ceil(K/128)] (1x128 blocks) with b_scale_inv [ceil(N/128), ceil(K/128)]
        (128x128 blocks, DeepSeek-V3's recipe) or [N, ceil(K/128)] (1x128): fp8ext.quantize_blockwise makes
        them in the memory layout cuBLASLt reads.
    out_dtype: float32, bfloat16 (default) or float16; or float8_e4m3fn / float8_e5m2 with per-tensor
    input scales, where out = fp8(d * out_scale) and amax_out (one float32) is set to max|d|, d being the
    product before out_scale (cuBLASLt overwrites it). bias: [N], bfloat16 (float16 for a float16 output).
    accumulate=True adds the product into `out` (beta = 1), e.g. an fp32 weight gradient. use_fast_accum
    trades accuracy for speed (Transformer Engine uses it in the forward pass only). autotune: see
    set_gemm_autotune. Returns out.
    a and b may also be fp8ext.FP8Tensor operands: their data and scale_inv are used (a scale_inv argument given
    as well must be None).
    """
    a, a_scale_inv = _operand(a, a_scale_inv, "a")
    b, b_scale_inv = _operand(b, b_scale_inv, "b")
    fa, fb = _fp8_format(a, "a"), _fp8_format(b, "b")
    for t, arg in ((a, "a"), (b, "b")):
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"gemm(): {arg} is on {t.device.type}; fp8ext runs on cpu and cuda")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm(): a and b must be 2-D ([M, K] and [N, K]), got shapes {list(a.shape)} and "
                         f"{list(b.shape)}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"gemm(): out must be a torch.Tensor or None, got {type(out).__name__}")
        if out_dtype is not None and out_dtype != out.dtype:
            raise ValueError(f"gemm(): out is {out.dtype} but out_dtype={out_dtype}")
        out_dtype = out.dtype
    elif accumulate:
        raise ValueError("gemm(): accumulate=True adds into out: pass out=")
    out_dtype = out_dtype or torch.bfloat16
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"gemm(): out_dtype must be one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype}")
    if torch.compiler.is_compiling():
        return _gemm_compiled(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype, bias=bias,
                              use_fast_accum=use_fast_accum, out=out, accumulate=accumulate, out_scale=out_scale,
                              amax_out=amax_out)
    tune = _autotune if autotune is None else bool(autotune)
    return gemm_eager(a, b, a_scale_inv, b_scale_inv, out_dtype=out_dtype, bias=bias, use_fast_accum=use_fast_accum,
                      out=out, accumulate=accumulate, out_scale=out_scale, amax_out=amax_out, tune=tune)


def _operand(t, scale_inv, arg: str):
    """(FP8 data, scale_inv) of a gemm() operand: an FP8Tensor, or a float8 tensor with its scale_inv argument."""
    if isinstance(t, FP8Tensor):
        if scale_inv is not None:
            raise TypeError(f"gemm(): {arg} is an FP8Tensor, which carries its scale_inv: leave {arg}_scale_inv unset")
        return t.data, t.scale_inv
    if scale_inv is None:
        raise TypeError(f"gemm(): {arg}_scale_inv is required with a float8 tensor {arg} (or pass an FP8Tensor)")
    return t, scale_inv


def epilogue_bias_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The bias dtype cuBLASLt's FP8 bias epilogue takes for an out_dtype output: float16 for a float16 output,
    bfloat16 otherwise."""
    return torch.float16 if out_dtype == torch.float16 else torch.bfloat16


def bias_epilogue(bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> bool:
    """Whether cuBLASLt's FP8 bias epilogue takes `bias` for an out_dtype output (epilogue_bias_dtype; never with a
    float32 output). Otherwise the caller adds the bias after the GEMM."""
    return bias is not None and out_dtype != torch.float32 and bias.dtype == epilogue_bias_dtype(out_dtype)


def gemm_fp8(a: FP8Tensor, b: FP8Tensor, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
             fast: bool = False, *, out: Optional[torch.Tensor] = None, accumulate: bool = False) -> torch.Tensor:
    """a @ b^T of two FP8Tensors as gemm() computes it, without the public wrapper's argument checks (C checks
    everything anyway): the library's own layers call this; under torch.compile it is the torch op."""
    if torch.compiler.is_compiling():
        return _gemm_compiled(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=out_dtype, bias=bias,
                              use_fast_accum=fast, out=out, accumulate=accumulate)
    return gemm_eager(a.data, b.data, a.scale_inv, b.scale_inv, out_dtype=out_dtype, bias=bias, use_fast_accum=fast,
                      out=out, accumulate=accumulate)


def weight_capsules(w: FP8Tensor, bias: Optional[torch.Tensor]) -> tuple:
    """The weight side of gemm_with_weight: (w's data, its scale_inv, bias or None) as DLPack capsules and w's
    format code. A layer whose weight is fixed (inference) makes them once and keeps them while its buffers are
    unchanged: fp8ext's C layer reads a capsule without consuming it."""
    return dl_fp8(w.data), _to_dl(w.scale_inv), None if bias is None else _to_dl(bias), w.fmt.code


def direct_gemm_ok(data: torch.Tensor) -> bool:
    """Whether gemm_with_weight (and the inference layers' direct casts) run for an operand on data's device: a GPU,
    outside torch.compile, with fp8ext.debug, GEMM autotuning and fp8ext's profiling ranges off (the public
    functions serve the rest)."""
    return data.is_cuda and not _autotune and not torch.compiler.is_compiling() and not debug.enabled() and \
        not profiling_enabled()


def gemm_with_weight(x8: FP8Tensor, weight: tuple, n: int, out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    """x8 @ W^T (+ bias) [rows, n] in out_dtype, W and the bias given as weight_capsules: a decode step's GEMMs
    without gemm()'s Python (the C call checks every argument all the same). Where direct_gemm_ok(x8.data)."""
    data = x8.data
    device = data.device
    out = torch.empty((data.shape[0], n), dtype=out_dtype, device=device)
    stream = stream_of(device)
    w, w_sinv, bias, w_fmt = weight
    _C.gemm(dl_fp8(data), w, x8.fmt.code, w_fmt, _to_dl(x8.scale_inv), w_sinv, _to_dl(out), bias=bias,
            fast_accum=fast, workspace=workspace(device, stream), stream=stream)
    return out


def gemm_eager(a, b, a_scale_inv, b_scale_inv, *, out_dtype, bias=None, use_fast_accum=False, out=None,
               accumulate=False, out_scale=None, amax_out=None, tune: bool = False) -> torch.Tensor:
    """gemm() of float8 tensors without the public wrapper's checks (C checks everything), eagerly."""
    fa, fb, fo = _FP8[a.dtype], _FP8[b.dtype], _FP8.get(out_dtype)
    device = a.device
    if debug.enabled():
        for s, arg in ((a_scale_inv, "a_scale_inv"), (b_scale_inv, "b_scale_inv"), (out_scale, "out_scale")):
            debug.check_scale(s, "gemm", arg)
    if out is None:
        out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype, device=device)
    on_gpu = device.type == "cuda"
    stream = stream_of(device) if on_gpu else 0
    def run(tune_scratch=None):
        return _C.gemm(dl_fp8(a), dl_fp8(b), fa.code, fb.code, _dl_any(a_scale_inv, "a_scale_inv"),
                       _dl_any(b_scale_inv, "b_scale_inv"), dl_fp8(out, "gemm", "out") if fo else _dl_any(out, "out"),
                       out_fmt=fo.code if fo else -1, bias=_dl_opt(bias, "bias"),
                       out_scale=_dl_opt(out_scale, "out_scale"), amax_out=_dl_opt(amax_out, "amax_out"),
                       accumulate=accumulate, fast_accum=use_fast_accum,
                       workspace=workspace(device, stream) if on_gpu else None, stream=stream, autotune=tune,
                       tune_scratch=tune_scratch)

    modes = run()
    if len(modes) == 3:  # autotune's first call of a problem ran nothing: it asks for torch memory to time into
        modes = run(_to_dl(torch.empty(modes[2], dtype=torch.uint8, device=device)))
        if len(modes) != 2:
            raise RuntimeError("gemm(): autotune asked for timing memory twice for one problem")
    if not on_gpu:
        _emulate(a, b, a_scale_inv, b_scale_inv, modes, bias, out, accumulate, out_scale, amax_out, fo)
    return out


def _dl_any(t, arg: str):
    """A tensor argument's capsule; anything else is passed on for C to say what it expected. What torch cannot
    export (a meta tensor has no data) is refused naming `arg`, by dl() on that path only."""
    if not isinstance(t, torch.Tensor):
        return t
    try:
        return _to_dl(t)
    except (BufferError, RuntimeError):
        dl(t, "gemm", arg)  # raises the error that names arg
        raise


def _dl_opt(t, arg: str):
    return None if t is None else _dl_any(t, arg)


def _expand_scale(s: torch.Tensor, mode: int, rows: int, k: int) -> torch.Tensor:
    """A scale_inv tensor as a float32 factor broadcastable to an operand [rows, k]."""
    if mode == _MODE_TENSOR:
        return s.reshape(())
    if mode == _MODE_ROW:
        return s.reshape(rows, 1)
    if mode == _MODE_1x128:
        return s.repeat_interleave(128, dim=1)[:, :k]
    return s.repeat_interleave(128, dim=0)[:rows].repeat_interleave(128, dim=1)[:, :k]


def _emulate(a, b, sa, sb, modes, bias, out, accumulate, out_scale, amax_out, fo) -> None:
    """The CPU path: (a * sa) @ (b * sb)^T in float32, then the epilogue in cuBLASLt's order."""
    m, k = a.shape
    n = b.shape[0]
    av = dequantize(a) * _expand_scale(sa, modes[0], m, k)
    bv = dequantize(b) * _expand_scale(sb, modes[1], n, k)
    d = av @ bv.t()
    if bias is not None:
        d = d + bias.float()
    if accumulate:
        d = d + out.float()
    if fo is None:
        out.copy_(d)
        return
    if amax_out is not None:
        amax_out.copy_(_amax(d).reshape(amax_out.shape))
    out.view(torch.uint8).copy_(quantize(d, fo, out_scale if out_scale is not None else 1.0).view(torch.uint8))


def _gemm_compiled(a, b, a_scale_inv, b_scale_inv, *, out_dtype, bias=None, use_fast_accum=False, out=None,
                   accumulate=False, out_scale=None, amax_out=None):
    """Under torch.compile: the functional torch op, then copies into the caller's out / amax_out."""
    res, new_amax = torch.ops.fp8ext.gemm(a, b, a_scale_inv, b_scale_inv, out_dtype, bias, use_fast_accum,
                                          out if accumulate else None, out_scale, amax_out is not None)
    if amax_out is not None:
        amax_out.copy_(new_amax.reshape(amax_out.shape))
    if out is not None:
        out.copy_(res)
        return out
    return res
