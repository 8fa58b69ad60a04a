"""The command lines' errors: a wrong argument, a missing or damaged file, a full disk end `python -m fp8ext.train`
(and compare, validate) with one line on stderr that names the argument or the file, and a non-zero exit status;
nothing half-runs and reports success. --debug shows the traceback instead."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from fp8ext.train import checkpoint, cli, compare

RUN = ["--preset", "tiny", "--batch_size", "2", "--seq_len", "16", "--eval_batches", "1", "--no_progress",
       "--device", "cpu"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> pathlib.Path:
    """A small corpus (tens of kB), so that a run reads it in no time."""
    f = tmp_path_factory.mktemp("data") / "text.txt"
    f.write_text(pathlib.Path(__file__).read_text() * 4)
    return f


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text) -> pathlib.Path:
    """A run directory with a genuine checkpoint at step 2 of 4."""
    out = tmp_path_factory.mktemp("run")
    cli.main(RUN + ["--data", str(text), "--max_steps", "4", "--stop_after", "2", "--out_dir", str(out)])
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 2
    return out


def fails(capsys, argv, code=None) -> str:
    """cli.main(argv) must fail: the one line it writes on stderr (nothing else there, no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code not in (0, None), "the command reported success"
    if code is not None:
        assert e.value.code == code
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("fp8ext-train: error: ") and "Traceback" not in err, lines[0]
    return lines[0]


BAD_ARGUMENTS = [
    (["--batch_size", "0"], "--batch_size"),
    (["--batch_size", "-1"], "--batch_size"),
    (["--seq_len", "0"], "--seq_len"),
    (["--seq_len", str(2**21 + 1)], "--seq_len"),  # longer than any model config takes
    (["--grad_accum_steps", "0"], "--grad_accum_steps"),
    (["--max_steps", "-5"], "--max_steps"),
    (["--max_steps", "0"], "--max_steps"),
    (["--eval_every", "0"], "--eval_every"),
    (["--eval_batches", "0"], "--eval_batches"),
    (["--amax_history_len", "0"], "--amax_history_len"),
    (["--amax_history_len", "100000"], "--amax_history_len"),
    (["--save_every", "-1"], "--save_every"),
    (["--stop_after", "-2"], "--stop_after"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "-0.001"], "--lr"),
    (["--lr", "abc"], "--lr"),
    (["--weight_decay", "-0.1"], "--weight_decay"),
    (["--seed", str(2**64)], "--seed"),
]


@pytest.mark.parametrize("extra, name", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_a_wrong_argument_is_refused_in_one_line_naming_it(tmp_path, capsys, extra, name):
    line = fails(capsys, RUN + ["--max_steps", "2", "--out_dir", str(tmp_path / "out")] + extra, code=2)
    assert f"argument {name}:" in line, line
    assert not (tmp_path / "out").exists(), "nothing ran"


PATH_CASES = ["out_dir_is_a_file", "out_dir_under_a_file", "resume_missing", "data_missing", "device_bogus",
              "device_mps", "device_cuda_without_one"]


@pytest.mark.parametrize("case", PATH_CASES)
def test_a_wrong_path_or_device_is_refused_in_one_line_naming_it(tmp_path, capsys, case):
    (tmp_path / "file").write_text("x")
    out = ["--out_dir", str(tmp_path / "out")]
    extra, names = {
        "out_dir_is_a_file": (["--out_dir", str(tmp_path / "file")], ["--out_dir", str(tmp_path / "file")]),
        "out_dir_under_a_file": (["--out_dir", str(tmp_path / "file" / "run")], ["--out_dir", str(tmp_path / "file")]),
        "resume_missing": (out + ["--resume", str(tmp_path / "none")], ["--resume", str(tmp_path / "none")]),
        "data_missing": (out + ["--data", str(tmp_path / "none.txt")], ["--data", str(tmp_path / "none.txt")]),
        "device_bogus": (out + ["--device", "bogus"], ["--device", "bogus"]),
        "device_mps": (out + ["--device", "mps"], ["--device", "mps"]),
        "device_cuda_without_one": (out + ["--device", "cuda"], ["--device cuda"]),
    }[case]
    if case == "device_cuda_without_one" and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    line = fails(capsys, RUN + ["--max_steps", "2"] + extra, code=1)
    assert all(n in line for n in names), line
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_debug_shows_the_traceback(tmp_path):
    """Without --debug the same error is one line (the tests above); with it, the whole traceback."""
    r = subprocess.run([sys.executable, "-m", "fp8ext.train", *RUN, "--max_steps", "2", "--out_dir", str(tmp_path),
                        "--device", "bogus", "--debug"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback (most recent call last)" in r.stderr, r.stderr
    assert "ValueError: --device: 'bogus' is not a device" in r.stderr, r.stderr


def test_data_without_text_or_shorter_than_a_sequence_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "empty.txt").write_bytes(b"")
    line = fails(capsys, RUN + ["--max_steps", "2", "--out_dir", str(tmp_path / "o"),
                                "--data", str(tmp_path / "empty.txt")], code=1)
    assert "--data" in line and str(tmp_path / "empty.txt") in line, line
    (tmp_path / "short.txt").write_text("x" * 200)  # 10 bytes of validation text: no sequence of 16 + 1
    line = fails(capsys, RUN + ["--max_steps", "2", "--out_dir", str(tmp_path / "o"),
                                "--data", str(tmp_path / "short.txt")], code=1)
    assert "--seq_len 16" in line and "10 bytes" in line, line
    assert not (tmp_path / "o" / "checkpoint.pt").exists()


# ---- --resume: damaged checkpoints, and checkpoints out of range -------------------------------------------------

def _damaged(trained: pathlib.Path, tmp_path: pathlib.Path, case: str) -> pathlib.Path:
    good = (trained / "checkpoint.pt").read_bytes()
    path = tmp_path / "bad" / "checkpoint.pt"
    path.parent.mkdir()
    if case in ("truncated", "empty", "garbage"):
        path.write_bytes({"truncated": good[:len(good) // 2], "empty": b"",
                          "garbage": b"this is not a checkpoint " * 40}[case])
        return path
    state = torch.load(trained / "checkpoint.pt", weights_only=True)
    state["args"] = dict(state["args"])
    if case.startswith("step"):
        state["step"] = {"step_huge": 10**30, "step_negative": -5, "step_float": 2.0, "step_text": "2"}[case]
    else:
        key, value = {"seq_len_text": ("seq_len", "abc"), "seq_len_list": ("seq_len", [16]),
                      "seq_len_zero": ("seq_len", 0), "lr_nan": ("lr", float("nan")),
                      "preset_unknown": ("preset", "huge"), "args_list": (None, None)}[case]
        if key is None:
            state["args"] = ["--preset", "tiny"]
        else:
            state["args"][key] = value
    torch.save(state, path)
    return path


RESUME_CASES = {
    "truncated": "truncated, damaged or not a file torch.save wrote",
    "empty": "is empty",
    "garbage": "truncated, damaged or not a file torch.save wrote",
    "step_huge": "is at step 1000000000000000000000000000000, past --max_steps 4",
    "step_negative": "its step is -5, not an integer >= 0",
    "step_float": "its step is 2.0, not an integer >= 0",
    "step_text": "its step is '2', not an integer >= 0",
    "seq_len_text": "its args['seq_len'] is 'abc' (expected an integer, got a str)",
    "seq_len_list": "its args['seq_len'] is [16] (expected an integer, got a list)",
    "seq_len_zero": "its args['seq_len'] is 0 (expected an integer from 1",
    "lr_nan": "its args['lr'] is nan (expected a finite number",
    "preset_unknown": "its args['preset'] is 'huge' (expected one of",
    "args_list": "its args are a list, not the dict of the training run's options",
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_refuses_a_damaged_or_out_of_range_checkpoint_naming_the_file(trained, text, tmp_path, capsys, case):
    bad = _damaged(trained, tmp_path, case)
    out = tmp_path / "out"
    line = fails(capsys, RUN + ["--data", str(text), "--max_steps", "4", "--out_dir", str(out),
                                "--resume", str(bad.parent)], code=1)
    assert f"--resume: {bad}" in line and RESUME_CASES[case] in line, line
    assert not (out / "checkpoint.pt").exists() and not (out / "metrics.jsonl").exists(), "nothing was trained"


def test_resume_refuses_a_checkpoint_of_another_model_by_name(trained, text, tmp_path, capsys):
    line = fails(capsys, RUN + ["--data", str(text), "--max_steps", "4", "--out_dir", str(tmp_path),
                                "--separate_qkv", "--resume", str(trained)], code=1)
    assert f"{trained / 'checkpoint.pt'} holds a model trained with no --separate_qkv; this run has " \
           "--separate_qkv: another model" in line, line


def test_resume_at_the_last_step_still_finishes_without_training(trained, text, tmp_path, capsys):
    """The edge of the step's range: a checkpoint at step == --max_steps is a finished run, not an error."""
    cli.main(RUN + ["--data", str(text), "--max_steps", "2", "--out_dir", str(tmp_path), "--resume", str(trained)])
    assert "done at step 2" in capsys.readouterr().out


# ---- saving ------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ as on Linux")
def test_a_full_disk_while_saving_names_the_file_and_keeps_the_last_checkpoint(trained, text, tmp_path):
    """A file-size limit makes every write past 300 kB fail (EFBIG), as a full disk does (ENOSPC): torch.save
    then raises "unexpected pos". The resumed run must fail naming the checkpoint, leave the previous one as it
    was and no checkpoint.tmp behind."""
    import resource
    import shutil
    import signal
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = (run / "checkpoint.pt").read_bytes()

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    r = subprocess.run([sys.executable, "-m", "fp8ext.train", *RUN, "--data", str(text), "--max_steps", "4",
                        "--out_dir", str(run), "--resume", str(run)], preexec_fn=small_files,
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"could not write the checkpoint {run / 'checkpoint.pt'}" in lines[0], lines[0]
    assert "is the last complete checkpoint, unchanged" in lines[0], lines[0]
    assert (run / "checkpoint.pt").read_bytes() == before, "the previous checkpoint is intact"
    assert not (run / "checkpoint.tmp").exists(), "the half-written file is removed"


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(str(tmp_path), model, opt, 1, {})
    before = (tmp_path / "checkpoint.pt").read_bytes()

    def full_disk(obj, f):
        f.write(b"the first bytes")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    with pytest.raises(OSError, match=r"could not write the checkpoint .*checkpoint\.pt .*unexpected pos"):
        checkpoint.save(str(tmp_path), model, opt, 2, {})
    assert (tmp_path / "checkpoint.pt").read_bytes() == before
    assert not (tmp_path / "checkpoint.tmp").exists()


# ---- compare, validate ---------------------------------------------------------------------------------------------

def _fake_run(d: pathlib.Path, precision: str, val_loss: float, tokens_per_s: float) -> str:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text(f'{{"step": 1, "loss": 5.0, "val_loss": {val_loss}}}\n')
    (d / "run.json").write_text(f'{{"precision": "{precision}", "tokens_per_s": {tokens_per_s}, '
                                '"device_name": "cpu"}')
    return str(d)


def test_compare_names_the_runs_it_compares(tmp_path, capsys):
    a = _fake_run(tmp_path / "x" / "fp32", "fp32", 2.0, 100.0)
    b = _fake_run(tmp_path / "x" / "fp8", "fp8", 2.2, 50.0)
    compare.compare(a, b)
    out = capsys.readouterr().out
    assert f"validation loss of fp8 ({b}) vs fp32 ({a}): +10.00%" in out, out
    assert f"tokens/s of fp8 ({b}) / fp32 ({a}): 0.50x" in out, out
    assert "B vs A" not in out and "B / A" not in out


def test_compare_command_fails_in_one_line_naming_the_folder(tmp_path, capsys):
    a = _fake_run(tmp_path / "a", "fp32", 2.0, 100.0)
    with pytest.raises(SystemExit) as e:
        compare.main([a, str(tmp_path / "missing"), "--plot", ""])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.splitlines()) == 1 and str(tmp_path / "missing") in err, err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("not json\n")
    with pytest.raises(SystemExit):
        compare.main([a, str(tmp_path / "b"), "--plot", ""])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{tmp_path / 'b' / 'metrics.jsonl'} line 1 is not JSON" in err, err


def test_validate_titles_name_the_baseline_that_ran(tmp_path):
    from fp8ext.validate import titles
    from fp8ext.validate._report import section_status
    from fp8ext.validate._run import Run
    cpu, gpu = titles(on_gpu=False), titles(on_gpu=True)
    for section in ("block", "train", "inference"):
        assert cpu[section].endswith("against float32") and gpu[section].endswith("against bf16"), section
        assert "bf16" not in cpu[section]
    run = Run(device=torch.device("cpu"), quick=True, profile=False, out_dir=str(tmp_path), sections=["train"])
    assert section_status(run, "train")["title"] == "Training steps: FP8 against float32"


def test_validate_refuses_a_report_path_that_is_a_file_in_one_line(tmp_path, capsys):
    from fp8ext.validate import main
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit) as e:
        main(["--report", str(tmp_path / "f")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--report" in err and str(tmp_path / "f") in err
