"""What every fp8ext command line shares: argument types that refuse bad values where they are parsed, and one
line on stderr (not a traceback) when a command fails; `--debug` shows the traceback.

    p = OneLineParser(prog="python -m fp8ext.train")
    p.add_argument("--batch_size", type=positive_int, default=8)
    add_debug(p)
    args = p.parse_args(argv)
    with one_line_errors(p.prog, args.debug):
        run(args)

A failure ends the process with SystemExit(1) and the line "PROG: error: MESSAGE"; argparse's own usage errors
keep exit status 2. KeyboardInterrupt is reported in one line too (exit 130).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from typing import Iterator

__all__ = ["OneLineParser", "positive_int", "nonnegative_int", "finite_float", "nonnegative_float", "device_type",
           "usable_device", "add_debug", "one_line_errors"]


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a wrong argument reported in one line on stderr ("PROG: error: MESSAGE", exit status 2)
    instead of the usage text and the message; --help still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (--help lists the options)\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def finite_float(text: str) -> float:
    """argparse type: a finite float (no nan, inf)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def nonnegative_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    v = finite_float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def device_type(text: str) -> str:
    """argparse type: a device torch spells, cpu or cuda (cuda, cuda:N); whether it is there is checked when the
    command runs (usable_device)."""
    import torch
    try:
        d = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if d.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"fp8ext runs on cpu or cuda, got {text!r}")
    return text


def usable_device(text, default: str):
    """The torch.device of --device `text` (`default` when not given), if this torch can use it; else a ValueError
    saying why (a CPU-only build, no CUDA device, an index past the devices)."""
    import torch
    try:
        d = torch.device(text or default)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device: {text!r} is not a device; expected cpu, cuda or cuda:N") from None
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"--device: {text!r}: fp8ext runs on cpu or cuda, not {d.type}")
    if d.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if not torch.version.cuda else "torch sees no CUDA device"
            raise ValueError(f"--device {text or default}: {why}; use --device cpu (or leave --device out)")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: torch sees {torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                             f"cuda:{torch.cuda.device_count() - 1}")
    return d


def add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", help="on an error, print the whole traceback, not one line")


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())  # a message over several lines becomes one
    name = type(e).__name__
    # Errors fp8ext raises for bad input say what was wrong in their message; others keep their type's name.
    if not msg:
        return name
    if name in ("ValueError", "TypeError", "RuntimeError", "CheckpointError", "HFModelError", "LoadError",
                "FileNotFoundError", "IsADirectoryError", "NotADirectoryError", "PermissionError", "OSError"):
        return msg
    return f"{name}: {msg}"


@contextlib.contextmanager
def one_line_errors(prog: str, debug: bool = False) -> Iterator[None]:
    """Turns any exception raised inside into one line "PROG: error: MESSAGE" on stderr and exit status 1
    (130 for Ctrl-C); with debug, re-raises it unchanged. SystemExit passes through."""
    try:
        yield
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:  # noqa: BLE001 - the point: no traceback for a user's error, unless --debug
        if debug:
            raise
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        raise SystemExit(1) from None
