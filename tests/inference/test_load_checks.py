"""load_quantized checks a checkpoint before it builds anything from it: a genuine checkpoint with one thing
changed (a tensor, the metadata's record, config.json) is refused with a ValueError or TypeError naming the file
and the tensor or key; genuine checkpoints still load."""
import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8ext import inference
from fp8ext.models.transformer import Transformer, TransformerConfig, preset

CFG = preset("tiny")
# block128 needs q/k/v and gate/up parts of multiples of 128 rows (they are separate layers in the Llama checkpoint)
BLOCK_CFG = TransformerConfig(d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256)
SCHEMES = [("tensor", "static"), ("tensor", "dynamic"), ("channel", "static"), ("channel", "dynamic"),
           ("block128", "dynamic")]


def factory(cfg):
    return Transformer(TransformerConfig(**cfg))


def save_checkpoint(out, weights="channel", activations="static"):
    torch.manual_seed(0)
    model = Transformer(BLOCK_CFG if weights == "block128" else CFG).eval()
    inference.calibrate(model, [torch.randint(0, 256, (2, 32))], progress=False)  # input and K/V amaxes
    inference.quantize_model(model, weights, activations)
    inference.save_quantized(model, out)
    return model


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """One checkpoint with every kind of tensor: per-channel weight scales, static input scales, K/V scales."""
    out = tmp_path_factory.mktemp("genuine")
    save_checkpoint(out)
    return out


@pytest.fixture
def ckpt(genuine, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(genuine, d)
    return d


def rewrite_tensors(d, change):
    path = str(d / "model.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata=meta)


def rewrite_record(d, change):
    path = str(d / "model.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    record = json.loads(meta["fp8ext"])
    change(record)
    save_file(load_file(path), path, metadata={**meta, "fp8ext": json.dumps(record)})


def rewrite_config(d, change):
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def names(path, key):
    """A pattern for a message naming the file `path` and then `key`."""
    return re.escape(str(path)) + ".*" + re.escape(key)


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_genuine_checkpoints_still_load_and_compute_as_saved(tmp_path, weights, activations):
    model = save_checkpoint(tmp_path, weights, activations)
    loaded = inference.load_quantized(tmp_path, factory, device="cpu")
    ids = torch.randint(0, 256, (2, 16))
    assert torch.equal(loaded(ids), model(ids)), f"{weights}/{activations}: the loaded model computes as saved"


@pytest.mark.parametrize("value", [float("inf"), 0.0, float("nan"), -1.0])
@pytest.mark.parametrize("key", ["model.layers.0.self_attn.q_proj.input_scale",
                                 "model.layers.1.mlp.down_proj.weight_scale", "model.layers.1.self_attn.k_scale"])
def test_a_scale_that_is_not_finite_and_positive_is_refused_with_its_value(ckpt, key, value):
    def change(t):
        t[key] = t[key].clone()
        t[key].view(-1)[0] = value
    rewrite_tensors(ckpt, change)
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", key) + " must be finite and positive.*"
                       + re.escape(f"got {value}")):
        inference.load_quantized(ckpt, factory, device="cpu")


def test_an_e5m2_weight_under_an_e4m3_record_is_refused(ckpt):
    key = "model.layers.0.mlp.gate_proj.weight"
    rewrite_tensors(ckpt, lambda t: t.update({key: t[key].float().to(torch.float8_e5m2)}))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", key) + " is F8_E5M2.*format E4M3"):
        inference.load_quantized(ckpt, factory, device="cpu")


@pytest.mark.parametrize("dtype, name", [(torch.float32, "F32"), (torch.uint8, "U8"), (torch.int32, "I32")])
def test_a_weight_that_is_not_fp8_is_refused(ckpt, dtype, name):
    key = "model.layers.1.self_attn.o_proj.weight"
    rewrite_tensors(ckpt, lambda t: t.update({key: t[key].view(torch.uint8).to(dtype)}))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", key) + f" is {name}"):
        inference.load_quantized(ckpt, factory, device="cpu")


@pytest.mark.parametrize("out_dtype", ["load", "float8_e4m3fn", "int64"])
def test_out_dtype_outside_bfloat16_float16_float32_is_refused(ckpt, out_dtype):
    rewrite_record(ckpt, lambda r: r["layers"]["model.layers.0.mlp.down_proj"].update(out_dtype=out_dtype))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", "model.layers.0.mlp.down_proj")
                       + r".*out_dtype.*"
                       + re.escape(repr(out_dtype))):
        inference.load_quantized(ckpt, factory, device="cpu")


@pytest.mark.parametrize("field, value, exc", [
    ("n_layers", 10 ** 6, ValueError), ("n_heads", 0, ValueError), ("d_model", "64", TypeError),
    ("norm_eps", float("nan"), ValueError), ("fused_qkv", "yes", TypeError), ("n_layres", 2, TypeError)])
def test_a_model_config_value_of_the_wrong_type_or_range_is_refused_before_the_model_is_built(ckpt, field, value,
                                                                                              exc):
    rewrite_config(ckpt, lambda c: c["fp8ext_model_config"].update({field: value}))
    built = []
    with pytest.raises(exc, match=names(ckpt / "config.json", field)):
        inference.load_quantized(ckpt, lambda c: built.append(c) or factory(c), device="cpu")
    assert not built, "the factory is not called with a config that fails its checks"


def test_n_layers_must_match_the_blocks_in_the_file(ckpt):
    rewrite_config(ckpt, lambda c: c["fp8ext_model_config"].update(n_layers=3))
    with pytest.raises(ValueError, match=names(ckpt / "config.json", "n_layers is 3") + r".*layers \[0, 1\]"):
        inference.load_quantized(ckpt, factory, device="cpu")


def test_a_record_without_layers_is_refused(ckpt):
    rewrite_record(ckpt, lambda r: r.update(layers={}))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", "'fp8ext'") + ".*no quantized layers"):
        inference.load_quantized(ckpt, factory, device="cpu")


@pytest.mark.parametrize("field, value, exc, says", [
    (None, None, ValueError, "has no ['format', 'weights', 'activations']"),
    ("weights", "row", ValueError, "weights must be one of"),
    ("activations", "sometimes", ValueError, "activations must be one of"),
    ("format", "E5M2", ValueError, "['format'] must be one of"),
    ("input_amax", -1.0, ValueError, "['input_amax'] must be finite, >= 0 and at most 3.40282e+38 (float32's "
                                     "largest), got -1.0"),
    ("input_amax", float("inf"), ValueError, "['input_amax'] must be finite, >= 0 and at most 3.40282e+38"),
    ("input_amax", "3", TypeError, "['input_amax'] must be a number")])
def test_a_layer_record_with_a_missing_or_unknown_field_is_refused(ckpt, field, value, exc, says):
    name = "model.layers.1.self_attn.q_proj"
    rewrite_record(ckpt, lambda r: r["layers"].__setitem__(name, {} if field is None else
                                                           {**r["layers"][name], field: value}))
    with pytest.raises(exc, match=names(ckpt / "model.safetensors", f"layers[{name!r}]") + ".*" + re.escape(says)):
        inference.load_quantized(ckpt, factory, device="cpu")


def test_malformed_metadata_json_is_refused(ckpt):
    path = str(ckpt / "model.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    save_file(load_file(path), path, metadata={**meta, "fp8ext": meta["fp8ext"][:-7]})
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", "metadata 'fp8ext' is not well-formed")):
        inference.load_quantized(ckpt, factory, device="cpu")


def rewrite_record_text(d, change):
    """The metadata record's JSON text changed by change(text) (for what json.dumps does not write)."""
    path = str(d / "model.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    save_file(load_file(path), path, metadata={**meta, "fp8ext": change(meta["fp8ext"])})


@pytest.mark.parametrize("text, says", [
    ("1e400", "must be finite, >= 0 and at most 3.40282e+38 (float32's largest), got inf"),  # parsed as inf
    ("1e39", "must be finite, >= 0 and at most 3.40282e+38 (float32's largest), got 1e+39"),
    ("1" + "0" * 400, "is an integer of 401 digits, beyond any float")])  # overflowed converting to a float
def test_an_amax_no_float32_tensor_can_have_is_refused_naming_the_layer(ckpt, text, says):
    name = "model.layers.1.self_attn.q_proj"
    rewrite_record(ckpt, lambda r: r["layers"][name].update(input_amax=12345.5))
    rewrite_record_text(ckpt, lambda t: t.replace("12345.5", text))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", name) + ".*input_amax.*" + re.escape(says)):
        inference.load_quantized(ckpt, factory, device="cpu")


def test_a_kv_amax_beyond_float_is_refused_naming_it(ckpt):
    rewrite_record(ckpt, lambda r: r["kv_cache"]["model.layers.0.self_attn"].update(k_amax=[7777.5, 1.0]))
    rewrite_record_text(ckpt, lambda t: t.replace("7777.5", "9" * 400))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", "k_amax") + ".*integer of 400 digits"):
        inference.load_quantized(ckpt, factory, device="cpu")


@pytest.mark.parametrize("where", ["config.json", "metadata"])
def test_json_nested_too_deeply_is_refused_before_it_is_parsed(ckpt, where):
    """100,000 nested arrays: json.loads would exhaust the recursion limit (RecursionError); refused unparsed."""
    deep = "[" * 100_000 + "]" * 100_000
    if where == "config.json":
        (ckpt / "config.json").write_text((ckpt / "config.json").read_text().rstrip()[:-1] + f', "extra": {deep}}}')
        path = ckpt / "config.json"
    else:
        rewrite_record_text(ckpt, lambda t: t[:-1] + f', "extra": {deep}}}')
        path = ckpt / "model.safetensors"
    with pytest.raises(ValueError, match=names(path, "nests arrays and objects 100001 deep; fp8ext reads at most 64")):
        inference.load_quantized(ckpt, factory, device="cpu")


def test_brackets_inside_json_strings_are_not_nesting(ckpt):
    rewrite_config(ckpt, lambda c: c.update(note="[" * 200 + '\\"{' + "]" * 3))
    inference.load_quantized(ckpt, factory, device="cpu")


def test_an_integer_beyond_any_float_in_config_json_is_refused_naming_the_key(ckpt):
    text = (ckpt / "config.json").read_text()
    cfg = json.loads(text)
    cfg["fp8ext_model_config"]["rope_theta"] = 31415.5
    (ckpt / "config.json").write_text(json.dumps(cfg).replace("31415.5", "1" + "0" * 400))
    with pytest.raises(ValueError, match=names(ckpt / "config.json", "fp8ext_model_config.rope_theta is an integer "
                                                                      "of 401 digits")):
        inference.load_quantized(ckpt, factory, device="cpu")


def test_malformed_config_json_is_refused(ckpt):
    (ckpt / "config.json").write_text((ckpt / "config.json").read_text()[:-3])
    with pytest.raises(ValueError, match=names(ckpt / "config.json", "not well-formed JSON")):
        inference.load_quantized(ckpt, factory, device="cpu")


@pytest.mark.parametrize("which", [("k_scale",), ("k_scale", "v_scale")])
def test_kv_scales_of_the_wrong_shape_are_refused_at_load(ckpt, which):
    rewrite_tensors(ckpt, lambda t: t.update({f"model.layers.0.self_attn.{k}": torch.full((CFG.n_kv_heads + 1,),
                                                                                            0.01) for k in which}))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", "model.layers.0.self_attn.k_scale is [3]")):
        inference.load_quantized(ckpt, factory, device="cpu")


@pytest.mark.parametrize("key, shape", [("model.layers.0.mlp.gate_proj.weight_scale", (1,)),  # per tensor: channel
                                        ("model.layers.0.self_attn.k_proj.input_scale", (2,)),
                                        ("model.layers.1.mlp.down_proj.weight", (64, 208))])
def test_a_tensor_whose_shape_does_not_fit_its_layer_is_refused(ckpt, key, shape):
    def change(t):
        t[key] = torch.ones(shape, dtype=t[key].dtype) if t[key].dtype == torch.float32 else \
            torch.zeros(shape, dtype=torch.uint8).view(t[key].dtype)
    rewrite_tensors(ckpt, change)
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", f"{key} is {list(shape)}")):
        inference.load_quantized(ckpt, factory, device="cpu")


def test_an_input_scale_for_a_dynamic_layer_or_none_for_a_static_one_is_refused(ckpt, tmp_path):
    name = "model.layers.0.mlp.up_proj"
    rewrite_tensors(ckpt, lambda t: t.pop(f"{name}.input_scale"))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", f"holds no {name}.input_scale")):
        inference.load_quantized(ckpt, factory, device="cpu")
    save_checkpoint(tmp_path, "channel", "dynamic")
    rewrite_tensors(tmp_path, lambda t: t.update({f"{name}.input_scale": torch.ones(1)}))
    with pytest.raises(ValueError, match=names(tmp_path / "model.safetensors", f"holds {name}.input_scale")
                       + ".*dynamic"):
        inference.load_quantized(tmp_path, factory, device="cpu")


def test_a_tensor_the_model_has_no_place_for_is_refused(ckpt):
    rewrite_tensors(ckpt, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(4)}))
    with pytest.raises(ValueError, match=names(ckpt / "model.safetensors", "model.layers.0.extra.weight") +
                       ".*no place"):
        inference.load_quantized(ckpt, factory, device="cpu")
