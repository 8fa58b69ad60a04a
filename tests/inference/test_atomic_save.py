"""Saving over a checkpoint never loses it: save_quantized (and `python -m fp8ext.inference quantize --out`) write
every file into a hidden folder in the output folder and rename them into place only once all are complete, so a
write that fails midway (a full disk, a quota, a kill) leaves the previous checkpoint byte for byte as it was, and
loadable; a save that succeeds replaces it; neither leaves temporary files behind."""
import errno
import json
import os
import pathlib

import pytest
import safetensors.torch
import torch
from torch import nn

from fp8ext import inference
from fp8ext.inference import export
from fp8ext.models.transformer import Transformer, TransformerConfig, preset


def factory(cfg):
    return Transformer(TransformerConfig(**cfg))


class TwoLinears(nn.Module):
    """A model that is not fp8ext's Transformer (saved by save_quantized's general path, not as a Llama)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.b(self.a(x))


def quantized(kind, seed):
    torch.manual_seed(seed)
    if kind == "transformer":
        model = Transformer(preset("tiny"))
        batches = [torch.randint(0, 256, (2, 16))]
    else:
        model = TwoLinears()
        batches = [torch.randn(4, 64)]
    inference.calibrate(model, batches, progress=False)
    inference.quantize_model(model, "channel", "static", progress=False)
    return model


def snapshot(d: pathlib.Path) -> dict:
    """Every file under d (hidden ones and folders included) -> its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else None for p in sorted(d.rglob("*"))}


def failing_save_file(monkeypatch, after: int = 0):
    """safetensors' save_file writes part of its file, then fails as a full disk does (after `after` good calls)."""
    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) > after:
            with open(filename, "wb") as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", filename)
        return real(tensors, filename, metadata=metadata)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.parametrize("kind", ["transformer", "two linears"])
@pytest.mark.parametrize("shards", [False, True])
def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, kind, shards):
    out = tmp_path / "out"
    size = {"max_shard_size": 4_000} if shards else {}
    inference.save_quantized(quantized(kind, 0), out, **size)
    (out / "notes.txt").write_text("the user's own file")
    before = snapshot(out)
    failing_save_file(monkeypatch, after=1 if shards else 0)  # sharded: the second shard fails
    with pytest.raises(OSError, match="No space left on device"):
        inference.save_quantized(quantized(kind, 1), out, **size)
    monkeypatch.undo()
    assert snapshot(out) == before, "the previous checkpoint's files byte for byte, and no temporary files"
    if kind == "transformer":
        loaded = inference.load_quantized(out, factory, device="cpu")
        ids = torch.randint(0, 256, (1, 8))
        assert torch.equal(loaded(ids), inference.load_quantized(out, factory, device="cpu")(ids))


@pytest.mark.parametrize("first, second", [({}, {}), ({"max_shard_size": 4_000}, {}), ({}, {"max_shard_size": 4_000})])
def test_a_save_over_a_checkpoint_replaces_it_and_leaves_nothing_else(tmp_path, first, second):
    out = tmp_path / "out"
    inference.save_quantized(quantized("transformer", 0), out, **first)
    (out / "notes.txt").write_text("the user's own file")
    model = quantized("transformer", 1)
    inference.save_quantized(model, out, **second)
    files = sorted(p.name for p in out.iterdir())
    if second:
        assert files[:1] == ["config.json"] and files[-2:] == ["model.safetensors.index.json", "notes.txt"]
        assert all(f.startswith("model-") for f in files[1:-2]) and len(files) > 4
    else:
        assert files == ["config.json", "model.safetensors", "notes.txt"], "the old shards and index are removed"
    loaded = inference.load_quantized(out, factory, device="cpu")
    ids = torch.randint(0, 256, (1, 8))
    assert torch.equal(loaded(ids), model(ids)), "the new checkpoint's model"


@pytest.mark.parametrize("failing", [2, 3])
def test_a_rename_that_fails_puts_the_previous_files_back(tmp_path, monkeypatch, failing):
    """Once written, the files are renamed into place one by one; when a rename fails, those already moved are put
    back (here: the shards of the new save, or the new weights without their config.json)."""
    out = tmp_path / "out"
    inference.save_quantized(quantized("transformer", 0), out, max_shard_size=40_000)
    before = snapshot(out)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == failing:
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="Input/output error"):
        inference.save_quantized(quantized("transformer", 1), out, **({} if failing == 2 else
                                                                       {"max_shard_size": 40_000}))
    monkeypatch.undo()
    assert snapshot(out) == before


def test_a_failed_save_into_a_new_folder_leaves_no_folder(tmp_path, monkeypatch):
    failing_save_file(monkeypatch)
    with pytest.raises(OSError):
        inference.save_quantized(quantized("transformer", 0), tmp_path / "new")
    assert list(tmp_path.iterdir()) == []


def test_an_output_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=f"{tmp_path / 'file'} exists and is not a folder"):
        inference.save_quantized(quantized("transformer", 0), tmp_path / "file" / "out")


def test_write_json_replaces_a_file_only_once_it_is_complete(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text('{"old": true}')

    def fsync(fd):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="quota"):
        export.write_json(path, {"new": True})
    monkeypatch.undo()
    assert path.read_text() == '{"old": true}' and [p.name for p in tmp_path.iterdir()] == ["config.json"]
    export.write_json(path, {"new": True})
    assert json.loads(path.read_text()) == {"new": True} and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_quantize_command_that_fails_midway_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    from fp8ext.inference.__main__ import main
    run = tmp_path / "run"
    run.mkdir()
    text = tmp_path / "text.txt"
    text.write_bytes(b"def f(x):\n    return x + 1\n" * 400)
    torch.manual_seed(0)
    torch.save({"model": Transformer(preset("tiny")).state_dict(), "optimizer": {}, "step": 0, "rng": {},
                "args": {"preset": "tiny", "seq_len": 32, "data": str(text)}}, run / "checkpoint.pt")
    out = tmp_path / "fp8"
    command = ["quantize", "--checkpoint", str(run), "--calib_batches", "1", "--batch_size", "2", "--out", str(out),
               "--device", "cpu"]
    assert main(command) == 0
    before = snapshot(out)
    assert json.loads((out / "config.json").read_text())["fp8ext_source"]["training_checkpoint"].endswith(
        "checkpoint.pt")
    failing_save_file(monkeypatch)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(command + ["--weights", "tensor"])
    monkeypatch.undo()
    err = capsys.readouterr().err  # the progress bars, then one line
    assert exit_.value.code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("python -m fp8ext.inference quantize: error: ") and \
        "No space left on device" in err.strip().splitlines()[-1], err
    assert snapshot(out) == before
    assert main(command + ["--weights", "tensor"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == "tensor"
    assert "fp8ext_source" in cfg and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
