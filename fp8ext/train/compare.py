"""`python -m fp8ext.train.compare DIR_A DIR_B [--plot FILE]`: two training runs side by side: their loss
curves (training and validation) in one plot, the final validation losses, and the ratio of their tokens/s."""

from __future__ import annotations

import argparse
import os
import json
import pathlib
import sys
from typing import Optional

from .._cli import OneLineParser, add_debug, one_line_errors

__all__ = ["compare", "main", "parser"]


def _run(run_dir: str):
    d = pathlib.Path(run_dir)
    if not (d / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"compare: {d} holds no metrics.jsonl (not a fp8ext.train output directory)")
    rows = [_json(d / "metrics.jsonl", line, i) for i, line in
            enumerate((d / "metrics.jsonl").read_text().splitlines(), 1) if line.strip()]
    info = _json(d / "run.json", (d / "run.json").read_text()) if (d / "run.json").is_file() else {}
    if not all(isinstance(r, dict) and "step" in r and "loss" in r for r in rows) or not isinstance(info, dict):
        raise ValueError(f"compare: {d} holds a metrics.jsonl or run.json that fp8ext.train did not write")
    return rows, info


def _json(path: pathlib.Path, text: str, line: int = 0):
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"compare: {path}{f' line {line}' if line else ''} is not JSON ({e})") from None


def _label(run_dir: str, info: dict) -> str:
    """The run's precision, and its folder's name where that says something else ("fp8", "fp8 (run-2)")."""
    precision, name = info.get("precision", "?"), pathlib.Path(run_dir).name
    return precision if name == precision else f"{precision} ({name})"


def _named(run_dir: str, info: dict) -> str:
    """The run's precision and its folder, to say which run is which: "fp8 (runs/quickstart/fp8)"."""
    return f"{info.get('precision', '?')} ({run_dir})"


def compare(dir_a: str, dir_b: str, plot: Optional[str] = None) -> dict:
    """Prints the comparison of two runs (B relative to A, each named by its precision and folder) and writes the
    loss plot to `plot` if given."""
    (rows_a, info_a), (rows_b, info_b) = _run(dir_a), _run(dir_b)
    va = [r for r in rows_a if "val_loss" in r]
    vb = [r for r in rows_b if "val_loss" in r]
    result = {"a": dir_a, "b": dir_b,
              "val_loss_a": va[-1]["val_loss"] if va else None, "val_loss_b": vb[-1]["val_loss"] if vb else None,
              "step_a": rows_a[-1]["step"] if rows_a else None, "step_b": rows_b[-1]["step"] if rows_b else None,
              "tokens_per_s_a": info_a.get("tokens_per_s"), "tokens_per_s_b": info_b.get("tokens_per_s")}
    la, lb = _label(dir_a, info_a), _label(dir_b, info_b)
    na, nb = _named(dir_a, info_a), _named(dir_b, info_b)
    result.update(name_a=na, name_b=nb)
    print(f"{'':<28}{la:>22}{lb:>22}")
    for key, name, fmt in (("step", "steps", "{}"), ("val_loss", "final validation loss", "{:.4f}"),
                           ("tokens_per_s", "tokens/s (median)", "{:,.0f}")):
        a, b = result[f"{key}_a"], result[f"{key}_b"]
        print(f"{name:<28}{fmt.format(a) if a is not None else 'n/a':>22}{fmt.format(b) if b is not None else 'n/a':>22}")
    if result["val_loss_a"] and result["val_loss_b"]:
        result["val_loss_change"] = result["val_loss_b"] / result["val_loss_a"] - 1
        print(f"validation loss of {nb} vs {na}: {result['val_loss_change']:+.2%}")
    if result["tokens_per_s_a"] and result["tokens_per_s_b"]:
        result["speed_ratio"] = result["tokens_per_s_b"] / result["tokens_per_s_a"]
        note = "" if info_b.get("device_name", "cpu") != "cpu" else " (CPU: FP8 is emulated there, not a speed figure)"
        print(f"tokens/s of {nb} / {na}: {result['speed_ratio']:.2f}x{note}")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        # distinct styles, so that curves which coincide (FP8 tracking the baseline) stay visible as two
        for rows, v, label, style, marker in ((rows_a, va, la, "-", "o"), (rows_b, vb, lb, "--", "s")):
            line, = ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, lw=1.2, alpha=0.8,
                            label=f"{label}: training")
            if v:
                ax.plot([r["step"] for r in v], [r["val_loss"] for r in v], marker, ls=":", color=line.get_color(),
                        ms=7 if marker == "o" else 5, mfc="none" if marker == "o" else line.get_color(),
                        label=f"{label}: validation")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats per byte)")
        ax.set_title("Training runs compared")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        plt.close(fig)
        print(f"plot: {plot}")
    return result


def _default_plot(dir_a: str, dir_b: str) -> pathlib.Path:
    """compare.png in the folder holding both runs (runs/ for runs/bf16 and runs/fp8), not the working directory."""
    a, b = pathlib.Path(dir_a).resolve(), pathlib.Path(dir_b).resolve()
    common = pathlib.Path(os.path.commonpath([a, b]))
    return (common if common not in (a, b) else common.parent) / "compare.png"


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests/project/test_docs.py parses the documented commands with it)."""
    p = OneLineParser(prog="python -m fp8ext.train.compare", description=__doc__.split("\n")[0])
    p.add_argument("dir_a")
    p.add_argument("dir_b")
    p.add_argument("--plot", default=None,
                   help="where to write the loss plot (default: compare.png next to the two runs; '' for none)")
    add_debug(p)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    with one_line_errors(p.prog, args.debug):
        plot = args.plot if args.plot is not None else str(_default_plot(args.dir_a, args.dir_b))
        compare(args.dir_a, args.dir_b, plot=plot or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
