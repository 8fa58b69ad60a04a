"""The host-time floor of a small FP8Linear training step: how fast the step could be if fp8ext's C calls were free.

A small layer (default 4096 x 1024 x 1024, bf16, no bias) is bound by the host: each step's time is the time the CPU
takes to issue it. This runs, in one process, rounds of:

    bf16                      nn.Linear fwd+bwd (torch's C++ autograd node)
    Function(empty)           a minimal torch.autograd.Function whose forward and backward only allocate their
                              outputs: what any Python-level autograd node costs before doing anything
    fp8 delayed / current     FP8Linear fwd+bwd inside fp8_autocast, as a training loop runs it
    ... [C calls free]        the same with fp8ext._C.linear_fwd, linear_bwd and scale_update replaced by functions
                              that return at once (no launches, no C work): fp8ext's Python and torch's machinery alone

and prints each step's host time (steps issued back to back, medians of rounds) and the ratios. If the "C calls free"
step is already slower than what a goal allows, no work inside the C calls can meet the goal.

    python benchmarks/host_floor.py [--shape M K N] [--rounds 15]
"""
import argparse
import statistics
import time

import torch
from torch import nn

import fp8ext
from fp8ext import _C


BUSY = [0]  # GPU cycles of a sleep kernel queued before each round: > 0 keeps the GPU busy while the steps are issued


def host_us(step, steps: int = 20, rounds: int = 15) -> float:
    for _ in range(3):
        step()
    runs = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        if BUSY[0]:
            torch.cuda._sleep(BUSY[0])
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        runs.append((time.perf_counter() - t0) / steps * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def steps(m: int, k: int, n: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            return x.new_empty((m, n))

        @staticmethod
        def backward(ctx, g):
            return g.new_empty((m, k)), g.new_empty((n, k))

    def fp8(recipe):
        def step():
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                y = f8(x)
            y.backward(gy)
        return step

    return {"bf16": lambda: lin(x).backward(gy), "Function(empty)": lambda: Empty.apply(x, lin.weight).backward(gy),
            "fp8 delayed": fp8(fp8ext.DelayedScaling()), "fp8 current": fp8(fp8ext.Float8CurrentScaling())}


class free_c_calls:
    """Within: the linear pass and scale-update C calls return at once (the GEMMs 'ran', nothing was launched)."""
    names = ("linear_fwd", "linear_bwd", "scale_update")

    def __enter__(self):
        self.saved = {name: getattr(_C, name) for name in self.names}
        _C.linear_fwd = _C.linear_bwd = lambda *a, **k: True
        _C.scale_update = lambda *a, **k: None

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(_C, name, fn)


class timed_c_calls:
    """Within: the same C calls, each timed (perf_counter around the call): {name: [seconds, calls]}."""

    def __enter__(self):
        self.saved = {name: getattr(_C, name) for name in free_c_calls.names}
        self.spent = {name: [0.0, 0] for name in free_c_calls.names}

        def wrap(name, fn):
            def call(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    cell = self.spent[name]
                    cell[0] += time.perf_counter() - t0
                    cell[1] += 1
            return call
        for name, fn in self.saved.items():
            setattr(_C, name, wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(_C, name, fn)


def inside(impls, rounds: int) -> None:
    """Host time of each C call inside the FP8 steps (per call), next to the same call's time back to back."""
    for name in ("fp8 delayed", "fp8 current"):
        with timed_c_calls() as t:
            host_us(impls[name], rounds=rounds)
        print(f"{name}: inside the step, per call: " +
              ", ".join(f"{c} {s / max(n, 1) * 1e6:.1f} us" for c, (s, n) in t.spent.items() if n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=3, default=[4096, 1024, 1024])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=3, help="passes over the variants, alternating")
    ap.add_argument("--inside", action="store_true", help="also time each C call inside the steps")
    ap.add_argument("--busy", action="store_true", help="also run everything with the GPU kept busy (a sleep kernel "
                    "queued before each round): kernel launches then join a non-empty queue")
    args = ap.parse_args()
    torch.manual_seed(0)
    impls = steps(*args.shape)
    times = {}
    for _ in range(args.repeats):
        for name, fn in impls.items():
            times.setdefault(name, []).append(host_us(fn, rounds=args.rounds))
        with free_c_calls():
            for name in ("fp8 delayed", "fp8 current"):
                times.setdefault(f"{name} [C calls free]", []).append(host_us(impls[name], rounds=args.rounds))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, M,K,N {','.join(map(str, args.shape))}; "
          f"host us per fwd+bwd step, median of {args.repeats} passes (each a median of {args.rounds} rounds)")
    bf16 = statistics.median(times["bf16"])
    for name, runs in times.items():
        t = statistics.median(runs)
        print(f"{t:8.1f} us  ({bf16 / t:.2f}x bf16's speed)  {name}   [passes: {', '.join(f'{r:.0f}' for r in runs)}]")
    print(f"a step at 0.75x bf16's speed may take {bf16 / 0.75:.0f} us")
    if args.inside:
        inside(impls, args.rounds)
    if args.busy:
        BUSY[0] = 40_000_000  # about 20 ms at H100/H200 clocks: longer than a round of 20 steps
        print("with the GPU busy while the steps are issued:")
        for name in ("bf16", "Function(empty)", "fp8 delayed", "fp8 current"):
            print(f"{host_us(impls[name], rounds=args.rounds):8.1f} us  {name}")
        if args.inside:
            inside(impls, args.rounds)


if __name__ == "__main__":
    main()
