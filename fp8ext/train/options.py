"""fp8ext.train's command line: its parser and the argument types it checks (the options a run records in its
checkpoint, checked again against this parser when the checkpoint is read: fp8ext.train.checkpoint)."""

from __future__ import annotations

import argparse

from .._cli import OneLineParser, add_debug, finite_float, nonnegative_float, nonnegative_int, positive_int
from ..models.transformer import PRESETS, SIZE_LIMITS

__all__ = ["parser", "positive_float", "seq_len_type", "amax_history_type", "seed_type"]

_DESCRIPTION = ("`python -m fp8ext.train` / `fp8ext-train`: train the dense transformer of fp8ext.models.transformer "
                "on\nbyte-level text, in bf16 (default) or FP8, on one device or several (torchrun: DDP, or FSDP2 "
                "with --fsdp).")  # the first paragraph of fp8ext/train/cli.py's docstring

_MAX_SEQ_LEN = SIZE_LIMITS["max_seq_len"]  # the longest context a model config takes
_MAX_AMAX_HISTORY = 16384  # DelayedScaling's limit


def _int_in(low: int, high: int):
    """argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, got {text!r}")
        return v
    parse.__name__ = f"integer in [{low}, {high}]"
    return parse


seq_len_type = _int_in(1, _MAX_SEQ_LEN)
amax_history_type = _int_in(1, _MAX_AMAX_HISTORY)
seed_type = _int_in(-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed takes


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return v


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="fp8ext-train", description=_DESCRIPTION,
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--use_fp8", action="store_true",
                   help="run the blocks' linear layers in FP8 (E4M3 forward, E5M2 gradients); raises on a GPU "
                        "without FP8 tensor cores; emulated (exact casts, float32 products) on a CPU")
    p.add_argument("--fp8_recipe", choices=["delayed", "current", "block", "rowwise"], default="delayed",
                   help="delayed: scales from an amax history (HYBRID, 'max'); current: from each tensor's own amax; "
                        "block: Float8BlockScaling (1x128 activation and gradient tiles, 128x128 weight blocks, E4M3, "
                        "power-of-two scales); rowwise: Float8RowwiseScaling (one scale per row, E4M3)")
    p.add_argument("--amax_history_len", type=amax_history_type, default=16,
                   help=f"delayed scaling: steps of amax history (1 to {_MAX_AMAX_HISTORY})")
    p.add_argument("--fp8_attention", action="store_true",
                   help="with --use_fp8 and the delayed or current recipe: attention in FP8 too (the recipe's "
                        "fp8_dpa; cuDNN's FP8 fused attention on a GPU, which needs `pip install "
                        "nvidia-cudnn-frontend` and, to train, head_dim 128 (the 1b preset); an emulation on a CPU)")
    p.add_argument("--fp8_attention_backward", choices=["high_precision", "fp8"], default=None,
                   help="with --fp8_attention: its backward in high precision (bf16 on a GPU; the default: the 1b "
                        "preset diverged with the FP8 backward) or in FP8 (dO, dS and dQ/dK/dV in E5M2, Transformer "
                        "Engine's default)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--separate_qkv", action="store_true", help="three Q/K/V projections instead of one fused")
    p.add_argument("--no_fused_kernels", action="store_true",
                   help="on a GPU, run RMSNorm, RoPE and SwiGLU as torch's ops instead of fp8ext's fused kernels")
    p.add_argument("--batch_size", type=positive_int, default=8, help="sequences per micro-batch per device")
    p.add_argument("--grad_accum_steps", type=positive_int, default=1)
    p.add_argument("--seq_len", type=seq_len_type, default=64,
                   help=f"tokens (bytes) per sequence, 1 to {_MAX_SEQ_LEN}, fewer than the validation text has")
    p.add_argument("--max_steps", type=positive_int, default=300, help="optimizer steps")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate (AdamW; warm-up, then cosine)")
    p.add_argument("--weight_decay", type=nonnegative_float, default=0.1)
    p.add_argument("--data", default=None,
                   help="a text file or a directory of them; default: this Python's standard-library sources")
    p.add_argument("--out_dir", default="runs/latest", help="metrics.jsonl and checkpoint.pt go here")
    p.add_argument("--resume", default=None, help="a checkpoint file or a run directory to continue from")
    p.add_argument("--save_every", type=nonnegative_int, default=0,
                   help="also checkpoint every N steps (0: at the end only)")
    p.add_argument("--no_save", action="store_true", help="write no checkpoint (benchmark runs)")
    p.add_argument("--stop_after", type=nonnegative_int, default=0,
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
    p.add_argument("--seed", type=seed_type, default=0)
    p.add_argument("--eval_every", type=positive_int, default=100,
                   help="validation loss every N steps (and at the end)")
    p.add_argument("--eval_batches", type=positive_int, default=8)
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu; default: cuda when there is one")
    p.add_argument("--compare", action="store_true",
                   help="train twice, high precision into OUT_DIR/bf16 (OUT_DIR/fp32 on a CPU) and FP8 into "
                        "OUT_DIR/fp8, then print the comparison")
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    add_debug(p)
    return p
