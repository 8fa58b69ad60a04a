"""Generation with a KV cache in bf16 and FP8: the same tokens as recomputing the whole sequence, half the memory
in FP8, and attention over exactly the dequantized cache."""
import pytest
import torch
import torch.nn.functional as F

import fp8ext
from fp8ext.inference import KVCache, generate
from fp8ext.models.transformer import Transformer, preset


def model_and_prompt(seed=0):
    torch.manual_seed(seed)
    return Transformer(preset("tiny")).eval(), torch.randint(0, 256, (2, 24))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_bf16_cache_generates_what_recomputing_generates():
    model, prompt = model_and_prompt()
    ref, _ = generate(model, prompt, 16, kv_cache=None)
    got, stats = generate(model, prompt, 16, kv_cache="bf16")
    assert torch.equal(got, ref) and got.shape == (2, 40)
    assert stats["prefill_tokens_per_s"] > 0 and stats["decode_tokens_per_s"] > 0


@torch.no_grad()
def test_fp8_cache_halves_memory_and_keeps_the_logits_close():
    model, prompt = model_and_prompt()
    fp8, bf16 = KVCache(model.cfg, 2, 64, "fp8"), KVCache(model.cfg, 2, 64, "bf16")
    assert fp8.nbytes * 2 == bf16.nbytes
    full = model(prompt)
    pre8, pre16 = model(prompt, kv_cache=fp8, start_pos=0), model(prompt, kv_cache=bf16, start_pos=0)
    assert rel(pre16, full) < 5e-3 and rel(pre8, full) < 0.03
    nxt = full[:, -1:].argmax(-1)
    step8 = model(nxt, kv_cache=fp8, start_pos=24)
    whole = model(torch.cat([prompt, nxt], 1))[:, -1:]
    assert rel(step8, whole) < 0.03, "a decode step over the FP8 cache"


@torch.no_grad()
def test_attention_reads_exactly_the_dequantized_fp8_bytes_with_per_head_scales():
    torch.manual_seed(1)
    cfg = preset("tiny")
    cache = KVCache(cfg, 1, 16, "fp8")
    k = torch.randn(1, cfg.n_kv_heads, 8, cfg.head_dim) * torch.tensor([1.0, 50.0])[None, :, None, None]
    v = torch.randn(1, cfg.n_kv_heads, 8, cfg.head_dim)
    k_all, v_all = cache.update(0, k, v, 0)
    k_scale, v_scale = cache.scales(0)
    want_scale = k.abs().amax(dim=(0, 2, 3)) * 2 / fp8ext.E4M3.max  # one binade of headroom
    assert torch.equal(k_scale, want_scale), "per-head scales from the prefill"
    stored = cache.k[0, :, :, :8]
    assert stored.dtype == torch.float8_e4m3fn
    assert torch.equal(stored, fp8ext.quantize((k / k_scale[None, :, None, None]).contiguous(), fp8ext.E4M3))
    assert torch.equal(k_all, fp8ext.dequantize(stored.contiguous()) * k_scale[None, :, None, None])
    assert rel(k_all, k) < 0.04 and rel(v_all, v) < 0.04


def test_given_scales_are_used_and_misuse_is_refused():
    model, prompt = model_and_prompt()
    cfg = model.cfg
    cache = KVCache(cfg, 2, 30, "fp8", k_scale=torch.full((cfg.n_kv_heads,), 0.5), v_scale=torch.ones(cfg.n_kv_heads))
    with torch.no_grad():
        model(prompt, kv_cache=cache, start_pos=0)
        assert torch.equal(cache.scales(1)[0], torch.full((cfg.n_kv_heads,), 0.5))
        with pytest.raises(ValueError, match="start_pos 3 must continue it"):
            model(prompt[:, :1], kv_cache=cache, start_pos=3)
        with pytest.raises(NotImplementedError, match="prefill once, then decode"):
            model(prompt[:, :2], kv_cache=cache, start_pos=24)
        with pytest.raises(ValueError, match="exceed max_len 30"):
            for pos in range(24, 31):
                model(prompt[:, :1], kv_cache=cache, start_pos=pos)
    with pytest.raises(ValueError, match="dtype must be 'fp8' or 'bf16'"):
        KVCache(cfg, 1, 8, "fp16")


def test_generate_command_line(tmp_path, capsys):
    from fp8ext import inference
    from fp8ext.inference.__main__ import main
    model, prompt = model_and_prompt()
    inference.quantize_model(model, "channel", "dynamic", out_dtype=torch.float32)
    inference.save_quantized(model, tmp_path)
    main(["generate", "--model", str(tmp_path), "--prompt", "def f", "--max_new_tokens", "8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("def f") and "decode" in out and "KV cache fp8" in out
