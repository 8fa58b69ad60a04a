"""FP4, FP6 and block-scaled formats: quantization error of every format fp8ext has on the same data, codec checks
of the small formats, and (on a GPU, where fp8ext.WeightOnlyLinear exists) weight-only decode latency."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._bench import bench_ms
from ..core.formats import E2M1, E2M3, E3M2, E4M3, E5M2, SmallFormat
from ..lowp.weight_only import WeightOnlyLinear
from ..ops import dequantize, mx, quantize
from ..ops.mx import dequantize_mx, dequantize_nvfp4, quantize_mx, quantize_nvfp4

from ._run import Run

SECTION = "fp4"
WEIGHT_ONLY_FORMATS = ("fp8", "mxfp6", "mxfp4", "nvfp4")
NOT_AVAILABLE = "not available in this build (fp8ext.WeightOnlyLinear does not exist in this version)"


def _per_tensor(x: torch.Tensor, fmt) -> torch.Tensor:
    """x scaled so that max|x| lands on the format's largest value, quantized, and scaled back."""
    scale = fmt.max / x.abs().max().item()
    q = quantize(x, fmt, scale)
    return dequantize(q, 1.0 / scale, fmt=fmt if isinstance(fmt, SmallFormat) else None)


def _mx(x: torch.Tensor, elem) -> torch.Tensor:
    q, s = quantize_mx(x, elem)
    return dequantize_mx(q, s, elem)


def _nvfp4(x: torch.Tensor) -> torch.Tensor:
    return dequantize_nvfp4(*quantize_nvfp4(x))


def round_trips():
    """{label: x -> x rounded through the format}, per-tensor scaled formats first, then block-scaled ones."""
    out = {"bf16": lambda x: x.bfloat16().float()}
    for f in (E4M3, E5M2, E3M2, E2M3, E2M1):
        out[f"{f.name} per tensor"] = lambda x, f=f: _per_tensor(x, f)
    for family, elems in (("MXFP8", (E4M3, E5M2)), ("MXFP6", (E3M2, E2M3)),
                          ("MXFP4", (E2M1,))):
        for e in elems:
            out[f"{family} {e.name}"] = lambda x, e=e: _mx(x, e)
    out["NVFP4"] = _nvfp4
    return out


def data(quick: bool):
    """Random matrices (CPU, float32): normal values, and heavy-tailed ones (Student's t, 3 degrees of freedom,
    the outliers activations have)."""
    g = torch.Generator().manual_seed(0)
    shape = (64, 512) if quick else (256, 2048)
    normal = torch.randn(shape, generator=g)
    t3 = torch.distributions.StudentT(3.0).sample(shape)
    return shape, {"normal": normal, "heavy-tailed (Student t, 3 dof)": t3}


def check(run: Run) -> None:
    torch.manual_seed(0)
    shape, sets = data(run.quick)
    for label, fn in round_trips().items():
        for dist, x in sets.items():
            err = float((fn(x) - x).norm() / x.norm())
            run.measure(SECTION, "quantization error", err, "relative RMS error", case=dist, precision=label,
                        shape=shape, device="cpu")
    _check_small_codecs(run)
    _check_mx_idempotent(run, sets["normal"], shape)
    x = sets["normal"]
    run.trace(SECTION, "block-scaled quantization", {
        "quantize_mx E2M1": lambda: quantize_mx(x, E2M1),
        "quantize_nvfp4": lambda: quantize_nvfp4(x)})
    run.note(SECTION, "Quantization error = ||x - dequantize(quantize(x))|| / ||x|| on the CPU (block-scaled formats "
                      "run on the CPU in this version). Per tensor: one scale mapping max|x| to the format's largest "
                      "value. MX: blocks of 32 with a power-of-two E8M0 scale. NVFP4: blocks of 16 with an E4M3 "
                      "scale and a float32 tensor scale.")


def _check_small_codecs(run: Run) -> None:
    """Every code of E2M1 (FP4), E2M3 and E3M2 (FP6) decodes to a value that encodes back to the same code."""
    for f in (E2M1, E2M3, E3M2):
        codes = torch.arange(1 << f.bits, dtype=torch.int32).to(torch.uint8)
        back = quantize(dequantize(codes, fmt=f), f)
        bad = int((back != codes).sum())
        run.check(SECTION, f"every {f.name} code decodes and encodes back to itself", bad == 0, value=bad, limit=0,
                  unit="codes that differ", shape=(1 << f.bits,), device="cpu")


def _check_mx_idempotent(run: Run, x: torch.Tensor, shape) -> None:
    """Quantizing an MX-quantized tensor again changes nothing (the block scales are powers of two)."""
    for e in mx.MX_ELEMENT_FORMATS:
        once = _mx(x, e)
        bad = int((_mx(once, e) != once).sum())
        run.check(SECTION, f"MX {e.name}: quantizing a quantized tensor again changes nothing", bad == 0, value=bad,
                  limit=0, unit="values that differ", shape=shape, device="cpu")


def weight_only_linear():
    """fp8ext.WeightOnlyLinear where this version has it, else None (every version since fp8ext.lowp has it)."""
    return WeightOnlyLinear


def speed(run: Run) -> None:
    wol = weight_only_linear()
    if wol is None:
        run.skip(SECTION, "weight-only decode latency (WeightOnlyLinear) at M=1", NOT_AVAILABLE)
        return
    if run.speed_skipped(SECTION, "weight-only decode latency (WeightOnlyLinear) at M=1 against bf16 F.linear"):
        return
    torch.manual_seed(0)
    k, n = (4096, 4096) if run.quick else (4096, 14336)
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        t_bf16 = bench_ms(lambda: F.linear(x, lin.weight), reps=100)
        run.measure(SECTION, "decode latency at M=1", t_bf16 * 1e3, "us", case="F.linear", precision="bf16",
                    shape=(1, k, n))
        for fmt in WEIGHT_ONLY_FORMATS:
            layer = wol.from_linear(lin, fmt)
            t = bench_ms(lambda: layer(x), reps=100)
            run.measure(SECTION, "decode latency at M=1", t * 1e3, "us", case="WeightOnlyLinear", precision=fmt,
                        shape=(1, k, n))
            run.measure(SECTION, "speedup vs bf16", t_bf16 / t, "x", case=f"WeightOnlyLinear {fmt}, M=1",
                        shape=(1, k, n))
            run.trace(SECTION, f"weight-only {fmt} decode", {f"WeightOnlyLinear {fmt}": lambda: layer(x),
                                                             "bf16 F.linear": lambda: F.linear(x, lin.weight)})
