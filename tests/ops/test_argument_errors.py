"""Bad input: every op and argument gets a TypeError or ValueError that names the function and the
argument; nothing crashes and nothing is computed in some other way instead."""

import numpy as np
import pytest
import torch

import dlpack_craft
import fp8ext
from fp8ext import _C

X = torch.randn(8, 16)


def raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@pytest.mark.parametrize("bad, exc, match", [
    (torch.arange(8), TypeError, r"quantize\(\): x must be float32, bfloat16 or float16, got int64 on cpu"),
    (torch.zeros(4, dtype=torch.float64), TypeError, r"x must be float32.*got float64"),
    ([1.0, 2.0], TypeError, r"quantize\(\): x must be a torch.Tensor or an array that supports DLPack, got list"),
    (X.t(), ValueError, r"quantize\(\): x must be contiguous"),
    (np.zeros(4, dtype=np.int32), TypeError, r"x must be float32.*got int32"),
])
def test_quantize_bad_x(bad, exc, match):
    raises(exc, match, fp8ext.quantize, bad)


@pytest.mark.parametrize("fmt, exc, match", [
    (fp8ext.Format.HYBRID, ValueError, r"quantize\(\): fmt=Format.HYBRID names a recipe"),
    ("e3m4", TypeError, r"quantize\(\): fmt must be fp8ext.E4M3 or fp8ext.E5M2"),
    (torch.float16, TypeError, r"fmt must be"),
    (3, TypeError, r"fmt must be"),
])
def test_bad_fmt(fmt, exc, match):
    raises(exc, match, fp8ext.quantize, X, fmt)
    raises(exc, match.replace("quantize", "cast_transpose"), fp8ext.cast_transpose, X, fmt)


@pytest.mark.parametrize("scale, exc, match", [
    (float("nan"), ValueError, r"scale must be finite and positive in float32, got nan"),
    (float("inf"), ValueError, r"scale must be finite and positive"),
    (0.0, ValueError, r"scale must be finite and positive"),
    (-2.0, ValueError, r"scale must be finite and positive"),
    (1e39, ValueError, r"scale must be finite and positive in float32"),
    (1e-50, ValueError, r"scale must be finite and positive in float32"),
    (torch.ones(2), ValueError, r"scale must hold exactly one float32 element, got shape \[2\]"),
    (torch.ones((), dtype=torch.float64), TypeError, r"scale must be a float32 tensor with one element, got float64"),
    ("2.0", TypeError, r"scale must be a torch.Tensor or an array|scale must be a tensor or array"),
])
def test_bad_scale(scale, exc, match):
    raises(exc, match, fp8ext.quantize, X, fp8ext.E4M3, scale)
    raises(exc, match, fp8ext.cast_transpose, X, fp8ext.E4M3, scale)
    raises(exc, match.replace("scale", "scale_inv"), fp8ext.dequantize, fp8ext.quantize(X), scale)


@pytest.mark.parametrize("amax_out, exc, match", [
    (torch.zeros(2), ValueError, r"amax_out must hold exactly one float32 element"),
    (torch.zeros((), dtype=torch.bfloat16), TypeError, r"amax_out must be a float32 tensor with one element, got bfloat16"),
    (1.0, TypeError, r"amax_out must be a tensor or array that supports DLPack"),
])
def test_bad_amax_out(amax_out, exc, match):
    raises(exc, match, fp8ext.quantize, X, amax_out=amax_out)
    raises(exc, match, fp8ext.cast_transpose, X, amax_out=amax_out)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"])
def test_bad_seed(seed):
    raises(ValueError, r"quantize\(\): seed must be an int in \[0, 2\*\*63\)", fp8ext.quantize, X, stochastic=True,
           seed=seed)


def test_dequantize_bad_inputs():
    raises(TypeError, r"dequantize\(\): q must be a torch.float8_e4m3fn or torch.float8_e5m2 tensor", fp8ext.dequantize, X)
    raises(TypeError, r"dequantize\(\): q must be a torch.float8", fp8ext.dequantize, torch.zeros(3, dtype=torch.uint8))
    raises(TypeError, r"dequantize\(\): dtype must be torch.float32, torch.bfloat16 or torch.float16",
           fp8ext.dequantize, fp8ext.quantize(X), 1.0, torch.int32)
    raises(ValueError, r"dequantize\(\): q is torch.float8_e4m3fn but fmt=fp8ext.E5M2", fp8ext.dequantize,
           fp8ext.quantize(X), fmt=fp8ext.E5M2)
    raises(ValueError, r"dequantize\(\): q must be contiguous", fp8ext.dequantize, fp8ext.quantize(X).t())
    raises(TypeError, r"dequantize\(\): q must be a torch float8 tensor", fp8ext.dequantize, [1, 2])


def test_amax_bad_inputs():
    raises(TypeError, r"amax\(\): x must be float32, bfloat16 or float16, got int32", fp8ext.amax,
           torch.zeros(3, dtype=torch.int32))
    raises(ValueError, r"amax\(\): x must be contiguous", fp8ext.amax, X.t())
    raises(TypeError, r"amax\(\): x must be a torch.Tensor or an array", fp8ext.amax, 3.0)


@pytest.mark.parametrize("x, exc, match", [
    (torch.randn(8), ValueError, r"cast_transpose\(\): x must be 2-D, got shape \[8\]"),
    (torch.randn(2, 3, 4), ValueError, r"cast_transpose\(\): x must be 2-D"),
    (torch.zeros(4, 4, dtype=torch.int8), TypeError, r"cast_transpose\(\): x must be float32.*got int8"),
    (X.t(), ValueError, r"cast_transpose\(\): x must be contiguous"),
])
def test_cast_transpose_bad_x(x, exc, match):
    raises(exc, match, fp8ext.cast_transpose, x)


# ---- the C boundary itself (what fp8ext.ops relies on) ------------------------------------------

def cap(t):
    return torch._C._to_dlpack(t)


def test_c_checks_outputs():
    x = torch.randn(4, 4)
    raises(ValueError, r"quantize\(\): out has shape \[4, 3\] but x has shape \[4, 4\]", _C.quantize, cap(x),
           cap(torch.empty(4, 3, dtype=torch.uint8)), 0, 1.0)
    raises(TypeError, r"quantize\(\): out must be uint8 \(FP8 bytes\), got float32", _C.quantize, cap(x),
           cap(torch.empty(4, 4)), 0, 1.0)
    raises(ValueError, r"quantize\(\): out must be contiguous", _C.quantize, cap(x),
           cap(torch.empty(4, 4, dtype=torch.uint8).t()), 0, 1.0)
    raises(ValueError, r"quantize\(\): fmt must be 0 \(E4M3\), 1 \(E5M2\) or 2..7 \(the small formats\), "
           r"got 9", _C.quantize, cap(x), cap(torch.empty(4, 4, dtype=torch.uint8)), 9, 1.0)
    raises(ValueError, r"cast_transpose\(\): fmt must be 0 \(E4M3\) or 1 \(E5M2\), got 2", _C.cast_transpose,
           cap(x), cap(torch.empty(4, 2, dtype=torch.uint8)), cap(torch.empty(2, 4, dtype=torch.uint8)), 2, 1.0)
    raises(ValueError, r"cast_transpose\(\): out_t must have shape \[4, 2\]", _C.cast_transpose, cap(torch.randn(2, 4)),
           cap(torch.empty(2, 4, dtype=torch.uint8)), cap(torch.empty(2, 4, dtype=torch.uint8)), 0, 1.0)
    raises(TypeError, r"dequantize\(\): out must be float32, bfloat16 or float16, got uint8", _C.dequantize,
           cap(torch.zeros(4, dtype=torch.uint8)), cap(torch.zeros(4, dtype=torch.uint8)), 0, 1.0)
    raises(TypeError, r"amax\(\): out must be a float32 tensor, got None", _C.amax, cap(x), None)


def test_c_checks_capsules_and_readonly():
    x = torch.randn(4)
    c = cap(x)
    torch.from_dlpack(c)  # consumes it: renamed "used_dltensor"
    raises(ValueError, r"quantize\(\): x is a capsule named 'used_dltensor', expected an unused 'dltensor' capsule",
           _C.quantize, c, cap(torch.empty(4, dtype=torch.uint8)), 0, 1.0)
    out = np.zeros(4, dtype=np.uint8)
    raises(ValueError, r"quantize\(\): out is read-only", _C.quantize, cap(x),
           dlpack_craft.capsule(out, versioned=True, read_only=True), 0, 1.0)
    raises(ValueError, r"quantize\(\): out is a DLPack 2.0 tensor; fp8ext reads major version 1", _C.quantize, cap(x),
           dlpack_craft.capsule(out, versioned=True, major=2), 0, 1.0)
    _C.quantize(cap(x), dlpack_craft.capsule(out, versioned=True), 0, 1.0)
    assert np.array_equal(out, fp8ext.quantize(x).view(torch.uint8).numpy())


def test_c_rejects_other_devices():
    x = np.zeros(4, dtype=np.float32)
    raises(ValueError, r"quantize\(\): x is on DLPack device type 10:0; fp8ext runs on cpu and cuda devices",
           _C.quantize, dlpack_craft.capsule(x, device_type=10), np.zeros(4, dtype=np.uint8), 0, 1.0)
    raises(ValueError, r"quantize\(\): x is on meta; fp8ext runs on cpu and cuda", fp8ext.quantize,
           torch.empty(4, device="meta"))


def test_c_accepts_versioned_capsules_and_numpy_outputs():
    x = torch.randn(16)
    out = np.zeros(16, dtype=np.uint8)
    _C.quantize(torch._C._to_dlpack_versioned(x) if hasattr(torch._C, "_to_dlpack_versioned") else cap(x), out, 0, 1.0)
    assert np.array_equal(out, fp8ext.quantize(x).view(torch.uint8).numpy())


def test_cuda_tensor_without_a_usable_gpu_is_an_error_not_a_fallback():
    """A tensor that claims to live on a CUDA device, where this build or machine cannot run CUDA."""
    if fp8ext.cuda_available():
        pytest.skip("a CUDA device is present: the GPU tests cover CUDA tensors")
    x = np.zeros(4, dtype=np.float32)
    out = np.zeros(4, dtype=np.uint8)
    c_x, c_out = dlpack_craft.capsule(x, device_type=2), dlpack_craft.capsule(out, device_type=2)
    match = "built without CUDA" if not _C.WITH_CUDA else r"quantize\(\): CUDA error cudaError"
    with pytest.raises(RuntimeError, match=match):
        _C.quantize(c_x, c_out, 0, 1.0)
    raises(ValueError, r"quantize\(\): out is on cpu but x is on cuda:0", _C.quantize, dlpack_craft.capsule(x, device_type=2),
           np.zeros(4, dtype=np.uint8), 0, 1.0)


def test_quantize_blocks_rejects_bad_geometry_at_the_c_boundary():
    x = torch.randn(9, 128)
    out = torch.empty(9, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"quantize_blocks\(\): scale_inv \(1 floats\) is too small"):
        _C.quantize_blocks(cap(x), cap(out), cap(torch.zeros(1)), 0, 1, 128, 2**61, 0)
    with pytest.raises(ValueError, match=r"quantize_blocks\(\): scale_inv \(8 floats\) is too small"):
        _C.quantize_blocks(cap(x), cap(out), cap(torch.zeros(8)), 0, 1, 128, 1, 0)
    with pytest.raises(ValueError, match=r"x must have at least one column"):
        _C.quantize_blocks(cap(torch.zeros(4, 0)), cap(torch.zeros(4, 0, dtype=torch.uint8)), cap(torch.zeros(4)),
                           0, 1, 0, 1, 0)
    with pytest.raises(ValueError, match=r"blocks of 2 x 64 are not supported"):
        _C.quantize_blocks(cap(x), cap(out), cap(torch.zeros(64)), 0, 2, 64, 1, 0)
