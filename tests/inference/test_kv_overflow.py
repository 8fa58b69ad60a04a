"""An FP8 KV cache with an NVFP4 overflow (KVCache(..., overflow="nvfp4", budget_bytes=N)): its storage stays within
the budget, the moved positions read back as NVFP4 of their FP8 values, bit for bit, the newest stay exactly FP8,
attention stays close to the all-FP8 cache's, rollbacks work across the boundary, and generation runs."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fp8ext
from fp8ext.inference import KVCache, decode_attention, generate
from fp8ext.models.transformer import Transformer, preset

CFG = preset("tiny")  # 2 layers, 2 K/V heads of 16
SHAPE = (2, CFG.n_kv_heads, 1, CFG.head_dim)  # one position of K or V, batch 2
CHUNK = 8


def fp8_bytes(max_len, batch=2):
    return KVCache(CFG, batch, max_len, "fp8").nbytes


def caches(max_len, budget):
    """An overflowing cache and an all-FP8 one with the same given per-head scales (so the same FP8 bytes)."""
    scales = dict(k_scale=torch.tensor([0.01, 0.05]), v_scale=torch.tensor([0.02, 0.01]))
    return (KVCache(CFG, 2, max_len, "fp8", overflow="nvfp4", budget_bytes=budget, overflow_chunk=CHUNK, **scales),
            KVCache(CFG, 2, max_len, "fp8", **scales))


def kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*SHAPE, generator=g) * torch.tensor([1.0, 4.0])[None, :, None, None],
             torch.randn(*SHAPE, generator=g)) for _ in range(n)]


def fp8_values(k_cache, scale, length):
    """What an all-FP8 cache holds for positions [0, length): its E4M3 bytes times the per-head scales."""
    return fp8ext.dequantize(k_cache[:, :, :length].contiguous()) * scale[None, :, None, None]


def nvfp4(x):
    return fp8ext.dequantize_nvfp4(*fp8ext.quantize_nvfp4(x.contiguous()))


def feed(cache, steps, start, layers=(0,)):
    """Appends one position per step to `layers`; returns layer 0's last (k, v, length, k_scale, v_scale)."""
    for t, (k, v) in enumerate(steps):
        out = [cache.append(layer, k, v, start + t) for layer in layers]
    return out[0]


@pytest.mark.parametrize("share", [0.75, 0.85, 0.95])
def test_storage_stays_within_the_budget_and_the_oldest_positions_move(share):
    budget = int(fp8_bytes(64) * share)
    cache, _ = caches(64, budget)
    assert cache.nbytes <= budget, f"{cache.nbytes} bytes allocated for a budget of {budget}"
    feed(cache, kv(64, 0), 0, layers=range(CFG.n_layers))
    assert cache.lengths == [64, 64]
    moved = cache.overflowed
    assert moved[0] == moved[1] > 0 and moved[0] % CHUNK == 0, f"whole chunks moved, got {moved}"
    assert 64 - moved[0] <= cache.fp8_capacity, "the FP8 part holds at most fp8_capacity positions"
    row = fp8_bytes(1)  # one position's K and V in FP8, every layer
    least = cache.fp8_capacity * row + (64 - cache.fp8_capacity) * row * 9 // 16  # the rest at 4.5 bits a value
    assert cache.nbytes >= least, f"nbytes {cache.nbytes} counts the NVFP4 part too (at least {least})"


def test_a_budget_for_all_fp8_moves_nothing():
    cache, plain = caches(64, fp8_bytes(64))
    assert cache.nbytes == plain.nbytes and cache.fp8_capacity == 64
    feed(cache, kv(64, 0), 0)
    assert cache.overflowed == [0, 0]


def test_moved_positions_are_nvfp4_of_the_fp8_values_and_the_newest_stay_fp8():
    cache, plain = caches(48, int(fp8_bytes(48) * 0.8))
    steps = kv(48, 1)
    k, v, length, _, _ = feed(cache, steps, 0)
    pk, pv, plength, ks, vs = feed(plain, steps, 0)
    n4 = cache.overflowed[0]
    assert length == plength == 48 and n4 >= 2 * CHUNK, f"{n4} positions moved"
    for got, fp8 in ((k, fp8_values(pk, ks, 48)), (v, fp8_values(pv, vs, 48))):
        assert got.dtype == torch.float32 and got.shape == fp8.shape
        for c0 in range(0, n4, CHUNK):  # each chunk quantized as one tensor (its own tensor scale)
            want = nvfp4(fp8[:, :, c0:c0 + CHUNK])
            assert torch.equal(got[:, :, c0:c0 + CHUNK], want), f"positions {c0}..{c0 + CHUNK}: NVFP4 of the FP8"
        assert torch.equal(got[:, :, n4:], fp8[:, :, n4:]), "the newest positions exactly as in the FP8 cache"
        assert not torch.equal(got[:, :, :n4], fp8[:, :, :n4]), "the moved positions did change"


def test_a_prefill_longer_than_the_fp8_part_moves_chunks_as_one_token_steps_do():
    """update() with more positions than the FP8 part holds stores them in pieces: the same bytes as appending."""
    cache, _ = caches(48, int(fp8_bytes(48) * 0.8))
    stepped, _ = caches(48, int(fp8_bytes(48) * 0.8))
    steps = kv(40, 2)
    k_all, v_all = torch.cat([k for k, _ in steps], 2), torch.cat([v for _, v in steps], 2)
    k, v = cache.update(0, k_all, v_all, 0)
    sk, sv, *_ = feed(stepped, steps, 0)
    assert cache.overflowed[0] == stepped.overflowed[0] > 0
    assert torch.equal(k, sk) and torch.equal(v, sv)


@torch.no_grad()
def test_attention_over_the_overflow_is_close_to_the_all_fp8_caches():
    cache, plain = caches(64, int(fp8_bytes(64) * 0.75))
    steps = kv(64, 3)
    q = torch.randn(2, CFG.n_heads, CFG.head_dim, generator=torch.Generator().manual_seed(4)) * 0.3
    got = decode_attention(q, *feed(cache, steps, 0))
    want = decode_attention(q, *feed(plain, steps, 0))
    assert cache.overflowed[0] >= 32, "half the positions or more in NVFP4"
    err = ((got - want).norm() / want.norm()).item()
    # measured 0.138 with 56 of 64 positions in NVFP4 (the K/V themselves: 0.088 relative RMS error, NVFP4's
    # 2-bit significands on random values; the output, a softmax-weighted mean of random V, cancels and so
    # magnifies it); above 0.01 shows the NVFP4 part is what attention read
    assert 0.01 < err < 0.2, f"relative error of attention over the NVFP4 part {err:.4f}"


@pytest.mark.parametrize("cut", [5, 20], ids=["into the NVFP4 part", "after a move in the rolled-back span"])
def test_truncate_across_the_boundary_keeps_what_stays_and_refills_in_fp8(cut):
    cache, plain = caches(48, int(fp8_bytes(48) * 0.8))  # 10 positions in FP8
    steps, again = kv(24, 5), kv(2, 6)
    both = range(CFG.n_layers)  # truncate rolls back every layer
    feed(cache, steps[:16], 0, both)
    assert cache.overflowed[0] == CHUNK
    old_k, old_v, *_ = feed(cache, steps[16:], 16, both)
    assert cache.overflowed[0] == 2 * CHUNK, "positions 8..16 moved after position 16"
    feed(plain, steps, 0, both)
    cache.truncate(cut)
    plain.truncate(cut)
    assert cache.lengths == [cut, cut] and cache.overflowed == [min(cut, 2 * CHUNK)] * 2
    k, v, length, _, _ = feed(cache, again, cut)
    pk, pv, _, ks, vs = feed(plain, again, cut)
    assert length == cut + 2 and cache.overflowed[0] == min(cut, 2 * CHUNK), "the refill moved nothing"
    for got, old, fp8 in ((k, old_k, fp8_values(pk, ks, length)), (v, old_v, fp8_values(pv, vs, length))):
        assert torch.equal(got[:, :, :cut], old[:, :, :cut]), "the positions kept read as before the rollback"
        assert torch.equal(got[:, :, cut:], fp8[:, :, cut:]), "the new positions exactly in FP8"


@torch.no_grad()
def test_generate_runs_greedy_with_an_overflowing_cache():
    torch.manual_seed(0)
    model, prompt = Transformer(CFG).eval(), torch.randint(0, 256, (2, 24))
    budget = 11000  # of 11264 for 44 positions in FP8: 16 in FP8, the rest moves
    ref, fp8_stats = generate(model, prompt, 20, kv_cache="fp8")
    got, stats = generate(model, prompt, 20, kv_cache="fp8", kv_overflow="nvfp4", kv_budget_bytes=budget)
    assert got.shape == (2, 44) and torch.equal(got[:, :24], prompt)
    assert stats["cache_bytes"] <= budget < fp8_stats["cache_bytes"] and not stats["cuda_graph"]
    agree = (got[:, 24:] == ref[:, 24:]).float().mean().item()
    assert agree >= 0.9, f"greedy tokens as with the all-FP8 cache: {agree:.2f} (measured 1.00)"
    with pytest.raises(ValueError, match="cuda_graph=True needs kv_cache='fp8' on a GPU, without kv_overflow"):
        generate(model, prompt, 4, kv_overflow="nvfp4", kv_budget_bytes=budget, cuda_graph=True)
    with pytest.raises(ValueError, match="kv_overflow='nvfp4' is not available with a draft"):
        generate(model, prompt, 4, kv_overflow="nvfp4", kv_budget_bytes=budget, draft=model)


@pytest.mark.parametrize("kwargs, cfg, match", [
    (dict(overflow="nvfp8", budget_bytes=8000), CFG, r"overflow must be None or 'nvfp4', got 'nvfp8'"),
    (dict(overflow="nvfp4", budget_bytes=0), CFG, r"budget_bytes must be an int > 0"),
    (dict(overflow="nvfp4", budget_bytes=-5), CFG, r"budget_bytes must be an int > 0"),
    (dict(overflow="nvfp4"), CFG, r"budget_bytes must be an int > 0 with overflow='nvfp4', got None"),
    (dict(budget_bytes=8000), CFG, r"budget_bytes applies with overflow='nvfp4' only"),
    (dict(overflow="nvfp4", budget_bytes=8000, dtype="bf16"), CFG, r"overflow='nvfp4'.*needs dtype='fp8'"),
    (dict(overflow="nvfp4", budget_bytes=8000, overflow_chunk=0), CFG, r"overflow_chunk must be an int > 0"),
    (dict(overflow="nvfp4", budget_bytes=8000), preset("tiny", d_model=96, n_heads=4),
     r"head_dim to be a multiple of 16.*head_dim 24"),
    (dict(overflow="nvfp4", budget_bytes=4000), CFG, r"budget_bytes 4000 is below the \d+ bytes"),
])
def test_bad_overflow_arguments_are_refused_naming_them(kwargs, cfg, match):
    with pytest.raises(ValueError, match=match):
        KVCache(cfg, 2, 32, **kwargs)


def test_device_positions_are_refused_with_overflow():
    cache, _ = caches(32, int(fp8_bytes(32) * 0.9))
    with pytest.raises(ValueError, match="advance_to: not with overflow='nvfp4'"):
        cache.advance_to(1)


def test_the_quality_benchmark_dry_run_measures_every_cache(tmp_path):
    """benchmarks/quality_kv_overflow.py --dry_run: the tiny untrained model on the CPU, every row measured or (a
    budget too small for 128 positions) refused with the reason, the overflow rows within their budgets."""
    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "kv_overflow.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "quality_kv_overflow.py"), "--dry_run",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["bf16", "fp8", "fp8 + nvfp4 at 60%", "fp8 + nvfp4 at 75%", "fp8 + nvfp4 at 90%"]
    assert "below the" in rows["fp8 + nvfp4 at 60%"]["refused"]
    for name in ("fp8 + nvfp4 at 75%", "fp8 + nvfp4 at 90%"):
        r = rows[name]
        assert r["cache_bytes"] <= r["budget_bytes"] and 0 < r["fp8_positions"] < 128, r
        assert math.isfinite(r["loss"]) and abs(r["vs_bf16_cache"] - 1) < 0.05, r
    assert rows["fp8"]["cache_bytes"] * 2 == rows["bf16"]["cache_bytes"]
    assert "| fp8 + nvfp4 at 75% |" in proc.stdout


def test_decode_steps_read_nothing_back_to_the_host(monkeypatch):
    """Appends and truncates of an overflowing cache read no tensor value on the host (on a GPU each read would be
    a synchronisation inside a decode step): the NVFP4 part is dequantized without checking its codes."""
    cfg = preset("tiny")
    cache = KVCache(cfg, 2, 80, "fp8", overflow="nvfp4", budget_bytes=16224, overflow_chunk=8)
    g = torch.Generator().manual_seed(0)

    def mk(n):
        return torch.randn(2, cfg.n_kv_heads, n, cfg.head_dim, generator=g)
    for layer in range(2):
        cache.update(layer, mk(40), mk(40), 0)
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, real=real, name=name, **k: reads.append(name) or real(self, *a, **k))
    for t in range(40, 70):
        for layer in range(2):
            cache.append(layer, mk(1), mk(1), t)
    cache.truncate(12)
    for t in range(12, 30):
        for layer in range(2):
            cache.append(layer, mk(1), mk(1), t)
    monkeypatch.undo()
    assert cache.overflowed[0] > 0 and reads == [], f"host reads: {reads[:5]}"


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_cache": None, "kv_overflow": "nvfp4", "kv_budget_bytes": 10**6}, "kv_overflow='nvfp4' needs a KV cache"),
    ({"kv_cache": "fp8", "kv_overflow": "nvfp4"}, "kv_overflow and kv_budget_bytes go together"),
    ({"kv_cache": "fp8", "kv_budget_bytes": 10**6}, "kv_overflow and kv_budget_bytes go together"),
])
def test_generate_and_decode_loss_refuse_overflow_arguments_they_would_ignore(kwargs, match):
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).eval()
    ids = torch.randint(0, 256, (1, 8))
    with pytest.raises(ValueError, match=f"generate: {match}"):
        generate(model, ids, 4, **kwargs)
    with pytest.raises(ValueError, match=f"decode_loss: {match}"):
        fp8ext.inference.decode_loss(model, ids, ids, **kwargs)
