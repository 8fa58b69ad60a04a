"""Host time of single fp8ext._C calls and of the torch calls around them, at a small layer's shape: where the
host-bound FP8Linear step of profile_host.py spends its time below Python. Each call is issued back to back, its
DLPack capsules made beforehand (so the figure is the call itself), few enough calls not to fill the launch queue;
medians of rounds. For the capsule conversions, allocations and Python-to-C crossings the step also makes, the
same numbers for torch._C._to_dlpack, torch.empty and a C call that does no work.

    python benchmarks/profile_c_calls.py [--shape M K N] [--calls 40] [--rounds 7]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import fp8ext
from fp8ext import _C
from fp8ext.ops.matmul import pass_stream

_to_dl = torch._C._to_dlpack


def host_us(fn, calls: int, rounds: int) -> float:
    """Median over rounds of the host time per call (us), `calls` calls issued back to back per round."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[4096, 1024, 1024])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    m, k, n = args.shape
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    one = lambda v: torch.full((1,), v, device=dev, dtype=torch.float32)  # noqa: E731
    xs, xa, wsc, wa, gs, ga = one(1.0), one(0.0), one(1.0), one(0.0), one(1.0), one(0.0)
    e4, e5 = fp8ext.E4M3.code, fp8ext.E5M2.code
    align, sinv_bytes = _C.LINEAR_ALIGN, _C.LINEAR_SINV_BYTES
    rmk, rmn = -(-m * k // align) * align, -(-m * n // align) * align
    saved = torch.empty(sinv_bytes + rmk + n * k, dtype=torch.uint8, device=dev)
    scratch = torch.empty(rmk + n * k, dtype=torch.uint8, device=dev)
    bscratch = torch.empty(rmn + m * n, dtype=torch.uint8, device=dev)
    y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    dx = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
    dw = torch.empty(n, k, device=dev, dtype=torch.bfloat16)
    q = torch.empty(m, k, device=dev, dtype=torch.uint8)
    qt = torch.empty(k, m, device=dev, dtype=torch.uint8)
    w8 = torch.empty(n, k, device=dev, dtype=torch.uint8)
    sinv = one(1.0)
    stream, ws = pass_stream(dev)
    cap = {name: _to_dl(t) for name, t in dict(x=x, w=w, dy=dy, xs=xs, xa=xa, wsc=wsc, wa=wa, gs=gs, ga=ga,
                                                 saved=saved, scratch=scratch, bscratch=bscratch, y=y, dx=dx, dw=dw,
                                                 q=q, qt=qt, w8=w8, sinv=sinv).items()}
    history = torch.zeros(6, 16, device=dev)
    scale, scale_inv = torch.ones(6, device=dev), torch.ones(6, device=dev)
    fmt_max = torch.full((6,), 448.0, device=dev)
    su = (_to_dl(history), _to_dl(scale), _to_dl(scale_inv), _to_dl(fmt_max))
    small_a, small_b, small_c = (torch.ones(16, device=dev) for _ in range(3))

    def fwd():  # a fresh capsule per use: DLPack capsules are single-use in general
        _C.linear_fwd(_to_dl(x), _to_dl(w), _to_dl(saved), _to_dl(scratch), _to_dl(y), e4, x_scale=_to_dl(xs),
                      x_amax=_to_dl(xa), w_scale=_to_dl(wsc), w_amax=_to_dl(wa), workspace=ws, stream=stream)

    def bwd():
        _C.linear_bwd(_to_dl(dy), _to_dl(saved), _to_dl(bscratch), m, k, n, e4, e5, g_scale=_to_dl(gs),
                      g_amax=_to_dl(ga), dx=_to_dl(dx), dw=_to_dl(dw), workspace=ws, stream=stream)

    fwd(), bwd()
    calls = {
        "C call doing no work (cast_transpose_dbias_workspace)": lambda: _C.cast_transpose_dbias_workspace(64, 64),
        "torch._C._to_dlpack of a CUDA tensor": lambda: _to_dl(x),
        "torch.empty, 4 MiB uint8 on the GPU": lambda: torch.empty(m * k, dtype=torch.uint8, device=dev),
        "torch.add(out=) on 16 floats (one launch through torch)": lambda: torch.add(small_a, small_b, out=small_c),
        "_C.amax (2 capsules, 1 launch)": lambda: _C.amax(_to_dl(x), _to_dl(xa), stream=stream),
        "_C.cast_transpose x (6 capsules, 1 launch)": lambda: _C.cast_transpose(
            _to_dl(x), _to_dl(q), _to_dl(qt), e4, _to_dl(xs), _to_dl(xa), stream=stream, scale_inv_out=_to_dl(sinv)),
        "_C.gemm forward, per tensor, bf16 out (5 capsules + workspace, cuBLASLt)": lambda: _C.gemm(
            _to_dl(q), _to_dl(w8), e4, e4, _to_dl(sinv), _to_dl(sinv), _to_dl(y), fast_accum=True, workspace=ws,
            stream=stream),
        "_C.scale_update, 6 slots (4 capsules made once, 1 launch)": lambda: _C.scale_update(
            *su, 0, 0.0, True, 0.5, stream=stream),
        "_C.linear_fwd (9 capsules, 2 casts + 1 GEMM)": fwd,
        "_C.linear_bwd (7 capsules, 1 cast + 2 GEMMs)": bwd,
        "F.linear bf16 forward (cuBLAS, torch's dispatch)": lambda: F.linear(x, w),
    }
    del cap
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, M,K,N {m},{k},{n}; host us per call, "
          f"{args.calls} calls back to back, median of {args.rounds} rounds")
    for name, fn in calls.items():
        for _ in range(5):
            fn()
    for name, fn in calls.items():
        print(f"{host_us(fn, args.calls, args.rounds):8.1f} us  {name}", flush=True)


if __name__ == "__main__":
    main()
