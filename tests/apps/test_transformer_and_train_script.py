"""The dense transformer and the training script: presets, data, short runs in bf16/fp32 and FP8, exact resume,
FP8 <-> bf16 checkpoints, two-process DDP and FSDP2 over gloo, and the comparison tool."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fp8ext
from fp8ext.models.transformer import PRESETS, Transformer, TransformerConfig, preset
from fp8ext.train import cli, data, trainer
from fp8ext.train.compare import compare

# on the CPU everywhere (a GPU machine too): these tests check the script's behaviour, not a device's speed
RUN = ["--preset", "tiny", "--batch_size", "4", "--seq_len", "32", "--eval_batches", "2", "--no_progress",
       "--device", "cpu"]


def metrics(run_dir):
    return [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ---- the model --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, low, high", [("tiny", 0.05e6, 0.5e6), ("small", 100e6, 140e6), ("1b", 0.9e9, 1.1e9),
                                             ("llama8b-2l", 0.4e9, 0.5e9), ("llama8b-4l", 0.85e9, 0.9e9)])
def test_preset_sizes(name, low, high):
    n = Transformer(PRESETS[name], device="meta").num_parameters()
    assert low <= n <= high, f"{name}: {n / 1e6:.1f}M parameters"


def test_config_refuses_dimensions_fp8_gemms_cannot_take():
    with pytest.raises(ValueError, match="d_ff must be a multiple of 16"):
        TransformerConfig(d_ff=100)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        TransformerConfig(d_model=64, n_heads=3)


def test_fused_and_separate_qkv_compute_the_same_function():
    torch.manual_seed(0)
    fused = Transformer(preset("tiny"))
    sep = Transformer(preset("tiny", fused_qkv=False))
    sd = fused.state_dict()
    for i in range(len(fused.blocks)):
        q, k, v = sd.pop(f"blocks.{i}.attn.qkv_proj.weight").split([64, 32, 32])
        sd.pop(f"blocks.{i}.attn.qkv_proj._extra_state", None)
        sd.update({f"blocks.{i}.attn.q_proj.weight": q, f"blocks.{i}.attn.k_proj.weight": k,
                   f"blocks.{i}.attn.v_proj.weight": v})
    sep.load_state_dict(sd, strict=False)
    ids = torch.randint(0, 256, (2, 16))
    assert torch.allclose(fused(ids), sep(ids), atol=1e-5)


def test_fp8_forward_is_close_to_high_precision_and_keeps_embedding_and_head_out_of_fp8():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    ids = torch.randint(0, 256, (4, 32))
    ref = model(ids[:, :-1], ids[:, 1:])[1]
    recipe = fp8ext.DelayedScaling()
    with torch.no_grad():  # first FP8 step records amaxes; the second uses the scales they give
        model(ids[:, :-1], fp8=True, fp8_recipe=recipe)
    loss = model(ids[:, :-1], ids[:, 1:], fp8=True, fp8_recipe=recipe)[1]
    assert abs(loss.item() - ref.item()) < 0.02 * ref.item()
    assert type(model.lm_head) is torch.nn.Linear and type(model.embed) is torch.nn.Embedding


def test_compiled_fp8_training_has_no_graph_breaks(tmp_path):
    """--compile --use_fp8: the FP8 context's scale update and the layers' slot registration stay out of the
    compiled forward (a graph break inside the model's fp8_autocast made dynamo run the whole forward eagerly)."""
    out = tmp_path / "compiled"
    r = subprocess.run([sys.executable, "-m", "fp8ext.train", *RUN, "--use_fp8", "--compile", "--max_steps", "2",
                        "--eval_every", "1000", "--no_save", "--out_dir", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((out / "run.json").read_text())
    assert info["graph_breaks"] == 0, "the compiled forward broke its graph"


def test_model_self_test_runs():
    out = subprocess.run([sys.executable, "-m", "fp8ext.models.transformer", "--fp8", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "FP8: on (emulated on the CPU" in out and "parameters:" in out and "loss" in out


# ---- data ---------------------------------------------------------------------------------------------------

def test_standard_library_corpus_is_deterministic_with_a_held_out_share():
    a, b = data.load_corpus(), data.load_corpus()
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    share = a.val.numel() / (a.train.numel() + a.val.numel())
    assert 0.02 < share < 0.10 and a.train.numel() > 5_000_000, a.description


def test_text_file_and_directory_corpora(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(bytes(range(256)) * 40)
    c = data.load_corpus(str(f))
    assert c.val.numel() == 512 and torch.equal(c.val, c.train.new_tensor(list(range(256)) * 2))
    d = tmp_path / "many"
    d.mkdir()
    for i in range(25):
        (d / f"{i:02d}.txt").write_text(f"file {i}\n" * 10)
    c = data.load_corpus(str(d))
    assert b"file 0\n" in bytes(c.val.tolist()) and b"file 20\n" in bytes(c.val.tolist())
    assert b"file 1\n" not in bytes(c.val.tolist())
    with pytest.raises(FileNotFoundError, match="--data"):
        data.load_corpus(str(tmp_path / "missing"))


def test_batches_depend_only_on_their_coordinates():
    corpus = torch.arange(10_000).to(torch.uint8)
    x1, y1 = data.batch(corpus, 4, 16, seed=1, step=5, micro=1, rank=0)
    x2, y2 = data.batch(corpus, 4, 16, seed=1, step=5, micro=1, rank=0)
    x3, _ = data.batch(corpus, 4, 16, seed=1, step=5, micro=1, rank=1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


# ---- training -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fp8", [False, True], ids=["high_precision", "fp8"])
def test_short_training_run_learns_and_writes_its_outputs(tmp_path, fp8):
    out = tmp_path / "run"
    cli.main(RUN + ["--max_steps", "30", "--eval_every", "15", "--lr", "3e-3", "--out_dir", str(out)]
             + (["--use_fp8"] if fp8 else []))
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert sum(r["loss"] for r in rows[-5:]) / 5 < rows[0]["loss"] - 0.5, "the loss fell"
    assert [r["step"] for r in rows if "val_loss" in r] == [15, 30]
    info = json.loads((out / "run.json").read_text())
    assert info["precision"] == ("fp8" if fp8 else "fp32") and info["final_val_loss"] == rows[-1]["val_loss"]
    if fp8:
        assert info["fp8_scaled_tensors"] == 3 * 4 * 2, "x, w and the gradient of 4 linears in 2 blocks"
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["step"] == 30 and set(ck) >= {"model", "optimizer", "rng", "args"}
    assert any(k.endswith("_extra_state") for k in ck["model"]), "the FP8 scaling state is in the checkpoint"


@pytest.mark.parametrize("extra", [["--use_fp8"], ["--use_fp8", "--grad_accum_steps", "2"],
                                   ["--use_fp8", "--fp8_recipe", "current"], []],
                         ids=["fp8", "fp8_accum2", "fp8_current", "high_precision"])
def test_resumed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path, extra):
    common = RUN + ["--max_steps", "8", "--eval_every", "4"] + extra
    cli.main(common + ["--out_dir", str(tmp_path / "straight")])
    cli.main(common + ["--out_dir", str(tmp_path / "resumed"), "--stop_after", "3"])  # as if the job ended
    cli.main(common + ["--out_dir", str(tmp_path / "resumed"), "--resume", str(tmp_path / "resumed")])
    a, b = metrics(tmp_path / "straight"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[-1]["val_loss"] == b[-1]["val_loss"]


@pytest.mark.parametrize("first, second", [(["--use_fp8"], []), ([], ["--use_fp8"])], ids=["fp8_to_bf16", "bf16_to_fp8"])
def test_fp8_and_bf16_checkpoints_resume_each_other(tmp_path, first, second):
    out = tmp_path / "run"
    cli.main(RUN + ["--max_steps", "20", "--eval_every", "20", "--lr", "3e-3", "--out_dir", str(out)] + first)
    before = metrics(out)[-1]["val_loss"]
    cli.main(RUN + ["--max_steps", "24", "--eval_every", "4", "--lr", "3e-3", "--out_dir", str(out),
                    "--resume", str(out)] + second)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 25))
    assert abs(rows[-1]["val_loss"] - before) < 0.05 * before, "it continued from the checkpoint, not from scratch"


def test_fp8_on_a_gpu_without_fp8_tensor_cores_raises(monkeypatch):
    monkeypatch.setattr(trainer, "cuda_available", lambda: True)  # the name _check_fp8 reads
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"--use_fp8: NVIDIA A100 \(compute capability 8.0\) has no FP8"):
        trainer._check_fp8(torch.device("cuda", 0), 0)


def test_resume_from_a_missing_checkpoint_names_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(RUN + ["--max_steps", "2", "--out_dir", str(tmp_path / "x"), "--resume", str(tmp_path / "none")])
    assert e.value.code == 1 and f"--resume: no checkpoint at {tmp_path / 'none'}" in capsys.readouterr().err


def test_compare_prints_losses_and_speed_ratio_and_plots(tmp_path, capsys):
    cli.main(RUN + ["--max_steps", "6", "--eval_every", "3", "--out_dir", str(tmp_path), "--compare"])
    out = capsys.readouterr().out
    fp8, fp32 = f"fp8 ({tmp_path / 'fp8'})", f"fp32 ({tmp_path / 'fp32'})"  # each run named: which is which
    assert "final validation loss" in out and f"tokens/s of {fp8} / {fp32}" in out, out
    assert f"validation loss of {fp8} vs {fp32}" in out, out
    assert (tmp_path / "compare.png").stat().st_size > 10_000
    r = compare(str(tmp_path / "fp32"), str(tmp_path / "fp8"))  # fp32: the high-precision run on a CPU
    assert r["step_a"] == r["step_b"] == 6 and r["val_loss_a"] > 0 and r["speed_ratio"] > 0


def test_compare_names_each_run_by_its_precision_once():
    from fp8ext.train.compare import _label
    assert _label("runs/quickstart/fp8", {"precision": "fp8"}) == "fp8"  # not "fp8 (fp8)"
    assert _label("runs/baseline", {"precision": "bf16"}) == "bf16 (baseline)"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_over_gloo_hold_the_same_fp8_scales(tmp_path, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fp8ext.train", *RUN, "--max_steps", "6", "--eval_every", "3", "--use_fp8", "--out_dir", str(tmp_path)]
    if mode == "fsdp":
        cmd.append("--fsdp")
    if mode == "fsdp":  # FSDP2 resumes what a single process saved (same checkpoint layout)
        cli.main(RUN + ["--max_steps", "6", "--eval_every", "3", "--use_fp8", "--out_dir", str(tmp_path),
                        "--stop_after", "3"])
        cmd += ["--resume", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["world_size"] == 2 and info["fp8_scaled_tensors"] == 24
    assert info["fp8_scales_equal_across_ranks"] is True, "amaxes max-reduced across ranks"
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 7))
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ck["model"]["blocks.0.ffn.w13.weight"].shape == (384, 64), "the full, unsharded weight was saved"


PROBE = """
import json, os, sys
from fp8ext.train import cli
code = cli.main(sys.argv[1:])
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
with open(os.path.join(os.path.dirname(__file__), f"threads.{os.environ['RANK']}.json"), "w") as f:
    json.dump(sorted(names), f)  # a file per rank: the two ranks' prints interleave on one pipe
sys.exit(code)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's threads from Linux's /proc")
def test_fsdp_over_gloo_leaves_no_process_group_threads_behind(tmp_path):
    """DTensor's caches keep FSDP2's device mesh alive after training; the trainer releases the mesh's gloo group
    after destroy_process_group, so its worker threads end before the interpreter exits (a group destroyed
    during interpreter exit aborted one run in tens: "terminate called without an active exception")."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *RUN,
           "--max_steps", "2", "--eval_every", "2", "--use_fp8", "--fsdp", "--out_dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    threads = {rank: json.loads((tmp_path / f"threads.{rank}.json").read_text()) for rank in (0, 1)}
    assert not any("gloo" in name for names in threads.values() for name in names), threads


TWO_GPUS = fp8ext.cuda_available() and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices and fp8ext built with CUDA")
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_gpus_over_nccl_hold_the_same_fp8_scales(tmp_path, mode):
    """The same job on two GPUs (NCCL, torchrun): one process per GPU, bf16 autocast, FP8 GEMMs on the device."""
    args = [a for a in RUN if a not in ("--device", "cpu")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "fp8ext.train", *args, "--max_steps", "6", "--eval_every", "3", "--use_fp8", "--out_dir", str(tmp_path)]
    if mode == "fsdp":
        cmd.append("--fsdp")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["world_size"] == 2 and info["device"] == "cuda:0" and info["precision"] == "fp8"
    assert info["fp8_scaled_tensors"] == 24
    assert info["fp8_scales_equal_across_ranks"] is True, "amaxes max-reduced across ranks"
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert math.isfinite(info["final_val_loss"])


def test_fused_kernels_switch_is_recorded_and_restored(tmp_path):
    assert fp8ext.fused.TRAINING
    cli.main(RUN + ["--max_steps", "2", "--eval_every", "2", "--no_fused_kernels", "--out_dir", str(tmp_path)])
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["fused_kernels"] == [] and info["args"]["no_fused_kernels"] is True
    assert fp8ext.fused.TRAINING, "the switch is restored after the run"


def test_any_seed_works_and_gives_its_own_batches():
    corpus = torch.arange(10_000).to(torch.uint8)
    a = data.batch(corpus, 2, 8, seed=20240101, step=10**6)[0]
    b = data.batch(corpus, 2, 8, seed=2**62, step=3)[0]
    assert a.shape == b.shape == (2, 8) and not torch.equal(a, b)


def test_metrics_keep_one_row_per_step_when_resuming_from_an_earlier_checkpoint(tmp_path):
    common = RUN + ["--max_steps", "8", "--eval_every", "4", "--out_dir", str(tmp_path)]
    cli.main(common + ["--stop_after", "6", "--save_every", "4"])  # saves at 4, stops (and saves) at 6
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    ck["step"] = 4  # as if the job had died after step 6 with only the step-4 checkpoint written
    cli_state = tmp_path / "early"
    cli_state.mkdir()
    torch.save(ck, cli_state / "checkpoint.pt")
    cli.main(common + ["--resume", str(cli_state)])
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, 9))
