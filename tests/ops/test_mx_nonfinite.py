"""NaN and Inf in the block-scaled quantizers (fp8ext/ops/mx.py's "Non-finite values"): a block holding NaN or Inf gets
the NaN scale (MX: E8M0 0xFF, NVFP4: E4M3 0x7F) and dequantizes to NaN as a whole, while every other block gets
the bytes it gets without it; the FP8 casts and the per-row / per-block FP8 quantizers keep their saturating rule;
the weight packers refuse a non-finite weight. GPU tests compare the kernels with the CPU reference byte for byte.
Also: the argument errors of quantize_mx / dequantize_mx / quantize_nvfp4 / dequantize_nvfp4."""

import pytest
import torch
from torch import nn

import fp8ext
from conftest import requires_cuda
from fp8ext.inference import FP8InferenceLinear

MX_ELEMS = [fp8ext.E4M3, fp8ext.E5M2, fp8ext.E3M2, fp8ext.E2M3, fp8ext.E2M1]
RULES = ["floor", "rceil"]
DTYPES = [torch.float32, torch.bfloat16]
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
INF_NAN = [float("nan"), float("inf"), float("-inf")]
NEG_NAN = {torch.float32: torch.tensor(-0x400000, dtype=torch.int32),  # 0xFFC00000
           torch.bfloat16: torch.tensor(-0x40, dtype=torch.int16)}  # 0xFFC0


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def finite_sample(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values with a different power-of-two magnitude per 16 columns, and a zero block."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-12, 12, (rows, cols // 16, 1), generator=g).float())
    x = (torch.randn(rows, cols // 16, 16, generator=g) * mag).reshape(rows, cols)
    x[0, :32] = 0.0
    return x.to(dtype)


def with_bad_block(x: torch.Tensor, row: int, col0: int, width: int, value: float, big: float = 0.0):
    """(x with `value` inside the block [row, col0:col0 + width] and, if big, a large finite value beside it,
    the same x with that block zeroed)."""
    bad, clean = x.clone(), x.clone()
    bad[row, col0 + 5] = value
    if big:
        bad[row, col0 + 1] = big
    clean[row, col0:col0 + width] = 0.0
    return bad, clean


def outside(t: torch.Tensor, row: int, col0: int, width: int) -> torch.Tensor:
    """t's values outside the block [row, col0:col0 + width], as a flat tensor."""
    keep = torch.ones(t.shape, dtype=torch.bool)
    keep[row, col0:col0 + width] = False
    return t[keep.to(t.device)]


# ---- MX ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("f", MX_ELEMS, ids=lambda f: f.name)
def test_mx_block_with_nan_or_inf_gets_the_nan_scale_and_others_are_unaffected(f, rule, dtype, bad):
    x, clean = with_bad_block(finite_sample(4, 128, dtype), 1, 64, 32, BAD[bad], big=3e4)
    elems, scales = fp8ext.quantize_mx(x, f, scale_rule=rule)
    assert scales[1, 2].item() == 0xFF, f"a block holding {bad} has the E8M0 NaN code, got {scales[1, 2].item():#x}"
    back = fp8ext.dequantize_mx(elems, scales, f)
    assert back[1, 64:96].isnan().all(), f"every element of the {bad} block dequantizes to NaN: {back[1, 64:96]}"
    want_e, want_s = fp8ext.quantize_mx(clean, f, scale_rule=rule)
    assert torch.equal(outside(scales, 1, 2, 1), outside(want_s, 1, 2, 1)), "the other blocks' scales"
    assert torch.equal(outside(_u8(elems), 1, 64, 32), outside(_u8(want_e), 1, 64, 32)), "the other blocks' codes"
    assert torch.isfinite(outside(back, 1, 64, 32)).all(), "the other blocks dequantize to finite values"


@pytest.mark.parametrize("block", [16, 64])
def test_mx_other_block_sizes_follow_the_same_rule(block):
    x, clean = with_bad_block(finite_sample(2, 128, torch.float32), 0, block, block, float("inf"))
    elems, scales = fp8ext.quantize_mx(x, fp8ext.E4M3, block)
    assert scales[0, 1].item() == 0xFF
    assert fp8ext.dequantize_mx(elems, scales, fp8ext.E4M3, block)[0, block:2 * block].isnan().all()
    want_e, want_s = fp8ext.quantize_mx(clean, fp8ext.E4M3, block)
    assert torch.equal(outside(scales, 0, 1, 1), outside(want_s, 0, 1, 1))
    assert torch.equal(outside(_u8(elems), 0, block, block), outside(_u8(want_e), 0, block, block))


def test_mx_block_codes_of_a_non_finite_block_are_those_of_the_nan_block():
    """The elements of a non-finite block are x * 2^127 saturated, as for a block holding a NaN: E4M3 keeps the NaN,
    +-Inf and every nonzero finite value give +-max, zero stays zero."""
    x = torch.tensor([float("inf"), float("-inf"), 100.0, -3.0, 0.0, float("nan")] + [1.0] * 26)
    elems, scales = fp8ext.quantize_mx(x, fp8ext.E4M3)
    assert scales.tolist() == [0xFF]
    assert _u8(elems)[:6].tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x00, 0x7F]


# ---- NVFP4 -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_block_with_nan_or_inf_gets_the_nan_scale_and_is_left_out_of_the_tensor_amax(dtype, bad):
    """The bad block also holds the tensor's largest finite value: it still does not count in the tensor's amax."""
    x, clean = with_bad_block(finite_sample(4, 64, dtype, seed=1), 2, 16, 16, BAD[bad], big=3e4)
    elems, bs, ts = fp8ext.quantize_nvfp4(x)
    assert _u8(bs)[2, 1].item() == 0x7F, f"a block holding {bad} has the E4M3 NaN code, got {_u8(bs)[2, 1].item():#x}"
    back = fp8ext.dequantize_nvfp4(elems, bs, ts)
    assert back[2, 16:32].isnan().all(), f"every element of the {bad} block dequantizes to NaN: {back[2, 16:32]}"
    want_e, want_bs, want_ts = fp8ext.quantize_nvfp4(clean)
    assert ts.view(torch.int32).item() == want_ts.view(torch.int32).item(), \
        f"tensor_scale {ts.item()} is the one without the bad block, {want_ts.item()}"
    assert torch.equal(outside(_u8(bs), 2, 1, 1), outside(_u8(want_bs), 2, 1, 1)), "the other block scales"
    assert torch.equal(outside(elems, 2, 16, 16), outside(want_e, 2, 16, 16)), "the other blocks' codes"
    assert torch.isfinite(outside(back, 2, 16, 16)).all(), "the other blocks dequantize to finite values"


def test_nvfp4_every_block_non_finite_gives_tensor_scale_1_and_nan_blocks():
    x = torch.full((2, 32), float("inf"))
    x[1, 16:] = float("nan")
    elems, bs, ts = fp8ext.quantize_nvfp4(x)
    assert ts.item() == 1.0 and _u8(bs).flatten().tolist() == [0x7F] * 4
    assert fp8ext.dequantize_nvfp4(elems, bs, ts).isnan().all()


# ---- FP8 casts and the per-row / per-block FP8 quantizers (established rules, unchanged) ------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("f", [fp8ext.E4M3, fp8ext.E5M2], ids=lambda f: f.name)
def test_fp8_cast_keeps_nan_and_saturates_inf(f, dtype):
    """saturate=True (the default, Transformer Engine's and __NV_SATFINITE's rule): NaN stays NaN with its sign,
    +-Inf becomes +-max. saturate=False: the format's own overflow (E5M2 Inf, E4M3 NaN)."""
    x = torch.tensor([float("nan"), 0.0, float("inf"), -float("inf"), 2.0], dtype=dtype)
    x[1] = NEG_NAN[dtype].view(dtype)  # the sign of a NaN does not survive torch's conversions: set its bits
    sat = _u8(fp8ext.quantize(x, f, 1.0)).tolist()
    assert sat[:4] == [0x7F, 0xFF, f.max_code, 0x80 | f.max_code], sat
    nosat = _u8(fp8ext.quantize(x, f, 1.0, saturate=False)).tolist()
    assert nosat[:4] == [0x7F, 0xFF, f.overflow_code, 0x80 | f.overflow_code], nosat
    assert sat[4] == nosat[4] == _u8(fp8ext.quantize(x[4:], f, 1.0)).item()


def _rowwise(x, f):
    return fp8ext.quantize_rowwise(x, f)


def _block1x128(x, f):
    return fp8ext.quantize_blockwise(x, f, (1, 128))


def _block128x128(x, f):
    return fp8ext.quantize_blockwise(x, f, (128, 128))


# (quantizer, the bad block as (row, col0, rows, cols), the scale_inv entry of that block)
BLOCK_QUANTIZERS = {"rowwise": (_rowwise, (3, 0, 1, 256), (3,)),
                    "1x128": (_block1x128, (3, 128, 1, 128), (3, 1)),
                    "128x128": (_block128x128, (0, 128, 128, 128), (0, 1))}


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("f", [fp8ext.E4M3, fp8ext.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("kind", BLOCK_QUANTIZERS)
def test_fp8_block_quantizers_give_a_non_finite_block_scale_1_and_leave_the_others(kind, f, dtype, bad):
    """A block holding NaN or Inf has nothing finite to fit: scale 1, the saturating cast of its values (NaN stays
    NaN, Inf saturates), scale_inv 1; the other blocks are what they are without it."""
    fn, (r0, c0, nr, nc), sidx = BLOCK_QUANTIZERS[kind]
    x = finite_sample(128, 256, dtype, seed=2)
    x[r0 + nr // 2, c0 + 17] = BAD[bad]
    clean = x.clone()
    clean[r0:r0 + nr, c0:c0 + nc] = 0.0
    q, s = fn(x, f)
    assert s[sidx].item() == 1.0, f"{kind}: scale_inv of the {bad} block is 1, got {s[sidx].item()}"
    want_block = fp8ext.quantize(x[r0:r0 + nr, c0:c0 + nc].contiguous(), f, 1.0)
    assert torch.equal(_u8(q[r0:r0 + nr, c0:c0 + nc]), _u8(want_block)), "the bad block is the saturating cast"
    wq, ws = fn(clean, f)
    keep = torch.ones(q.shape, dtype=torch.bool)
    keep[r0:r0 + nr, c0:c0 + nc] = False
    assert torch.equal(_u8(q)[keep], _u8(wq)[keep]), f"{kind}: the other blocks' codes"
    s_keep = torch.ones(s.shape, dtype=torch.bool)
    s_keep[sidx] = False
    assert torch.equal(s[s_keep], ws[s_keep]), f"{kind}: the other blocks' scale_inv"


# ---- weight packers ----------------------------------------------------------------------------------------------

def _linear(k, n, value, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight[3, 17] = value
    return lin


@pytest.mark.parametrize("value", INF_NAN, ids=str)
@pytest.mark.parametrize("fmt", fp8ext.WEIGHT_ONLY_FORMATS)
def test_weight_only_linear_refuses_a_non_finite_weight(fmt, value):
    with pytest.raises(ValueError, match=r"Linear\.weight holds NaN or Inf \(1 of 16384 values, the first .* at "
                                         r"\[3, 17\]\)"):
        fp8ext.WeightOnlyLinear.from_linear(_linear(256, 64, value), fmt)
    layer = fp8ext.WeightOnlyLinear.from_linear(_linear(256, 64, 1.0), fmt)
    with pytest.raises(ValueError, match=r"pack_\(\): weight holds NaN or Inf \(1 of 16384 values"):
        layer.pack_(_linear(256, 64, value).weight)


@pytest.mark.parametrize("value", INF_NAN, ids=str)
@pytest.mark.parametrize("weights", ["tensor", "channel", "block128"])
def test_fp8_inference_linear_refuses_a_non_finite_weight(weights, value):
    with pytest.raises(ValueError, match=r"FP8InferenceLinear\.from_linear: Linear\.weight holds NaN or Inf \(1 of "
                                         r"4096 values, the first .* at \[3, 17\]\)"):
        FP8InferenceLinear.from_linear(_linear(64, 64, value), weights, "dynamic")


# ---- argument errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block, err", [(0, ValueError), (-32, ValueError), (32.0, TypeError), ("32", TypeError),
                                        (True, TypeError), (None, TypeError)], ids=repr)
def test_mx_block_must_be_a_positive_int(block, err):
    x = torch.randn(4, 64)
    elems, scales = fp8ext.quantize_mx(x)
    with pytest.raises(err, match=r"quantize_mx\(\): block must be a positive int"):
        fp8ext.quantize_mx(x, block=block)
    with pytest.raises(err, match=r"dequantize_mx\(\): block must be a positive int"):
        fp8ext.dequantize_mx(elems, scales, block=block)


def test_dequantize_mx_names_the_argument_it_refuses():
    x = torch.randn(4, 64)
    elems, scales = fp8ext.quantize_mx(x)
    e5, _ = fp8ext.quantize_mx(x, fp8ext.E5M2)
    with pytest.raises(TypeError, match=r"dequantize_mx\(\): elements must be torch.float8_e4m3fn .* got list"):
        fp8ext.dequantize_mx([0] * 64, scales)
    with pytest.raises(TypeError, match=r"elements must be torch.float8_e4m3fn .*got torch.float8_e5m2"):
        fp8ext.dequantize_mx(e5, scales)
    with pytest.raises(TypeError, match=r"elements must be uint8 codes for elem=E2M1, got torch.float32"):
        fp8ext.dequantize_mx(x, scales, fp8ext.E2M1)
    with pytest.raises(TypeError, match=r"scales must be uint8 E8M0 codes, got list"):
        fp8ext.dequantize_mx(elems, [1, 2])
    with pytest.raises(TypeError, match=r"dtype must be one of .* got torch.int32"):
        fp8ext.dequantize_mx(elems, scales, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"elements \[\] and scales \[\] do not match blocks of 32"):
        fp8ext.dequantize_mx(torch.zeros((), dtype=torch.uint8), torch.zeros((), dtype=torch.uint8), fp8ext.E2M1)
    back = fp8ext.dequantize_mx(elems.view(torch.uint8), scales)  # the float8 elements' bytes are accepted
    assert torch.equal(back, fp8ext.dequantize_mx(elems, scales))


def test_nvfp4_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"quantize_nvfp4\(\): the last dimension of x must be a multiple of 16 "
                                         r"\(NVFP4's block\), got shape \[2, 24\]"):
        fp8ext.quantize_nvfp4(torch.randn(2, 24))
    with pytest.raises(TypeError, match=r"quantize_nvfp4\(\): x must be a float32, bfloat16 or float16 tensor"):
        fp8ext.quantize_nvfp4([1.0] * 16)
    elems, bs, ts = fp8ext.quantize_nvfp4(torch.randn(2, 32))
    with pytest.raises(TypeError, match=r"dequantize_nvfp4\(\): block_scales must be torch.float8_e4m3fn"):
        fp8ext.dequantize_nvfp4(elems, bs.view(torch.uint8), ts)
    with pytest.raises(TypeError, match=r"dequantize_nvfp4\(\): elements must be uint8 E2M1 codes"):
        fp8ext.dequantize_nvfp4(elems.float(), bs, ts)
    with pytest.raises(TypeError, match=r"dequantize_nvfp4\(\): tensor_scale must be a one-element float tensor"):
        fp8ext.dequantize_nvfp4(elems, bs, 1.0)
    with pytest.raises(ValueError, match=r"dequantize_nvfp4\(\): elements \[2, 32\] and block_scales \[2, 1\]"):
        fp8ext.dequantize_nvfp4(elems, bs[:, :1], ts)


# ---- on a GPU: the kernels give the CPU reference's bytes ----------------------------------------------------------

def _mixed_sample(dtype: torch.dtype, block: int) -> torch.Tensor:
    """[64, 512]: blocks holding NaN, +Inf, -Inf, NaN and Inf together, a non-finite value beside the largest finite
    value of the tensor, whole non-finite blocks, and finite blocks everywhere else."""
    x = finite_sample(64, 512, torch.float32, seed=5)
    x[1, 5] = float("nan")
    x[2, 3 * block + 1] = float("inf")
    x[3, 7] = float("-inf")
    x[4, 2 * block], x[4, 2 * block + 3] = float("nan"), float("inf")
    x[5, block + 2], x[5, block + 3] = 6e4, float("inf")
    x[6, :block] = float("inf")
    x[7, block:2 * block] = float("nan")
    x[63, -1] = float("-inf")  # the last block of the tensor
    return x.to(dtype)


def _gpu_equals_cpu(got, want, what):
    assert got.is_cuda and got.shape == want.shape and got.dtype == want.dtype, what
    g, w = _u8(got).cpu().reshape(-1), _u8(want).reshape(-1)
    bad = (g != w).nonzero().flatten()[:4].tolist()
    assert not bad, f"{what}: {int((g != w).sum())} bytes differ, first at {bad}: gpu {g[bad].tolist()}, " \
                    f"cpu {w[bad].tolist()}"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("f", MX_ELEMS, ids=lambda f: f.name)
def test_mx_non_finite_blocks_on_the_gpu_give_the_cpu_bytes(f, rule, dtype):
    x = _mixed_sample(dtype, 32)
    e_cpu, s_cpu = fp8ext.quantize_mx(x, f, scale_rule=rule)
    e_gpu, s_gpu = fp8ext.quantize_mx(x.cuda(), f, scale_rule=rule)
    _gpu_equals_cpu(s_gpu, s_cpu, f"{f.name} {rule} {dtype} scales")
    _gpu_equals_cpu(e_gpu, e_cpu, f"{f.name} {rule} {dtype} elements")
    assert (s_cpu[1:8] == 0xFF).sum().item() == 7, "one NaN-scaled block in each of rows 1 to 7"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_nvfp4_non_finite_blocks_on_the_gpu_give_the_cpu_bytes(dtype):
    x = _mixed_sample(dtype, 16)
    e_cpu, b_cpu, t_cpu = fp8ext.quantize_nvfp4(x)
    e_gpu, b_gpu, t_gpu = fp8ext.quantize_nvfp4(x.cuda())
    assert t_gpu.cpu().view(torch.int32).item() == t_cpu.view(torch.int32).item(), \
        f"tensor_scale gpu {t_gpu.item()}, cpu {t_cpu.item()}"
    _gpu_equals_cpu(b_gpu, b_cpu, f"{dtype} block scales")
    _gpu_equals_cpu(e_gpu, e_cpu, f"{dtype} elements")
    assert torch.isfinite(t_cpu) and _u8(b_cpu)[5, 1].item() == 0x7F


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("f", [fp8ext.E4M3, fp8ext.E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("kind", BLOCK_QUANTIZERS)
def test_fp8_block_quantizers_with_non_finite_blocks_on_the_gpu_give_the_cpu_bytes(kind, f, dtype):
    fn = BLOCK_QUANTIZERS[kind][0]
    x = _mixed_sample(dtype, 128)
    x = torch.cat([x, x.flip(0)])  # 128 rows: one full 128 x 128 block row
    q_cpu, s_cpu = fn(x, f)
    q_gpu, s_gpu = fn(x.cuda(), f)
    _gpu_equals_cpu(q_gpu, q_cpu, f"{kind} {f.name} {dtype} codes")
    assert torch.equal(s_gpu.cpu(), s_cpu), f"{kind} {f.name} {dtype} scale_inv"
