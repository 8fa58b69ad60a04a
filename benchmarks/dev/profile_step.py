"""Host-side profile of one FP8Linear training step (development aid): where the Python and C time goes.

    python benchmarks/dev/profile_step.py
"""
import cProfile
import pstats
import time

import torch

import fp8ext


def main():
    m, k, n = 4096, 1024, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    f8 = fp8ext.FP8Linear(k, n, bias=False, device="cuda", params_dtype=torch.bfloat16)
    recipe = fp8ext.DelayedScaling()

    def step():
        f8._weight_cache = None
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            y = f8(x)
        y.backward(gy)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(100):
        step()
    print(f"host time per step: {(time.perf_counter() - t0) * 1e4:.0f} us")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        step()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumtime").print_stats(40)


if __name__ == "__main__":
    main()
