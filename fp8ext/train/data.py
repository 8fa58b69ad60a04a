"""Byte-level training data that needs no download.

By default the corpus is the source code of the running Python's standard library (its .py files, sorted by
path; about 30 MB on CPython 3.11): real text with long-range structure, on every machine that runs Python.
`--data PATH` takes a text file or a directory of text files instead. Tokens are bytes (vocabulary 256).

Split, deterministic: of a directory (or the standard library) every 20th file in path order is validation;
a single file, or a directory of fewer than 20 files, gives its last 5 % of bytes to validation.

Batches are drawn at random offsets by a generator seeded from (seed, step, micro-batch, rank), so a run
resumed from a checkpoint at step k reads exactly the batches the uninterrupted run read.
"""

from __future__ import annotations

import os
import pathlib
import sysconfig
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

__all__ = ["ByteCorpus", "load_corpus", "batch", "VAL_EVERY"]

VAL_EVERY = 20  # every 20th file is validation


@dataclass
class ByteCorpus:
    train: torch.Tensor  # uint8, 1-D
    val: torch.Tensor  # uint8, 1-D
    description: str


def _files_of(root: pathlib.Path, suffix: Optional[str]) -> List[pathlib.Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [pathlib.Path(dirpath, f) for f in filenames if suffix is None or f.endswith(suffix)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _split_files(files: List[pathlib.Path], what: str) -> ByteCorpus:
    if not files:
        raise ValueError(f"--data: no files in {what}")
    chunks = [p.read_bytes() for p in files]
    if len(files) >= VAL_EVERY:
        train = b"\n".join(c for i, c in enumerate(chunks) if i % VAL_EVERY)
        val = b"\n".join(c for i, c in enumerate(chunks) if i % VAL_EVERY == 0)
    else:
        whole = b"\n".join(chunks)
        cut = len(whole) - max(1, len(whole) // 20)
        train, val = whole[:cut], whole[cut:]
    for part, data in (("training", train), ("validation", val)):
        if not data:
            raise ValueError(f"--data: {what} holds no {part} text ({sum(map(len, chunks))} bytes in "
                             f"{len(files)} file{'s' if len(files) != 1 else ''}); give it more text")
    return ByteCorpus(torch.frombuffer(bytearray(train), dtype=torch.uint8),
                      torch.frombuffer(bytearray(val), dtype=torch.uint8),
                      f"{what}: {len(files)} files, {len(train) / 1e6:.1f} MB train, {len(val) / 1e6:.2f} MB val")


def load_corpus(path: Optional[str] = None) -> ByteCorpus:
    """The standard library's sources (path None), a text file, or every file under a directory."""
    if path is None:
        root = pathlib.Path(sysconfig.get_paths()["stdlib"])
        return _split_files(_files_of(root, ".py"), f"Python {sysconfig.get_python_version()} standard library")
    p = pathlib.Path(path)
    if p.is_dir():
        return _split_files(_files_of(p, None), str(p))
    if p.is_file():
        return _split_files([p], str(p))
    raise FileNotFoundError(f"--data: {path} is neither a file nor a directory")


def batch(data: torch.Tensor, batch_size: int, seq_len: int, seed: int, step: int, micro: int = 0, rank: int = 0,
          device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), int64 [batch_size, seq_len] each, from random offsets of `data` chosen by a generator
    seeded from (seed, step, micro, rank): the same arguments always give the same batch."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"the corpus ({data.numel()} bytes) is shorter than seq_len + 1 ({seq_len + 1})")
    key = (((seed * 1_000_003 + step) * 1009 + micro) * 65_537 + rank) % (1 << 63)  # any seed: manual_seed
    g = torch.Generator().manual_seed(key)                                             # takes 63 bits
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    tokens = data[idx].long()
    if device is not None and torch.device(device).type != "cpu":
        tokens = tokens.pin_memory().to(device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]
