"""The files of an FP8 checkpoint on disk (fp8ext.inference.export's format): the tensors written to
model.safetensors or to shards with their index, every file of a save staged in a hidden folder and renamed into
place once all are complete, JSON written atomically; and the tensors read back (onto a device, aligned) into a
model."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Dict, Iterator, Union

import torch
from torch import nn

from .._io import atomic_write, fsync
from ..core.build import VERSION
from ._header import read_header, read_sharded_header

__all__ = ["WEIGHTS_FILE", "INDEX_FILE", "write_tensors", "staged", "write_json", "read_tensors", "aligned",
           "load_state", "checkpoint_header"]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> file, as save_pretrained's
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportError("fp8ext.inference: save_quantized/load_quantized need safetensors: "
                          "pip install safetensors (or fp8ext[inference])") from None
    return st


def _bytes(size: Union[int, str]) -> int:
    """max_shard_size in bytes: an int, or a number with a unit (KB, MB, GB; KiB, MiB, GiB)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        for unit in sorted(_UNITS, key=len, reverse=True):
            number = text[:-len(unit)]
            if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
                return int(float(number) * _UNITS[unit])
    raise ValueError(f"save_quantized(): max_shard_size must be a positive number of bytes or a size such as '5GB', "
                     f"got {size!r}")


def write_tensors(tensors: Dict[str, torch.Tensor], out_dir: Union[str, pathlib.Path], record: Dict[str, Any],
                  max_shard_size: Union[int, str]) -> pathlib.Path:
    """out_dir (made if missing; the folder `staged` gives, when saving) with model.safetensors, or shards of at
    most max_shard_size bytes (a larger tensor alone in its shard) and the index; fp8ext's `record` in the
    header's metadata. Returns out_dir as a Path."""
    st = _safetensors()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "producer": f"fp8ext {VERSION}", "fp8ext": json.dumps(record)}
    limit = _bytes(max_shard_size)
    shards, size = [[]], 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    if len(shards) == 1:
        st.save_file(tensors, str(out / WEIGHTS_FILE), metadata=meta)
        return out
    weight_map = {}
    for i, names in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        st.save_file({k: tensors[k] for k in names}, str(out / name), metadata=meta)
        weight_map.update(dict.fromkeys(names, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out


def _checkpoint_files(d: pathlib.Path) -> list:
    """The files of a checkpoint in `d` that a save replaces or removes: weights, shards, index, config.json."""
    return [d / WEIGHTS_FILE, d / INDEX_FILE, d / "config.json", *sorted(d.glob("model-*-of-*.safetensors"))]


@contextlib.contextmanager
def staged(out_dir: Union[str, pathlib.Path]) -> Iterator[pathlib.Path]:
    """A new, empty hidden folder in out_dir (made if missing), on out_dir's file system, to write a checkpoint's
    files into. When the block ends, the files are flushed to the disk and moved into out_dir, each by one rename
    (os.replace) over the file of that name, config.json last; then the checkpoint files of an earlier save that
    the new one does not have (other shards, an index or model.safetensors) are removed. out_dir's other files are
    left alone. If the block raises (a full disk, a quota, Ctrl-C), the folder is removed (and out_dir too, if
    this made it); if a rename fails, the files already moved are put back (the previous ones were kept as hard
    links until then): a failed save never costs the previous checkpoint."""
    out = pathlib.Path(out_dir)
    for existing in (out, *out.parents):  # the nearest part of out_dir that exists must be a folder
        if existing.exists():
            if not existing.is_dir():
                raise NotADirectoryError(f"save_quantized: {existing} exists and is not a folder"
                                         + ("" if existing == out else f" (so {out} cannot be one)"))
            break
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".fp8ext-partial-", dir=out))
    done = False
    try:
        yield tmp
        new = sorted(tmp.iterdir(), key=lambda f: (f.name == "config.json", f.name))  # config.json last
        for f in new:
            fsync(f)
        _swap_in(new, out, tmp)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made and not done:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if empty


def _swap_in(new: list, out: pathlib.Path, tmp: pathlib.Path) -> None:
    """staged's last step: the files `new` (in tmp) renamed into out, the previous checkpoint's other files removed;
    on any failure the previous files are put back from links to them kept in tmp/.previous."""
    previous = tmp / ".previous"
    previous.mkdir()
    old = [f for f in _checkpoint_files(out) if f.exists()]
    for f in old:  # a second name for each previous file (no copy), to put back
        try:
            os.link(f, previous / f.name)
        except OSError:  # a file system without hard links
            shutil.copy2(f, previous / f.name)
    stale = [f for f in old if not (tmp / f.name).exists()]
    moved = []
    try:
        for f in new:
            os.replace(f, out / f.name)
            moved.append(f.name)
        for f in stale:
            f.unlink(missing_ok=True)
        fsync(out)
    except BaseException:
        for name in [*moved, *(f.name for f in stale)]:  # best effort: the error that stopped the save is raised
            with contextlib.suppress(OSError):
                if (previous / name).exists():
                    os.replace(previous / name, out / name)
                else:
                    (out / name).unlink(missing_ok=True)
        raise


def write_json(path: Union[str, pathlib.Path], value: Any) -> None:
    """path as indented JSON, written beside it first and renamed over it (os.replace) once complete and flushed
    to the disk: a failed write leaves the file as it was."""
    with atomic_write(path) as f:
        f.write(json.dumps(value, indent=2))


def checkpoint_header(d: pathlib.Path):
    """The safetensors header of a checkpoint directory: model.safetensors's, or its shards' through the index."""
    return read_header(d / WEIGHTS_FILE) if (d / WEIGHTS_FILE).is_file() else read_sharded_header(d / INDEX_FILE)


def read_tensors(header, device) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint `header` describes (its file or its shards), read onto `device`."""
    st = _safetensors()
    state: Dict[str, torch.Tensor] = {}
    for path in sorted(set(header.files.values())):
        state.update(st.load_file(str(path), device=str(device)))
    return state


def aligned(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The tensors contiguous and 16-byte aligned, as cuBLASLt wants its operands (safetensors aligns tensors in a
    file to 8 bytes only); copies only those that are not."""
    return {k: v if v.data_ptr() % 16 == 0 and v.is_contiguous() else v.contiguous().clone()
            for k, v in state.items()}


def load_state(model: nn.Module, state: Dict[str, torch.Tensor], path: pathlib.Path) -> None:
    """state into `model` (assigned: the meta tensors are replaced); ValueError when the file at `path` lacks a
    tensor the model needs."""
    missing = [k for k in model.load_state_dict(state, strict=False, assign=True).missing_keys
               if not k.endswith("_extra_state")]  # high-precision fp8ext.Linear layers' FP8 state is not saved
    if missing:
        raise ValueError(f"load_quantized: {path} holds no {missing[:5]} for this model")
