"""benchmarks/bench_speculative.py: its dry run (CPU, a tiny model trained two steps) measures every draft format, k
and batch size, and the speculative greedy output is the FP8 target's, token for token; a mismatch is reported at
its position, not raised."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_speculative.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_speculative", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench_speculative")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry_run", "--out_dir", str(out / "run"), "--json",
                           str(out / "speculative.json")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
                              "PYTHONPATH")]))})
    assert proc.returncode == 0, f"the dry run exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "| mxfp4 draft | 2 | 1 |" in proc.stdout, f"the markdown table is printed:\n{proc.stdout[-2000:]}"
    return json.loads((out / "speculative.json").read_text())


def test_dry_run_measures_every_format_k_and_batch(dry_run):
    bench = _bench()
    got = {(r["format"], r["k"], r["batch"]) for r in dry_run["speculative"]}
    want = {(f, k, b) for f in bench.FORMATS for k in bench.KS for b in bench.BATCHES}
    assert got == want and len(dry_run["speculative"]) == len(want), f"one row per configuration: {sorted(got)}"
    for r in dry_run["speculative"]:
        assert 0 < r["acceptance_rate"] <= 1 and r["tokens_per_s"] > 0, r
    targets = {(r["config"], r["batch"]) for r in dry_run["targets"]}
    assert targets == {(c, b) for c in ("bf16 target", "fp8 target") for b in bench.BATCHES}, targets
    assert {"device", "torch", "date", "settings", "model"} <= dry_run.keys()
    assert dry_run["model"]["train_args"]["preset"] == "tiny"


def test_dry_run_speculative_greedy_output_is_the_fp8_targets(dry_run):
    wrong = [(r["format"], r["k"], r["batch"], r["first_mismatch"]) for r in dry_run["speculative"]
             if not r["identical"]]
    assert not wrong, f"the speculative greedy tokens equal the FP8 target's on the CPU; differ at {wrong}"
    assert all(r["runs_agree"] for r in dry_run["speculative"] + dry_run["targets"])
    assert any(r["acceptance_rate"] < 1 for r in dry_run["speculative"]), "some draft tokens rejected (checked too)"


def test_first_mismatch_is_the_first_generated_position_that_differs_in_any_sequence():
    first_mismatch = _bench().first_mismatch
    want = torch.arange(24).reshape(2, 12)
    assert first_mismatch(want.clone(), want, prompt_len=4) is None
    got = want.clone()
    got[1, 9] = -1
    got[0, 11] = -1
    assert first_mismatch(got, want, prompt_len=4) == 5, "position 9 of the sequence, 5 of the generated tokens"


def test_dry_run_with_hf_measures_the_transformers_model_and_its_drafts(tmp_path):
    """--hf: the same weights as a transformers LlamaForCausalLM (fp8ext's Llama export in memory), its drafts
    against it, every format, k and batch; greedy output equal to the model's own."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry_run", "--hf", "--out_dir", str(tmp_path / "run"),
                           "--json", str(tmp_path / "hf.json")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
                              "PYTHONPATH")]))})
    assert proc.returncode == 0, f"the dry run exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    result, bench = json.loads((tmp_path / "hf.json").read_text()), _bench()
    got = {(r["format"], r["k"], r["batch"]) for r in result["speculative"]}
    assert got == {(f, k, b) for f in bench.FORMATS for k in bench.KS for b in bench.BATCHES}
    assert all(r["identical"] and r["runs_agree"] for r in result["speculative"])
    assert {r["config"] for r in result["targets"]} == {"transformers bf16 target"}
    assert "| transformers, mxfp4 draft | 2 | 1 |" in proc.stdout


def test_the_transformers_copy_computes_the_same_logits():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from fp8ext.models.transformer import Transformer, preset
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        assert torch.equal(_bench().hf_model(model)(ids).logits, model(ids))
