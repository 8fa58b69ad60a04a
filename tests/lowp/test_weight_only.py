"""Weight-only layers: packing against fp8ext.mx and fp8ext.quantize, the stored bytes, the CPU path, and the
few-token CUDA kernel against a float64 product with the dequantized weight."""
import pytest
import torch
import torch.nn as nn

import fp8ext
from conftest import requires_cuda
from fp8ext.weight_only import WEIGHT_ONLY_FORMATS, WeightOnlyLinear, bits_per_weight


def linear(k, n, bias=False, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(3.0)
        lin.weight[0, :7] = torch.tensor([0.0, -0.0, 1e-30, 5.0, -7.0, 1e-3, 2.0 ** -20])
    return lin


@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
def test_dequantized_weight_is_the_formats_own_rounding(fmt):
    lin = linear(256, 64)
    w = lin.weight.detach()
    layer = WeightOnlyLinear.from_linear(lin, fmt)
    got = layer.dequantized_weight()
    if fmt == "fp8":  # per row: x * (448 / amax) rounded to E4M3, times amax / 448
        amax = w.abs().amax(dim=1)
        scale = torch.full_like(amax, 448.0) / amax
        want = fp8ext.quantize((w * scale[:, None]).contiguous()).float() * (1.0 / scale)[:, None]
    elif fmt == "nvfp4":
        want = fp8ext.dequantize_nvfp4(*fp8ext.quantize_nvfp4(w))
    else:
        elem = {"mxfp8": fp8ext.E4M3, "mxfp6": fp8ext.E3M2, "mxfp6_e2m3": fp8ext.E2M3, "mxfp4": fp8ext.E2M1}[fmt]
        want = fp8ext.dequantize_mx(*fp8ext.quantize_mx(w, elem), elem=elem)
    assert torch.equal(got, want)


def test_error_and_bytes_order_the_formats():
    lin = linear(1024, 256)
    w = lin.weight.detach()
    err, size = {}, {}
    for fmt in WEIGHT_ONLY_FORMATS:
        layer = WeightOnlyLinear.from_linear(lin, fmt)
        err[fmt] = float((layer.dequantized_weight() - w).norm() / w.norm())
        size[fmt] = layer.nbytes
        assert abs(layer.nbytes * 8 / w.numel() - bits_per_weight(fmt, 1024)) < 0.01, fmt
    assert err["mxfp4"] > err["mxfp6_e2m3"] > err["mxfp8"]
    assert err["nvfp4"] < err["mxfp4"]  # smaller blocks, finer scales
    assert 0.05 < err["mxfp4"] < 0.2 and err["fp8"] < 0.04
    assert size["mxfp4"] < size["nvfp4"] < size["mxfp6"] < size["fp8"] < w.numel() * 2


def test_cpu_forward_is_f_linear_with_the_dequantized_weight_and_bias():
    lin = linear(256, 64, bias=True)
    layer = WeightOnlyLinear.from_linear(lin, "mxfp4")
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, layer.dequantized_weight(torch.bfloat16), lin.bias.detach().bfloat16())
    assert torch.equal(layer(x), want)
    assert layer(x).shape == (3, 5, 64)


def test_gradients_flow_to_the_input_through_the_dequantized_weight():
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "mxfp4")
    x = torch.randn(2, 256, requires_grad=True)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, layer.dequantized_weight().sum(0).expand(2, 256))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="fmt must be one of"):
        WeightOnlyLinear(256, 64, "int4")
    with pytest.raises(ValueError, match="multiple of mxfp4's block size 32"):
        WeightOnlyLinear(100, 64, "mxfp4")
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "fp8")
    with pytest.raises(ValueError, match="last dimension must be 256"):
        layer(torch.randn(2, 128))
    with pytest.raises(ValueError, match="weight holds NaN or Inf"):
        layer.pack_(torch.full((64, 256), float("nan")))
    with pytest.raises(TypeError, match="must have a 2-D weight"):
        WeightOnlyLinear.from_linear(nn.ReLU(), "fp8")


def test_state_dict_round_trips_the_packed_bytes():
    a = WeightOnlyLinear.from_linear(linear(256, 64), "nvfp4")
    b = WeightOnlyLinear(256, 64, "nvfp4")
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.dequantized_weight(), b.dequantized_weight())


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
@pytest.mark.parametrize("m,k,n", [(1, 256, 64), (3, 2304, 192), (16, 4096, 1024), (8, 1024, 4096), (16, 512, 64)])
def test_kernel_equals_the_float64_product(fmt, m, k, n):
    lin = linear(k, n, bias=(m == 3), seed=k + n)
    layer = WeightOnlyLinear.from_linear(lin, fmt).cuda()
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    assert layer.uses_kernel(x)
    got = layer(x)
    w = layer.dequantized_weight(torch.float64)
    want = x.double() @ w.T
    if lin.bias is not None:
        want = (want.bfloat16() + lin.bias.detach().cuda().bfloat16()).double()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-2, f"{fmt} {m}x{k}x{n}: max error {err:.2e} of the largest output"
    assert torch.equal(layer(x), got), "a second call (the counters reset themselves) gives the same bytes"


@requires_cuda
@pytest.mark.cuda
def test_many_tokens_and_other_dtypes_take_the_dequantized_gemm():
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "mxfp6").cuda()
    for x in (torch.randn(17, 256, dtype=torch.bfloat16, device="cuda"), torch.randn(2, 256, device="cuda"),
              torch.randn(2, 256, dtype=torch.bfloat16, device="cuda", requires_grad=True)):
        assert not layer.uses_kernel(x)
        want = torch.nn.functional.linear(x, layer.dequantized_weight(x.dtype))
        assert torch.equal(layer(x), want)


def _float64_product(layer, x):
    return x.double() @ layer.dequantized_weight(torch.float64).T


def _raw_call(layer, x, splits, workspace=None):
    """The kernel through fp8ext._C with an explicit split of K (the layer chooses its own)."""
    from fp8ext._C import weight_only
    from fp8ext.weight_only import _FORMATS
    m, n = x.shape[0], layer.out_features
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    ws = torch.empty(splits * m * n, device="cuda") if workspace is None else workspace
    from fp8ext.core.boundary import dl, dl_opt
    weight_only(dl(x), dl(layer.codes), dl_opt(layer.block_scales), dl_opt(layer.channel_scale),
                dl_opt(layer.tensor_scale), dl(ws), dl(layer._counters), dl(out), _FORMATS[layer.fmt][0], splits,
                torch.cuda.current_stream().cuda_stream)
    return out


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 15, 16])
def test_every_split_of_k_gives_the_product(fmt, m):
    """One split (the output written directly), a few (the last block adds them), one chunk of 256 per block, and
    a split longer than the kernel's 4-stage pipeline; x rows 1..16 (8 or 16 rows staged)."""
    k, n = 2816, 128  # 11 chunks of 256
    layer = WeightOnlyLinear.from_linear(linear(k, n, seed=m), fmt).cuda()
    torch.manual_seed(100 + m)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    want = _float64_product(layer, x)
    for splits in (1, 2, 3, 11):
        got = _raw_call(layer, x, splits)
        err = (got.double() - want).abs() / want.abs().max()
        assert err.max() < 4e-3, f"{fmt} m={m} splits={splits}: error {err.max():.2e} at {divmod(int(err.argmax()), n)}"
    assert torch.equal(layer._counters.cpu(), torch.zeros_like(layer._counters.cpu())), "the counters reset"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["fp8", "mxfp6", "mxfp4", "nvfp4"])
def test_wide_layers_choose_few_splits_and_stay_exact(fmt):
    """A layer wide enough to be split in few parts along K: each block streams 2-16 chunks through the
    pipeline."""
    k, n = 4096, 16384
    layer = WeightOnlyLinear.from_linear(linear(k, n, seed=7), fmt).cuda()
    for m in (1, 16):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        _, _, splits = layer._kernel_args(m)
        assert 1 <= splits <= 8, f"{fmt} m={m}: {splits} splits for a {n}-wide layer"
        err = (layer(x).double() - _float64_product(layer, x)).abs().max()
        assert err / _float64_product(layer, x).abs().max() < 4e-3


@requires_cuda
@pytest.mark.cuda
def test_blocks_per_sm_and_alignment_are_checked():
    from fp8ext._C import weight_only_blocks_per_sm
    for fmt in range(6):
        for m in (1, 16):
            assert weight_only_blocks_per_sm(fmt, m, torch.cuda.current_device()) >= 1
    with pytest.raises(ValueError, match="m 1..16"):
        weight_only_blocks_per_sm(0, 17, 0)
    with pytest.raises(ValueError, match="device"):
        weight_only_blocks_per_sm(0, 1, 1000)
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "mxfp4").cuda()
    flat = torch.randn(2 * 256 + 8, dtype=torch.bfloat16, device="cuda")
    x = flat[1:257].view(1, 256)  # contiguous, 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte boundary"):
        _raw_call(layer, x, 1)
    # the layer itself copies such an input to aligned memory
    assert torch.equal(layer(x), layer(x.clone()))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_fp4_codes_are_stored_in_the_kernels_order(fmt):
    """Each 32-bit word of stored codes holds 8 values along K; the kernel's decode (rotations left by 0, 4 and 10 and
    a mask for pairs 0-2; pair 3's bits 6 and 22 from a rotation by 6, the rest from one by 14) must give each pair of
    values as bfloat16 bit patterns: sign at bit 15 (31), the three magnitude bits at 6-8 (22-24)."""
    lin = linear(256, 64)
    layer = WeightOnlyLinear.from_linear(lin, fmt)
    w = lin.weight.detach()
    codes = fp8ext.quantize_nvfp4(w)[0] if fmt == "nvfp4" else fp8ext.quantize_mx(w, fp8ext.E2M1)[0]
    b = layer._rows()[0].reshape(64, 32, 4).to(torch.int64)
    q = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF if r else x

    pair_mask = 0x81C081C0
    decoded = [q & pair_mask, rotl(q, 4) & pair_mask, rotl(q, 10) & pair_mask,
               (rotl(q, 6) & 0x00400040) | (rotl(q, 14) & 0x81808180)]
    c = codes.reshape(64, 32, 8).to(torch.int64)
    for p in range(4):
        lo, hi = c[..., 2 * p], c[..., 2 * p + 1]
        want = (lo >> 3) << 15 | (lo & 7) << 6 | (hi >> 3) << 31 | (hi & 7) << 22
        assert torch.equal(decoded[p], want), p


@pytest.mark.parametrize("fmt", ["mxfp6", "mxfp6_e2m3"])
def test_fp6_codes_are_stored_in_the_kernels_order(fmt):
    """Each three 32-bit words of stored codes hold 16 values along K; the kernel's parts (funnel shifts of two of the
    words, masked, csrc/kernels/weight_only.cu fp6_pair) must give each pair of values as bfloat16 bit patterns: the
    sign at bit 15 (31), the other five bits at 5-9 for E3M2 and 4-8 for E2M3 (21-25, 20-24)."""
    from fp8ext.weight_only import _FP6_PAIRS
    elem = fp8ext.E3M2 if fmt == "mxfp6" else fp8ext.E2M3
    name, low = ("e3m2", 5) if fmt == "mxfp6" else ("e2m3", 4)
    lin = linear(256, 64)
    layer = WeightOnlyLinear.from_linear(lin, fmt)
    codes = fp8ext.quantize_mx(lin.weight.detach(), elem)[0].view(torch.uint8).to(torch.int64).reshape(64, 16, 16)
    b = layer._rows()[0].reshape(64, 16, 3, 4).to(torch.int64)
    words = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    for j, parts in enumerate(_FP6_PAIRS[name]):
        got = 0
        for lo, hi, rot, mask in parts:
            got = got | ((((words[..., hi] << 32 | words[..., lo]) << rot) >> 32) & mask)
        a, c = codes[..., 2 * j], codes[..., 2 * j + 1]
        want = (a >> 5) << 15 | (a & 31) << low | (c >> 5) << 31 | (c & 31) << (low + 16)
        assert torch.equal(got, want), j


def _exact_weight(layer):
    """The stored weight in float64, each value formed exactly (element times its scales), then rounded once to
    float32 as the kernel's output is before its bfloat16 rounding."""
    from fp8ext.weight_only import _fp4_unpack_kernel
    if layer.fmt != "nvfp4":
        return layer.dequantized_weight(torch.float32)
    rows, block_scales = layer._rows()
    codes = _fp4_unpack_kernel(rows)
    values = fp8ext.dequantize(codes, 1.0, torch.float32, fmt=fp8ext.E2M1).double()
    s = block_scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
    return (values * s * layer.tensor_scale.double()).float()


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
@pytest.mark.parametrize("m", [5, 16])
def test_kernel_decodes_every_weight_exactly(fmt, m):
    """Tokens that are unit vectors pick single weights: out[i, n] = W[n, k_i], one product and no rounding before
    the output's, so every decoded value (signs, zeros, the smallest codes, large and small block scales) must
    come out exactly."""
    k, n = 1024, 128
    lin = linear(k, n, seed=3)
    with torch.no_grad():  # blocks scaled far apart: MX scales from 2^-40 to 2^20
        lin.weight.mul_(torch.logspace(-12, 6, n, base=2.0 ** 2.5)[:, None])
    layer = WeightOnlyLinear.from_linear(lin, fmt).cuda()
    want_w = _exact_weight(layer).cuda()
    for start in range(0, k, 64):
        cols = torch.arange(start, start + 64, 64 // m + (64 % m > 0), device="cuda")[:m]
        x = torch.zeros(len(cols), k, dtype=torch.bfloat16, device="cuda")
        x[torch.arange(len(cols)), cols] = 1.0
        got = layer(x)
        want = want_w[:, cols].T.bfloat16()
        bad = (got != want).nonzero()
        assert len(bad) == 0, f"{fmt}: {len(bad)} outputs differ, first at token {bad[0].tolist()}: " \
                              f"{got[tuple(bad[0])].item()} vs {want[tuple(bad[0])].item()}"


@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
def test_kernel_sized_layers_store_tiles_of_64_rows_by_256_values(fmt):
    """Tiles ordered by group of 64 rows, then along K; within a tile, quarters (K half, row half) row by row."""
    k, n = 512, 128
    lin = linear(k, n, seed=5)
    tiled = WeightOnlyLinear.from_linear(lin, fmt)
    rows, scales = tiled._rows()
    for stored, plain in ((tiled.codes, rows), (tiled.block_scales, scales)):
        if plain is None:
            continue
        half = plain.shape[1] // (k // 256) // 2  # bytes of 128 values of a row
        flat, pos = stored.reshape(-1), 0
        for g in range(n // 64):
            for c in range(k // 256):
                for kh in range(2):
                    for rh in range(2):
                        r0, b0 = 64 * g + 32 * rh, (2 * c + kh) * half
                        assert torch.equal(flat[pos:pos + 32 * half].reshape(32, half), plain[r0:r0 + 32, b0:b0 + half])
                        pos += 32 * half
    # a layer the kernel cannot run keeps plain rows; row by row, the tiled layer holds the same weight
    plain = WeightOnlyLinear.from_linear(linear(k, 96, seed=5), fmt)
    assert torch.equal(plain._rows()[0], plain.codes)
    if fmt != "nvfp4":  # (NVFP4's tensor scale depends on all rows)
        assert torch.equal(tiled.dequantized_weight()[:64], plain.dequantized_weight()[:64])


def test_the_split_fills_whole_waves_of_blocks():
    from fp8ext.weight_only import _splits
    # (chunks of 256 along K, groups of 64 columns, blocks the GPU runs at once) -> splits
    assert _splits(16, 224, 660) == 2   # 4096 x 14336, 5 blocks per multiprocessor: 448 blocks, one wave
    assert _splits(16, 224, 396) == 1   # the same with 3 per multiprocessor: 224 blocks of 16 chunks
    assert _splits(16, 64, 660) == 8    # 4096 x 4096: 512 blocks of 2 chunks
    assert _splits(11, 1, 660) == 11    # one column group: every chunk its own block
    assert _splits(1, 10_000, 660) == 1
    for chunks, groups, slots in ((56, 64, 660), (16, 224, 264), (40, 7, 500), (3, 500, 400)):
        s = _splits(chunks, groups, slots)
        per = -(-chunks // s)
        assert groups * s <= max(groups, slots), "one wave of blocks"
        assert -(-chunks // (s - 1 or 1)) > per or s == 1, "no fewer splits give the same chunks per block"


@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
def test_a_state_dict_saved_in_the_plain_layout_loads_into_the_tiles(fmt, tmp_path):
    """Checkpoints written before the tiled layout (module version 1: plain rows, FP4 in pack_fp4's order) are
    converted on load; state dicts of the current version load as they are."""
    from fp8ext.weight_only import _fp4_unpack_kernel, _fp6_unpack_kernel
    layer = WeightOnlyLinear.from_linear(linear(512, 128, seed=9), fmt)
    rows, scales = layer._rows()
    if fmt in ("mxfp4", "nvfp4"):
        rows = fp8ext.pack_fp4(_fp4_unpack_kernel(rows))
    elif fmt in ("mxfp6", "mxfp6_e2m3"):
        rows = fp8ext.pack_fp6(_fp6_unpack_kernel(rows, "e3m2" if fmt == "mxfp6" else "e2m3"))
    old = layer.state_dict()
    old["codes"] = rows.clone()
    if scales is not None:
        old["block_scales"] = scales.clone()
    old._metadata[""]["version"] = 1
    torch.save(old, tmp_path / "v1.pt")
    fresh = WeightOnlyLinear(512, 128, fmt)
    fresh.load_state_dict(torch.load(tmp_path / "v1.pt"))
    assert torch.equal(fresh.codes, layer.codes) and torch.equal(fresh.dequantized_weight(), layer.dequantized_weight())
    again = WeightOnlyLinear(512, 128, fmt)
    again.load_state_dict(layer.state_dict())  # the current version: unchanged
    assert torch.equal(again.codes, layer.codes)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp6", "mxfp6_e2m3"])
@pytest.mark.parametrize("k, n", [(512, 128), (96, 24)])
def test_a_state_dict_of_whole_fp4_and_fp6_codes_loads_bit_interleaved(fmt, k, n):
    """Module version 2 stored FP4 codes whole, value (6, 4, 2, 0, 7, 5, 3, 1)[i] of each 8 in nibble i of a 32-bit
    word, and FP6 codes in pack_fp6's order (tiled where the kernel runs the layer); loading such a state dict gives
    the same codes and weight."""
    from fp8ext.weight_only import _fp4_unpack_kernel, _fp6_unpack_kernel
    layer = WeightOnlyLinear.from_linear(linear(k, n, seed=4), fmt)
    if fmt in ("mxfp4", "nvfp4"):
        natural = _fp4_unpack_kernel(layer.codes)  # the stored bytes, tiles and all, as codes in K order per group
        v2 = fp8ext.pack_fp4(natural.reshape(n, -1, 8)[:, :, [6, 4, 2, 0, 7, 5, 3, 1]].reshape(n, -1))
    else:
        v2 = fp8ext.pack_fp6(_fp6_unpack_kernel(layer.codes, "e3m2" if fmt == "mxfp6" else "e2m3"))
    old = layer.state_dict()
    old["codes"] = v2
    old._metadata[""]["version"] = 2
    fresh = WeightOnlyLinear(k, n, fmt)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.codes, layer.codes)
    assert torch.equal(fresh.dequantized_weight(), layer.dequantized_weight())


def test_an_old_state_dict_with_codes_of_another_dtype_is_refused():
    """Packed codes of an earlier layout are re-packed on load; bytes of another dtype (which load_state_dict would
    cast) are refused, naming the key, instead of loading in the old layout."""
    layer = WeightOnlyLinear.from_linear(linear(256, 64), "mxfp4")
    old = layer.state_dict()
    old["codes"] = old["codes"].view(torch.int8).clone()
    old._metadata[""]["version"] = 2
    with pytest.raises(ValueError, match="codes must be uint8"):
        WeightOnlyLinear(256, 64, "mxfp4").load_state_dict(old)


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 8, 16])
def test_fp8_kernel_is_exact_over_a_wide_range_of_x(m):
    """x values spread over 2^-30 .. 2^30 give the product to float32 accumulation accuracy, and a single value per
    token is carried exactly (one product, rounded once), whatever its exponent."""
    k, n = 1024, 128
    layer = WeightOnlyLinear.from_linear(linear(k, n, seed=11), "fp8").cuda()
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 2.0 ** torch.randint(-30, 31, (m, k), generator=g)).bfloat16().cuda()
    want = _float64_product(layer, x)
    got = layer(x).double()
    assert ((got - want).abs() / want.abs().amax(dim=1, keepdim=True)).max() < 4e-3
    # one value per token (every bfloat16 mantissa, both signs, exponents -40 .. 40) at one column: out = v * W[:, k]
    # with a single rounding to float32 and one to bfloat16, as in float64
    w = layer.dequantized_weight(torch.float64).cuda()
    vals = ((1 + torch.arange(128) / 128) * 2.0 ** torch.arange(-40, 41, 5).repeat(8)[:128]
            * torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)).bfloat16()
    for start in range(0, 128, m):
        v = vals[start:start + m].cuda()
        cols = torch.arange(start, start + len(v), device="cuda") * 7 % k
        xk = torch.zeros(len(v), k, dtype=torch.bfloat16, device="cuda")
        xk[torch.arange(len(v)), cols] = v
        want = (v.double()[:, None] * w[:, cols].T).float().bfloat16()
        assert torch.equal(layer(xk), want), f"values {start}..{start + len(v) - 1}"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", WEIGHT_ONLY_FORMATS)
def test_kernel_propagates_nan_and_inf_of_x_to_that_token(fmt):
    k, n = 512, 64
    layer = WeightOnlyLinear.from_linear(linear(k, n, seed=5), fmt).cuda()
    x = torch.randn(3, k, dtype=torch.bfloat16, device="cuda")
    x[1, 300] = float("nan")
    x[2, 7] = float("inf")
    got = layer(x)
    assert bool(got[1].isnan().all()), "a NaN in x makes every output of its token NaN"
    assert not bool(got[2].isfinite().any()), "an Inf in x makes every output of its token Inf or NaN"
    want = _float64_product(layer, x[:1])
    assert float(((got[:1].double() - want).abs() / want.abs().max()).max()) < 4e-3
