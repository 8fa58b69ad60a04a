"""Training checkpoints as files: read without running code from them (the resume, quantize and eval commands
refuse a file that would), written durably (fsync before the rename), and a half-written one cleaned up."""
import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest
import torch

from fp8ext import inference
from fp8ext.models.transformer import Transformer, preset
from fp8ext.train import checkpoint, cli

RUN = ["--preset", "tiny", "--batch_size", "4", "--seq_len", "32", "--eval_batches", "2", "--no_progress",
       "--device", "cpu"]


class _TouchesAFile:
    """Unpickling it creates a file: what a crafted checkpoint could do instead (run any code)."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def crafted_checkpoint(run_dir: pathlib.Path, marker: pathlib.Path) -> pathlib.Path:
    """run_dir/checkpoint.pt with every key a checkpoint has, and a model entry that touches `marker` when loaded."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / checkpoint.CHECKPOINT_NAME
    torch.save({"model": _TouchesAFile(marker), "optimizer": {}, "step": 1,
                "args": {"preset": "tiny", "seq_len": 32}, "rng": {"torch": torch.get_rng_state(), "cuda": None}},
               path)
    return path


def quantized_dir_naming(out: pathlib.Path, training_checkpoint: pathlib.Path) -> pathlib.Path:
    """A genuine quantized model directory whose config.json names `training_checkpoint` as its source."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).to(torch.bfloat16)
    inference.quantize_model(model, "channel", "dynamic")
    inference.save_quantized(model, out)
    info = json.loads((out / "config.json").read_text())
    info["fp8ext_source"] = {"training_checkpoint": str(training_checkpoint), "seq_len": 32, "data": None}
    (out / "config.json").write_text(json.dumps(info))
    return out


@pytest.mark.parametrize("command", ["train_resume", "inference_quantize", "inference_eval"])
def test_commands_refuse_a_checkpoint_that_would_run_code_and_name_it(tmp_path, command):
    marker = tmp_path / "code_ran"
    bad = crafted_checkpoint(tmp_path / "run", marker)
    if command == "train_resume":
        args = ["fp8ext.train", *RUN, "--max_steps", "2", "--out_dir", str(tmp_path / "out"),
                "--resume", str(tmp_path / "run")]
    elif command == "inference_quantize":
        args = ["fp8ext.inference", "quantize", "--checkpoint", str(tmp_path / "run"), "--calib_batches", "1",
                "--out", str(tmp_path / "q"), "--device", "cpu"]
    else:
        q = quantized_dir_naming(tmp_path / "q", bad)
        args = ["fp8ext.inference", "eval", "--model", str(q), "--eval_batches", "1", "--device", "cpu"]
    r = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "loading the checkpoint ran code from it"
    assert r.returncode != 0, "the command succeeded on a checkpoint it cannot load safely"
    assert str(bad) in r.stderr and "not a checkpoint fp8ext can load safely" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, "a one-line error, not a traceback"


def test_read_refuses_a_file_that_is_not_a_training_checkpoint_and_says_what_it_lacks(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "step": 3}, tmp_path / "partial.pt")
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"--resume: .*partial\.pt is not an fp8ext.train checkpoint: it holds a dict without "
                             r"optimizer, args, rng"):
        checkpoint.read(str(tmp_path / "partial.pt"))
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(checkpoint.CheckpointError, match=r"list\.pt is not an fp8ext.train checkpoint: it holds a list"):
        checkpoint.read(str(tmp_path / "list.pt"))


def test_genuine_checkpoint_reads_back_equal_to_what_was_saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    checkpoint.save(str(tmp_path), model, opt, 5, {"preset": "tiny", "data": None, "lr": 1e-3})
    path, state = checkpoint.read(str(tmp_path))
    assert path == tmp_path / checkpoint.CHECKPOINT_NAME and state["step"] == 5
    assert state["args"] == {"preset": "tiny", "data": None, "lr": 1e-3}
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert torch.equal(state["optimizer"]["state"]["weight"]["exp_avg"], opt.state[model.weight]["exp_avg"])


def test_save_fsyncs_the_file_before_renaming_it_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_ino))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", pathlib.Path(src).name, pathlib.Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model = torch.nn.Linear(4, 4)
    checkpoint.save(str(tmp_path), model, torch.optim.AdamW(model.parameters()), 1, {})
    written = (tmp_path / checkpoint.CHECKPOINT_NAME).stat().st_ino  # a rename keeps the file's inode
    assert events[:2] == [("fsync", "file", written), ("replace", "checkpoint.tmp", "checkpoint.pt")], events
    if os.name == "posix":
        assert events[2:] == [("fsync", "dir", tmp_path.stat().st_ino)], "the directory holding the rename is synced"


def test_a_half_written_checkpoint_left_by_a_crash_is_removed_with_a_note(tmp_path, capsys):
    tmp_path.joinpath("checkpoint.tmp").write_bytes(b"the first bytes of a checkpoint")
    cli.main(RUN + ["--max_steps", "1", "--eval_every", "1", "--no_save", "--out_dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert not (tmp_path / "checkpoint.tmp").exists(), "the half-written file is gone"
    assert f"removed {tmp_path / 'checkpoint.tmp'}" in out, out
    assert json.loads((tmp_path / "run.json").read_text())["start_step"] == 0, "the run went on"
