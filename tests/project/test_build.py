"""What was built: a build asked to include CUDA has it, and the Python API is the same either way."""

import os

import fp8ext
from fp8ext import _C


def test_cuda_build_when_asked_for():
    info = fp8ext.build_info()
    if os.environ.get("FP8EXT_CUDA") == "1":  # CI sets this where nvcc exists: the kernels must have compiled
        assert info["cuda"] and info["cuda_archs"], info
    if info["cuda"]:
        assert info["no_cuda_reason"] == "" and info["cuda_runtime_version"] >= 12000
    else:
        assert info["no_cuda_reason"], "a CPU-only build says why"
        assert not fp8ext.cuda_available()


def test_same_api_in_every_build():
    for name in ("quantize", "dequantize", "amax", "cast_transpose", "formats", "build_info", "cuda_device_count"):
        assert callable(getattr(_C, name))
    assert set(fp8ext.__all__) <= set(dir(fp8ext))


def test_format_constants_come_from_the_core():
    import reference
    for f in (fp8ext.E4M3, fp8ext.E5M2):
        vals = reference.finite_positive(f.name)
        assert f.max == vals[-1] and f.min_subnormal == vals[1] and f.max_code == len(vals) - 1
        assert f.min_normal == vals[1 << f.mant_bits]
        assert f.max == float(__import__("torch").finfo(f.torch_dtype).max)
    assert fp8ext.E4M3.inf_code is None and fp8ext.E5M2.inf_code == 0x7C
    assert fp8ext.Format.HYBRID.value.max_fwd == 448.0 and fp8ext.Format.HYBRID.value.max_bwd == 57344.0
    assert fp8ext.Format.HYBRID.fwd is fp8ext.E4M3 and fp8ext.Format.HYBRID.bwd is fp8ext.E5M2


def test_python_m_fp8ext_reports_the_build_and_where_each_operation_runs():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "fp8ext"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = fp8ext.build_info()
    text = out.stdout
    assert f"fp8ext {fp8ext.__version__}" in text
    assert ("build: with CUDA kernels" in text) == info["cuda"]
    assert info["cuda"] or info["no_cuda_reason"] in text, "a CPU-only build says why"
    import torch
    hopper = fp8ext.cuda_available() and any(torch.cuda.get_device_capability(i) >= (9, 0)
                                             for i in range(torch.cuda.device_count()))
    where = "GPU" if hopper else "CPU reference"
    rows = [line for line in text.splitlines() if line.startswith("  ")]
    assert len(rows) == 10 and all(line.rstrip().endswith(where) for line in rows), rows


def test_a_cpu_only_fallback_build_warns_where_a_gpu_is_visible():
    fallback = {"cuda": False, "no_cuda_reason": "nvcc was not found (set CUDA_HOME or put nvcc on PATH)"}
    note = fp8ext._cpu_only_build_note(fallback, gpu_visible=True)
    assert "nvcc was not found" in note and "FP8EXT_CUDA=1" in note
    assert fp8ext._cpu_only_build_note(fallback, gpu_visible=False) is None, "no GPU: the CPU build is the one"
    chosen = {"cuda": False, "no_cuda_reason": "FP8EXT_CUDA=0 at build time"}
    assert fp8ext._cpu_only_build_note(chosen, gpu_visible=True) is None, "asked for: no warning"
    assert fp8ext._cpu_only_build_note({"cuda": True, "no_cuda_reason": ""}, gpu_visible=True) is None
