"""Durable file writes shared by fp8ext.train's checkpoints and fp8ext.inference's exports: a file is written beside
its final name, flushed to the disk and renamed over it (one os.replace), so that a crash, a full disk or Ctrl-C at
any point leaves the previous file or the new one, never a truncated file under the final name.

    with atomic_write(path, "wb", tmp_name="checkpoint.tmp") as f:
        torch.save(state, f)
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from typing import IO, Iterator, Optional, Union

__all__ = ["atomic_write", "fsync"]


def fsync(path: Union[str, pathlib.Path]) -> None:
    """Flushes a file, or a folder's entries (which makes a rename in it durable), to the disk. A file system that
    cannot (Windows cannot open a folder; some file systems refuse fsync on one: EINVAL) is left as it is: the
    write or rename itself has happened either way."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if os.path.isdir(path) else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: Union[str, pathlib.Path], mode: str = "x",
                 tmp_name: Optional[str] = None) -> Iterator[IO]:
    """The file object of a temporary file beside `path` (named tmp_name, default a hidden name of its own; opened
    with `mode`, "x"/"xb" or "w"/"wb"). When the block ends, the file is flushed and fsync'ed, renamed over `path`
    (os.replace) and the folder fsync'ed. If the block, the flush or the rename raises, the temporary file is
    removed and the exception passes: `path` is as it was."""
    path = pathlib.Path(path)
    tmp = path.with_name(tmp_name or f".{path.name}.partial-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync(path.parent)
