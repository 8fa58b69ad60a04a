"""Hugging Face transformers causal LMs (Llama, Mistral, Qwen2) through fp8ext.inference: calibrate records each
attention layer's per-KV-head K (after RoPE) and V amaxes, quantize_model gives them KV-cache scales, the saved
directory loads in transformers with fp8ext's logits, transformers' generate runs, and the CLI quantizes and
evaluates a model directory. Tiny random-init models built here; nothing is downloaded."""

import json
import logging
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face path needs the [test] extra")
pytest.importorskip("compressed_tensors", reason="transformers reads FP8 checkpoints through compressed-tensors")

from compressed_tensors.quantization.lifecycle.initialize import is_cached_attention_module  # noqa: E402

from fp8ext import inference  # noqa: E402
from fp8ext.inference import hf  # noqa: E402
from fp8ext.inference.__main__ import main  # noqa: E402

import ct_reference  # noqa: E402

SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
MODELS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
          "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
          "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}


def tiny(kind):
    torch.manual_seed(0)
    config_cls, model_cls = MODELS[kind]
    return model_cls(config_cls(**SIZES)).float().eval()


def ids(batch=2, seq=16, seed=1):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def reference_kv_amax(model, batches):
    """{attention name: (k_amax, v_amax)} from transformers' own DynamicCache after a forward with use_cache."""
    names = {m.layer_idx: n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")}
    out = {}
    with torch.no_grad():
        for x in batches:
            res = model(x, use_cache=True)
            cache = getattr(res, "cache", None) or res.past_key_values  # transformers 5.24's name, or earlier
            for i, layer in enumerate(cache.layers):
                k, v = (t.abs().amax(dim=(0, 2, 3)) for t in (layer.keys, layer.values))
                prev = out.get(names[i])
                out[names[i]] = (k, v) if prev is None else (torch.maximum(prev[0], k), torch.maximum(prev[1], v))
    return out


def calibrated(kind, weights="channel", activations="static"):
    model = tiny(kind)
    batches = [ids(seed=1), ids(seed=2)]
    want = reference_kv_amax(model, batches)
    inference.calibrate(model, batches, progress=False)
    return model, want


@pytest.mark.parametrize("kind", MODELS)
def test_calibrate_records_each_attention_layers_kv_amax_per_head(kind):
    model, want = calibrated(kind)
    got = model.fp8_kv_calibration
    assert sorted(got) == sorted(want) == [f"model.layers.{i}.self_attn" for i in range(2)]
    for name, (k, v) in want.items():
        assert got[name]["k_amax"].shape == (2,) and got[name]["k_amax"].dtype == torch.float32
        assert torch.equal(got[name]["k_amax"], k.float()), f"{name}: K amax (after RoPE) differs from the cache's"
        assert torch.equal(got[name]["v_amax"], v.float()), f"{name}: V amax differs from the cache's"


def test_calibrate_records_kv_with_a_users_forward_and_no_cache():
    model, want = calibrated("llama")
    again = tiny("llama")
    inference.calibrate(again, [ids(seed=1), ids(seed=2)], forward=lambda m, x: m(input_ids=x, use_cache=False),
                        progress=False)
    for name, (k, v) in want.items():
        assert torch.equal(again.fp8_kv_calibration[name]["k_amax"], k.float())
        assert torch.equal(again.fp8_kv_calibration[name]["v_amax"], v.float())


@pytest.mark.parametrize("kind", MODELS)
def test_quantize_model_gives_attention_layers_kv_cache_scales(kind):
    model, want = calibrated(kind)
    inference.quantize_model(model, "channel", "static")
    for name, (k, v) in want.items():
        attn = model.get_submodule(name)
        buffers = dict(attn.named_buffers(recurse=False))
        assert set(buffers) == {"k_scale", "v_scale"}
        # [n_kv_heads, 1, 1]: the shape compressed-tensors' attention broadcasts over K/V
        assert torch.equal(attn.k_scale, inference.kv_scales_from_amax(k).reshape(-1, 1, 1))
        assert torch.equal(attn.v_scale, inference.kv_scales_from_amax(v).reshape(-1, 1, 1))
        assert attn.k_scale.dtype == torch.float32
    assert model.fp8_quantization["kv_cache_scheme"]["strategy"] == "attn_head"
    assert isinstance(model.model.layers[0].self_attn.q_proj, inference.FP8InferenceLinear)


@pytest.mark.parametrize("kind", MODELS)
def test_transformers_loads_the_directory_with_fp8exts_logits(kind, tmp_path):
    model, _ = calibrated(kind)
    inference.quantize_model(model, "channel", "static")
    x = ids(seed=3)
    with torch.no_grad():
        want = model(x).logits
    as_transformers = ct_reference.logits_as_transformers_computes(model, x)  # K/V rounded where it rounds them
    out = inference.save_quantized(model, tmp_path / kind)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    scales = {f"model.layers.{i}.self_attn.{s}" for i in range(2) for s in ("k_scale", "v_scale")}
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    if is_cached_attention_module(loaded.model.layers[0].self_attn):  # it places the scales and rounds K/V
        assert not info["unexpected_keys"]
    else:  # compressed-tensors looks for `past_key_values` in attention's forward; transformers 5 calls it `cache`
        assert set(info["unexpected_keys"]) == scales, "only the KV-cache scales, which it does not place"
    with torch.no_grad():
        got = loaded.eval()(x).logits
    rel = ((got - as_transformers).norm() / as_transformers.norm()).item()
    print(f"{kind}: transformers vs fp8ext logits, relative L2 {rel:.2e}")
    assert rel < 1e-5, f"{kind}: transformers' logits differ from fp8ext's by {rel:.2e} (relative L2)"
    back = inference.load_quantized(out, hf.from_config, device="cpu")
    assert torch.equal(back.model.layers[1].self_attn.k_scale, model.model.layers[1].self_attn.k_scale)
    with torch.no_grad():
        assert torch.equal(back(x).logits, want), "fp8ext's own load of the directory gives the same logits"


@pytest.mark.parametrize("kind", MODELS)
def test_transformers_generate_runs_on_the_quantized_model(kind):
    model, _ = calibrated(kind)
    reference = tiny(kind)
    inference.quantize_model(model, "channel", "static")
    prompt = ids(1, 6, seed=4)
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 11) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():  # greedy: each new token is the argmax of a full forward over what came before
        for t in range(6, 11):
            assert out[0, t] == model(out[:, :t]).logits[0, -1].argmax()
    fp8 = model.generate(prompt, max_new_tokens=5, do_sample=False, **{hf.cache_argument(model): hf.fp8_kv_cache(model)})
    assert fp8.shape == (1, 11)
    assert reference.generate(prompt, max_new_tokens=5, do_sample=False).shape == (1, 11)


def test_fp8_kv_cache_rounds_k_and_v_to_e4m3_with_the_calibrated_scales():
    model, _ = calibrated("llama")
    inference.quantize_model(model, "channel", "static")
    cache = hf.fp8_kv_cache(model, scales="calibrated")
    assert cache.scale_source == "calibrated"
    with torch.no_grad():
        model(ids(1, 8), use_cache=True, **{hf.cache_argument(model): cache})
    attn = model.model.layers[0].self_attn
    codes = cache.layers[0].keys / attn.k_scale.view(1, -1, 1, 1)
    assert torch.allclose(codes, codes.to(torch.float8_e4m3fn).float(), rtol=1e-6, atol=0), \
        "stored K are E4M3 values times the scale (up to the float32 division here)"
    assert hf.fp8_kv_cache(tiny("llama")).scale_source == "prefill"
    with pytest.raises(ValueError, match="carries no KV-cache scales"):
        hf.fp8_kv_cache(tiny("llama"), scales="calibrated")


def test_fp8exts_generate_decodes_a_transformers_model_and_decode_loss_refuses_it():
    """generate drives a transformers causal LM through its caches (tests/inference/test_speculative_hf.py checks
    the tokens against transformers' own generate); decode_loss takes fp8ext's Transformer only."""
    model = tiny("llama")
    got, stats = inference.generate(model, ids(1, 4), 3, kv_cache="bf16")
    want, _ = inference.generate(model, ids(1, 4), 3, kv_cache=None)
    assert got.shape == (1, 7) and torch.equal(got, want) and stats["cache_bytes"] > 0
    with pytest.raises(TypeError, match="generate: model must be fp8ext's Transformer .*or a transformers causal "
                                        "LM, got Linear"):
        inference.generate(torch.nn.Linear(4, 4), ids(1, 4), 2)
    with pytest.raises(TypeError, match="decode_loss: model must be fp8ext's Transformer"):
        inference.decode_loss(model, ids(1, 4), ids(1, 4))


def test_cli_quantizes_and_evaluates_a_model_directory(tmp_path, capsys):
    src, out = tmp_path / "llama", tmp_path / "llama-fp8"
    tiny("llama").save_pretrained(src)
    data = tmp_path / "text.txt"
    data.write_bytes(bytes(range(256)) * 40)
    assert main(["quantize", "--model", str(src), "--out", str(out), "--calib_batches", "2", "--batch_size", "2",
                 "--seq_len", "16", "--activations", "static", "--data", str(data)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fp8ext_source"]["model"] == str(src.resolve()) and cfg["fp8ext_source"]["tokens"] == "bytes"
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert main(["eval", "--model", str(out), "--eval_batches", "1", "--batch_size", "1", "--seq_len", "8",
                 "--kv_cache"]) == 0
    text = capsys.readouterr().out
    assert "FP8 (channel weights, static activations) vs reference" in text
    assert "FP8 KV cache (calibrated scales)" in text


def test_cli_needs_a_model_or_a_checkpoint_not_both(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        main(["quantize", "--model", "a", "--checkpoint", "b", "--out", str(tmp_path / "o")])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--model", str(tmp_path), "--out", str(tmp_path / "o")])
    assert exit_.value.code == 1 and "is not a transformers model directory" in capsys.readouterr().err


def test_cli_refuses_bytes_for_a_vocabulary_under_256(tmp_path, capsys):
    src = tmp_path / "small"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, "vocab_size": 128})).save_pretrained(src)
    data = tmp_path / "text.txt"
    data.write_bytes(b"hello world " * 200)
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--model", str(src), "--out", str(tmp_path / "o"), "--data", str(data)])
    assert exit_.value.code == 1 and re.search(r"no tokenizer .* \(128 ids\)", capsys.readouterr().err)


def test_cli_generate_loads_a_quantized_directory_without_transformers_load_report(tmp_path, capfd):
    """transformers 5.24 reports the checkpoint's k_scale / v_scale (which vLLM reads; compressed-tensors places them
    only in transformers 5.17's attention) as UNEXPECTED keys in a logged warning: generate loads quietly."""
    model, _ = calibrated("llama")
    inference.quantize_model(model, "channel", "static", progress=False)
    out = inference.save_quantized(model, tmp_path / "fp8")
    logged = []  # what transformers logs, wherever its handler writes

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())
    keep = Keep()
    logging.getLogger("transformers").addHandler(keep)
    capfd.readouterr()
    try:
        assert main(["generate", "--model", str(out), "--prompt", "ab", "--max_new_tokens", "2", "--device",
                     "cpu"]) == 0
    finally:
        logging.getLogger("transformers").removeHandler(keep)
    captured = capfd.readouterr()
    shown = captured.out + captured.err + "".join(logged)
    assert "UNEXPECTED" not in shown and "LOAD REPORT" not in shown, shown
    assert "KV cache fp8" in captured.out


def test_cli_eval_of_a_directory_that_names_no_source_asks_for_reference(tmp_path, capsys, monkeypatch):
    """A transformers model saved from Python has no fp8ext_source.model: eval does not look in the working
    directory (a config.json there is not the reference), it asks for --reference."""
    model, _ = calibrated("llama")
    inference.quantize_model(model, "channel", "static", progress=False)
    out = inference.save_quantized(model, tmp_path / "fp8")
    tiny("llama").save_pretrained(tmp_path / "unrelated")
    monkeypatch.chdir(tmp_path / "unrelated")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["eval", "--model", str(out), "--eval_batches", "1", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 1 and len(err) == 1 and "pass --reference" in err[0], err
