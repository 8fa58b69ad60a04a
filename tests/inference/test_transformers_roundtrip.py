"""A Hugging Face transformers model quantized by fp8ext.inference loads in transformers itself: save_quantized's
directory goes through AutoModelForCausalLM.from_pretrained (with compressed-tensors, as a user's would) with no
missing, unexpected or mismatched keys, and gives fp8ext's logits. Each test builds a tiny random-init Llama; nothing
is downloaded."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers round trip needs the [test] extra")
pytest.importorskip("compressed_tensors", reason="transformers reads FP8 checkpoints through compressed-tensors")

from fp8ext import inference  # noqa: E402
from fp8ext.inference import hf  # noqa: E402

import ct_reference  # noqa: E402

SCHEMES = [("channel", "static"), ("tensor", "static"), ("channel", "dynamic"), ("tensor", "dynamic"),
           ("block128", "dynamic")]


def tiny_llama(dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def skeleton(dtype):
    """A model load_quantized fills: a tiny Llama with places for the calibrated KV-cache scales."""
    return hf.add_kv_scale_buffers(tiny_llama(dtype))


# compressed-tensors 0.20 places k_scale / v_scale only in attention whose forward takes `past_key_values`
# (transformers 5.17, which then rounds K/V with them); transformers 5.24 calls it `cache`, and these keys (which
# vLLM reads) are reported unexpected there
KV_SCALES = sorted(f"model.layers.{i}.self_attn.{s}" for i in range(2) for s in ("k_scale", "v_scale"))
UNEXPECTED = [] if ct_reference.rounds_kv(tiny_llama(torch.float32)) else KV_SCALES


def quantized(weights, activations, dtype, out_dir):
    """(fp8ext's quantized model, its logits on `ids`, ids, the saved directory)."""
    model = tiny_llama(dtype)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    inference.calibrate(model, [ids], progress=False)
    inference.quantize_model(model, weights, activations, out_dtype=dtype)
    with torch.no_grad():
        logits = model(ids).logits.float()
    return model, logits, ids, inference.save_quantized(model, out_dir)


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_transformers_loads_the_quantized_llama_with_fp8exts_logits(weights, activations, tmp_path, monkeypatch):
    # per-token activation scales computed as compressed-tensors does (amax / 448; fp8ext's kernel takes
    # 1 / (448 / amax), which can differ in the last bit): the comparison is then exact; the next test bounds
    # what fp8ext's own kernel gives
    ct_reference.use_compressed_tensors_arithmetic(monkeypatch)
    model, _, ids, out = quantized(weights, activations, torch.float32, tmp_path / "fp8")
    want = ct_reference.logits_as_transformers_computes(model, ids)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: sorted(v) for k, v in info.items()} == \
        {"missing_keys": [], "unexpected_keys": UNEXPECTED, "mismatched_keys": [], "error_msgs": []}
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
    with torch.no_grad():
        got = hf.eval()(ids).logits.float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-5, f"transformers' logits differ from fp8ext's by {rel:.2e} (relative L2)"


@pytest.mark.parametrize("weights", ["channel", "tensor"])
def test_with_fp8exts_per_token_scales_transformers_agrees_up_to_rounding_flips(weights, tmp_path):
    """fp8ext's own per-token kernel: an activation whose scaled value sits on an E4M3 rounding boundary may round
    to the neighbouring value in one of the two (each flip moves these tiny models' logits by about 7e-4)."""
    model, _, ids, out = quantized(weights, "dynamic", torch.float32, tmp_path / "fp8")
    want = ct_reference.logits_as_transformers_computes(model, ids)
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits.float()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 5e-3, f"transformers' logits differ from fp8ext's by {rel:.2e} (relative L2)"


def test_config_json_is_the_models_own_at_the_top_level(tmp_path):
    model, _, _, out = quantized("channel", "static", torch.bfloat16, tmp_path / "fp8")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] == model.config.hidden_size and "model_config" not in cfg
    assert cfg["dtype"] == "bfloat16", "the dtype of the tensors kept in high precision"
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16


def test_fp32_model_saves_its_real_dtype(tmp_path):
    _, _, _, out = quantized("tensor", "dynamic", torch.float32, tmp_path / "fp8")
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


@pytest.mark.parametrize("weights, activations", [("channel", "static"), ("block128", "dynamic")])
def test_the_directory_loads_back_into_fp8ext_with_the_same_logits(weights, activations, tmp_path):
    _, want, ids, out = quantized(weights, activations, torch.float32, tmp_path / "fp8")
    back = inference.load_quantized(out, skeleton(torch.float32), device="cpu")
    with torch.no_grad():
        got = back(ids).logits.float()
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_model_keeps_the_models_dtype_by_default(dtype):
    model = tiny_llama(dtype)
    ids = torch.randint(0, 256, (1, 8))
    inference.quantize_model(model, "channel", "dynamic")
    assert {m.out_dtype for m in model.modules() if isinstance(m, inference.FP8InferenceLinear)} == {dtype}
    with torch.no_grad():
        assert model(ids).logits.dtype == dtype  # a bfloat16 output in a float32 model failed inside attention


def test_a_sharded_checkpoint_loads_in_transformers_and_back_in_fp8ext(tmp_path):
    model, want, ids, out = quantized("channel", "static", torch.float32, tmp_path / "fp8")
    as_transformers = ct_reference.logits_as_transformers_computes(model, ids)
    sharded = inference.save_quantized(inference.load_quantized(out, skeleton(torch.float32), device="cpu"),
                                       tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and not (sharded / "model.safetensors").exists()
    assert sorted(p.name for p in sharded.glob("model-*.safetensors")) == files
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(sharded, output_loading_info=True)
    assert not info["missing_keys"] and sorted(info["unexpected_keys"]) == UNEXPECTED and not info["mismatched_keys"]
    with torch.no_grad():
        got = hf.eval()(ids).logits.float()
        assert ((got - as_transformers).norm() / as_transformers.norm()).item() < 1e-5
        back = inference.load_quantized(sharded, skeleton(torch.float32), device="cpu")
        assert torch.equal(back(ids).logits.float(), want)
    inference.save_quantized(back, sharded)  # saved again unsharded into the same folder: no stale shard is left
    assert sorted(p.name for p in sharded.glob("*.safetensors*")) == ["model.safetensors"]


@pytest.mark.parametrize("corrupt, match", [
    (lambda index, d: index["weight_map"].update({"lm_head.weight": "../model.safetensors"}), "shards must be files"),
    (lambda index, d: (d / sorted(set(index["weight_map"].values()))[-1]).unlink(), "which is missing"),
    (lambda index, d: index["weight_map"].update({"extra.weight": index["weight_map"]["lm_head.weight"]}),
     r"lists \['extra.weight'\], which no shard holds"),
])
def test_a_broken_shard_index_is_refused_naming_the_index(corrupt, match, tmp_path):
    model, _, _, _ = quantized("channel", "dynamic", torch.float32, tmp_path / "fp8")
    out = inference.save_quantized(model, tmp_path / "sharded", max_shard_size="200KB")
    path = out / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    corrupt(index, out)
    path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"model.safetensors.index.json: .*{match}"):
        inference.load_quantized(out, skeleton(torch.float32), device="cpu")


@pytest.mark.parametrize("size", [0, -1, "5XB", "GB", True, 1.5])
def test_max_shard_size_must_be_a_size(size, tmp_path):
    model, _, _, _ = quantized("channel", "dynamic", torch.float32, tmp_path / "fp8")
    with pytest.raises(ValueError, match="max_shard_size must be"):
        inference.save_quantized(model, tmp_path / "x", max_shard_size=size)
