"""fp8ext's FP8 checkpoints meet what vLLM's compressed-tensors and Llama loaders read. vLLM needs a GPU to
install, so its requirements were read from its source and are written down as checks in vllm_layout.py; these
tests hold fp8ext's output to them and show that the checks catch each kind of departure."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Hugging Face models come from the [test] extra")
pytest.importorskip("safetensors", reason="checkpoints need safetensors")

from fp8ext import inference  # noqa: E402

import vllm_layout  # noqa: E402

SCHEMES = [("channel", "static"), ("tensor", "static"), ("channel", "dynamic"), ("tensor", "dynamic"),
           ("block128", "dynamic")]


def tiny(kind="llama"):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    cfg = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[kind](**common)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def save(model, weights, activations, out, **kw):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    inference.calibrate(model, [ids], progress=False)
    inference.quantize_model(model, weights, activations, progress=False, **kw)
    return inference.save_quantized(model, out)


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_a_quantized_llama_meets_vllms_loader(weights, activations, tmp_path):
    out = save(tiny(), weights, activations, tmp_path / "fp8")
    assert vllm_layout.problems(out) == []


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_mistral_and_qwen2_meet_vllms_loader(kind, tmp_path):
    assert vllm_layout.problems(save(tiny(kind), "channel", "static", tmp_path / kind)) == []


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_fp8exts_own_transformer_exported_as_llama_meets_vllms_loader(weights, activations, tmp_path):
    from fp8ext.models.transformer import Transformer, TransformerConfig, preset
    torch.manual_seed(0)  # block scales stack only when each part's rows are a multiple of 128
    cfg = TransformerConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256) \
        if weights == "block128" else preset("tiny")
    out = save(Transformer(cfg).eval(), weights, activations, tmp_path / "fp8")
    assert vllm_layout.problems(out) == []


def test_kv_cache_scales_are_what_vllm_reads(tmp_path):
    out = save(tiny(), "tensor", "static", tmp_path / "fp8")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    shapes = {k: v[1] for k, v in vllm_layout.headers(out).items() if k.endswith(("k_scale", "v_scale"))}
    assert len(shapes) == 4 and set(shapes.values()) <= {(2,), (2, 1, 1)}


def edit_config(out, change):
    cfg = json.loads((out / "config.json").read_text())
    change(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


def test_the_checks_catch_a_fused_layer_quantized_in_part(tmp_path):
    """Ignoring q_proj alone leaves k/v_proj in FP8: vLLM cannot fuse them into one qkv_proj (save_quantized warns)."""
    with pytest.warns(UserWarning, match=r"self_attn.k_proj, model.layers.0.self_attn.v_proj quantized but "
                                         r"model.layers.0.self_attn.q_proj kept .* vLLM .* refuses"):
        out = save(tiny(), "channel", "dynamic", tmp_path / "fp8",
                   ignore=["lm_head", "model.layers.0.self_attn.q_proj"])
    found = vllm_layout.problems(out)
    assert any("qkv_proj" in p and "quantized alike" in p for p in found), found


@pytest.mark.parametrize("change, match", [
    (lambda c: c.update(architectures=["Transformer"]), "architectures"),
    (lambda c: c["quantization_config"].update(format="pack-quantized"), "format"),
    (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(dynamic=True), "weights"),
    (lambda c: c["quantization_config"]["kv_cache_scheme"].update(num_bits=4), "kv_cache_scheme"),
])
def test_the_checks_catch_a_config_vllm_refuses(change, match, tmp_path):
    out = save(tiny(), "tensor", "static", tmp_path / "fp8")
    edit_config(out, change)
    assert any(match in p for p in vllm_layout.problems(out))


def test_the_checks_catch_fp8exts_own_names(tmp_path):
    """A file with fp8ext's transformer's module names (blocks.N.attn.qkv_proj) is not vLLM's Llama."""
    import safetensors.torch as st
    out = save(tiny(), "tensor", "dynamic", tmp_path / "fp8")
    tensors = st.load_file(str(out / "model.safetensors"))
    tensors["blocks.0.attn.qkv_proj.weight"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    st.save_file(tensors, str(out / "model.safetensors"))
    assert any("blocks.0.attn.qkv_proj.weight" in p for p in vllm_layout.problems(out))
