"""A short tour of fp8ext: python -m fp8ext.demo [--out runs/fp8ext_demo.png] [--steps 300]

1. The two FP8 formats, as the C core defines them.
2. Real data: a small MLP trained on scikit-learn's handwritten digits (1797 8x8 images, shipped with the
   package, no download). Its weights, activations and gradients are quantized with per-tensor scaling
   (scale = fmt.max / amax) to E4M3 and to E5M2, and the relative error of each is printed: E4M3's extra
   mantissa bit wins where the scale fits the range; E5M2's range is what gradients need without one.
3. Correct FP8 rounding next to the simulation in the teaching notebook on FP8 training and inference
   (notebooks/lab_3_2_3_fp8_training_inference.ipynb, "the lab"), which rounds every value to a multiple of
   2^-mant_bits: wrong for small values (they collapse to 0) and for large ones (too fine).
Writes a plot of parts 2 and 3 when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import pathlib
import math
import time

import torch

import fp8ext


def format_table() -> str:
    rows = [("exponent / mantissa bits", lambda f: f"{f.exp_bits} / {f.mant_bits}"),
            ("exponent bias", lambda f: f"{f.bias}"),
            ("largest finite", lambda f: f"{f.max:g}"),
            ("smallest normal", lambda f: f"2^{int(math.log2(f.min_normal))} = {f.min_normal:.3g}"),
            ("smallest subnormal", lambda f: f"2^{int(math.log2(f.min_subnormal))} = {f.min_subnormal:.3g}"),
            ("dynamic range (max/min subnormal)", lambda f: f"{f.max / f.min_subnormal:.3g}"),
            ("Inf", lambda f: f"{f.inf_code:#04x}" if f.has_inf else "none"),
            ("NaN", lambda f: "0x7f (S.1111.111)" if f.name == "E4M3" else "0x7d-0x7f"),
            ("values in [1, 2)", lambda f: f"{2 ** f.mant_bits}")]
    lines = [f"{'':36}{'E4M3':>20}{'E5M2':>20}"]
    lines += [f"{name:36}{get(fp8ext.E4M3):>20}{get(fp8ext.E5M2):>20}" for name, get in rows]
    return "\n".join(lines)


def rel_error(x: torch.Tensor, fmt: fp8ext.FP8Format, scaled: bool = True) -> float:
    """||dequant(quant(x)) - x|| / ||x||, per-tensor scale fmt.max / amax (or scale 1)."""
    amax = fp8ext.amax(x).item()
    scale = fmt.max / amax if scaled and amax > 0 else 1.0
    back = fp8ext.dequantize(fp8ext.quantize(x, fmt, scale), 1.0 / scale)
    return ((back - x).norm() / x.norm()).item()


def lab_simulate_fp8(x: torch.Tensor, fmt: fp8ext.FP8Format) -> torch.Tensor:
    """The teaching lab's simulate_fp8: clamp, then round to a fixed grid of 2^-mant_bits (not FP8)."""
    m = 2 ** fmt.mant_bits
    return torch.round(x.clamp(-fmt.max, fmt.max) * m) / m


def train_digits(steps: int):
    """Trains a 64-128-10 MLP on the digits set; returns named real tensors from the last step."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t0 = time.time()
    for step in range(steps):
        opt.zero_grad()
        hidden = model[1](model[0](x))
        hidden.retain_grad()
        loss = torch.nn.functional.cross_entropy(model[2](hidden), y)
        loss.backward()
        opt.step()
        if step % max(1, steps // 4) == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.1f}s)", flush=True)
    acc = (model(x).argmax(1) == y).float().mean().item()
    print(f"  training accuracy {acc:.1%}")
    return {"weight fc1": model[0].weight.detach(), "weight fc2": model[2].weight.detach(),
            "activation (hidden)": hidden.detach(), "gradient of fc1 weight": model[0].weight.grad,
            "gradient of hidden activation": hidden.grad}


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests/project/test_docs.py parses the documented commands with it)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/fp8ext_demo.png", help="where to write the plot ('' for none)")
    ap.add_argument("--steps", type=int, default=300, help="training steps on the digits data")
    return ap


def main(argv=None):
    args = parser().parse_args(argv)
    info = fp8ext.build_info()
    print(f"fp8ext {fp8ext.__version__}: {'CUDA ' + info['cuda_archs'] if info['cuda'] else 'CPU-only'} build, "
          f"GPU in use: {fp8ext.cuda_available()}\n")
    print("1. FP8 formats (from fp8ext's C core)\n" + format_table() + "\n")

    print("2. E4M3 vs E5M2 on real tensors (MLP on scikit-learn digits)")
    tensors = train_digits(args.steps)
    errors = {}
    print(f"  {'tensor':32}{'amax':>10}{'E4M3 err':>11}{'E5M2 err':>11}{'E4M3 unscaled':>15}{'E5M2 unscaled':>15}")
    for name, t in tensors.items():
        e = [rel_error(t, fp8ext.E4M3), rel_error(t, fp8ext.E5M2), rel_error(t, fp8ext.E4M3, False),
             rel_error(t, fp8ext.E5M2, False)]
        errors[name] = e
        print(f"  {name:32}{t.abs().max().item():10.2e}" + "".join(f"{v:11.2%}" for v in e[:2]) +
              "".join(f"{v:15.2%}" for v in e[2:]))
    print("  (relative Frobenius error; scaled: scale = fmt.max / amax, the delayed-scaling rule with a fresh amax)\n")

    print("3. Correct FP8 rounding vs the teaching lab's fixed-grid simulate_fp8 (relative error of one value)")
    values = torch.logspace(-3, 2, 11)
    print(f"  {'value':>10}{'E4M3 fp8ext':>14}{'E4M3 lab grid':>15}{'E5M2 fp8ext':>14}{'E5M2 lab grid':>15}")
    for v in values.tolist():
        t = torch.tensor([v])
        cols = []
        for f in (fp8ext.E4M3, fp8ext.E5M2):
            right = fp8ext.dequantize(fp8ext.quantize(t, f)).item()
            lab = lab_simulate_fp8(t, f).item()
            cols += [abs(right - v) / v, abs(lab - v) / v]
        print(f"  {v:10.4g}" + "".join(f"{c:14.2%}" if i % 2 == 0 else f"{c:15.2%}" for i, c in enumerate(cols)))
    print("  In the normal range real FP8's relative error stays below 2^-(mant_bits+1) (6.25% E4M3, 12.5% E5M2) at\n"
          "  every magnitude; the lab's grid rounds small values to 0 and is not FP8 at all for large ones.")
    if args.out:
        plot(errors, args.out)


def plot(errors, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    v = torch.logspace(-3, 2, 400)
    for f, color in ((fp8ext.E4M3, "tab:blue"), (fp8ext.E5M2, "tab:red")):
        right = (fp8ext.dequantize(fp8ext.quantize(v, f)) - v).abs() / v
        lab = (lab_simulate_fp8(v, f) - v).abs() / v
        a.loglog(v, right.clamp(min=1e-6), color=color, label=f"{f.name}: fp8ext (round to nearest even)")
        a.loglog(v, lab.clamp(min=1e-6), color=color, ls="--", alpha=0.7, label=f"{f.name}: lab's fixed grid")
    a.set(xlabel="value", ylabel="relative error", title="Rounding one value to FP8")
    a.legend(fontsize=8)
    names = list(errors)
    xs = torch.arange(len(names)).float()
    bars = (("E4M3, scale = max/amax", "tab:blue", None), ("E5M2, scale = max/amax", "tab:red", None),
            ("E4M3, no scale", "tab:blue", "//"), ("E5M2, no scale", "tab:red", "//"))
    for k, (label, color, hatch) in enumerate(bars):
        b.bar(xs + (k - 1.5) * 0.2, [errors[n][k] for n in names], 0.2, label=label, color=color, hatch=hatch,
              alpha=0.55 if hatch else 1.0)
    b.set_xticks(xs.tolist(), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    b.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator
    percent = FuncFormatter(lambda y, _: f"{y * 100:g}%")  # labels where the bars are (1 %, 2 %, 5 %, ...)
    b.yaxis.set_major_formatter(percent)
    b.yaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
    low = min(e for row in errors.values() for e in row if e > 0)
    b.set_ylim(bottom=10 ** math.floor(math.log10(low)))  # a labelled tick below the lowest bar
    b.yaxis.set_minor_formatter(percent)
    b.set(ylabel="relative error (Frobenius norm)", title="FP8 on the tensors of an MLP trained on digits")
    b.legend(fontsize=8)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
