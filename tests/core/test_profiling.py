"""Profiler ranges: fp8ext's ops and FP8Linear appear in a torch.profiler trace when profiling is on, not when off."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fp8ext

NAMES = {"fp8ext.quantize", "fp8ext.dequantize", "fp8ext.amax", "fp8ext.cast_transpose", "fp8ext.gemm",
         "FP8Linear.forward"}


def traced(tmp_path):
    layer = fp8ext.Linear(32, 32)
    x = torch.randn(16, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        q = fp8ext.quantize(x)
        fp8ext.dequantize(q)
        fp8ext.amax(x)
        fp8ext.cast_transpose(x)
        fp8ext.gemm(q, q, a_scale_inv=torch.ones(()), b_scale_inv=torch.ones(()))
        with fp8ext.fp8_autocast(enabled=True):
            layer(x).sum().backward()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    return {e["name"] for e in json.loads(path.read_text())["traceEvents"] if "name" in e}


@pytest.fixture
def profiling():
    fp8ext.set_profiling(True)
    yield
    fp8ext.set_profiling(False)


def test_ranges_are_in_the_chrome_trace_when_profiling_is_on(tmp_path, profiling):
    assert fp8ext.profiling_enabled()
    names = traced(tmp_path)
    assert NAMES <= names, f"missing: {NAMES - names}"


def test_no_ranges_when_profiling_is_off(tmp_path):
    assert not fp8ext.profiling_enabled()
    assert not (NAMES & traced(tmp_path))


def test_the_environment_variable_switches_it_on():
    out = subprocess.run([sys.executable, "-c", "import fp8ext; print(fp8ext.profiling_enabled())"],
                         env={**os.environ, "FP8EXT_PROFILE": "1"}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_decorated_functions_keep_their_names_and_docs():
    assert fp8ext.quantize.__name__ == "quantize" and "fp8(x * scale)" in fp8ext.quantize.__doc__
    assert fp8ext.gemm.__name__ == "gemm"
