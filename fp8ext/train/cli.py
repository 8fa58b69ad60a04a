"""`python -m fp8ext.train` / `fp8ext-train`: train the dense transformer of fp8ext.models.transformer on
byte-level text, in bf16 (default) or FP8, on one device or several (torchrun: DDP, or FSDP2 with --fsdp).

    python -m fp8ext.train --preset tiny --max_steps 300                  # bf16 (float32 on a CPU)
    python -m fp8ext.train --preset tiny --max_steps 300 --use_fp8        # FP8 linear layers
    python -m fp8ext.train --preset tiny --max_steps 300 --compare        # both, then the comparison
    torchrun --nproc_per_node=2 -m fp8ext.train --preset small --use_fp8  # two GPUs (DDP)
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import List, Optional

from .._cli import one_line_errors, usable_device
from .options import (amax_history_type, parser, positive_float, seed_type,  # noqa: F401 (fp8ext.train.cli's names)
                      seq_len_type)

__all__ = ["main", "parser"]


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the command line. A wrong argument ends it as argparse does (exit status 2); any other failure (a
    checkpoint that cannot be loaded safely, a full disk, ...) with one line on stderr naming what was wrong
    (exit status 1; --debug shows the traceback)."""
    p = parser()
    args = p.parse_args(argv)
    if args.fp8_attention and not (args.use_fp8 or args.compare) or args.fp8_attention and \
            args.fp8_recipe not in ("delayed", "current"):
        p.error("--fp8_attention needs --use_fp8 (or --compare) and --fp8_recipe delayed or current (per-tensor "
                "scales)")
    if args.fp8_attention_backward is not None and not args.fp8_attention:
        p.error("--fp8_attention_backward needs --fp8_attention")
    with one_line_errors(p.prog, args.debug):
        _check_paths(args)
        _check_device(args.device)
        return _run(args)


def _check_paths(args: argparse.Namespace) -> None:
    """The paths the run reads and writes, checked before the corpus is read and the model is built."""
    out = pathlib.Path(args.out_dir)
    for existing in (out, *out.parents):  # the nearest part of --out_dir that exists must be a folder
        if existing.exists():
            if not existing.is_dir():
                raise NotADirectoryError(f"--out_dir: {existing} exists and is not a folder"
                                         + ("" if existing == out else f" (so {out} cannot be one)"))
            break
    if args.data is not None and not (pathlib.Path(args.data).is_file() or pathlib.Path(args.data).is_dir()):
        raise FileNotFoundError(f"--data: {args.data} is neither a file nor a directory")
    if args.resume is not None:
        from .checkpoint import CHECKPOINT_NAME
        r = pathlib.Path(args.resume)
        if not (r.is_file() or (r / CHECKPOINT_NAME).is_file()):
            raise FileNotFoundError(f"--resume: no checkpoint at {r / CHECKPOINT_NAME if r.is_dir() else r}")


def _check_device(device: Optional[str]) -> None:
    """--device: cpu, or a CUDA device that torch sees."""
    if device is not None:
        usable_device(device, "cpu")


def _run(args: argparse.Namespace) -> int:
    from .trainer import train
    if not args.compare:
        train(args)
        return 0
    from .compare import compare
    import torch
    out = pathlib.Path(args.out_dir)
    on_gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    runs = []
    for name, fp8 in (("bf16" if on_gpu else "fp32", False), ("fp8", True)):
        run_args = argparse.Namespace(**{**vars(args), "use_fp8": fp8, "out_dir": str(out / name), "compare": False})
        train(run_args)
        runs.append(str(out / name))
    compare(runs[0], runs[1], plot=str(out / "compare.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
