"""GEMM: fp8ext.gemm against the float64 product of the same FP8 inputs, then TFLOP/s next to bf16 matmul."""

from __future__ import annotations

import torch

from .._bench import fp8_gemm_operands, rounds
from ..core.formats import E4M3, E5M2
from ..ops import quantize
from ..ops.matmul import gemm
from ..testing import gemm_error_bound, gemm_reference

from ._run import Run

SECTION = "gemm"


def check_shapes(quick: bool):
    shapes = [(64, 128, 96), (128, 512, 256), (32, 4096, 64)]
    return shapes if quick else shapes + [(256, 1024, 512), (16, 8192, 48)]


def speed_shapes(quick: bool):
    if quick:
        return [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096)]
    return [(s, s, s) for s in (1024, 2048, 4096, 8192)] + [(8192, 4096, 4096), (8192, 4096, 14336),
                                                            (8192, 14336, 4096)]


def _worst_ratio(out, a8, b8, sa, sb, *, bias=None, on_gpu: bool) -> float:
    """max |out - float64 reference| / bound over the output; <= 1 is correct. The bound models Hopper's
    tensor-core accumulator on a GPU and plain float32 accumulation on the CPU (fp8ext.testing)."""
    ref = gemm_reference(a8, b8, sa, sb, bias=bias)
    kw = {} if on_gpu else {"accum_bits": None}
    bound = gemm_error_bound(a8, b8, sa, sb, out_dtype=out.dtype, bias=bias, **kw)
    return float(((out.double() - ref).abs() / bound).max())


def check(run: Run) -> None:
    torch.manual_seed(0)
    for (m, k, n) in check_shapes(run.quick):
        _, _, x8, w8, sx, sw = fp8_gemm_operands(m, k, n, device=run.device)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = gemm(x8, w8, a_scale_inv=sx, b_scale_inv=sw, out_dtype=out_dtype)
            ratio = _worst_ratio(out, x8, w8, sx, sw, on_gpu=run.on_gpu)
            run.check(SECTION, f"E4M3 x E4M3 -> {str(out_dtype).replace('torch.', '')} within the error bound of "
                               "the float64 product", ratio <= 1.0, value=ratio, limit=1.0,
                      unit="largest error / bound", shape=(m, k, n))
    m, k, n = check_shapes(True)[1]
    x = torch.randn(m, k, device=run.device)
    g = torch.randn(n, k, device=run.device) * 1e-3
    bias = torch.randn(n, device=run.device, dtype=torch.bfloat16)
    one = torch.ones((), device=run.device)
    sx, sg = torch.tensor(0.25, device=run.device), torch.tensor(4096.0, device=run.device)
    a8, b8 = quantize(x, E4M3, sx.reciprocal()), quantize(g, E5M2, sg)
    out = gemm(a8, b8, a_scale_inv=sx, b_scale_inv=sg.reciprocal(), bias=bias, out_dtype=torch.bfloat16)
    ratio = _worst_ratio(out, a8, b8, sx, sg.reciprocal(), bias=bias, on_gpu=run.on_gpu)
    run.check(SECTION, "E4M3 x E5M2 with bias -> bf16 within the error bound of the float64 product",
              ratio <= 1.0, value=ratio, limit=1.0, unit="largest error / bound", shape=(m, k, n))
    run.trace(SECTION, f"gemm {m}x{k}x{n}", {"fp8ext.gemm": lambda: gemm(a8, a8, a_scale_inv=one,
                                                                                 b_scale_inv=one)})
    run.note(SECTION, "Correctness: every output element against the float64 product of the same FP8 inputs, "
                      "inside the rounding-error bound of fp8ext.testing.gemm_error_bound ("
                      + ("Hopper's tensor-core accumulator" if run.on_gpu else "float32 accumulation, as the "
                         "CPU emulation does") + ").")


def speed(run: Run) -> None:
    if run.speed_skipped(SECTION, "TFLOP/s of fp8ext.gemm against torch bf16 matmul"):
        return
    torch.manual_seed(0)
    for (m, k, n) in speed_shapes(run.quick):
        xb, wb, x8, w8, sxi, swi = fp8_gemm_operands(m, k, n)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        flop = 2 * m * n * k
        impls = {
            "bf16 torch.matmul": lambda: torch.matmul(xb, wb.t()),
            "fp8ext.gemm E4M3": lambda: gemm(x8, w8, a_scale_inv=sxi, b_scale_inv=swi, out=out),
        }
        t = rounds(impls, reps=10 if flop > 2e12 else 30)
        shape = (m, k, n)
        for name, (ms, _, _) in t.items():
            run.measure(SECTION, "throughput", flop / ms / 1e9, "TFLOP/s", case="M x K x N",
                        precision="bf16" if name.startswith("bf16") else "fp8ext E4M3", shape=shape)
        run.measure(SECTION, "speedup vs bf16", t["bf16 torch.matmul"][0] / t["fp8ext.gemm E4M3"][0], "x",
                    case="GEMM", shape=shape)
        run.trace(SECTION, f"gemm {m}x{k}x{n}", impls)
        del xb, wb, x8, w8, out
    torch.cuda.empty_cache()
    run.note(SECTION, "TFLOP/s = 2 M N K / median time of out[M, N] = x[M, K] @ w[N, K]^T, bf16 output, "
                      "per-tensor scales, random data; bf16 and FP8 interleaved over three rounds.")
