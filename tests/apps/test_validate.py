"""python -m fp8ext.validate: the quick run on the CPU (exit status, metrics.json, report.html), its arguments,
--profile's traces, the page rendered in headless Chromium, and on a GPU the benchmarks' figures."""

import html
import json
import os
import shutil
import subprocess
import sys

import pytest

import fp8ext
from fp8ext.validate import SECTIONS, parser, titles, validate

HEADLINE_KEYS = {"what", "date", "environment", "options", "summary", "sections", "checks", "figures", "skipped",
                 "notes", "traces", "errors", "plots"}
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def run_cli(args, env_extra=None, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "fp8ext.validate", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    """One `--quick` run on the CPU (CUDA hidden, so it is the CPU path on any machine): (result, folder)."""
    out = tmp_path_factory.mktemp("validate") / "report"
    res = run_cli(["--quick", "--report", str(out)], env_extra={"CUDA_VISIBLE_DEVICES": ""})
    return res, out


def load_metrics(out):
    return json.loads((out / "metrics.json").read_text())


def test_quick_cpu_run_passes(cpu_report):
    res, out = cpu_report
    assert res.returncode == 0, f"exit {res.returncode}\nstdout:\n{res.stdout}\nstderr:\n{res.stderr[-3000:]}"
    assert "correctness checks: all passed" in res.stdout
    assert "report.html" in res.stdout


def test_metrics_json_has_every_key_and_all_checks_pass(cpu_report):
    _, out = cpu_report
    m = load_metrics(out)
    assert HEADLINE_KEYS <= set(m), HEADLINE_KEYS - set(m)
    env = m["environment"]
    for key in ("date", "device", "torch", "fp8ext", "torch_cuda", "driver", "cublaslt", "no_gpu_reason"):
        assert key in env, key
    assert env["fp8ext"] == fp8ext.__version__ and env["device_type"] == "cpu"
    assert set(m["sections"]) == set(SECTIONS)
    assert m["summary"]["all_passed"] and m["summary"]["failed"] == 0 and m["summary"]["checks"] >= 30
    bad = [c for c in m["checks"] if not c["passed"]]
    assert not bad, bad
    assert not m["errors"], m["errors"]
    for c in m["checks"]:
        assert {"section", "name", "passed", "value", "limit", "unit", "shape", "device"} <= set(c)
    # the codec on all 65,536 bf16 patterns, for both formats
    codec = [c for c in m["checks"] if c["section"] == "casts" and "all bf16 bit patterns" in c["name"]]
    assert {c["name"].split()[3] for c in codec} == {"E4M3", "E5M2"} and all(c["shape"] == "65536" for c in codec)
    assert any(c["section"] == "gemm" and c["unit"] == "largest error / bound" for c in m["checks"])
    for f in m["figures"]:
        assert {"value", "unit", "shape", "device", "metric", "precision"} <= set(f) and f["unit"], f
    formats = {f["precision"] for f in m["figures"] if f["metric"] == "quantization error"}
    assert {"E4M3 per tensor", "E5M2 per tensor", "E2M1 per tensor", "E2M3 per tensor", "E3M2 per tensor",
            "MXFP4 E2M1", "NVFP4"} <= formats


def test_speed_is_skipped_with_the_reason_on_a_cpu(cpu_report):
    _, out = cpu_report
    m = load_metrics(out)
    reasons = {s["section"]: s["reason"] for s in m["skipped"]}
    for section in ("casts", "gemm", "linear", "block", "train", "inference"):
        assert "no GPU" in reasons[section], section
        assert m["sections"][section]["speed"].startswith("skipped: no GPU")
    assert "fp4" in reasons  # WeightOnlyLinear: not in this build, or no GPU
    assert not any(f["unit"] in ("ms", "TFLOP/s", "TB/s", "tokens/s") for f in m["figures"])
    assert m["plots"]["quant_error.png"] == "written" and (out / "quant_error.png").stat().st_size > 1000
    assert m["plots"]["memory.png"] == "written" and (out / "memory.png").exists()
    for name in ("tflops.png", "speedup.png"):
        assert "no GPU" in m["plots"][name] and not (out / name).exists()


def test_a_skip_reason_shared_by_sections_is_printed_once(cpu_report):
    res, out = cpu_report
    reason = load_metrics(out)["sections"]["casts"]["speed"][len("skipped: "):]
    assert res.stdout.count(reason) == 1, res.stdout
    assert res.stdout.count("speed: skipped (*)") >= 6 and f"(*) {reason}" in res.stdout
    page = (out / "report.html").read_text()
    assert page.count(html.escape(reason)) >= 1 and page.count("skipped (*)") >= 6


def test_report_html_is_self_contained_and_has_every_section(cpu_report):
    _, out = cpu_report
    page = (out / "report.html").read_text()
    for section in SECTIONS:  # the model sections' titles name float32, the baseline that ran on the CPU
        assert f'<h2 id="{section}">' in page and titles(on_gpu=False)[section] in page, section
    for section in ("block", "train", "inference"):  # not the GPU's "FP8 against bf16"
        assert "float32" in titles(on_gpu=False)[section] and titles(on_gpu=True)[section] not in page, section
    for heading in ("Plots", "Environment"):
        assert f">{heading}</h2>" in page
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert 'src="http' not in page and "url(http" not in page
    assert page.count('src="data:image/png;base64,') == 2  # memory and quantization error; no speed plots on a CPU
    assert "Speed was not measured" in page and "All " in page and "checks passed" in page


def test_arguments_are_checked_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(["--only", "casts,warp"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--only" in err and "warp" in err and "casts,gemm,linear,block,train,inference,fp4" in err
    assert parser().parse_args(["--only", "fp4, casts"]).only == ["casts", "fp4"]  # the report's order


def test_profile_writes_a_chrome_trace_per_benchmark(tmp_path):
    import torch
    m = validate(str(tmp_path), quick=True, profile=True, sections=["gemm"], device=torch.device("cpu"),
                 progress=False)
    assert m["summary"]["all_passed"] and m["traces"]
    assert not fp8ext.profiling_enabled()  # switched back off
    for t in m["traces"]:
        trace = json.loads((tmp_path / t["file"]).read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "fp8ext.gemm" in names and set(t["ranges"]) <= names


def chromium():
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def run_chromium(binary, page, tmp_path, *flags):
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--enable-logging=stderr", "--v=0", *flags,
           page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_report_renders_in_headless_chromium(cpu_report, tmp_path):
    binary = chromium()
    if binary is None:
        pytest.skip(f"no Chromium binary found (looked for {', '.join(CHROMIUM_NAMES)}); "
                    "install it with `apt-get install -y chromium`")
    PIL = pytest.importorskip("PIL.Image", reason="Pillow (a matplotlib dependency) reads the screenshot")
    _, out = cpu_report
    page = out / "report.html"
    shot = tmp_path / "report.png"
    res = run_chromium(binary, page, tmp_path, "--window-size=1280,2400", f"--screenshot={shot}")
    assert res.returncode == 0 and shot.exists(), res.stderr[-3000:]
    console = [line for line in res.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, "the page logged to the console:\n" + "\n".join(console)
    img = PIL.open(shot).convert("RGB")
    assert img.size == (1280, 2400)
    colours = img.getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 50, "the screenshot is (nearly) one colour: the page did not render"
    assert len(img.resize((64, 120)).getcolors(maxcolors=1 << 14)) > 10  # not one colour in any large region
    dom = run_chromium(binary, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-3000:]
    for section in SECTIONS:
        assert f'id="{section}"' in dom.stdout, section
    assert dom.stdout.count("<img") == 2


@pytest.mark.cuda
@pytest.mark.skipif(not fp8ext.cuda_available(), reason="needs a CUDA device and fp8ext built with CUDA")
def test_quick_gpu_run_measures_fp8_against_bf16(tmp_path):
    out = tmp_path / "report"
    res = run_cli(["--quick", "--only", "casts,gemm,linear", "--report", str(out)], timeout=600)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr[-3000:]}"
    m = load_metrics(out)
    assert m["environment"]["device_type"] == "cuda" and m["summary"]["all_passed"]
    tflops = [f for f in m["figures"] if f["unit"] == "TFLOP/s"]
    assert {f["precision"] for f in tflops} == {"bf16", "fp8ext E4M3"} and all(f["value"] > 0 for f in tflops)
    assert any(f["metric"] == "speedup vs bf16" for f in m["figures"])
    assert any(f["metric"] == "GPU memory peak" for f in m["figures"])
    assert all(m["plots"][p] == "written" for p in ("tflops.png", "speedup.png", "memory.png"))
