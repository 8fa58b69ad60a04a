"""Float8BlockScaling and Float8RowwiseScaling: the recipes, their power-of-two scales, and FP8Linear under them
compared bit for bit with the composition of quantize_blockwise / quantize_rowwise and gemm, and with float64."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8ext
from fp8ext.recipe import Float8BlockScaling, Float8RowwiseScaling, Format, MMParams, QParams

from conftest import DEVICES, assert_same_bytes


# ---- the recipes --------------------------------------------------------------------------------------------

def test_block_recipe_has_transformer_engines_names_and_defaults():
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    pow2 = os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1"  # TE's switch, read as TE reads it
    assert r.fp8_quant_fwd_inp == r.fp8_quant_fwd_weight == r.fp8_quant_bwd_grad == QParams(power_2_scale=pow2)
    assert r.fp8_gemm_fprop == r.fp8_gemm_dgrad == r.fp8_gemm_wgrad == MMParams(use_split_accumulator=True)
    assert fp8ext.Float8BlockScaling is Float8BlockScaling and hash(r) == hash(Float8BlockScaling())
    q = Float8RowwiseScaling()
    assert q.fp8_format is Format.E4M3 and q.power_2_scale and q.amax_epsilon == 0.0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x_block_scaling_dim=2), NotImplementedError, "x_block_scaling_dim=2 is not supported"),
    (dict(grad_block_scaling_dim=2), NotImplementedError, "grad_block_scaling_dim=2 is not supported"),
    (dict(w_block_scaling_dim=3), ValueError, "w_block_scaling_dim must be 1"),
    (dict(fp8_gemm_wgrad=MMParams(use_split_accumulator=False)), ValueError, "fp8_gemm_wgrad must be MMParams"),
    (dict(fp8_format=Format.E5M2), ValueError, "pure E5M2"),
    (dict(fp8_mha=True), NotImplementedError, "fp8_mha=True"),
    (dict(fp8_quant_fwd_inp=0.5), TypeError, "fp8_quant_fwd_inp must be a fp8ext.recipe.QParams"),
])
def test_block_recipe_refuses_what_it_cannot_do(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8BlockScaling(**kwargs)


def test_rowwise_recipe_and_qparams_refuse_bad_values():
    with pytest.raises(ValueError, match="amax_epsilon must be a finite number"):
        QParams(amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="amax_epsilon must be a finite number"):
        Float8RowwiseScaling(amax_epsilon=float("nan"))
    for bad in (True, 1e39):
        with pytest.raises(ValueError, match="Float8RowwiseScaling: amax_epsilon must be a finite number"):
            Float8RowwiseScaling(amax_epsilon=bad)
    with pytest.raises(ValueError, match="pure E5M2"):
        Float8RowwiseScaling(fp8_format=Format.E5M2)


# ---- power-of-two scales and amax_epsilon in the casts --------------------------------------------------------

def _block_amax64(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """float64 amax of each br x bc block of x (partial blocks at the edges)."""
    rows, cols = x.shape
    xp = F.pad(x.double().abs(), (0, -cols % bc, 0, -rows % br))
    return xp.reshape(xp.shape[0] // br, br, xp.shape[1] // bc, bc).amax(dim=(1, 3))


def _pow2_scale64(amax: torch.Tensor, fmt_max: float, eps: float = 0.0) -> torch.Tensor:
    a = amax.clamp(min=eps)
    s = torch.where(a > 0, fmt_max / a, torch.ones_like(a))
    return torch.exp2(torch.floor(torch.log2(s)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [(1, 128), (128, 128), "row"])
@pytest.mark.parametrize("fmt", [fp8ext.E4M3, fp8ext.E5M2])
def test_power_of_two_scales_match_a_float64_reference_and_torchs_cast(device, block, fmt):
    torch.manual_seed(0)
    x = (torch.randn(256, 384) * torch.logspace(-6, 6, 384)).to(device, torch.bfloat16)
    x[5, :200] = 0  # an all-zero 1x128 tile and part of a row
    if block == "row":
        q, s = fp8ext.quantize_rowwise(x, fmt, power_2_scale=True)
        amax = _block_amax64(x.cpu(), 1, x.shape[1])[:, 0]
        want = _pow2_scale64(amax, fmt.max)
        scale_full = want[:, None].expand(x.shape)
    else:
        q, s = fp8ext.quantize_blockwise(x, fmt, block, power_2_scale=True)
        amax = _block_amax64(x.cpu(), *block)
        want = _pow2_scale64(amax, fmt.max)
        scale_full = want.repeat_interleave(block[0], 0)[:x.shape[0]].repeat_interleave(128, 1)[:, :x.shape[1]]
    assert torch.equal(s.cpu().double(), 1 / want), "scale_inv = 2^-floor(log2(fmt.max / amax))"
    ref = (x.cpu().float() * scale_full.float()).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)
    assert_same_bytes(q.cpu(), ref, "codes = torch's cast of x * scale")


@pytest.mark.parametrize("device", DEVICES)
def test_amax_epsilon_floors_each_blocks_amax(device):
    x = torch.zeros(4, 256, device=device)
    x[1, :128] = 1e-9  # below epsilon
    x[2, 128:] = 3.0   # above it
    q, s = fp8ext.quantize_blockwise(x, fp8ext.E4M3, (1, 128), amax_epsilon=1e-6)
    s = s.cpu()
    assert s[0, 0].item() == pytest.approx(1e-6 / 448, rel=1e-6), "an all-zero block takes fmt.max / epsilon"
    assert s[1, 0].item() == pytest.approx(1e-6 / 448, rel=1e-6)
    assert s[2, 1].item() == pytest.approx(3.0 / 448, rel=1e-6)
    with pytest.raises(ValueError, match="amax_epsilon must be a finite number >= 0"):
        fp8ext.quantize_rowwise(x, amax_epsilon=-1.0)


# ---- FP8Linear under the recipes, against the composition of the public ops ---------------------------------

def _composition(recipe, x, w, b, dy):
    """(y, dx, dW, db) of one FP8 linear step built from quantize_blockwise / quantize_rowwise and gemm only: every
    GEMM operand cast from the high-precision tensor along the dimension that GEMM contracts."""
    if isinstance(recipe, Float8BlockScaling):
        fwd, bwd = recipe.fp8_format.fwd, recipe.fp8_format.bwd
        qp = recipe.fp8_quant_fwd_inp.power_2_scale

        def cast(t, fmt, blocks):
            return fp8ext.quantize_blockwise(t.contiguous(), fmt, blocks, power_2_scale=qp)
        tile, wblock, fast = (1, 128), ((128, 128) if recipe.w_block_scaling_dim == 2 else (1, 128)), False
    else:
        fwd, bwd = recipe.fp8_format.fwd, recipe.fp8_format.bwd

        def cast(t, fmt, _blocks):
            return fp8ext.quantize_rowwise(t.contiguous(), fmt, power_2_scale=recipe.power_2_scale)
        tile = wblock = None
        fast = True
    x8, xs = cast(x, fwd, tile)
    w8, ws = cast(w, fwd, wblock)
    y = fp8ext.gemm(x8, w8, a_scale_inv=xs, b_scale_inv=ws, out_dtype=x.dtype, use_fast_accum=fast) + b
    g8, gs = cast(dy, bwd, tile)
    wt8, wts = cast(w.t(), fwd, wblock)
    dx = fp8ext.gemm(g8, wt8, a_scale_inv=gs, b_scale_inv=wts, out_dtype=x.dtype)
    gt8, gts = cast(dy.t(), bwd, tile)
    xt8, xts = cast(x.t(), fwd, tile)
    dw = fp8ext.gemm(gt8, xt8, a_scale_inv=gts, b_scale_inv=xts, out_dtype=w.dtype)
    db = dy.float().sum(0).to(b.dtype)
    return y, dx, dw, db


RECIPES = [Float8BlockScaling(), Float8BlockScaling(fp8_format=Format.HYBRID, w_block_scaling_dim=1),
           Float8BlockScaling(fp8_quant_fwd_inp=QParams(), fp8_quant_fwd_weight=QParams(),
                              fp8_quant_bwd_grad=QParams()),
           Float8RowwiseScaling(), Float8RowwiseScaling(fp8_format=Format.HYBRID, power_2_scale=False)]
IDS = ["block", "block-hybrid-1x128w", "block-f32-scales", "rowwise", "rowwise-hybrid-f32"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_fp8linear_step_equals_the_composition_of_the_ops_bit_for_bit(device, recipe):
    torch.manual_seed(1)
    m, k, n = 192, 272, 144  # K and N not multiples of 128: partial tiles and blocks at their edges
    layer = fp8ext.Linear(k, n, device=device, params_dtype=torch.bfloat16)
    x = (torch.randn(m, k, device=device) * torch.logspace(-2, 2, k, device=device)).bfloat16().requires_grad_()
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    y.backward(dy)
    want = _composition(recipe, x.detach(), layer.weight.detach(), layer.bias.detach(), dy)
    for what, got, ref in zip(("y", "dx", "dW", "db"), (y, x.grad, layer.weight.grad, layer.bias.grad), want):
        assert got.dtype == ref.dtype and torch.equal(got, ref), f"{what} differs from the composition of the ops"


def _relerr(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _row_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean over rows of each row's relative error: what each token's output or gradient loses."""
    return ((a.double() - ref).norm(dim=1) / ref.norm(dim=1)).mean().item()


@pytest.mark.parametrize("device", DEVICES)
def test_block_and_rowwise_recipes_beat_per_tensor_scaling_on_inputs_with_outliers(device):
    """Two tokens whose activations are 1e5 times the others' (and one such token in the output gradient): a
    per-tensor scale fitted to them flushes the ordinary tokens' values, while row and 1 x 128 tile scales keep
    each token's own range. Each token's output and input gradient against float64; the weight gradient (a sum
    over tokens) no worse than per-tensor scaling's."""
    torch.manual_seed(2)
    m, k, n = 128, 512, 256
    x = torch.randn(m, k, device=device)
    x[[3, 50]] *= 1e5
    w = torch.randn(n, k, device=device) * 0.05
    dy = torch.randn(m, n, device=device)
    dy[10] *= 1e5
    y64 = x.double() @ w.double().t()
    dx64, dw64 = dy.double() @ w.double(), dy.double().t() @ x.double()
    errs = {}
    for name, recipe in (("delayed", fp8ext.DelayedScaling()), ("current", fp8ext.CurrentScaling()),
                         ("block", Float8BlockScaling()), ("rowwise", Float8RowwiseScaling())):
        layer = fp8ext.Linear(k, n, bias=False, device=device)
        with torch.no_grad():
            layer.weight.copy_(w)
        xr = x.clone().requires_grad_()
        for _ in range(2):  # delayed scaling's second step uses the first step's amaxes
            xr.grad = layer.weight.grad = None
            with fp8ext.fp8_autocast(fp8_recipe=recipe):
                y = layer(xr)
            y.backward(dy)
        errs[name] = (_row_err(y, y64), _row_err(xr.grad, dx64), _relerr(layer.weight.grad, dw64))
    for fine in ("block", "rowwise"):
        for coarse in ("delayed", "current"):
            # y: the ordinary tokens lose most of their bits to a per-tensor E4M3 scale; dx: E5M2 (HYBRID) reaches
            # further down, so the per-tensor recipes lose less there
            for i, (what, factor) in enumerate((("y", 0.5), ("dx", 1.0))):
                assert errs[fine][i] < factor * errs[coarse][i], f"{what}: {fine} {errs[fine][i]:.4f}, {coarse} " \
                                                                 f"{errs[coarse][i]:.4f}"
        assert max(errs[fine][:2]) < 0.06, f"{fine}: relative errors {errs[fine]}"
        # the weight gradient's tiles run along the tokens: an outlier token's tile flushes the ordinary tokens
        # there, in every recipe
        assert errs[fine][2] < 1.5 * min(errs["delayed"][2], errs["current"][2]), errs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES[::3], ids=IDS[::3])
def test_token_counts_that_are_not_multiples_of_16_are_padded_for_the_weight_gradient(device, recipe):
    torch.manual_seed(3)
    layer = fp8ext.Linear(256, 128, device=device)
    x = torch.randn(3, 13, 256, device=device, requires_grad=True)  # 39 tokens
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double().reshape(-1, 256), layer.weight.detach().double(), dy.double().reshape(-1, 128)
    assert _relerr(y.reshape(-1, 128), x64 @ w64.t() + layer.bias.double()) < 0.05
    assert _relerr(x.grad.reshape(-1, 256), dy64 @ w64) < 0.06
    assert _relerr(layer.weight.grad, dy64.t() @ x64) < 0.06


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES[::3], ids=IDS[::3])
def test_layernorm_modules_and_converted_models_train_under_the_recipes(device, recipe):
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(device)
    ref = [p.detach().clone() for p in model.parameters()]
    fp8 = fp8ext.convert_to_fp8(model)
    ln_mlp = fp8ext.LayerNormMLP(128, 256, normalization="RMSNorm", device=device)
    ln_lin = fp8ext.LayerNormLinear(128, 64, normalization="RMSNorm", device=device)
    x = torch.randn(32, 128, device=device)
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        out = fp8(x) + ln_mlp(x)
        out2 = ln_lin(out)
    out2.float().pow(2).mean().backward()
    for mod in (fp8, ln_mlp, ln_lin):
        for name, p in mod.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    with torch.no_grad():  # the converted model's output is the high-precision model's, up to FP8's error
        hp = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(device)
        for p, r in zip(hp.parameters(), ref):
            p.copy_(r)
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            got = fp8(x)
        assert _relerr(got, hp(x).double()) < 0.06
    assert fp8[0].fp8_state() == {}, "block and row-wise scaling keep no state across steps"


def test_state_dict_round_trips_and_a_converted_layer_loads_under_another_recipe():
    torch.manual_seed(5)
    a = fp8ext.Linear(128, 128)
    x = torch.randn(16, 128)
    with fp8ext.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        ya = a(x)
    b = fp8ext.Linear(128, 128)
    b.load_state_dict(a.state_dict())
    with fp8ext.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        assert torch.equal(b(x), ya), "no scaling state: the same weights give the same output"
    with fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling()):
        b(x)  # the layer takes delayed scaling's slots now, and block scaling again after
    with fp8ext.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        assert torch.equal(b(x), ya)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", RECIPES[::3], ids=IDS[::3])
def test_compiled_layer_equals_eager_bit_for_bit(device, recipe):
    torch.manual_seed(6)
    layer = fp8ext.Linear(256, 128, device=device)
    x = torch.randn(32, 256, device=device, requires_grad=True)

    def step(fn, xi):
        xi.grad = layer.weight.grad = layer.bias.grad = None
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            y = fn(xi)
        y.float().pow(2).sum().backward()
        return y.detach(), xi.grad.clone(), layer.weight.grad.clone()

    eager = step(layer, x)
    compiled = step(torch.compile(layer, backend="aot_eager", fullgraph=True), x)
    for what, a, b in zip(("y", "dx", "dW"), eager, compiled):
        assert torch.equal(a, b), f"{what}: compiled differs from eager"


RUN = ["--preset", "tiny", "--batch_size", "4", "--seq_len", "32", "--eval_batches", "2", "--no_progress",
       "--device", "cpu"]


def _metrics(run_dir):
    return [json.loads(line) for line in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["block", "rowwise"])
def test_training_script_learns_and_resumes_exactly_with_the_recipe(tmp_path, name):
    from fp8ext.train import cli
    common = RUN + ["--max_steps", "24", "--eval_every", "12", "--lr", "3e-3", "--use_fp8", "--fp8_recipe", name]
    cli.main(common + ["--out_dir", str(tmp_path / "straight")])
    rows = _metrics(tmp_path / "straight")
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert sum(r["loss"] for r in rows[-4:]) / 4 < rows[0]["loss"] - 0.4, "the loss fell"
    cli.main(common + ["--out_dir", str(tmp_path / "resumed"), "--stop_after", "10"])
    cli.main(common + ["--out_dir", str(tmp_path / "resumed"), "--resume", str(tmp_path / "resumed")])
    assert [r["loss"] for r in _metrics(tmp_path / "resumed")] == [r["loss"] for r in rows]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_over_gloo_train_with_block_scaling_as_one_does(tmp_path, mode):
    """Block scales come from each rank's own tiles (nothing to reduce across ranks): with DDP or FSDP2 over two
    processes, each on half the batch, the losses follow those of one process on the whole batch (not bit for bit:
    the weight gradient's 1 x 128 tiles run along the tokens, and each rank tiles its own half)."""
    from fp8ext.train import cli
    args = RUN[:2] + ["--seq_len", "32", "--eval_batches", "2", "--no_progress", "--device", "cpu", "--max_steps",
                      "6", "--eval_every", "6", "--use_fp8", "--fp8_recipe", "block"]
    cli.main(args + ["--batch_size", "4", "--out_dir", str(tmp_path / "one")])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fp8ext.train",
           *args, "--batch_size", "2", "--out_dir", str(tmp_path / "two")] + (["--fsdp"] if mode == "fsdp" else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(1, 7))
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.02), f"step {a['step']}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["1x128", "128x128", "row"])
@pytest.mark.parametrize("shape", [(16, 8), (144, 136), (256, 384), (272, 1000), (128, 128)])
@pytest.mark.parametrize("fmt, pow2, eps", [(fp8ext.E4M3, True, 0.0), (fp8ext.E5M2, False, 1e-3)],
                         ids=["e4m3-pow2", "e5m2-f32-eps"])
def test_one_pass_transposed_cast_equals_casting_the_transpose(device, kind, shape, fmt, pow2, eps):
    """fp8ext.ops.quantize_blocks_t (the kernels the block and row-wise recipes' casts use) against quantize_blockwise
    / quantize_rowwise of x and of x^T made by torch: partial tiles at both edges, bf16, float16 and float32, an
    all-zero column, a column holding NaN and Inf (its tiles get scale 1)."""
    from fp8ext.ops import quantize_blocks_t
    torch.manual_seed(7)

    def ref(t):
        if kind == "row":
            return fp8ext.quantize_rowwise(t.contiguous(), fmt, power_2_scale=pow2, amax_epsilon=eps)
        block = (1, 128) if kind == "1x128" else (128, 128)
        return fp8ext.quantize_blockwise(t.contiguous(), fmt, block, power_2_scale=pow2, amax_epsilon=eps)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(shape) * torch.logspace(-3, 3 if dtype != torch.float16 else 1, shape[1])).to(device, dtype)
        x[:, 3] = 0  # an all-zero column: a zero 1 x 128 tile of x^T
        x[1, 5], x[2, 5] = float("nan"), float("-inf")
        q, s, qt, st = quantize_blocks_t(x, fmt, kind, pow2, eps)
        q_ref, s_ref = ref(x)
        qt_ref, st_ref = ref(x.t())
        assert_same_bytes(q, q_ref, "q")
        assert_same_bytes(qt, qt_ref, "qt")
        assert torch.equal(s, s_ref) and s.stride() == s_ref.stride(), "scale_inv"
        assert torch.equal(st, st_ref) and st.stride() == st_ref.stride(), "scale_inv_t"


def test_row_wise_transposed_cast_of_no_rows_has_unit_scales():
    from fp8ext.ops import quantize_blocks_t
    q, s, qt, st = quantize_blocks_t(torch.zeros(0, 32), fp8ext.E4M3, "row", True, 0.0)
    assert q.shape == (0, 32) and qt.shape == (32, 0) and torch.equal(st, torch.ones(32))


def test_custom_ops_fake_implementations_match_the_real_ones():
    """What torch.compile traces (the fake implementations' shapes and strides) is what the ops return."""
    from fp8ext.formats import E4M3
    for kind in ("row", "1x128", "128x128"):
        for shape in ((16, 8), (144, 136), (256, 384)):
            x = torch.randn(shape, dtype=torch.bfloat16)
            torch.library.opcheck(torch.ops.fp8ext.quantize_blocks_t.default, (x, E4M3.code, kind, True, 0.0))
            torch.library.opcheck(torch.ops.fp8ext.quantize_blocks.default, (x, E4M3.code, kind, True, 0.0))


def test_a_kept_weight_cast_is_not_reused_under_another_recipe():
    torch.manual_seed(8)
    layer = fp8ext.Linear(256, 128)
    x = torch.randn(32, 256)
    outs = {}
    for name, recipe in (("block", Float8BlockScaling()), ("rowwise", Float8RowwiseScaling()),
                         ("block-f32", Float8BlockScaling(fp8_quant_fwd_weight=QParams()))):
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            layer(x, is_first_microbatch=True)
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            fresh = layer(x)
        outs[name] = fresh
    for name, recipe in (("rowwise", Float8RowwiseScaling()), ("block", Float8BlockScaling())):
        with fp8ext.fp8_autocast(fp8_recipe=Float8BlockScaling(fp8_quant_fwd_weight=QParams())):
            layer(x, is_first_microbatch=True)  # keeps a cast with float32 block scales
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            assert torch.equal(layer(x, is_first_microbatch=False), outs[name]), name


def test_transposed_cast_refuses_bad_outputs():
    from fp8ext import _C
    cap = torch._C._to_dlpack
    x = torch.randn(32, 256)
    q, s = torch.empty(32, 256, dtype=torch.uint8), torch.zeros(2, 32)
    with pytest.raises(ValueError, match=r"qt and scale_inv_t come together"):
        _C.quantize_blocks(cap(x), cap(q), cap(s), 0, 1, 128, 1, 32, qt=cap(torch.empty(256, 32, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"qt must be \[256, 32\]"):
        _C.quantize_blocks(cap(x), cap(q), cap(s), 0, 1, 128, 1, 32, qt=cap(torch.empty(32, 256, dtype=torch.uint8)),
                           scale_inv_t=cap(torch.zeros(256)), stride_rt=1, stride_ct=256)
    with pytest.raises(ValueError, match=r"scale_inv_t \(8 floats\) is too small"):
        _C.quantize_blocks(cap(x), cap(q), cap(s), 0, 1, 128, 1, 32, qt=cap(torch.empty(256, 32, dtype=torch.uint8)),
                           scale_inv_t=cap(torch.zeros(8)), stride_rt=1, stride_ct=256)
    x128, q128 = torch.randn(128, 128), torch.empty(128, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"needs 1 x 128 or 128 x 128 blocks, or 1 x cols"):  # 1 x cols, stride_ct 1
        _C.quantize_blocks(cap(x), cap(q), cap(torch.zeros(32)), 0, 1, 256, 1, 0,
                           qt=cap(torch.empty(256, 32, dtype=torch.uint8)), scale_inv_t=cap(torch.zeros(256)),
                           stride_rt=1, stride_ct=1)
    # 128 x 128 blocks over 128 columns with stride_ct 0 are blocks, not rows: one scale for x^T's one block
    st1, s4 = torch.zeros(1), torch.zeros(4)
    _C.quantize_blocks(cap(x128), cap(q128), cap(s4), 0, 128, 128, 4, 1,
                       qt=cap(torch.empty(128, 128, dtype=torch.uint8)), scale_inv_t=cap(st1), stride_rt=1, stride_ct=0)
    assert st1.item() == s4[0].item() == fp8ext.quantize_blockwise(x128, block=(128, 128))[1].item()
    with pytest.raises(ValueError, match=r"row-wise scale_inv_t must be contiguous"):
        _C.quantize_blocks(cap(x), cap(q), cap(torch.zeros(32)), 0, 1, 256, 1, 0,
                           qt=cap(torch.empty(256, 32, dtype=torch.uint8)), scale_inv_t=cap(torch.zeros(512)),
                           stride_rt=2, stride_ct=0)


# ---- RMSNorm and SwiGLU computed inside the block casts -----------------------------------------------------

def _norm_modules(kind, device):
    torch.manual_seed(9)
    if kind == "linear":
        def make():
            return fp8ext.LayerNormLinear(256, 128, normalization="RMSNorm", params_dtype=torch.bfloat16, device=device)
    else:
        def make():
            return fp8ext.LayerNormMLP(256, 384, normalization="RMSNorm", activation="swiglu", bias=kind == "mlp_bias",
                                       params_dtype=torch.bfloat16, device=device)
    a, b = make(), make()
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("op", ["rmsnorm", "swiglu"])
def test_block_scaled_fused_cast_reference_path_is_the_separate_steps(op):
    """On the CPU the fused path (reference=True) computes the step with the reference definitions and casts it with
    the block quantizer: the output and the weight's gradient of the step followed by FP8Linear, bit for bit."""
    from fp8ext import fused
    from fp8ext.modules import fused_linear as FL
    torch.manual_seed(10)
    k = 256
    lin_a = fp8ext.Linear(k, 128, params_dtype=torch.bfloat16)
    lin_b = fp8ext.Linear(k, 128, params_dtype=torch.bfloat16)
    lin_b.load_state_dict(lin_a.state_dict())
    x = torch.randn(32, 2 * k if op == "swiglu" else k, dtype=torch.bfloat16)
    gamma = torch.rand(k) + 0.5
    recipe = Float8BlockScaling()
    with fp8ext.fp8_autocast(fp8_recipe=recipe):
        if op == "rmsnorm":
            ya = FL.fused_input_linear(lin_a, FL.RMSNORM, x, gamma, 1e-5, reference=True)
            yb = lin_b(fused.rms_norm_train_reference(x, gamma, 1e-5, x.dtype)[0])
        else:
            ya = FL.fused_input_linear(lin_a, FL.SWIGLU, x, reference=True)
            yb = lin_b(fused.swiglu_reference(x))
    assert ya is not None and torch.equal(ya, yb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(lin_a.weight.grad, lin_b.weight.grad)


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device and fp8ext built with CUDA")
@pytest.mark.parametrize("kind", ["linear", "mlp", "mlp_bias"])
def test_layernorm_modules_on_the_gpu_fuse_the_block_casts_and_equal_their_separate_steps(kind, monkeypatch):
    """LayerNormLinear and LayerNormMLP under Float8BlockScaling compute RMSNorm and SwiGLU inside the block casts of
    the next GEMM's input on a GPU, and give the output and every gradient of the same module run step by step."""
    from fp8ext.modules import fused_linear as FL
    fused_m, sep_m = _norm_modules(kind, "cuda")
    calls = []
    real = FL._cast_with_prologue
    monkeypatch.setattr(FL, "_cast_with_prologue", lambda op, *a, **kw: calls.append(op) or real(op, *a, **kw))
    x = torch.randn(4, 48, 256, device="cuda", dtype=torch.bfloat16) * 2
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    for step in range(2):
        with fp8ext.fp8_autocast(fp8_recipe=Float8BlockScaling()):
            ya = fused_m(xa)
            FL.ENABLED = False
            try:
                yb = sep_m(xb)
            finally:
                FL.ENABLED = True
        dy = torch.randn_like(ya)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.equal(ya, yb), step
        assert torch.equal(xa.grad, xb.grad), step
        for (name, pa), pb in zip(fused_m.named_parameters(), sep_m.parameters()):
            assert torch.equal(pa.grad, pb.grad), (step, name)
        for t in (xa, xb, *fused_m.parameters(), *sep_m.parameters()):
            t.grad = None
    per_step = {"linear": [FL.RMSNORM], "mlp": [FL.RMSNORM, FL.SWIGLU, FL.DSWIGLU], "mlp_bias": [FL.RMSNORM, FL.SWIGLU]}
    assert calls == per_step[kind] * 2, "the block casts took the fused paths"


def test_block_scaled_fused_mlp_reference_path_is_the_separate_steps():
    """LayerNormMLP's one-node path (RMSNorm, fc1, SwiGLU, fc2) under Float8BlockScaling on the CPU (reference=True):
    the output and both weights' gradients of the steps run one after the other, bit for bit."""
    from fp8ext import fused
    from fp8ext.modules import fused_linear as FL
    torch.manual_seed(11)
    layers = [(fp8ext.Linear(256, 768, bias=False, params_dtype=torch.bfloat16),
               fp8ext.Linear(384, 256, params_dtype=torch.bfloat16)) for _ in range(2)]
    for a, b in zip(layers[0], layers[1]):
        b.load_state_dict(a.state_dict())
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    gamma = torch.rand(256) + 0.5
    with fp8ext.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        ya = FL.fused_mlp(*layers[0], x, gamma, 1e-5, reference=True)
        fc1, fc2 = layers[1]
        yb = fc2(fused.swiglu_reference(fc1(fused.rms_norm_train_reference(x, gamma, 1e-5, x.dtype)[0])))
    assert ya is not None and torch.equal(ya, yb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    for (a, b), what in zip(zip(layers[0], layers[1]), ("fc1", "fc2")):
        assert torch.equal(a.weight.grad, b.weight.grad), what


def test_block_prologue_refuses_what_it_cannot_take():
    from fp8ext import _C
    cap = torch._C._to_dlpack
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    q, s = torch.empty(32, 256, dtype=torch.uint8), torch.zeros(2, 32)
    qt, st = torch.empty(256, 32, dtype=torch.uint8), torch.zeros(256)
    with pytest.raises(ValueError, match=r"a prologue needs a bf16 or float16 x on a GPU"):
        _C.quantize_blocks(cap(x), cap(q), cap(s), 0, 1, 128, 1, 32, qt=cap(qt), scale_inv_t=cap(st), stride_rt=1,
                           stride_ct=256, prologue=1)
    with pytest.raises(ValueError, match=r"prologue must be 0 \(none\), 1 \(RMSNorm\) or 2 \(SwiGLU\), got 3"):
        _C.quantize_blocks(cap(x), cap(q), cap(s), 0, 1, 128, 1, 32, qt=cap(qt), scale_inv_t=cap(st), stride_rt=1,
                           stride_ct=256, prologue=3)
