"""Casts: the FP8 codec on every bf16 bit pattern, and its bandwidth next to the device's copy bandwidth."""

from __future__ import annotations

import math

import torch

from .._bench import bench_ms, copy_tbps
from ..core.formats import E4M3, E5M2
from ..ops import cast_transpose, dequantize, quantize

from ._run import Run

SECTION = "casts"
FORMATS = (E4M3, E5M2)


def all_bf16(device="cpu") -> torch.Tensor:
    """The 65,536 bf16 bit patterns: every finite value, both infinities, both zeros and every NaN."""
    return torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(device)


def mismatches(got: torch.Tensor, want: torch.Tensor, fmt, any_nan_equal: bool) -> int:
    """How many FP8 bytes differ; with any_nan_equal, two NaNs count as equal whatever their codes."""
    a, b = got.cpu().view(torch.uint8), want.cpu().view(torch.uint8)
    diff = a != b
    if any_nan_equal:
        nan = a.view(fmt.torch_dtype).float().isnan() & b.view(fmt.torch_dtype).float().isnan()
        diff &= ~nan
    return int(diff.sum())


def torch_saturates(fmt) -> bool:
    """Whether this torch's own cast saturates past the format's largest value (releases differ for E4M3)."""
    return torch.tensor([1e6]).to(fmt.torch_dtype).view(torch.uint8).item() == fmt.max_code


def check(run: Run) -> None:
    x_cpu = all_bf16()
    x = x_cpu.to(run.device)
    n = x.numel()
    for fmt in FORMATS:
        _check_against_torch(run, fmt, x, x_cpu)
        if run.on_gpu:
            _check_against_cpu_reference(run, fmt, x, x_cpu)
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.torch_dtype)
        got = dequantize(codes.to(run.device), 1.0, torch.float32).cpu()
        want = codes.float()
        bad = int(((got != want) & ~(got.isnan() & want.isnan())).sum())
        run.check(SECTION, f"dequantize {fmt.name} -> float32 equals torch's own decoding on all 256 codes",
                  bad == 0, value=bad, limit=0, unit="codes that differ", shape=(256,))
    _check_cast_transpose_and_amax(run)
    run.trace(SECTION, "quantize all bf16 patterns", {
        f"quantize {f.name}": (lambda f=f: quantize(x, f)) for f in FORMATS})
    run.note(SECTION, f"The codec is checked on all {n:,} bf16 bit patterns (every finite value, both infinities, "
                      "zeros and every NaN) for E4M3 and E5M2.")


def _check_against_torch(run: Run, fmt, x: torch.Tensor, x_cpu: torch.Tensor) -> None:
    """fp8ext.quantize on this device against torch's x.to(float8) on the CPU, an independent implementation.
    Past the format's range torch's rule depends on its release, so fp8ext is asked for the same rule."""
    sat = torch_saturates(fmt)
    for scale in (1.0, 0.37):
        want = (x_cpu.float() * scale).to(fmt.torch_dtype)
        got = quantize(x, fmt, scale, saturate=sat)
        bad = mismatches(got, want, fmt, any_nan_equal=True)
        rule = "saturating" if sat else "overflowing"
        run.check(SECTION, f"quantize bf16 -> {fmt.name} (scale {scale}, {rule}) equals torch's "
                           f".to({fmt.torch_dtype}) on all bf16 bit patterns",
                  bad == 0, value=bad, limit=0, unit="values that differ", shape=x.shape)


def _check_against_cpu_reference(run: Run, fmt, x: torch.Tensor, x_cpu: torch.Tensor) -> None:
    """The GPU kernels against fp8ext's bit-exact CPU reference, byte for byte (NaN codes included)."""
    for sat in (True, False):
        for scale in (1.0, 0.37):
            got = quantize(x, fmt, torch.tensor(scale, device=x.device), saturate=sat)
            want = quantize(x_cpu, fmt, scale, saturate=sat)
            bad = mismatches(got, want, fmt, any_nan_equal=False)
            run.check(SECTION, f"quantize bf16 -> {fmt.name} on the GPU (scale {scale}, saturate={sat}) equals "
                               "the CPU reference byte for byte", bad == 0, value=bad, limit=0,
                      unit="bytes that differ", shape=x.shape)


def _check_cast_transpose_and_amax(run: Run) -> None:
    torch.manual_seed(0)
    shape = (256, 384)
    x = torch.randn(shape, dtype=torch.bfloat16, device=run.device) * 40
    acc = torch.zeros((), device=run.device)
    q, qt = cast_transpose(x, E4M3, 2.0, amax_out=acc)
    want = quantize(x.cpu(), E4M3, 2.0)
    bad = mismatches(q, want, E4M3, False) + mismatches(qt, want.t().contiguous(), E4M3, False)
    run.check(SECTION, "cast_transpose gives quantize's bytes and their transpose", bad == 0, value=bad, limit=0,
              unit="bytes that differ", shape=shape)
    want_amax = x.float().abs().max().item()
    run.check(SECTION, "cast_transpose's fused amax equals max|x|", acc.item() == want_amax, value=acc.item(),
              limit=want_amax, unit="", shape=shape)


def speed(run: Run) -> None:
    if run.speed_skipped(SECTION, "bandwidth of quantize, dequantize and cast_transpose against copy"):
        return
    torch.manual_seed(0)
    n = 1 << (24 if run.quick else 28)
    copy = copy_tbps(min(2 * n, 1 << 30))
    run.measure(SECTION, "bandwidth", copy, "TB/s", case="copy (read + written)", precision="copy",
                shape=f"{min(2 * n, 1 << 30)} bytes")
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(2.0, device="cuda")
    acc = torch.zeros((), device="cuda")
    q = quantize(x, E4M3, scale)
    side = math.isqrt(n)
    x2 = x[: side * side].view(side, side)
    cases = {  # name: (function, bytes read + written, shape)
        "quantize bf16 -> E4M3 with amax": (lambda: quantize(x, E4M3, scale, amax_out=acc), 3 * n,
                                            (n,)),
        "dequantize E4M3 -> bf16": (lambda: dequantize(q, scale, torch.bfloat16), 3 * n, (n,)),
        "cast_transpose bf16 -> E4M3 and its transpose": (
            lambda: cast_transpose(x2, E4M3, scale, amax_out=acc), 4 * side * side, (side, side)),
    }
    for name, (fn, nbytes, shape) in cases.items():
        tbps = nbytes / bench_ms(fn) / 1e9
        run.measure(SECTION, "bandwidth", tbps, "TB/s", case=name, precision="fp8ext", shape=shape)
        run.measure(SECTION, "fraction of copy bandwidth", tbps / copy, "fraction", case=name,
                    precision="fp8ext", shape=shape)
        run.trace(SECTION, name, {"fp8ext": fn, "copy": lambda: x.clone()})
    run.note(SECTION, "Bandwidth counts bytes read plus written: quantize and dequantize 3 bytes per element, "
                      "cast_transpose 4, copy 2.")
