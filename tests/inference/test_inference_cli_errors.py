"""`python -m fp8ext.inference` refuses a bad argument or a bad file in one line on stderr ("python -m
fp8ext.inference COMMAND: error: ..." naming the argument or the file; exit status 2 for an argument its parser
refuses, 1 for anything found when the command runs), with the whole traceback only under --debug; eval never
takes a reference model it was not given or told of, and names the reference by the dtype it computes in."""
import json
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8ext import inference
from fp8ext.inference.__main__ import main
from fp8ext.models.transformer import Transformer, preset

PROG = "python -m fp8ext.inference"


def training_run(d, preset_name="tiny", text=None):
    """A training checkpoint as fp8ext.train writes it (tiny, untrained), with its own small text to read."""
    d.mkdir(parents=True)
    if text is None:
        text = d / "text.txt"
        text.write_bytes(b"def f(x):\n    return x + 1\n" * 400)
    torch.manual_seed(0)
    torch.save({"model": Transformer(preset("tiny")).state_dict(), "optimizer": {}, "step": 0, "rng": {},
                "args": {"preset": preset_name, "seq_len": 32, "data": str(text)}}, d / "checkpoint.pt")
    return d


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A training run, its quantized directory (config.json names the run), and one saved from Python (names none)."""
    root = tmp_path_factory.mktemp("cli")
    run = training_run(root / "run")
    assert main(["quantize", "--checkpoint", str(run), "--calib_batches", "1", "--batch_size", "2", "--out",
                 str(root / "fp8"), "--device", "cpu"]) == 0
    torch.manual_seed(1)
    model = Transformer(preset("tiny"))
    inference.calibrate(model, [torch.randint(0, 256, (2, 16))], progress=False)
    inference.quantize_model(model, "channel", "dynamic", progress=False)
    inference.save_quantized(model, root / "from-python")
    return {"run": run, "fp8": root / "fp8", "from-python": root / "from-python", "root": root}


def base(command, files, tmp_path):
    return {"quantize": ["quantize", "--checkpoint", str(files["run"]), "--out", str(tmp_path / "out"),
                         "--calib_batches", "1", "--batch_size", "2"],
            "eval": ["eval", "--model", str(files["fp8"]), "--eval_batches", "1", "--batch_size", "2"],
            "generate": ["generate", "--model", str(files["fp8"]), "--prompt", "x", "--max_new_tokens", "2"],
            }[command] + ["--device", "cpu"]


def one_line_error(capsys, argv, code):
    """main(argv)'s exit status must be `code` and its stderr exactly one line "PROG COMMAND: error: ..."."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit_.value.code == code and len(lines) == 1, f"exit {exit_.value.code}, stderr:\n{err}"
    assert lines[0].startswith(f"{PROG} {argv[0]}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("command, extra, says", [
    ("quantize", ["--batch_size", "0"], "argument --batch_size: expected an integer >= 1, got '0'"),
    ("quantize", ["--calib_batches", "0"], "argument --calib_batches: expected an integer >= 1, got '0'"),
    ("quantize", ["--calib_batches", "-1"], "argument --calib_batches: expected an integer >= 1, got '-1'"),
    ("quantize", ["--seq_len", "0"], "argument --seq_len: expected an integer >= 1, got '0'"),
    ("eval", ["--eval_batches", "0"], "argument --eval_batches: expected an integer >= 1, got '0'"),
    ("eval", ["--batch_size", "-1"], "argument --batch_size: expected an integer >= 1, got '-1'"),
    ("eval", ["--device", "bogus"], "argument --device: expected cpu, cuda or cuda:N, got 'bogus'"),
    ("generate", ["--temperature", "nan"], "argument --temperature: expected a finite number, got 'nan'"),
    ("generate", ["--temperature", "-0.5"], "argument --temperature: expected a number >= 0, got '-0.5'"),
    ("generate", ["--max_new_tokens", "-1"], "argument --max_new_tokens: expected an integer >= 0, got '-1'"),
    ("generate", ["--speculate", "0"], "argument --speculate: expected an integer >= 1, got '0'"),
    ("generate", ["--device", "meta"], "argument --device: fp8ext runs on cpu or cuda, got 'meta'"),
])
def test_a_bad_argument_is_refused_in_one_line_naming_it(files, tmp_path, capsys, command, extra, says):
    line = one_line_error(capsys, base(command, files, tmp_path) + extra, 2)
    assert says in line


@pytest.mark.parametrize("command, extra, says", [
    ("eval", ["--seq_len", "100000"], "--seq_len: sequences of 100000 tokens are longer than the model's context"),
    ("quantize", ["--seq_len", "100000"], "--seq_len: sequences of 100000 tokens are longer than the model's"),
    ("generate", ["--max_new_tokens", "100000"], "--max_new_tokens 100000: the prompt (1 bytes) and the new tokens"),
    ("generate", ["--prompt", ""], "--prompt is empty"),
    ("generate", ["--speculate", "2"], "--speculate (draft tokens per round) goes with --draft"),
])
def test_an_argument_the_model_cannot_take_is_refused_in_one_line(files, tmp_path, capsys, command, extra, says):
    assert says in one_line_error(capsys, base(command, files, tmp_path) + extra, 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal of --device cuda where there is no GPU")
@pytest.mark.parametrize("command", ["quantize", "eval", "generate"])
def test_device_cuda_without_cuda_says_so_in_one_line(files, tmp_path, capsys, command):
    line = one_line_error(capsys, base(command, files, tmp_path) + ["--device", "cuda"], 1)
    assert "--device cuda: " in line and ("CPU-only build" in line or "no CUDA device" in line), line


def copy_of(d, tmp_path):
    return shutil.copytree(d, tmp_path / "model")


def test_deeply_nested_config_json_is_refused_in_one_line_naming_it(files, tmp_path, capsys):
    d = copy_of(files["fp8"], tmp_path)
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    for command in ("eval", "generate"):
        argv = base(command, files, tmp_path)
        argv[argv.index("--model") + 1] = str(d)
        line = one_line_error(capsys, argv, 1)
        assert f"{d / 'config.json'}: nests arrays and objects 100000 deep" in line, line


def test_an_input_amax_beyond_float_is_refused_in_one_line_naming_the_file_and_key(files, tmp_path, capsys):
    d = copy_of(files["fp8"], tmp_path)
    path = str(d / "model.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    record = json.loads(meta["fp8ext"])
    record["layers"]["model.layers.0.mlp.down_proj"]["input_amax"] = 12345.5
    save_file(load_file(path), path, metadata={**meta, "fp8ext": json.dumps(record).replace("12345.5", "1e400")})
    argv = base("generate", files, tmp_path)
    argv[argv.index("--model") + 1] = str(d)
    line = one_line_error(capsys, argv, 1)
    assert f"{path}: " in line and "model.layers.0.mlp.down_proj" in line and "input_amax'] must be finite" in line


def test_a_checkpoint_naming_a_larger_preset_is_refused_before_the_model_is_built(files, tmp_path, capsys):
    """args preset '1b' over a tiny model's tensors: refused from the shapes, without allocating the 1b model
    (about 4 GB in float32)."""
    run = training_run(tmp_path / "run", preset_name="1b", text=files["run"] / "text.txt")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = one_line_error(capsys, base("quantize", {**files, "run": run}, tmp_path), 1)
    assert f"--checkpoint: {run / 'checkpoint.pt'}: embed.weight is [256, 64], but the model of its arguments " \
           "(preset '1b') has embed.weight [256, 2048]" in line, line
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024  # ru_maxrss: KiB on Linux
    assert grown_mib < 500, f"the peak memory grew by {grown_mib:.0f} MiB"


def test_eval_without_reference_does_not_take_a_checkpoint_from_the_working_directory(files, tmp_path, capsys,
                                                                                       monkeypatch):
    """A directory save_quantized wrote from Python names no training checkpoint: eval asks for --reference rather
    than reading ./checkpoint.pt (an unrelated model here)."""
    shutil.copy(files["run"] / "checkpoint.pt", tmp_path / "checkpoint.pt")
    monkeypatch.chdir(tmp_path)
    line = one_line_error(capsys, ["eval", "--model", str(files["from-python"]), "--eval_batches", "1",
                                   "--device", "cpu"], 1)
    assert f"--reference: {files['from-python'] / 'config.json'} names no training checkpoint" in line
    assert "pass --reference" in line
    capsys.readouterr()
    assert main(["eval", "--model", str(files["from-python"]), "--reference", str(files["run"]), "--eval_batches",
                 "1", "--batch_size", "2", "--device", "cpu", "--data", str(files["run"] / "text.txt")]) == 0
    assert "vs bf16: perplexity" in capsys.readouterr().out


def test_eval_names_the_reference_by_the_dtype_it_computes_in(files, monkeypatch, capsys):
    import fp8ext.inference.__main__ as cli
    training_model = cli._training_model

    def float32_reference(*args):
        model, train_args, path = training_model(*args)
        return model.float(), train_args, path
    monkeypatch.setattr(cli, "_training_model", float32_reference)
    capsys.readouterr()
    assert main(base("eval", files, files["root"])) == 0
    out = capsys.readouterr().out
    assert " fp32: loss" in out and "vs fp32: perplexity" in out and "bf16" not in out, out


def test_debug_raises_the_error_itself(files, tmp_path):
    with pytest.raises(ValueError, match="names no training checkpoint"):
        main(["eval", "--model", str(files["from-python"]), "--device", "cpu", "--debug"])


def test_the_command_prints_one_line_and_nothing_else(files, tmp_path):
    """The whole process: no traceback, no warning, one line (--debug's traceback: test_debug_raises_the_error_itself,
    as an uncaught exception prints it)."""
    r = subprocess.run([sys.executable, "-m", "fp8ext.inference", "eval", "--model", str(files["from-python"]),
                        "--device", "cpu"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.startswith(f"{PROG} eval: error: --reference: ") and r.stderr.count("\n") == 1, r.stderr
