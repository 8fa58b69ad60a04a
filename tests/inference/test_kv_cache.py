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


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@torch.no_grad()
def test_a_chunk_after_cached_positions_gives_the_logits_of_one_token_steps(dtype):
    """Several tokens after cached ones (speculative decoding's verification) see the cache and the chunk's own
    earlier tokens, as one-token steps do; a rollback (truncate) then a new chunk gives the same again."""
    model, prompt = model_and_prompt()
    chunked, stepped = (KVCache.from_model(model, 2, 40, dtype) for _ in range(2))
    model(prompt[:, :20], kv_cache=chunked, start_pos=0)
    model(prompt[:, :20], kv_cache=stepped, start_pos=0)
    steps = torch.cat([model(prompt[:, t:t + 1], kv_cache=stepped, start_pos=t) for t in range(20, 24)], 1)
    tol = 1e-5  # measured 2e-7 with either cache (float32 on the CPU)
    assert rel(model(prompt[:, 20:], kv_cache=chunked, start_pos=20), steps) < tol, "chunk of 4 after 20 cached"
    chunked.truncate(21)
    again = model(prompt[:, 21:], kv_cache=chunked, start_pos=21)
    assert rel(again, steps[:, 1:]) < tol, "the same positions after rolling back 3 of them"


def test_given_scales_are_used_and_misuse_is_refused():
    model, prompt = model_and_prompt()
    cfg = model.cfg
    cache = KVCache(cfg, 2, 30, "fp8", k_scale=torch.full((cfg.n_kv_heads,), 0.5), v_scale=torch.ones(cfg.n_kv_heads))
    with torch.no_grad():
        model(prompt, kv_cache=cache, start_pos=0)
        assert torch.equal(cache.scales(1)[0], torch.full((cfg.n_kv_heads,), 0.5))
        with pytest.raises(ValueError, match="start_pos 3 must continue it"):
            model(prompt[:, :1], kv_cache=cache, start_pos=3)
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
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu", "--cuda_graph", "on"])
    assert exit_.value.code == 1 and "error: --cuda_graph on needs --kv_cache fp8 on a GPU" in capsys.readouterr().err


# ---- decode steps as a CUDA graph: the position in device memory ----------------------------------------------
from conftest import requires_cuda  # noqa: E402
from fp8ext.inference import attention, decode_loss  # noqa: E402


def test_graphed_decoding_is_refused_where_it_cannot_run():
    model, prompt = model_and_prompt()
    with pytest.raises(ValueError, match="cuda_graph=True needs kv_cache='fp8' on a GPU"):
        generate(model, prompt, 4, kv_cache="fp8", cuda_graph=True)  # on the CPU
    with pytest.raises(ValueError, match="cuda_graph=True needs kv_cache='fp8' on a GPU"):
        decode_loss(model, prompt, prompt, kv_cache="bf16", cuda_graph=True)
    _, stats = generate(model, prompt, 4, kv_cache="fp8")
    assert stats["cuda_graph"] is False  # auto: not on a CPU
    with torch.no_grad():
        cache = KVCache(model.cfg, 2, 64, "fp8")
        model(prompt, kv_cache=cache, start_pos=0)
        pos = torch.tensor([24])
        with pytest.raises(ValueError, match="one-token decode steps over an FP8 KV cache"):
            model(prompt, kv_cache=cache, start_pos=pos)
        with pytest.raises(ValueError, match="needs an FP8 cache on a GPU"):
            model(prompt[:, :1], kv_cache=cache, start_pos=pos)
        q = torch.randn(2, model.cfg.n_heads, model.cfg.head_dim)
        ks, vs = cache.scales(0)
        with pytest.raises(ValueError, match="a tensor length \\(CUDA graphs\\) needs an FP8 cache on a GPU"):
            attention.decode_attention(q, cache.k[0], cache.v[0], pos, ks, vs)


@requires_cuda
@pytest.mark.cuda
def test_device_position_and_length_give_the_int_paths_bytes():
    from fp8ext import _C
    from fp8ext.core.boundary import dl, dl_fp8, stream_of
    torch.manual_seed(0)
    b, h, kv, hd, max_len = 2, 8, 2, 128, 700
    q = torch.randn(b, h, hd, device="cuda", dtype=torch.bfloat16)
    k = (torch.randn(b, kv, max_len, hd, device="cuda") * 3).to(torch.float8_e4m3fn)
    v = (torch.randn(b, kv, max_len, hd, device="cuda") * 3).to(torch.float8_e4m3fn)
    ks, vs = torch.rand(kv, device="cuda") * 0.05 + 0.01, torch.rand(kv, device="cuda") + 0.1
    whole = attention.decode_attention(q, k, v, max_len, ks, vs)
    # the same splits as the int path over the whole cache: the same bytes; beyond max_len it is clamped
    for n in (max_len, max_len + 5):
        assert torch.equal(attention.decode_attention(q, k, v, torch.tensor([n], device="cuda"), ks, vs), whole)
    for n in (1, 17, 333):
        got = attention.decode_attention(q, k, v, torch.tensor([n], device="cuda"), ks, vs)
        want = attention.decode_attention_reference(q.float(), k, v, n, ks, vs)
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1.6e-2 * float(want.abs().max()))
    # kv_store: pos_dev stores where pos stores; out of range stores nothing
    x = torch.randn(b, kv, 1, hd, device="cuda", dtype=torch.bfloat16)
    a, c = torch.zeros_like(k), torch.zeros_like(k)
    _C.kv_store(dl(x), dl(ks), dl_fp8(a), 321, stream_of(x.device))
    _C.kv_store(dl(x), dl(ks), dl_fp8(c), 0, stream_of(x.device), pos_dev=dl(torch.tensor([321], device="cuda")))
    assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)) and a.view(torch.uint8)[:, :, 321].any()
    for bad in (-1, max_len):
        _C.kv_store(dl(x), dl(ks), dl_fp8(c), 0, stream_of(x.device), pos_dev=dl(torch.tensor([bad], device="cuda")))
    assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))
    with pytest.raises(TypeError, match="pos_dev must be one int64 element"):
        _C.kv_store(dl(x), dl(ks), dl_fp8(c), 0, stream_of(x.device), pos_dev=dl(torch.tensor([1.0], device="cuda")))


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16 model", "FP8 model"])
def test_graphed_decode_steps_match_the_eager_ones(quantized):
    from fp8ext import inference
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).to("cuda", torch.bfloat16).eval()
    if quantized:
        inference.quantize_model(model, "channel", "dynamic")
    ids = torch.randint(0, 256, (3, 40), device="cuda")
    eager = decode_loss(model, ids[:, :-1], ids[:, 1:], kv_cache="fp8", prompt_len=8, cuda_graph=False)
    graphed = decode_loss(model, ids[:, :-1], ids[:, 1:], kv_cache="fp8", prompt_len=8, cuda_graph=True)
    # the same kernels; decode attention splits the positions as for the whole cache, so sums differ in order
    assert abs(graphed - eager) <= 2e-3 * eager, (graphed, eager)
    prompt = ids[:, :12]
    out, stats = generate(model, prompt, 10, kv_cache="fp8")
    assert stats["cuda_graph"] is True and out.shape == (3, 22) and torch.equal(out[:, :12], prompt)
    ref, ref_stats = generate(model, prompt, 10, kv_cache="fp8", cuda_graph=False)
    assert ref_stats["cuda_graph"] is False
    assert torch.equal(out[:, 12], ref[:, 12])  # the first new token comes from the prefill in both
    assert (out == ref).float().mean() > 0.9  # later ones may part at a near-tie of the logits
    # a graphed step checks what the host can: the tokens' shape and that the position continues the cache
    from fp8ext.inference.generate import _GraphedStep
    with torch.no_grad():
        cache = KVCache.from_model(model, 3, 20, "fp8")
        model(prompt, kv_cache=cache, start_pos=0)
        step = _GraphedStep(model, cache, 3, ids.device)
        with pytest.raises(ValueError, match="position 13 must continue the cache"):
            step(ids[:, 12:13], 13)
        with pytest.raises(ValueError, match="tokens must be"):
            step(ids[:1, 12:13], 12)
        step(ids[:, 12:13], 12)
        assert cache.lengths == [13] * model.cfg.n_layers


def _prefilled(cfg, b, max_len, pre, dtype, device, seed=1):
    """An FP8 cache whose every layer holds `pre` positions (its scales set from them), and the same twice more."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, cfg.n_kv_heads, pre, cfg.head_dim)
    caches = [KVCache(cfg, b, max_len, "fp8", device) for _ in range(3)]
    for layer in range(cfg.n_layers):
        k, v = (torch.randn(shape, generator=g).mul(4).to(device, dtype) for _ in range(2))
        for cache in caches:
            cache.append(layer, k, v, 0)
    return caches


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_append_stores_the_bytes_of_rope_qkv_then_append(dtype):
    from fp8ext.ops import fused
    cfg = preset("tiny", d_model=256, n_heads=4, n_kv_heads=2)  # head_dim 64
    h, kv, hd, b, max_len, pre = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 3, 40, 9
    ref, got, graphed = _prefilled(cfg, b, max_len, pre, dtype, "cuda")
    torch.manual_seed(0)
    cos, sin = torch.randn(max_len, hd // 2, device="cuda"), torch.randn(max_len, hd // 2, device="cuda")
    qkv = torch.randn(b, 1, (h + 2 * kv) * hd, device="cuda", dtype=dtype) * 5
    q_ref, k_ref, v_ref = fused.rope_qkv(qkv, cos[pre:], sin[pre:], h, kv)
    want = ref.append(1, k_ref, v_ref, pre)
    step = got.rope_append(1, qkv, cos[pre:], sin[pre:], h, pre)
    assert step is not None and torch.equal(step[0], q_ref) and step[0].shape == (b, h, 1, hd)
    assert step[3] == want[2] == pre + 1 and got.lengths == [pre, pre + 1] == ref.lengths

    def stored(cache, layer, n):  # the bytes of positions [0, n) of a layer's K and V (the rest is empty memory)
        return [t[layer, :, :, :n].view(torch.uint8) for t in (cache.k, cache.v)]

    for layer, n in ((0, pre), (1, pre + 1)):
        assert all(torch.equal(a, c) for a, c in zip(stored(got, layer, n), stored(ref, layer, n))), layer
    assert all(t[:, :, pre].any() for t in stored(got, 1, pre + 1))
    # CUDA graphs' form: the position in device memory, the step's rows of cos and sin; lengths stay the host's
    pos = torch.tensor([pre], device="cuda")
    for layer in (1, 0):
        step = graphed.rope_append(layer, qkv, cos.index_select(0, pos), sin.index_select(0, pos), h, pos)
        assert torch.equal(step[0], q_ref) and int(step[3]) == pre + 1
    assert graphed.lengths == [pre, pre]  # the host's lengths: advance_to's business
    ref.append(0, k_ref, v_ref, pre)
    for layer in (0, 1):
        assert all(torch.equal(a, c) for a, c in zip(stored(graphed, layer, pre + 1), stored(ref, layer, pre + 1)))
    pos.fill_(pre + 1)  # the length is written by the kernel, from the position it reads
    assert int(graphed.rope_append(1, qkv, cos[pre:], sin[pre:], h, pos)[3]) == pre + 2
    # a device position outside the cache stores nothing (q is still written)
    before = (graphed.k.clone(), graphed.v.clone())
    for bad in (-1, max_len):
        step = graphed.rope_append(0, qkv * 2, cos[pre:], sin[pre:], h, torch.tensor([bad], device="cuda"))
        assert torch.equal(step[0], fused.rope_qkv(qkv * 2, cos[pre:], sin[pre:], h, kv)[0])
    for now, then in zip((graphed.k, graphed.v), before):
        assert torch.equal(now.view(torch.uint8), then.view(torch.uint8))
    with pytest.raises(ValueError, match="start_pos 3 must continue it"):
        got.rope_append(0, qkv, cos, sin, h, 3)
    # a strided qkv is copied first; one that wants a gradient is left to rope_qkv (whose autograd it needs)
    strided = qkv.transpose(0, 2).contiguous().transpose(0, 2)
    assert not strided.is_contiguous()
    again = _prefilled(cfg, b, max_len, pre, dtype, "cuda")[0]
    assert torch.equal(again.rope_append(1, strided, cos[pre:], sin[pre:], h, pre)[0], q_ref)
    assert all(torch.equal(a, c) for a, c in zip(stored(again, 1, pre + 1), stored(ref, 1, pre + 1)))
    assert again.rope_append(0, qkv.clone().requires_grad_(), cos[pre:], sin[pre:], h, pre) is None


@requires_cuda
@pytest.mark.cuda
def test_decode_steps_with_and_without_the_fused_store_agree(monkeypatch):
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(0, 256, (3, 12), device="cuda")
    fused_out, _ = generate(model, prompt, 6, kv_cache="fp8", cuda_graph=False)
    calls = []
    monkeypatch.setattr(KVCache, "rope_append", lambda self, *a: calls.append(1))  # None: rope_qkv, then append
    plain, _ = generate(model, prompt, 6, kv_cache="fp8", cuda_graph=False)
    assert calls and torch.equal(fused_out, plain)


def test_rope_append_leaves_cpu_and_bf16_caches_to_rope_qkv_and_append():
    cfg = preset("tiny")
    qkv = torch.randn(2, 1, (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim)
    cos = sin = torch.ones(4, cfg.head_dim // 2)
    fp8, = _prefilled(cfg, 2, 16, 3, torch.float32, "cpu")[:1]
    assert fp8.rope_append(0, qkv, cos, sin, cfg.n_heads, 3) is None  # a CPU tensor
    assert KVCache(cfg, 2, 16, "bf16").rope_append(0, qkv, cos, sin, cfg.n_heads, 0) is None


def test_rope_qkv_cache_arguments_are_checked():
    from fp8ext import _C
    from fp8ext.core.boundary import dl
    x = torch.zeros(1, 1, 64)
    args = (dl(x), dl(torch.ones(4, 8)), dl(torch.ones(4, 8)), dl(torch.zeros(1, 2, 1, 16)), dl(torch.zeros(1)),
            dl(torch.zeros(1)), 2, 1, 0)
    with pytest.raises(ValueError, match="k_scale and v_scale come together"):
        _C.rope_qkv(*args, k_scale=dl(torch.ones(1)))
    with pytest.raises(ValueError, match="k_scale and v_scale come together, and not with backward"):
        _C.rope_qkv(*args, 0, True, k_scale=dl(torch.ones(1)), v_scale=dl(torch.ones(1)))
    for kw in ("pos_dev", "length_out"):
        with pytest.raises(ValueError, match="pos_dev and length_out are for stores into a KV cache"):
            _C.rope_qkv(*args, **{kw: dl(torch.zeros(1, dtype=torch.int64))})
