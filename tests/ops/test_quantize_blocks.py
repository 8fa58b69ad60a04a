"""Block scaling (quantize_rowwise, quantize_blockwise) against numpy: per block, scale = fmt.max / amax
(1 for an all-zero block), q = fp8(x * scale) saturating, scale_inv = 1 / scale; GPU == CPU byte for byte."""

import numpy as np
import pytest
import torch

import fp8ext
import reference
from conftest import requires_cuda
from fp8ext.core.boundary import FP8_DLPACK
from fp8ext.testing import assert_fp8_equal

FORMATS = [fp8ext.E4M3, fp8ext.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference_blocks(x: torch.Tensor, fmt, br: int, bc: int):
    xf = x.float().numpy()
    rows, cols = xf.shape
    q = np.zeros(xf.shape, dtype=np.uint8)
    s_inv = np.zeros((-(-rows // br), -(-cols // bc)), dtype=np.float32)
    for i, r0 in enumerate(range(0, rows, br)):
        for j, c0 in enumerate(range(0, cols, bc)):
            blk = xf[r0:r0 + br, c0:c0 + bc]
            amax = np.float32(np.abs(blk).max())
            scale = np.float32(fmt.max) / amax if 0 < amax < np.inf else np.float32(1.0)
            with np.errstate(over="ignore"):
                q[r0:r0 + br, c0:c0 + bc] = reference.quantize(blk * scale, fmt.name, True, x=blk)
            s_inv[i, j] = np.float32(1.0) / scale
    return q, s_inv


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, (shape[0], 1), generator=g).float())
    x[0, :5] = 0.0
    if shape[0] > 4:
        x[4] = 0.0  # an all-zero row
    return x.to(dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, shape", [("row", (37, 200)), ("1x128", (36, 200)), ("1x128", (8, 512)),
                                         ("128x128", (200, 264)), ("128x128", (128, 128))])
def test_blocks_match_numpy(fmt, dtype, kind, shape):
    x = sample(shape, dtype)
    if kind == "row":
        q, s = fp8ext.quantize_rowwise(x, fmt)
        want_q, want_s = reference_blocks(x, fmt, 1, shape[1])
        want_s = want_s[:, 0]
    else:
        br = 1 if kind == "1x128" else 128
        q, s = fp8ext.quantize_blockwise(x, fmt, (br, 128))
        want_q, want_s = reference_blocks(x, fmt, br, 128)
    assert_fp8_equal(q, want_q, strict_nan=True, input=x, msg=f"{kind} {shape}")
    assert np.array_equal(s.numpy(), want_s), "scale_inv"


@pytest.mark.parametrize("kind", ["1x128", "128x128"])
def test_block_scale_layouts_are_what_gemm_reads(kind):
    x = torch.randn(64, 640)
    _, s = fp8ext.quantize_blockwise(x, block=(1, 128) if kind == "1x128" else (128, 128))
    if kind == "1x128":
        assert s.shape == (64, 5) and s.stride() == (1, 64)
    else:
        assert s.shape == (1, 5) and s.stride() == (8, 1)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, shape", [("row", (37, 200)), ("row", (64, 8192)), ("1x128", (36, 200)),
                                         ("1x128", (1024, 4096)), ("128x128", (200, 264)), ("128x128", (1024, 1536))])
def test_blocks_gpu_equals_cpu(fmt, dtype, kind, shape):
    x = sample(shape, dtype, seed=1)
    if kind == "row":
        q, s = fp8ext.quantize_rowwise(x, fmt)
        qg, sg = fp8ext.quantize_rowwise(x.cuda(), fmt)
    else:
        block = (1, 128) if kind == "1x128" else (128, 128)
        q, s = fp8ext.quantize_blockwise(x, fmt, block)
        qg, sg = fp8ext.quantize_blockwise(x.cuda(), fmt, block)
    assert_fp8_equal(qg, q, strict_nan=True, input=x, msg=f"{kind} {shape}")
    assert torch.equal(sg.cpu(), s) and sg.stride() == s.stride()


@pytest.mark.skipif(not FP8_DLPACK,
                    reason="this torch exports no float8 dtype through DLPack (fp8ext passes uint8 views then)")
def test_the_binding_refuses_float8_outputs_of_the_other_format():
    """The block casts' outputs go through the FP8 tensor descriptor's checks (csrc/py_fp8_tensor.c): an out or qt
    that is a float8 tensor of the other format is refused, naming it, instead of receiving codes it would
    misread."""
    from fp8ext import _C
    dl = torch._C._to_dlpack
    x = torch.randn(16, 128)
    sinv = torch.empty(16)
    q5 = torch.empty(16, 128, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"quantize_blocks\(\): out holds float8_e5m2 values but the format given "
                                         r"for it is E4M3"):
        _C.quantize_blocks(dl(x), dl(q5), dl(sinv), fp8ext.E4M3.code, 1, 128, 1, 0)
    q4 = torch.empty(16, 128, dtype=torch.float8_e4m3fn)
    qt5 = torch.empty(128, 16, dtype=torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"qt holds float8_e5m2"):
        _C.quantize_blocks(dl(x), dl(q4), dl(sinv), fp8ext.E4M3.code, 1, 128, 1, 0, qt=dl(qt5),
                           scale_inv_t=dl(torch.empty(128)), stride_rt=1, stride_ct=0)
    _C.quantize_blocks(dl(x), dl(q4), dl(sinv), fp8ext.E4M3.code, 1, 128, 1, 0)  # the matching format is taken
