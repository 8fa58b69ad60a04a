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

from ..models.transformer import PRESETS

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8ext-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--use_fp8", action="store_true",
                   help="run the blocks' linear layers in FP8 (E4M3 forward, E5M2 gradients); raises on a GPU "
                        "without FP8 tensor cores; emulated (exact casts, float32 products) on a CPU")
    p.add_argument("--fp8_recipe", choices=["delayed", "current", "block", "rowwise"], default="delayed",
                   help="delayed: scales from an amax history (HYBRID, 'max'); current: from each tensor's own amax; "
                        "block: Float8BlockScaling (1x128 activation and gradient tiles, 128x128 weight blocks, E4M3, "
                        "power-of-two scales); rowwise: Float8RowwiseScaling (one scale per row, E4M3)")
    p.add_argument("--amax_history_len", type=int, default=16)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--separate_qkv", action="store_true", help="three Q/K/V projections instead of one fused")
    p.add_argument("--no_fused_kernels", action="store_true",
                   help="on a GPU, run RMSNorm, RoPE and SwiGLU as torch's ops instead of fp8ext's fused kernels")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per micro-batch per device")
    p.add_argument("--grad_accum_steps", type=int, default=1)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--max_steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW; warm-up, then cosine)")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--data", default=None,
                   help="a text file or a directory of them; default: this Python's standard-library sources")
    p.add_argument("--out_dir", default="runs/latest", help="metrics.jsonl and checkpoint.pt go here")
    p.add_argument("--resume", default=None, help="a checkpoint file or a run directory to continue from")
    p.add_argument("--save_every", type=int, default=0, help="also checkpoint every N steps (0: at the end only)")
    p.add_argument("--no_save", action="store_true", help="write no checkpoint (benchmark runs)")
    p.add_argument("--stop_after", type=int, default=0,
                   help="stop after N steps of this invocation, with a checkpoint (the learning-rate schedule still "
                        "follows --max_steps): split a run into jobs and continue each with --resume")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--fp8_all_gather", action="store_true",
                   help="with --fsdp and --use_fp8 (delayed or current scaling): FSDP2 gathers each FP8 layer's weight "
                        "cast to FP8 (1 byte an element) instead of in high precision")
    p.add_argument("--activation_checkpointing", choices=["none", "full", "selective"], default="none",
                   help="recompute activations in the backward instead of keeping them, per transformer block "
                        "(torch.utils.checkpoint): full: the whole block; selective: all but the outputs of the matrix "
                        "products and attention (torch's selective activation checkpointing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_every", type=int, default=100, help="validation loss every N steps (and at the end)")
    p.add_argument("--eval_batches", type=int, default=8)
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu; default: cuda when there is one")
    p.add_argument("--compare", action="store_true",
                   help="train twice, high precision into OUT_DIR/bf16 (OUT_DIR/fp32 on a CPU) and FP8 into "
                        "OUT_DIR/fp8, then print the comparison")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the command line; a checkpoint that cannot be loaded safely ends it with a one-line error (SystemExit,
    as argparse does for a wrong argument) naming the file."""
    args = parser().parse_args(argv)
    from .checkpoint import CheckpointError  # torch and the model are imported only after the arguments parse
    try:
        return _run(args)
    except CheckpointError as e:
        raise SystemExit(f"fp8ext-train: {e}") from e


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
