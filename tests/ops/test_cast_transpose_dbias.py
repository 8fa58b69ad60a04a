"""cast_transpose_dbias: cast_transpose's bytes, amax and scale_inv, plus dbias = dy summed over rows.

dbias is summed in float32 in the fixed order that csrc/cast.h documents (per 64-row tile: 16 row groups of
4 rows, then the groups, then the tiles in order) and rounded once to dy's dtype, so every device must give the
bits of `ordered_sum` below, which redoes that order with torch float32 additions on the CPU; it is also held
to float64 within the error bound of that order. GPU instances (DEVICES) run where CUDA is present.
"""
import pytest
import torch

import fp8ext
from fp8ext import _C
from fp8ext.ops import cast_transpose_dbias  # also fp8ext.cast_transpose_dbias once __init__ exports it
from fp8ext.core.boundary import FP8_DLPACK
from conftest import DEVICES, requires_cuda

FORMATS = [fp8ext.E4M3, fp8ext.E5M2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Ragged and aligned: one row, 16 columns, edges of the 64x64 tiles, columns not a multiple of 8, several tiles.
SHAPES = [(1, 16), (1, 1), (3, 5), (64, 64), (65, 64), (64, 72), (130, 70), (200, 24), (257, 136), (1000, 40)]
TILE, GROUPS = 64, 16


def data(shape, dtype, device="cpu", seed=0, scale=30.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """dbias before its final rounding, in float32, in csrc/cast.h's order (each `+` one float32 rounding)."""
    xf = x.cpu().float()
    rows, cols = xf.shape
    total = torch.zeros(cols)
    for t0 in range(0, rows, TILE):
        tile_sum = torch.zeros(cols)
        for h in range(GROUPS):
            group = torch.zeros(cols)
            for r in range(t0 + h, min(t0 + TILE, rows), GROUPS):
                group = group + xf[r]
            tile_sum = tile_sum + group
        total = total + tile_sum
    return total


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_q_amax_and_scale_inv_are_cast_transposes(device, fmt, dtype, shape):
    x = data(shape, dtype, device)
    acc, want_acc = torch.full((), 0.5, device=device), torch.full((), 0.5, device=device)
    sinv, want_sinv = torch.zeros((), device=device), torch.zeros((), device=device)
    scale = torch.tensor(0.7, device=device)
    q, qt, db = cast_transpose_dbias(x, fmt, scale, amax_out=acc, scale_inv_out=sinv)
    wq, wqt = fp8ext.cast_transpose(x, fmt, scale, amax_out=want_acc, scale_inv_out=want_sinv)
    assert q.dtype == qt.dtype == fmt.torch_dtype and q.shape == shape and qt.shape == shape[::-1]
    assert q.device == qt.device == db.device == x.device
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), "q: cast_transpose's bytes"
    assert torch.equal(qt.view(torch.uint8), wqt.view(torch.uint8)), "q_t: cast_transpose's bytes"
    assert bits(acc).item() == bits(want_acc).item() == bits(x.abs().max().float()).item(), "amax_out = max|dy|"
    assert bits(sinv).item() == bits(want_sinv).item() == bits(torch.tensor(1.0) / 0.7).item(), "scale_inv = 1/scale"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dbias_has_the_documented_order_bits_in_dys_dtype(device, dtype, shape):
    x = data(shape, dtype, device, seed=1)
    _, _, db = cast_transpose_dbias(x, fp8ext.E5M2, 2.0)
    assert db.dtype == dtype and db.shape == (shape[1],), "dbias is [N] in dy's dtype, as Transformer Engine's"
    want = ordered_sum(x).to(dtype)
    diff = (db.cpu().float() - want.float()).abs().max()
    assert torch.equal(bits(db), bits(want)), f"dbias bits on {device}: max difference {diff}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1000, 40), (257, 136), (4096, 24)], ids=str)
def test_dbias_is_the_float64_sum_within_the_orders_error_bound(device, dtype, shape):
    x = data(shape, dtype, device, seed=2)
    _, _, db = cast_transpose_dbias(x, fp8ext.E5M2, 1.0)
    x64 = x.cpu().double()
    want, mag = x64.sum(0), x64.abs().sum(0)
    # Each term goes through at most 4 + 16 + tiles float32 additions (unit roundoff 2^-24 each), then one
    # rounding to dtype (half an ulp: eps / 2 relative).
    depth = TILE // GROUPS + GROUPS + -(-shape[0] // TILE)
    tol = depth * 2.0**-24 * mag * 1.01 + torch.finfo(dtype).eps * want.abs() + torch.finfo(dtype).tiny
    err = (db.cpu().double() - want).abs()
    assert bool((err <= tol).all()), f"max error {err.max():.3g}, bound {tol[err.argmax()]:.3g}"


@pytest.mark.parametrize("device", DEVICES)
def test_float32_dbias_buffer_holds_the_sum_before_rounding(device):
    x = data((300, 48), torch.bfloat16, device, seed=3)
    bufs = (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(x.shape[::-1], dtype=torch.float8_e4m3fn, device=device),
            torch.empty(48, dtype=torch.float32, device=device))
    q, qt, db = cast_transpose_dbias(x, out=bufs)
    assert q is bufs[0] and qt is bufs[1] and db is bufs[2]
    assert torch.equal(bits(db), bits(ordered_sum(x)))
    _, _, db16 = cast_transpose_dbias(x)
    assert torch.equal(bits(db.to(torch.bfloat16)), bits(db16)), "the bf16 dbias is the float32 one rounded once"


@pytest.mark.parametrize("device", DEVICES)
def test_workspace_holds_each_tiles_column_sums(device):
    """The C API's contract (csrc/cast.h): workspace[t] is tile t's column sums, on every device."""
    x = data((150, 24), torch.float16, device, seed=4)
    ws = torch.full(_C.cast_transpose_dbias_workspace(150, 24), float("nan"), device=device)
    assert ws.shape == (3, 24)
    q = torch.empty(x.shape, dtype=torch.uint8, device=device)
    qt = torch.empty(x.shape[::-1], dtype=torch.uint8, device=device)
    db = torch.empty(24, dtype=torch.float32, device=device)
    _C.cast_transpose_dbias(x, q, qt, db, ws, fp8ext.E4M3.code, 1.0,
                            stream=torch.cuda.current_stream().cuda_stream if device == "cuda" else 0)
    for t in range(3):
        assert torch.equal(bits(ws[t]), bits(ordered_sum(x[64 * t:64 * (t + 1)]))), f"tile {t}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(0, 16), (16, 0), (0, 0)], ids=str)
def test_empty_dy_gives_zero_dbias_and_still_writes_scale_inv(device, shape):
    x = torch.empty(shape, dtype=torch.bfloat16, device=device)
    acc, sinv = torch.full((), 3.0, device=device), torch.zeros((), device=device)
    q, qt, db = cast_transpose_dbias(x, fp8ext.E4M3, 4.0, acc, scale_inv_out=sinv)
    assert q.shape == shape and qt.shape == shape[::-1] and db.shape == (shape[1],)
    assert torch.equal(db.cpu(), torch.zeros(shape[1], dtype=torch.bfloat16)), "a sum over no rows is 0"
    assert acc.item() == 3.0 and sinv.item() == 0.25


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_columns(device):
    x = torch.ones(130, 4)
    x[70, 1] = float("nan")
    x[5, 2], x[100, 3] = float("inf"), float("-inf")
    x[6, 3] = float("inf")  # inf + -inf in one column: NaN
    _, _, db = cast_transpose_dbias(x.to(device))
    db = db.cpu()
    assert db[0].item() == 130.0 and db[2].item() == float("inf")
    assert db[1].isnan().item() and db[3].isnan().item(), "NaN (its bits are not specified: x86 and GPUs differ)"


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_dy_takes_the_element_path_with_the_same_results(device):
    """A dy starting 4 bytes past an aligned address: the GPU kernel's vector path cannot read it."""
    base = data((128 * 64 + 2,), torch.bfloat16, device, seed=5)
    x = base[2:].view(128, 64)
    q, qt, db = cast_transpose_dbias(x, fp8ext.E4M3, 0.5)
    wq, wqt = fp8ext.cast_transpose(x.contiguous(), fp8ext.E4M3, 0.5)
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), wqt.view(torch.uint8))
    assert torch.equal(bits(db), bits(ordered_sum(x).to(torch.bfloat16)))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8192, 64), (3000, 1024), (1040, 4096), (4097, 136), (2, 8200)], ids=str)
def test_gpu_equals_cpu_bit_for_bit_on_large_shapes(fmt, dtype, shape):
    """Many tiles: the second stage's batches of 16 loads and their tail, full and edge tiles mixed."""
    x = data(shape, dtype, seed=6, scale=300.0)
    acc_c, acc_g = torch.zeros(()), torch.zeros((), device="cuda")
    q, qt, db = cast_transpose_dbias(x, fmt, 0.5, acc_c, saturate=False)
    qg, qtg, dbg = cast_transpose_dbias(x.cuda(), fmt, torch.tensor(0.5, device="cuda"), acc_g, saturate=False)
    assert torch.equal(qg.cpu().view(torch.uint8), q.view(torch.uint8)), "q"
    assert torch.equal(qtg.cpu().view(torch.uint8), qt.view(torch.uint8)), "q_t"
    assert torch.equal(bits(dbg), bits(db)), "dbias"
    assert acc_g.item() == acc_c.item()


def pipeline(x, acc):
    q, qt, db = cast_transpose_dbias(x, fp8ext.E5M2, 2.0, amax_out=acc)
    db32 = torch.empty(x.shape[1], dtype=torch.float32, device=x.device)
    cast_transpose_dbias(x, fp8ext.E5M2, 2.0, out=(torch.empty_like(q), torch.empty_like(qt), db32))
    return q, qt, db * 1, db32


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_call_has_no_graph_break_and_matches_eager(device):
    torch._dynamo.reset()
    x = data((96, 40), torch.bfloat16, device, seed=7)
    compiled = torch.compile(pipeline, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    acc_e, acc_c = torch.zeros((), device=device), torch.zeros((), device=device)
    for e, c in zip(pipeline(x, acc_e), compiled(x, acc_c)):
        assert e.dtype == c.dtype and e.shape == c.shape
        assert torch.equal(bits(e) if e.element_size() > 1 else e.view(torch.uint8),
                           bits(c) if c.element_size() > 1 else c.view(torch.uint8))
    assert acc_c.item() == acc_e.item() == x.abs().max().float().item(), "the amax_out update survives compilation"


def test_torch_op_has_a_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(8, 4, dtype=torch.float16)
        q, qt, db, a = torch.ops.fp8ext.cast_transpose_dbias(x, fp8ext.E5M2.code, None, 1.0, True, torch.empty(1),
                                                             False)
    assert q.dtype == qt.dtype == torch.float8_e5m2 and q.shape == (8, 4) and qt.shape == (4, 8)
    assert db.dtype == torch.float16 and db.shape == (4,) and a.shape == (1,)


def c_args(x, dbias_dtype=None, ws_shape=None):
    """Buffers for _C.cast_transpose_dbias, right unless told otherwise."""
    rows, cols = x.shape
    return (x, torch.empty(x.shape, dtype=torch.uint8), torch.empty(cols, rows, dtype=torch.uint8),
            torch.empty(cols, dtype=dbias_dtype or x.dtype),
            torch.empty(ws_shape or _C.cast_transpose_dbias_workspace(rows, cols)))


def test_wrong_arguments_are_refused_by_name():
    x = data((48, 80), torch.bfloat16)
    fn = cast_transpose_dbias
    with pytest.raises(ValueError, match=r"cast_transpose_dbias\(\): x must be 2-D"):
        fn(torch.ones(4))
    with pytest.raises(TypeError, match=r"cast_transpose_dbias\(\): x must be float32, bfloat16 or float16, got "
                                        r"torch.int32"):
        fn(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"out must be a triple"):
        fn(x, out=(torch.empty(1), torch.empty(1)))
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    qt = torch.empty(x.shape[::-1], dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match=r"out\[2\] must be torch.bfloat16, got torch.float16"):
        fn(x, out=(q, qt, torch.empty(80, dtype=torch.float16)))
    with pytest.raises(ValueError, match=r"out\[2\] must have shape \[80\], got \[48\]"):
        fn(x, out=(q, qt, torch.empty(48, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"out\[1\] must have shape \[80, 48\]"):
        fn(x, out=(q, q, torch.empty(80, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match=r"scale must be finite and positive"):
        fn(x, scale=0.0)


def test_c_binding_checks_every_buffer_by_name():
    x = data((48, 80), torch.bfloat16)
    c = _C.cast_transpose_dbias
    with pytest.raises(TypeError, match=r"cast_transpose_dbias\(\): dbias must be bfloat16 \(x's dtype\) or float32, "
                                        r"got float16"):
        c(*c_args(x, torch.float16), 0, 1.0)
    a = c_args(x)
    with pytest.raises(ValueError, match=r"dbias must have shape \[80\]"):
        c(*a[:3], torch.empty(48, dtype=torch.bfloat16), a[4], 0, 1.0)
    with pytest.raises(ValueError, match=r"workspace must have shape \[1, 80\] \(one row per 64 rows of x\)"):
        c(*c_args(x, ws_shape=(2, 80)), 0, 1.0)
    with pytest.raises(TypeError, match=r"workspace must be float32, got float64"):
        c(*a[:4], torch.empty(1, 80, dtype=torch.float64), 0, 1.0)
    with pytest.raises(ValueError, match=r"workspace must be contiguous"):
        c(*a[:4], torch.empty(1, 160)[:, ::2], 0, 1.0)
    with pytest.raises(ValueError, match=r"dbias must be contiguous"):
        c(*a[:3], torch.empty(80, 2, dtype=torch.bfloat16)[:, 0], a[4], 0, 1.0)
    ws = torch.empty(1, 80)
    with pytest.raises(ValueError, match=r"dbias and workspace share memory"):
        c(*a[:3], ws[0], ws, 0, 1.0)
    with pytest.raises(ValueError, match=r"out_t must have shape \[80, 48\]"):
        c(a[0], a[1], a[1], *a[3:], 0, 1.0)
    if FP8_DLPACK:  # this torch exports float8 tensors, so C sees their format
        with pytest.raises(ValueError, match=r"out_t holds float8_e5m2 values but the format given for it is E4M3"):
            c(a[0], a[1], torch.empty(80, 48, dtype=torch.float8_e5m2), *a[3:], 0, 1.0)
    with pytest.raises(ValueError, match=r"fmt must be 0 \(E4M3\) or 1 \(E5M2\), got 7"):
        c(*a, 7, 1.0)
    with pytest.raises(ValueError, match=r"rows and cols must be >= 0"):
        _C.cast_transpose_dbias_workspace(-1, 4)
