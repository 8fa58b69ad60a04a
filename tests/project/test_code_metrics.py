"""The redesign's structural goals (issue 30), as benchmarks/code_metrics.py measures them: one autograd Function for
the FP8 linear and one for the fused MLP, no autograd forward over six inputs, and the figures script runs."""
import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _metrics():
    spec = importlib.util.spec_from_file_location("code_metrics", ROOT / "benchmarks" / "code_metrics.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_at_most_two_linear_autograd_functions_and_none_wider_than_six_inputs():
    figures = _metrics().static_figures(ROOT / "fp8ext")
    assert len(figures["linear_mlp_autograd_functions"]) <= 2, figures["linear_mlp_autograd_functions"]
    assert figures["widest_autograd_forward"][0] <= 6, figures["widest_autograd_forward"]


def test_the_figures_script_runs_and_traces_both_linear_paths(tmp_path):
    out = tmp_path / "metrics.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "code_metrics.py"), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert '"one_call"' in text and '"composed"' in text and "linear_autograd.py" in text
