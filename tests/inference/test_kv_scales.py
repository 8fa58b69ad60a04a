"""Calibrated FP8 KV-cache scales (recorded by calibrate, stored by quantize_model, saved and loaded bit for bit,
used by KVCache.from_model and generate) and the decode path through fp8ext.inference.attention.decode_attention
(the raw E4M3 cache bytes with per-head scales; the prefill still goes through SDPA)."""
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import fp8ext
from fp8ext import inference
from fp8ext.inference import KVCache, generate
from fp8ext.ops import attention as attention_mod  # where the decode step looks decode_attention up
from fp8ext.models.transformer import Transformer, TransformerConfig, preset

CFG = preset("tiny")


def factory(cfg):
    return Transformer(TransformerConfig(**cfg))


def calibrated_model(seed=0, weights="channel", activations="dynamic"):
    torch.manual_seed(seed)
    model = Transformer(CFG).eval()
    batches = [torch.randint(0, 256, (4, 96)) for _ in range(3)]
    inference.calibrate(model, batches, progress=False)
    return model, batches


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def independent_kv_amax(model, batches):
    """Per layer, per KV head: max|K after RoPE| and max|V|, from the QKV projection's output (a forward hook)
    and a float64 rotary embedding written here."""
    cfg = model.cfg
    h, kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    outs = {i: [] for i in range(cfg.n_layers)}
    hooks = [blk.attn.qkv_proj.register_forward_hook(lambda m, a, y, i=i: outs[i].append(y.detach()))
             for i, blk in enumerate(model.blocks)]
    for b in batches:
        model(b)
    for hk in hooks:
        hk.remove()
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    result = {}
    for i, ys in outs.items():
        ka = torch.zeros(kv, dtype=torch.float64)
        va = torch.zeros(kv, dtype=torch.float64)
        for y in ys:
            b, s, _ = y.shape
            _, k, v = y.double().split([h * hd, kv * hd, kv * hd], dim=-1)
            k = k.view(b, s, kv, hd)
            ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)[None, :, None, :]
            k1, k2 = k[..., : hd // 2], k[..., hd // 2:]
            kr = torch.cat([k1 * ang.cos() - k2 * ang.sin(), k1 * ang.sin() + k2 * ang.cos()], -1)
            ka = torch.maximum(ka, kr.abs().amax(dim=(0, 1, 3)))
            va = torch.maximum(va, v.view(b, s, kv, hd).abs().amax(dim=(0, 1, 3)))
        result[f"blocks.{i}.attn"] = (ka, va)
    return result


def test_calibration_records_per_head_k_and_v_amax_and_removes_its_hook():
    model, batches = calibrated_model()
    want = independent_kv_amax(model, batches)
    got = model.fp8_kv_calibration
    assert set(got) == set(want) == {f"blocks.{i}.attn" for i in range(CFG.n_layers)}
    for name, (ka, va) in want.items():
        assert got[name]["k_amax"].shape == (CFG.n_kv_heads,) and got[name]["k_amax"].dtype == torch.float32
        torch.testing.assert_close(got[name]["k_amax"].double(), ka, rtol=1e-5, atol=0)
        torch.testing.assert_close(got[name]["v_amax"].double(), va, rtol=1e-6, atol=0)
    assert all(blk.attn.kv_observer is None for blk in model.blocks), "calibrate removed its observers"
    assert all("kv_observer" not in vars(blk.attn) for blk in model.blocks)


def test_quantize_model_stores_amax_over_448_and_save_load_round_trips_the_scales_bit_for_bit(tmp_path):
    model, batches = calibrated_model()
    amax = {n: (d["k_amax"], d["v_amax"]) for n, d in model.fp8_kv_calibration.items()}
    inference.quantize_model(model, "channel", "static", out_dtype=torch.float32)
    for i, blk in enumerate(model.blocks):
        ka, va = amax[f"blocks.{i}.attn"]
        assert blk.attn.k_scale.dtype == torch.float32 and blk.attn.k_scale.shape == (CFG.n_kv_heads,)
        assert torch.equal(blk.attn.k_scale, ka / 448) and torch.equal(blk.attn.v_scale, va / 448)
    inference.save_quantized(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for i in range(CFG.n_layers):
            for kind in ("k", "v"):
                key = f"model.layers.{i}.self_attn.{kind}_scale"  # fp8ext's Transformer saves Llama's names
                # [n_kv_heads, 1, 1], as compressed-tensors' attention takes them
                assert f.get_slice(key).get_dtype() == "F32" and f.get_slice(key).get_shape() == [CFG.n_kv_heads, 1, 1]
        meta = json.loads(f.metadata()["fp8ext"])["kv_cache"]
    assert meta["model.layers.1.self_attn"]["v_amax"] == amax["blocks.1.attn"][1].tolist()
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    kvs = qc["kv_cache_scheme"]
    assert (kvs["num_bits"], kvs["type"], kvs["symmetric"], kvs["dynamic"], kvs["strategy"]) == \
        (8, "float", True, False, "attn_head")

    loaded = inference.load_quantized(tmp_path, factory, device="cpu")
    for a, b in zip(model.blocks, loaded.blocks):
        for kind in ("k_scale", "v_scale"):
            x, y = getattr(a.attn, kind), getattr(b.attn, kind)
            assert y.dtype == torch.float32 and torch.equal(x.view(torch.int32), y.view(torch.int32)), kind
    assert loaded.fp8_quantization["kv_cache_scheme"]["strategy"] == "attn_head"
    k_all, v_all = inference.model_kv_scales(loaded)
    assert k_all.shape == (CFG.n_layers, CFG.n_kv_heads)
    assert torch.equal(v_all[1], model.blocks[1].attn.v_scale)
    prompt = torch.randint(0, 256, (2, 16))
    a, sa = generate(model, prompt, 12, kv_cache="fp8")
    b, sb = generate(loaded, prompt, 12, kv_cache="fp8")
    assert torch.equal(a, b) and sa["kv_scales"] == sb["kv_scales"] == "calibrated"


def test_no_kv_calibration_means_no_scales_and_prefill_derived_scales_in_generate(tmp_path):
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    inference.quantize_model(model, "channel", "dynamic", out_dtype=torch.float32)  # no calibration at all
    assert model.blocks[0].attn.k_scale is None and inference.model_kv_scales(model) is None
    inference.save_quantized(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    loaded = inference.load_quantized(tmp_path, factory, device="cpu")
    assert loaded.blocks[0].attn.k_scale is None
    _, stats = generate(loaded, torch.randint(0, 256, (1, 8)), 4, kv_cache="fp8")
    assert stats["kv_scales"] == "prefill"
    _, stats = generate(loaded, torch.randint(0, 256, (1, 8)), 4, kv_cache="bf16")
    assert stats["kv_scales"] is None
    with pytest.raises(ValueError, match="carries no KV-cache scales"):
        generate(loaded, torch.randint(0, 256, (1, 8)), 4, kv_cache="fp8", kv_scales="calibrated")
    calibrated, _ = calibrated_model()
    inference.quantize_model(calibrated, "channel", "dynamic", kv_cache_scales=False)
    assert calibrated.blocks[0].attn.k_scale is None and calibrated.fp8_quantization["kv_cache_scheme"] is None


@torch.no_grad()
def teacher_forced(model, seq, kv, scales="auto", prompt=8, k_scale=None, v_scale=None):
    """Logits of positions prompt-1 .. end-1: prefill `prompt` tokens, then one true token per decode step."""
    b, n = seq.shape
    if k_scale is not None:
        cache = KVCache(model.cfg, b, n, kv, k_scale=k_scale, v_scale=v_scale)
    else:
        cache = KVCache.from_model(model, b, n, kv, scales=scales)
    outs = [model(seq[:, :prompt], kv_cache=cache, start_pos=0)[:, -1:]]
    for t in range(prompt, n - 1):
        outs.append(model(seq[:, t:t + 1], kv_cache=cache, start_pos=t))
    return torch.cat(outs, 1), cache


def test_generation_with_calibrated_scales_tracks_the_bf16_cache():
    model, _ = calibrated_model()
    inference.quantize_model(model, "channel", "dynamic", out_dtype=torch.float32)
    torch.manual_seed(5)
    seq = torch.randint(0, 256, (4, 128))
    ref, _ = teacher_forced(model, seq, "bf16")
    got, cache = teacher_forced(model, seq, "fp8", "calibrated")
    assert cache.scale_source == "calibrated"
    assert torch.equal(cache.scales(1)[0], model.blocks[1].attn.k_scale)
    err, agree = rel(got, ref), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert err < 0.02 and agree > 0.95, f"calibrated FP8 cache vs bf16 cache: logits error {err:.4f}, argmax {agree:.3f}"
    # the measure is sensitive: scales 16x too small saturate most of K and V
    k, v = inference.model_kv_scales(model)
    bad, _ = teacher_forced(model, seq, "fp8", k_scale=k / 16, v_scale=v / 16)
    assert rel(bad, ref) > 5 * err


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    from fp8ext.train import cli
    run = tmp_path_factory.mktemp("run")
    cli.main(["--preset", "tiny", "--batch_size", "8", "--seq_len", "64", "--max_steps", "60", "--lr", "3e-3",
              "--eval_every", "60", "--eval_batches", "1", "--no_progress", "--out_dir", str(run)])
    return run


@pytest.fixture(scope="module")
def trained_tiny(trained_run):
    model = Transformer(CFG)
    model.load_state_dict(torch.load(trained_run / "checkpoint.pt", weights_only=True)["model"])
    return model.eval()


def test_command_line_exports_kv_scales_and_eval_compares_the_caches(trained_run, tmp_path, capsys):
    from fp8ext.inference.__main__ import main
    main(["quantize", "--checkpoint", str(trained_run), "--calib_batches", "2", "--out", str(tmp_path / "fp8"),
          "--device", "cpu"])
    assert "FP8 KV-cache scales (per KV head) for 2 attention layers" in capsys.readouterr().out
    main(["eval", "--model", str(tmp_path / "fp8"), "--eval_batches", "1", "--batch_size", "2", "--kv_cache",
          "--device", "cpu"])
    out = capsys.readouterr().out
    losses = {l.split(":")[0].strip(): float(l.split("loss ")[1].split()[0]) for l in out.splitlines()
              if "nats/byte" in l}
    assert set(losses) == {"bf16", "fp8", "fp8, bf16 KV cache", "fp8, fp8 KV cache"}
    # the bf16 cache reads the same text as one forward pass: the same loss up to rounding
    assert abs(losses["fp8, bf16 KV cache"] - losses["fp8"]) < 0.01 * losses["fp8"]
    assert abs(losses["fp8, fp8 KV cache"] - losses["fp8, bf16 KV cache"]) < 0.02 * losses["fp8"]
    assert "FP8 KV cache (calibrated scales) vs bf16 KV cache" in out
    main(["generate", "--model", str(tmp_path / "fp8"), "--prompt", "def ", "--max_new_tokens", "4", "--device", "cpu"])
    stats_line = capsys.readouterr().out.splitlines()[-1]
    assert "KV cache fp8" in stats_line and "calibrated scales" in stats_line


def test_greedy_generation_of_a_trained_model_with_calibrated_scales_matches_the_bf16_cache(trained_tiny):
    from fp8ext.train.data import batch, load_corpus
    corpus = load_corpus()
    model = copy.deepcopy(trained_tiny)
    inference.calibrate(model, [batch(corpus.train, 8, 128, seed=1, step=i)[0] for i in range(4)], progress=False)
    inference.quantize_model(model, "channel", "dynamic", out_dtype=torch.float32)
    prompt, _ = batch(corpus.val, 8, 16, seed=9, step=0)
    a, stats = generate(model, prompt, 64, kv_cache="fp8")
    b, _ = generate(model, prompt, 64, kv_cache="bf16")
    assert stats["kv_scales"] == "calibrated"
    same = (a == b).all(dim=1).float().mean().item()
    assert same >= 0.75, f"{same:.0%} of the 8 greedy continuations (64 bytes each) equal the bf16 cache's"
    seq = torch.cat([prompt, b[:, 16:]], 1)  # the bf16 cache's text, read back through both caches
    ref, _ = teacher_forced(model, seq, "bf16", prompt=16)
    got, _ = teacher_forced(model, seq, "fp8", "calibrated", prompt=16)
    assert rel(got, ref) < 0.02 and (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.97


def old_decode_path(q, k_cache, v_cache, length, k_scale, v_scale):
    """What a decode step computed before the decode_attention path: the cached bytes [0, length) dequantized
    (fp8ext.dequantize, times the per-head scale) into q's dtype, K/V heads repeated, SDPA."""
    b, h, hd = q.shape
    kv = k_cache.shape[1]
    k = (fp8ext.dequantize(k_cache[:, :, :length].contiguous(), 1.0, torch.float32)
         * k_scale[None, :, None, None]).to(q.dtype)
    v = (fp8ext.dequantize(v_cache[:, :, :length].contiguous(), 1.0, torch.float32)
         * v_scale[None, :, None, None]).to(q.dtype)
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
    return F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_decode_steps_call_decode_attention_and_give_the_tokens_of_the_old_path(monkeypatch, dtype):
    torch.manual_seed(0)
    model = Transformer(CFG).eval().to(dtype)
    prompt = torch.randint(0, 256, (2, 24))
    calls = []
    real = attention_mod.decode_attention

    def spy(q, k_cache, v_cache, length, k_scale=None, v_scale=None, softmax_scale=None):
        calls.append((k_cache.dtype, tuple(k_cache.shape), length, tuple(k_scale.shape)))
        out = real(q, k_cache, v_cache, length, k_scale, v_scale)
        want = old_decode_path(q, k_cache, v_cache, length, k_scale, v_scale)
        assert rel(out.float(), want.float()) < (1e-5 if dtype == torch.float32 else 1e-2)
        return out

    monkeypatch.setattr(attention_mod, "decode_attention", spy)
    new, _ = generate(model, prompt, 40, kv_cache="fp8", temperature=1.0, seed=3)  # sampled: every token counts
    steps = 39  # the last token is picked without another step
    assert len(calls) == CFG.n_layers * steps
    assert all(c[0] == torch.float8_e4m3fn and c[1] == (2, CFG.n_kv_heads, 64, CFG.head_dim) for c in calls)
    assert [c[2] for c in calls[::CFG.n_layers]] == list(range(25, 25 + steps)), "the positions stored so far"
    assert all(c[3] == (CFG.n_kv_heads,) for c in calls)

    monkeypatch.setattr(attention_mod, "decode_attention", old_decode_path)
    old, _ = generate(model, prompt, 40, kv_cache="fp8", temperature=1.0, seed=3)
    if dtype == torch.float32:  # in bf16 the two round differently (checked per call above), and one sampled token
        assert torch.equal(new, old)  # that differs changes the rest, by a margin that depends on the CPU

    calls.clear()
    monkeypatch.setattr(attention_mod, "decode_attention", spy)
    generate(model, prompt, 8, kv_cache="bf16")
    assert not calls, "a bf16 cache decodes through SDPA"


def test_kv_cache_append_returns_the_raw_storage_and_scales_and_checks_its_arguments():
    torch.manual_seed(2)
    k_scale = torch.rand(CFG.n_layers, CFG.n_kv_heads) + 0.01
    v_scale = torch.rand(CFG.n_layers, CFG.n_kv_heads) + 0.01
    cache = KVCache(CFG, 1, 8, "fp8", k_scale=k_scale, v_scale=v_scale)
    assert cache.scale_source == "given"
    k = torch.randn(1, CFG.n_kv_heads, 1, CFG.head_dim) * 0.3
    v = torch.randn(1, CFG.n_kv_heads, 1, CFG.head_dim) * 0.3
    kc, vc, length, ks, vs = cache.append(1, k, v, 0)
    assert kc.data_ptr() == cache.k[1].data_ptr() and kc.shape == (1, CFG.n_kv_heads, 8, CFG.head_dim)
    assert length == 1 and torch.equal(ks, k_scale[1]) and torch.equal(vs, v_scale[1])
    assert torch.equal(kc[:, :, 0:1].view(torch.uint8),
                       fp8ext.quantize((k / k_scale[1][None, :, None, None]).contiguous(), fp8ext.E4M3).view(torch.uint8))
    assert cache.lengths == [0, 1]
    with pytest.raises(ValueError, match="start_pos 0 must continue it"):
        cache.append(1, k, v, 0)
    with pytest.raises(ValueError, match=r"k_scale must be \[n_kv_heads\] = \[2\] or \[n_layers, n_kv_heads\]"):
        KVCache(CFG, 1, 8, "fp8", k_scale=torch.ones(3), v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="v_scale must be finite and positive"):
        KVCache(CFG, 1, 8, "fp8", k_scale=torch.ones(2), v_scale=torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        KVCache(CFG, 1, 8, "fp8", k_scale=torch.ones(2))
    with pytest.raises(ValueError, match="FP8 cache only"):
        KVCache(CFG, 1, 8, "bf16", k_scale=torch.ones(2), v_scale=torch.ones(2))
    with pytest.raises(ValueError, match="k and v must be"):
        cache.append(0, k[:, :1], v[:, :1], 0)
    cache.append(0, k, v, 0)
    cache.truncate(0)
    assert cache.lengths == [0, 0]
    with pytest.raises(ValueError, match=r"truncate: length must be in \[0, 0\]"):
        cache.truncate(1)
