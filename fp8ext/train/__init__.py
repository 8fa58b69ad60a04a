"""Training with fp8ext: `python -m fp8ext.train` (or `fp8ext-train`) trains the dense transformer of
fp8ext.models.transformer in bf16 or FP8 on byte-level text; `python -m fp8ext.train.compare A B` compares two
runs. See fp8ext/train/cli.py for the arguments."""

__all__ = ["main"]


def main(argv=None) -> int:
    from .cli import main as _main
    return _main(argv)
