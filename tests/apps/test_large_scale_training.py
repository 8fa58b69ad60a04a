"""The training script's large-scale options on the CPU: activation checkpointing (--activation_checkpointing full
and selective) trains bit for bit as without it, in high precision and with every FP8 recipe, and a job of two
nodes (two torchrun launchers meeting at a c10d rendezvous) trains with DDP and FSDP2 over gloo."""
import json
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from fp8ext.train import cli

# a few steps of the tiny preset: enough for delayed scaling's scales to move (they update from the second step on)
RUN = ["--preset", "tiny", "--batch_size", "2", "--seq_len", "16", "--max_steps", "3", "--eval_every", "3",
       "--eval_batches", "1", "--no_progress", "--device", "cpu"]
# (id, arguments): high precision and each FP8 recipe; delayed scaling also over two micro-batches, where the
# second reuses the first's FP8 weight (is_first_microbatch)
PRECISIONS = [("high_precision", []), ("delayed", ["--use_fp8", "--fp8_recipe", "delayed"]),
              ("delayed_accum2", ["--use_fp8", "--fp8_recipe", "delayed", "--grad_accum_steps", "2"]),
              ("current", ["--use_fp8", "--fp8_recipe", "current"]), ("block", ["--use_fp8", "--fp8_recipe", "block"]),
              ("rowwise", ["--use_fp8", "--fp8_recipe", "rowwise"])]


def metrics(run_dir):
    return [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def differences(a, b, path="") -> list:
    """Where two checkpoint trees differ: tensors by dtype, shape and torch.equal, everything else by ==."""
    if path.endswith("_extra_state") and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == 2:
        # an FP8 layer's scaling state: column 0 is its manager's update count, which runs of equal recipes in one
        # process share (one manager); the scales and amax histories must be equal
        a, b = a[:, 1:], b[:, 1:]
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b), key=str)[:4]}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """run(name, args) -> the directory of a run without activation checkpointing, trained once per module."""
    done = {}

    def run(name, args):
        if name not in done:
            done[name] = tmp_path_factory.mktemp(f"no_checkpointing_{name}")
            cli.main(RUN + args + ["--out_dir", str(done[name])])
        return done[name]
    return run


# ---- activation checkpointing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name, args", PRECISIONS, ids=[n for n, _ in PRECISIONS])
def test_activation_checkpointing_trains_bit_for_bit_as_without_it(tmp_path, reference_runs, name, args, mode):
    """The recomputed forward computes what the first one did (FP8: the same recipe, scales and casts), so the
    losses, the weights, the FP8 scaling state and the optimizer state after a few steps are those of the run
    without checkpointing, to the bit."""
    ref = reference_runs(name, args)
    cli.main(RUN + args + ["--activation_checkpointing", mode, "--out_dir", str(tmp_path)])
    info = json.loads((tmp_path / "run.json").read_text())
    assert info["activation_checkpointing"] == mode and info["checkpointed_blocks"] == 2, "each block wrapped"
    got, want = metrics(tmp_path), metrics(ref)
    assert [r["loss"] for r in got] == [r["loss"] for r in want], f"{mode} checkpointing changed the losses"
    assert got[-1]["val_loss"] == want[-1]["val_loss"]
    a = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    b = torch.load(ref / "checkpoint.pt", weights_only=True)
    for part in ("model", "optimizer"):  # the model's keys too: the wrapper's prefix is not saved
        changed = differences(a[part], b[part], part)
        assert not changed, f"{mode} checkpointing changed {changed[:6]}"


def test_a_run_resumes_under_another_activation_checkpointing_setting(tmp_path):
    """The checkpoint's keys do not depend on the setting: a run saved without checkpointing continues with it
    (and with FP8 state loaded into the wrapped layers) exactly as the uninterrupted run."""
    common = RUN + ["--max_steps", "4", "--eval_every", "4", "--use_fp8", "--fp8_recipe", "current"]
    cli.main(common + ["--out_dir", str(tmp_path / "straight")])
    cli.main(common + ["--out_dir", str(tmp_path / "resumed"), "--stop_after", "2"])
    cli.main(common + ["--out_dir", str(tmp_path / "resumed"), "--resume", str(tmp_path / "resumed"),
                       "--activation_checkpointing", "selective"])
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == [r["loss"] for r in metrics(tmp_path / "straight")]


def test_activation_checkpointing_is_off_by_default_and_refuses_unknown_modes(tmp_path, capsys):
    assert cli.parser().parse_args([]).activation_checkpointing == "none"
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--activation_checkpointing", "everything"])
    assert "invalid choice: 'everything'" in capsys.readouterr().err


# ---- two nodes ------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(port: int, rdzv_id: str, out_dir, extra) -> list:
    """One node's launcher, as docs/training.md shows it (there on port 29400): torchrun with a c10d rendezvous
    at node 0's address, one process on this node, two nodes in all."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", rdzv_id,
            "-m", "fp8ext.train", "--preset", "tiny", "--device", "cpu", "--use_fp8", *extra, "--max_steps", "6",
            "--out_dir", str(out_dir)]


def run_two_nodes(tmp_path, extra, timeout_s: float = 300.0) -> None:
    """Starts the two launchers (each in its own process group, with its workers), waits for both; on a failure
    or past `timeout_s` kills both groups, so that a launcher left waiting at the rendezvous cannot hang the test."""
    port, rdzv_id = free_port(), f"fp8ext-test-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    procs = []
    try:
        for log in logs:
            with open(log, "w") as f:
                procs.append(subprocess.Popen(node_command(port, rdzv_id, tmp_path / "run", extra), stdout=f,
                                              stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                pytest.fail(f"the two launchers ran past {timeout_s:.0f} s:\n" + tail(logs))
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher's session: it and the workers it started
                p.wait()
    assert all(p.returncode == 0 for p in procs), f"exit codes {[p.returncode for p in procs]}\n" + tail(logs)


def tail(logs) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in logs)


@pytest.mark.parametrize("extra", [[], ["--fsdp"], ["--fsdp", "--activation_checkpointing", "selective"]],
                         ids=["ddp", "fsdp", "fsdp_checkpointed"])
def test_two_nodes_over_gloo_hold_the_same_fp8_scales(tmp_path, extra):
    """Two launchers meet at one rendezvous (two nodes of one process each, here on one host) and train as one
    job of world size 2: FP8 amaxes max-reduced across the nodes, finite losses, one output written by rank 0."""
    run_two_nodes(tmp_path, extra)
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert info["world_size"] == 2 and info["precision"] == "fp8" and info["fp8_scaled_tensors"] == 24
    assert info["fp8_scales_equal_across_ranks"] is True, "amaxes max-reduced across the nodes"
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, 7)), "one row per step, from one rank"
    assert all(math.isfinite(r["loss"]) for r in rows) and math.isfinite(info["final_val_loss"])
    if "--activation_checkpointing" in extra:
        assert info["checkpointed_blocks"] == 2
    ck = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert ck["model"]["blocks.0.ffn.w13.weight"].shape == (384, 64), "the full, unsharded weight was saved"


def test_docs_show_the_two_node_command_this_file_runs():
    """docs/training.md's two-node command is node_command's (with the guide's port, id and output directory)."""
    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    cmd = node_command(29400, "two-nodes", "runs/two-nodes", ["--fsdp"])
    shown = " ".join(["OMP_NUM_THREADS=1", "torchrun", *cmd[3:]])  # torchrun is `python -m torch.distributed.run`
    assert shown in doc, f"docs/training.md does not show {shown!r}"


# ---- FP8 all-gather under FSDP2 ----------------------------------------------------------------------------------

def run_fsdp(out_dir, recipe, extra) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fp8ext.train",
           *RUN, "--device", "cpu", "--use_fp8", "--fp8_recipe", recipe, "--fsdp", "--max_steps", "4",
           "--eval_every", "4", *extra, "--out_dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_fp8_all_gather_trains_as_the_high_precision_gather(tmp_path, recipe):
    """--fp8_all_gather: FSDP2 gathers the weights in FP8, each rank's shard cast with the whole weight's scale, so
    the losses and weights are those of gathering in high precision and casting after, bit for bit (with current
    scaling the whole checkpoint: with delayed scaling a saved copy applies the pending update with this rank's
    amaxes, and rank 0's weight amax is then its shard's)."""
    run_fsdp(tmp_path / "hp", recipe, [])
    run_fsdp(tmp_path / "fp8", recipe, ["--fp8_all_gather"])
    info = json.loads((tmp_path / "fp8" / "run.json").read_text())
    assert info["fp8_all_gather"] is True
    if recipe == "delayed":
        assert info["fp8_scales_equal_across_ranks"] is True
    assert json.loads((tmp_path / "hp" / "run.json").read_text())["fp8_all_gather"] is False
    assert [r["loss"] for r in metrics(tmp_path / "fp8")] == [r["loss"] for r in metrics(tmp_path / "hp")]
    a = torch.load(tmp_path / "fp8" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "hp" / "checkpoint.pt", weights_only=True)["model"]
    keys = [k for k in b if recipe == "current" or not k.endswith("_extra_state")]
    assert [k for k in keys if not torch.equal(a[k], b[k])] == []


def test_fp8_all_gather_refuses_what_it_cannot_gather(capsys):
    for args in (["--use_fp8"], ["--fsdp"], ["--fsdp", "--use_fp8", "--fp8_recipe", "block"]):
        with pytest.raises(SystemExit, match="--fp8_all_gather needs --fsdp and --use_fp8 with --fp8_recipe delayed "
                                             "or current"):
            cli.main(RUN + ["--device", "cpu", "--fp8_all_gather", "--max_steps", "1", *args])
