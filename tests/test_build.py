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
