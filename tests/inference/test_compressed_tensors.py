"""Other tools' compressed-tensors FP8 checkpoints load in fp8ext: directories written here by hand in the layout
llmcompressor writes (config.json's quantization_config from compressed-tensors' own presets, the architecture's
tensor names, weight_scale / input_scale / k_scale / v_scale in the shapes and dtypes other tools use, no fp8ext
metadata) load through load_quantized, with a factory and without one, and give transformers' own logits for the
same directory. Each test builds a tiny random-init Llama; nothing is downloaded."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers", reason="the transformers comparison needs the [test] extra")
ct = pytest.importorskip("compressed_tensors", reason="transformers reads FP8 checkpoints through compressed-tensors")
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, preset_name_to_scheme  # noqa: E402

from fp8ext import inference  # noqa: E402
from fp8ext.inference import hf  # noqa: E402

import ct_reference  # noqa: E402

E4M3_MAX = 448.0
N_LAYERS, N_KV = 2, 2
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def tiny_llama(intermediate=512, tie=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=intermediate,
                                   num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=N_KV,
                                   max_position_embeddings=128, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_weight(w: torch.Tensor, strategy: str):
    """(E4M3 weight, dequantizing float32 scale) with scale = amax / 448: per tensor [1], per channel [out, 1],
    per 128 x 128 block [ceil(out/128), ceil(in/128)]."""
    if strategy == "tensor":
        scale = (w.abs().amax() / E4M3_MAX).reshape(1)
        return _fp8(w, scale), scale
    if strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        return _fp8(w, scale), scale
    out, inp = w.shape
    rows, cols = -(-out // 128), -(-inp // 128)
    padded = torch.zeros(rows * 128, cols * 128, dtype=w.dtype)
    padded[:out, :inp] = w
    scale = padded.reshape(rows, 128, cols, 128).abs().amax(dim=(1, 3)) / E4M3_MAX
    full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out, :inp]
    return _fp8(w, full), scale


def input_amaxes(model):
    """max|x| of each linear layer's input over IDS (what a calibration pass records for static activations)."""
    amax, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: amax.__setitem__(name, max(amax.get(name, 0.0),
                                                                        args[0].abs().max().item()))))
    with torch.no_grad():
        model(IDS)
    for h in hooks:
        h.remove()
    return amax


def write_checkpoint(out, *, preset, ignore=("lm_head",), weight_scale=None, input_scale=(), scale_dtype=torch.float32,
                     kv=None, tie=False, intermediate=512, shard=False):
    """A compressed-tensors checkpoint of a tiny Llama as llmcompressor writes it, without fp8ext: `preset` is
    compressed-tensors' scheme name (FP8_DYNAMIC, FP8, FP8_BLOCK); weight_scale the per-tensor scale's shape
    ((1,) or ()) or None for the strategy's own; input_scale the static input scale's shape; kv: None, "head"
    (k_scale / v_scale [n_kv, 1, 1], strategy attn_head) or "tensor" ([] , strategy tensor); shard: split over
    two files with model.safetensors.index.json. Returns the directory."""
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(intermediate, tie)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    strategy = str(getattr(scheme.weights.strategy, "value", scheme.weights.strategy))
    static = scheme.input_activations is not None and not scheme.input_activations.dynamic
    amax = input_amaxes(model) if static else {}
    tensors = {}
    for name, t in model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue  # save_pretrained drops the tied copy
        layer = name.rpartition(".")[0]
        mod = model.get_submodule(layer) if layer else None
        if not isinstance(mod, torch.nn.Linear) or layer in ignore:
            tensors[name] = t.contiguous()
            continue
        q, scale = quantize_weight(t, strategy)
        if weight_scale is not None:
            scale = scale.reshape(weight_scale)
        tensors[name], tensors[f"{layer}.weight_scale"] = q, scale.to(scale_dtype)
        if static:
            tensors[f"{layer}.input_scale"] = torch.tensor(amax[layer] / E4M3_MAX).reshape(input_scale).to(scale_dtype)
    kv_scheme = None
    if kv is not None:
        kv_scheme = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False,
                                     strategy="attn_head" if kv == "head" else "tensor")
        shape = (N_KV, 1, 1) if kv == "head" else ()
        for i in range(N_LAYERS):
            for leaf, value in (("k_scale", 0.02), ("v_scale", 0.01)):
                tensors[f"model.layers.{i}.self_attn.{leaf}"] = torch.full(shape, value).to(scale_dtype)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore), format="float-quantized",
                            quantization_status="compressed", kv_cache_scheme=kv_scheme).to_dict()
    cfg = {**model.config.to_dict(), "architectures": ["LlamaForCausalLM"], "dtype": "float32",
           "torch_dtype": "float32", "quantization_config": qc}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    meta = {"format": "pt"}
    if not shard:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return out
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(out / file), metadata=meta)
        weight_map.update(dict.fromkeys(keys, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return out


def as_transformers_reads(src, dst):
    """A copy of the checkpoint `src` with the same values in the shapes transformers 5.24 + compressed-tensors
    0.20 accept: they refuse (size mismatch) the scalar [] scales older llmcompressor versions wrote and [out]
    per-channel scales, which fp8ext reads as they are."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(str(f))
        for k, t in tensors.items():
            if k.endswith(("weight_scale", "input_scale")) and t.dim() < 2 and t.numel() > 1:
                tensors[k] = t.reshape(-1, 1)
            elif k.endswith(("weight_scale", "input_scale")) and t.dim() == 0:
                tensors[k] = t.reshape(1)
        save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
    return dst


LAYOUTS = {
    # llmcompressor's FP8_DYNAMIC: per-channel weights [out, 1], dynamic per-token inputs, lm_head kept
    "dynamic-channel-bf16-scales": dict(preset="FP8_DYNAMIC", scale_dtype=torch.bfloat16),
    "dynamic-channel-flat-scales": dict(preset="FP8_DYNAMIC", weight_scale=(-1,)),  # [out]
    "dynamic-channel-tied-head": dict(preset="FP8_DYNAMIC", tie=True),  # no lm_head.weight in the file
    # FP8 (static per tensor), with the KV-cache scales of kv_cache_scheme
    "static-tensor-kv-per-head": dict(preset="FP8", weight_scale=(1,), input_scale=(), kv="head"),
    "static-tensor-scalar-f16-kv-per-tensor": dict(preset="FP8", weight_scale=(), input_scale=(), kv="tensor",
                                                   scale_dtype=torch.float16),
    "static-tensor-sharded": dict(preset="FP8", weight_scale=(1,), input_scale=(1,), kv="head", shard=True),
    "dynamic-channel-sharded": dict(preset="FP8_DYNAMIC", shard=True),
    # FP8_BLOCK: 128 x 128 weight blocks, dynamic 1 x 128 input groups
    "block128-dynamic-group": dict(preset="FP8_BLOCK"),
}


def plain_factory(config):
    """A factory as a user might write it: transformers' own from_config, no KV-scale places, rotary inv_freq left
    on the meta device (load_quantized computes it again)."""
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg),
                                                         dtype=torch.float32)


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def checkpoint(request, tmp_path_factory):
    """(fp8ext's directory, transformers' logits on IDS for the same values, the layout's options)."""
    kw = LAYOUTS[request.param]
    d = write_checkpoint(tmp_path_factory.mktemp(request.param), **kw)
    twin = as_transformers_reads(d, tmp_path_factory.mktemp(request.param + "-transformers"))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(twin, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.endswith(("k_scale", "v_scale")) for k in info["unexpected_keys"]), info  # transformers 5.24's gap
    with torch.no_grad():
        want = model.eval()(IDS).logits.float()
    return d, want, kw


def relative_l2(got, want):
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("factory", [None, plain_factory, hf.from_config], ids=["no-factory", "plain", "hf"])
def test_another_tools_checkpoint_gives_transformers_logits(checkpoint, factory, monkeypatch):
    d, want, kw = checkpoint
    ct_reference.use_compressed_tensors_arithmetic(monkeypatch)
    model = inference.load_quantized(d, factory, device="cpu")
    assert sum(isinstance(m, inference.FP8InferenceLinear) for m in model.modules()) == 7 * N_LAYERS
    with torch.no_grad():
        got = ct_reference.logits_as_transformers_computes(model, IDS)  # K/V rounded where transformers does
    rel = relative_l2(got, want)
    print(f"{d.name}: relative L2 {rel:.3e}")
    assert rel < 1e-5, f"fp8ext's logits differ from transformers' by {rel:.2e} (relative L2) for {kw}"


def test_fp8exts_per_token_scales_agree_up_to_rounding_flips(checkpoint):
    """With fp8ext's own per-token kernel a few activations may round to the neighbouring E4M3 value (each flip
    moves these tiny models' logits by about 7e-4, relative L2): the loaded numbers are the same."""
    d, want, kw = checkpoint
    model = inference.load_quantized(d, device="cpu")
    with torch.no_grad():
        rel = relative_l2(ct_reference.logits_as_transformers_computes(model, IDS), want)
    print(f"{d.name}: relative L2 {rel:.3e} (fp8ext's per-token scales)")
    assert rel < 5e-3, f"fp8ext's logits differ from transformers' by {rel:.2e} (relative L2) for {kw}"


def test_scales_are_float32_in_fp8exts_shapes_and_kv_scales_one_per_head(checkpoint):
    d, _, kw = checkpoint
    model = inference.load_quantized(d, device="cpu")
    layer = model.model.layers[0]
    for lin in (layer.self_attn.q_proj, layer.mlp.down_proj):
        assert lin.weight_scale.dtype == torch.float32
        want = {"FP8": [1], "FP8_DYNAMIC": [lin.out_features, 1],
                "FP8_BLOCK": [-(-lin.out_features // 128), -(-lin.in_features // 128)]}[kw["preset"]]
        assert list(lin.weight_scale.shape) == want, f"{kw}: weight_scale {list(lin.weight_scale.shape)}"
        if kw["preset"] == "FP8":
            assert list(lin.input_scale.shape) == [1] and lin.input_scale.dtype == torch.float32
    attn = layer.self_attn
    if kw.get("kv"):
        dtype = kw.get("scale_dtype", torch.float32)  # kept as [n_kv, 1, 1], compressed-tensors' attention's shape
        assert torch.equal(attn.k_scale, torch.full((N_KV, 1, 1), 0.02).to(dtype).float())
        assert torch.equal(attn.v_scale, torch.full((N_KV, 1, 1), 0.01).to(dtype).float())
    else:
        assert attn.k_scale is None and attn.v_scale is None
    if kw.get("tie"):
        assert model.lm_head.weight is model.model.embed_tokens.weight, "the tied head stays tied"


def test_a_skeleton_module_loads_too(checkpoint, monkeypatch):
    d, want, kw = checkpoint
    ct_reference.use_compressed_tensors_arithmetic(monkeypatch)
    model = inference.load_quantized(d, tiny_llama(tie=kw.get("tie", False)), device="cpu")
    with torch.no_grad():
        assert relative_l2(ct_reference.logits_as_transformers_computes(model, IDS), want) < 1e-5


def names(path, key):
    """A pattern for a message naming the file `path` and then `key`."""
    return re.escape(str(path)) + ".*" + re.escape(key)


@pytest.fixture
def dynamic(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", preset="FP8_DYNAMIC")


def rewrite_config(d, change):
    cfg = json.loads((d / "config.json").read_text())
    change(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


def rewrite_tensors(d, change):
    tensors = load_file(str(d / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


GROUP = "quantization_config.config_groups.group_0"


@pytest.mark.parametrize("change, key", [
    (lambda g: g["weights"].update(type="int"), f"{GROUP}.weights.type is 'int'"),
    (lambda g: g["weights"].update(num_bits=4), f"{GROUP}.weights.num_bits is 4"),
    (lambda g: g["weights"].update(symmetric=False), f"{GROUP}.weights.symmetric is False"),
    (lambda g: g["weights"].update(strategy="group", group_size=128), f"{GROUP}.weights.strategy is 'group'"),
    (lambda g: g["weights"].update(strategy="block", block_structure=[64, 64]),
     f"{GROUP}.weights.block_structure is [64, 64]"),
    (lambda g: g.update(input_activations=None), f"{GROUP}.input_activations is null"),
    (lambda g: g["input_activations"].update(strategy="group", group_size=128),
     f"{GROUP}.input_activations is dynamic with strategy 'group'"),
], ids=["int", "4-bit", "asymmetric", "group-weights", "block64", "weight-only", "group-inputs-channel-weights"])
def test_an_unsupported_scheme_is_refused_naming_the_config_key(dynamic, change, key):
    rewrite_config(dynamic, lambda qc: change(qc["config_groups"]["group_0"]))
    with pytest.raises(ValueError, match=names(dynamic / "config.json", key)):
        inference.load_quantized(dynamic, device="cpu")


def test_an_e5m2_weight_is_refused_naming_it(dynamic):
    key = "model.layers.1.mlp.up_proj.weight"
    rewrite_tensors(dynamic, lambda t: t.update({key: t[key].float().to(torch.float8_e5m2)}))
    with pytest.raises(ValueError, match=names(dynamic / "model.safetensors", f"{key} is F8_E5M2")):
        inference.load_quantized(dynamic, device="cpu")


def test_a_missing_weight_scale_is_refused_naming_it(dynamic):
    key = "model.layers.0.self_attn.o_proj.weight_scale"
    rewrite_tensors(dynamic, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=names(dynamic / "model.safetensors", f"no {key}")):
        inference.load_quantized(dynamic, device="cpu")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0.0, -1.0])
@pytest.mark.parametrize("key", ["model.layers.1.mlp.down_proj.weight_scale", "model.layers.0.self_attn.k_scale"])
def test_a_scale_that_is_not_finite_and_positive_is_refused(tmp_path, key, value):
    d = write_checkpoint(tmp_path / "ckpt", preset="FP8", kv="head", scale_dtype=torch.bfloat16)

    def change(t):
        t[key] = t[key].clone()
        t[key].view(-1)[0] = value
    rewrite_tensors(d, change)
    with pytest.raises(ValueError, match=names(d / "model.safetensors", key) + " must be finite and positive"):
        inference.load_quantized(d, device="cpu")


def test_a_scale_of_the_wrong_size_is_refused_naming_it(dynamic):
    key = "model.layers.0.mlp.gate_proj.weight_scale"
    rewrite_tensors(dynamic, lambda t: t.update({key: t[key][:16]}))
    with pytest.raises(ValueError, match=names(dynamic / "model.safetensors", f"{key} is [16, 1]")):
        inference.load_quantized(dynamic, device="cpu")


def test_without_transformers_a_transformers_directory_needs_a_factory(dynamic, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ImportError, match="needs transformers"):
        inference.load_quantized(dynamic, device="cpu")


def test_fp8exts_own_transformer_loads_without_a_factory(tmp_path):
    from fp8ext.models.transformer import Transformer, preset
    torch.manual_seed(0)
    model = Transformer(preset("tiny")).eval()
    ids = torch.randint(0, 256, (2, 16))
    inference.calibrate(model, [ids], progress=False)
    inference.quantize_model(model, "channel", "static")
    inference.save_quantized(model, tmp_path)
    loaded = inference.load_quantized(tmp_path, device="cpu")
    assert type(loaded) is Transformer and torch.equal(loaded(ids), model(ids))
