"""Bandwidth of fp8ext's casts next to torch eager, torch.compile and the device's copy bandwidth.

    python benchmarks/bench_quantize.py            # needs a CUDA GPU and fp8ext built with CUDA

Cases (all on random data, one run, medians of CUDA-event timings):
  quantize  bf16 -> E4M3, 2^28 elements, device scale, fused amax: 3 bytes/element (2 read, 1 written); also
            8192x4096 (a transformer layer's activations), allocating and into a preallocated output (out=)
  cast_transpose  bf16 16384x16384 -> E4M3 q and q^T, device scale, fused amax: 4 bytes/element; also with
                  16383 and 16380 rows (row counts that are not multiples of 8 or of the tile)
  cast_transpose_dbias  the same plus dbias = column sums of x: 4 bytes/element counted (the workspace adds
                  1/8 byte, dbias itself 2 bytes per column)
  dequantize  E4M3 -> bf16, 2^28 elements: 3 bytes/element;  amax  bf16, 2^28: 2 bytes/element
torch's versions compute the same function ((x.float() * scale).clamp(-448, 448).to(float8_e4m3fn),
x.abs().amax(), .t().contiguous()); their bytes are checked equal to fp8ext's before timing.
Goals (issue 2): quantize >= 2.6 TB/s, cast_transpose >= 2.3 TB/s on an H100.
"""

from __future__ import annotations

import sys

import torch

import fp8ext
from _harness import bench_ms, copy_tbps, device_header, save, spread, table

E4 = torch.float8_e4m3fn


def torch_quantize(x, scale):
    amax = x.abs().amax().float()
    q = (x.float() * scale).clamp(-448, 448).to(E4)
    return q, amax


def torch_cast_transpose(x, scale):
    amax = x.abs().amax().float()
    q = (x.float() * scale).clamp(-448, 448).to(E4)
    return q, q.t().contiguous(), amax


def row(name, impl, ms, nbytes, copy):
    tbps = nbytes / ms / 1e9
    return {"case": name, "impl": impl, "ms": ms, "TB/s": tbps, "of copy": tbps / copy}


def main():
    if not fp8ext.cuda_available():
        sys.exit("bench_quantize: needs a CUDA device and fp8ext built with CUDA")
    head = device_header()
    print(f"# {head['device']} ({head['sms']} SMs), torch {head['torch']}, CUDA {head['cuda']}, {head['date']}")
    torch.manual_seed(0)
    copy = copy_tbps()
    rows = [{"case": "copy 1 GiB", "impl": "torch", "ms": float("nan"), "TB/s": copy, "of copy": 1.0}]

    n = 1 << 28
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor(2.0, device="cuda")
    acc = torch.zeros((), device="cuda")
    q = fp8ext.quantize(x, fp8ext.E4M3, scale, amax_out=acc)
    tq, tamax = torch_quantize(x, scale)
    assert torch.equal(q.view(torch.uint8), tq.view(torch.uint8)) and acc.item() == tamax.item(), "fp8ext != torch"
    compiled_q = torch.compile(torch_quantize)
    ms, lo, hi = spread(lambda: fp8ext.quantize(x, fp8ext.E4M3, scale, amax_out=acc))
    rows.append(row("quantize+amax 2^28", "fp8ext", ms, 3 * n, copy) | {"spread": f"{lo:.3f}-{hi:.3f} ms"})
    rows.append(row("quantize+amax 2^28", "torch eager", bench_ms(lambda: torch_quantize(x, scale), 10), 3 * n, copy))
    rows.append(row("quantize+amax 2^28", "torch.compile", bench_ms(lambda: compiled_q(x, scale), 20), 3 * n, copy))
    rows.append(row("quantize (no amax) 2^28", "fp8ext", bench_ms(lambda: fp8ext.quantize(x, fp8ext.E4M3, scale)),
                    3 * n, copy))
    # the transformer-layer size Transformer Engine's anchors use: cast + amax of 8192x4096 bf16, allocating the
    # output each call and into a preallocated one (out=, as TE's quantize into an existing tensor)
    xs = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    qs = fp8ext.quantize(xs, fp8ext.E4M3, scale, amax_out=acc)
    assert torch.equal(fp8ext.quantize(xs, fp8ext.E4M3, scale, amax_out=acc, out=torch.empty_like(qs)).view(
        torch.uint8), qs.view(torch.uint8))
    rows.append(row("quantize+amax 8192x4096", "fp8ext, allocating",
                    bench_ms(lambda: fp8ext.quantize(xs, fp8ext.E4M3, scale, amax_out=acc), 50), 3 * xs.numel(), copy))
    rows.append(row("quantize+amax 8192x4096", "fp8ext, out=",
                    bench_ms(lambda: fp8ext.quantize(xs, fp8ext.E4M3, scale, amax_out=acc, out=qs), 50),
                    3 * xs.numel(), copy))
    del xs, qs
    rows.append(row("amax 2^28", "fp8ext", bench_ms(lambda: fp8ext.amax(x)), 2 * n, copy))
    rows.append(row("amax 2^28", "torch eager", bench_ms(lambda: x.abs().amax()), 2 * n, copy))
    rows.append(row("dequantize 2^28 -> bf16", "fp8ext",
                    bench_ms(lambda: fp8ext.dequantize(q, scale, torch.bfloat16)), 3 * n, copy))
    rows.append(row("dequantize 2^28 -> bf16", "torch eager",
                    bench_ms(lambda: (q.float() * scale).to(torch.bfloat16), 10), 3 * n, copy))
    del q, tq

    m = 16384
    x2 = x.view(m, m)
    qa, qta = fp8ext.cast_transpose(x2, fp8ext.E4M3, scale, amax_out=acc)
    ta, tta, _ = torch_cast_transpose(x2, scale)
    assert torch.equal(qa.view(torch.uint8), ta.view(torch.uint8)) and torch.equal(qta.view(torch.uint8),
                                                                                   tta.view(torch.uint8))
    del qa, qta, ta, tta
    compiled_ct = torch.compile(torch_cast_transpose)
    ms, lo, hi = spread(lambda: fp8ext.cast_transpose(x2, fp8ext.E4M3, scale, amax_out=acc))
    rows.append(row("cast_transpose 16384^2", "fp8ext", ms, 4 * n, copy) | {"spread": f"{lo:.3f}-{hi:.3f} ms"})
    rows.append(row("cast_transpose 16384^2", "torch eager", bench_ms(lambda: torch_cast_transpose(x2, scale), 10),
                    4 * n, copy))
    rows.append(row("cast_transpose 16384^2", "torch.compile", bench_ms(lambda: compiled_ct(x2, scale), 20), 4 * n,
                    copy))
    for r in (16383, 16380):  # the vector path covers every full tile, the scalar path only the tail
        xr = x[: r * m].view(r, m)
        qa, qta = fp8ext.cast_transpose(xr, fp8ext.E4M3, scale, amax_out=acc)
        ta, tta, _ = torch_cast_transpose(xr, scale)
        assert torch.equal(qa.view(torch.uint8), ta.view(torch.uint8)) and torch.equal(qta.view(torch.uint8),
                                                                                       tta.view(torch.uint8))
        del qa, qta, ta, tta
        rows.append(row(f"cast_transpose {r}x{m}", "fp8ext",
                        bench_ms(lambda: fp8ext.cast_transpose(xr, fp8ext.E4M3, scale, amax_out=acc)), 4 * r * m, copy))

    from fp8ext.ops import cast_transpose_dbias
    _, _, db = cast_transpose_dbias(x2, fp8ext.E4M3, scale, amax_out=acc)
    want = x2.float().sum(0)
    assert ((db.float() - want).abs() <= 1e-2 * x2.float().abs().sum(0)).all(), "dbias far from torch's sum"
    rows.append(row("cast_transpose_dbias 16384^2", "fp8ext",
                    bench_ms(lambda: cast_transpose_dbias(x2, fp8ext.E4M3, scale, amax_out=acc)), 4 * n, copy))
    rows.append(row("cast_transpose_dbias 16384^2", "torch eager",
                    bench_ms(lambda: (torch_cast_transpose(x2, scale), x2.float().sum(0).to(x2.dtype)), 10),
                    4 * n, copy))

    print(table(rows, ["case", "impl", "ms", "TB/s", "of copy", "spread"],
                {"ms": "{:.3f}", "TB/s": "{:.2f}", "of copy": "{:.0%}"}))
    base = {r["case"] + "|" + r["impl"]: r for r in rows}
    for case in ("quantize+amax 2^28", "cast_transpose 16384^2"):
        f = base[case + "|fp8ext"]["TB/s"]
        print(f"{case}: fp8ext {f:.2f} TB/s = {f / base[case + '|torch eager']['TB/s']:.1f}x torch eager, "
              f"{f / base[case + '|torch.compile']['TB/s']:.2f}x torch.compile, {f / copy:.0%} of copy")
    save("bench_quantize.json", {"header": head, "rows": rows})


if __name__ == "__main__":
    main()
