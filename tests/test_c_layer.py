"""Regression tests for the C layer's review findings: overlapping outputs, shape arithmetic, scales held in
host memory, empty inputs, the delayed-scaling rule for negative history entries, and (on a GPU) the
cast-transpose vector path, the GEMM plan cache's bound, autotune and the exit of a process that used cuBLASLt."""

import ctypes
import math
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import dlpack_craft
import fp8ext
from conftest import DEVICES, assert_same_bytes, requires_cuda
from fp8ext import _C

BAD_SCALES = [float("nan"), 0.0, -1.0, float("inf")]


# ---- outputs that overlap scale, each other or x: refused ----------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
@pytest.mark.parametrize("written, other", [("scale_inv_out", "scale"), ("amax_out", "scale"),
                                            ("scale_inv_out", "amax_out")])
def test_outputs_sharing_memory_with_scale_or_each_other_are_refused(device, op, written, other):
    buf = torch.ones(2, device=device)
    kwargs = {"scale": torch.ones((), device=device)}
    kwargs[written] = buf[0:1]
    kwargs[other] = buf[0] if other == "scale" else buf[0:1]  # a 0-d and a 1-element view of the same float
    x = torch.ones(4, 8, device=device)
    with pytest.raises(ValueError, match=rf"{op}\(\): {written} and {other} share memory"):
        getattr(fp8ext, op)(x, fp8ext.E4M3, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
def test_amax_out_inside_x_is_refused(device, op):
    x = torch.ones(4, 8, device=device)
    with pytest.raises(ValueError, match=rf"{op}\(\): amax_out and x share memory"):
        getattr(fp8ext, op)(x, fp8ext.E4M3, 1.0, amax_out=x[1, 2:3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
def test_neighbouring_elements_of_one_buffer_are_accepted(device, op):
    buf = torch.tensor([0.0, 0.0, 4.0], device=device)  # amax, scale_inv, scale side by side
    getattr(fp8ext, op)(torch.full((4, 8), -3.0, device=device), fp8ext.E4M3, buf[2], amax_out=buf[0:1],
                        scale_inv_out=buf[1:2])
    assert buf.tolist() == [3.0, 0.25, 4.0], "amax_out, scale_inv_out written; scale untouched"


# ---- a shape's element count: no negative dimension, no overflow ---------------------------------

def crafted_capsule(shape):
    """A DLPack capsule of float32 on the CPU claiming `shape` over a 16-byte buffer (never read: refused)."""
    buf = np.zeros(4, dtype=np.float32)
    dims = (ctypes.c_int64 * len(shape))(*shape)
    t = dlpack_craft.DLTensor(buf.ctypes.data, dlpack_craft.DLDevice(1, 0), len(shape),
                              dlpack_craft.DLDataType(2, 32, 1), dims, None, 0)
    m = dlpack_craft.DLManagedTensor(t, None, None)
    dlpack_craft._KEEP.extend([buf, dims, m])
    return dlpack_craft._capsule_new(ctypes.addressof(m), b"dltensor", None)


@pytest.mark.parametrize("shape, match", [
    ((-4, 4), r"amax\(\): x has shape \[-4, 4\]; a dimension cannot be negative"),
    ((4, -1), r"a dimension cannot be negative"),
    ((2**62, 4), r"amax\(\): x has shape \[4611686018427387904, 4\]; its element count does not fit in int64"),
    ((3, 2**62), r"does not fit in int64"),
    ((2**31, 2**31, 2**31), r"does not fit in int64"),
    ((2**61, 2), r"does not fit in int64"),  # 2**62 elements fit, 2**64 bytes of float32 do not
    ((0, 2**62, 4), r"does not fit in int64"),  # empty, but its strides would have wrapped
], ids=lambda v: str(list(v)) if isinstance(v, tuple) else "")
def test_shapes_whose_element_count_is_negative_or_overflows_are_refused(shape, match):
    out = torch.zeros(())
    with pytest.raises(ValueError, match=match):
        _C.amax(crafted_capsule(shape), torch._C._to_dlpack(out))
    assert out.item() == 0.0


# ---- scales and scale_invs in host memory follow the rule of Python numbers ----------------------

@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
def test_cpu_scale_tensor_must_be_finite_and_positive(op, bad):
    with pytest.raises(ValueError, match=rf"{op}\(\): scale must be finite and positive, got {bad:g} \(a CPU tensor\)"):
        getattr(fp8ext, op)(torch.ones(4, 8), fp8ext.E4M3, torch.tensor(bad))


@pytest.mark.parametrize("bad", BAD_SCALES, ids=str)
def test_cpu_scale_inv_tensor_of_dequantize_must_be_finite_and_positive(bad):
    q = fp8ext.quantize(torch.ones(8))
    with pytest.raises(ValueError, match=rf"dequantize\(\): scale_inv must be finite and positive, got {bad:g}"):
        fp8ext.dequantize(q, torch.tensor(bad))
