"""FP8 inference on the CPU: calibration, quantized layers, the compressed-tensors checkpoint (written, read back
bit for bit, checked against the layout vLLM loads)."""
import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

import fp8ext
from fp8ext import inference
from fp8ext.inference import FP8InferenceLinear
from fp8ext.models.transformer import Transformer, TransformerConfig, preset

SCHEMES = [("tensor", "static"), ("tensor", "dynamic"), ("channel", "static"), ("channel", "dynamic"),
           ("block128", "dynamic")]
CFG = preset("tiny", d_model=128, d_ff=384)
# fp8ext's transformer is saved as a Llama checkpoint, q/k/v and gate/up as separate layers: with 128 x 128 block
# scales each part's rows must be a multiple of 128 (q 256, k 128, v 128; gate 384, up 384)
BLOCK_CFG = preset("tiny", d_model=256, n_heads=2, n_kv_heads=1, d_ff=384)


def model_and_data(seed=0, cfg=CFG):
    torch.manual_seed(seed)
    model = Transformer(cfg).to(torch.bfloat16)
    batches = [torch.randint(0, 256, (4, 64)) for _ in range(3)]
    return model, batches, torch.randint(0, 256, (8, 64))


def factory(cfg):
    return Transformer(TransformerConfig(**cfg))


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_quantized_model_is_close_to_bf16_and_keeps_head_and_embedding(weights, activations):
    model, batches, ids = model_and_data()
    ref = model(ids)
    inference.calibrate(model, batches, progress=False)
    inference.quantize_model(model, weights, activations)
    fp8_layers = [m for m in model.modules() if isinstance(m, FP8InferenceLinear)]
    assert len(fp8_layers) == 4 * CFG.n_layers and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8_layers)
    assert type(model.lm_head) is nn.Linear and type(model.embed) is nn.Embedding
    assert not any(isinstance(m, fp8ext.FP8Linear) for m in model.modules()), "no high-precision copy left"
    err = rel_err(model(ids).float(), ref.float())
    assert err < 0.08, f"{weights}/{activations}: relative error of the logits {err:.4f}"


def test_a_quantized_model_prefills_with_fp8_attention_under_a_recipe_with_fp8_dpa(fp8_attention_calls):
    # what bench_inference.py's prefill row "+ FP8 attention" runs: the FP8 inference layers, and attention in FP8
    model, batches, ids = model_and_data()
    inference.quantize_model(model, "channel", "dynamic")
    with torch.no_grad():
        plain = model(ids)
        assert fp8_attention_calls == [], "no FP8 attention without the recipe"
        fp8 = model(ids, fp8=True, fp8_recipe=fp8ext.Float8CurrentScaling(fp8_dpa=True))
    assert len(fp8_attention_calls) == CFG.n_layers and all(kw["is_causal"] for kw in fp8_attention_calls)
    err = rel_err(fp8.float(), plain.float())
    assert 0 < err < 0.08, f"relative change of the logits with FP8 attention {err:.4f}"


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_mha_hands_attentions_fp8_bytes_to_the_output_projection(fp8_attention_calls, activations):
    model, batches, ids = model_and_data()
    if activations == "static":
        inference.calibrate(model, batches, progress=False)
    inference.quantize_model(model, "channel", activations)
    seen, made = [], []
    engine = fp8ext.modules.attention.FP8_ATTENTION_ENGINES["cpu"]
    fp8ext.modules.attention.FP8_ATTENTION_ENGINES["cpu"] = lambda *a, **kw: made.append(engine(*a, **kw)) or made[-1]
    hooks = [b.attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0])) for b in model.blocks]
    with torch.no_grad():
        plain = model(ids)
        dpa = model(ids, fp8=True, fp8_recipe=fp8ext.Float8CurrentScaling(fp8_dpa=True))
        seen.clear(), made.clear()
        mha = model(ids, fp8=True, fp8_recipe=fp8ext.Float8CurrentScaling(fp8_mha=True))
    for h in hooks:
        h.remove()
    assert [kw.get("fp8_output") for kw in fp8_attention_calls[-CFG.n_layers:]] == [True] * CFG.n_layers
    b, s = ids.shape
    for o8, x in zip(made, seen):  # o_proj reads attention's bytes and scale, not a bf16 tensor cast again
        assert isinstance(x, inference.FP8Activation) and x.shape == (b, s, o8.data.shape[1] * o8.data.shape[3])
        want = o8.data.permute(0, 2, 1, 3).reshape(b * s, -1)
        assert torch.equal(x.data.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(x.scale_inv, o8.scale_inv.reshape(()).expand(b * s))
    assert len(seen) == len(made) == CFG.n_layers
    assert 0 < rel_err(mha.float(), plain.float()) < 0.08
    assert rel_err(mha.float(), dpa.float()) < 0.05, "only the output projection's input scale differs from fp8_dpa"


def test_fp8_mha_is_refused_where_it_cannot_run():
    recipe = fp8ext.Float8CurrentScaling(fp8_mha=True)
    model, _, ids = model_and_data()
    with pytest.raises(NotImplementedError, match="fp8_mha=True .*no gradient.*fp8_dpa=True with fp8_mha=False"):
        model(ids, fp8=True, fp8_recipe=recipe)  # training: the FP8 output has no gradient
    with torch.no_grad(), pytest.raises(NotImplementedError, match="quantize the model first"):
        model(ids, fp8=True, fp8_recipe=recipe)  # an o_proj that takes no FP8 input
    model, _, ids = model_and_data(cfg=BLOCK_CFG)
    inference.quantize_model(model, "block128", "dynamic")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="weights 'tensor' or 'channel'"):
        model(ids, fp8=True, fp8_recipe=recipe)


@pytest.mark.parametrize("weights, activations", [s for s in SCHEMES if s[0] != "block128"])
def test_fp8_input_takes_an_activation_with_one_scale_as_a_float64_product(weights, activations):
    torch.manual_seed(2)
    lin = nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    x = torch.randn(2, 16, 256, dtype=torch.bfloat16)
    layer = FP8InferenceLinear.from_linear(lin, weights, activations, input_amax=3.0)
    sinv = torch.tensor(x.float().abs().max().item() / 448)
    x8 = fp8ext.quantize(x, fp8ext.E4M3, 1 / sinv)
    got = layer(layer.fp8_input(fp8ext.FP8Tensor(x8, None, sinv, fp8ext.E4M3)))
    want = (x8.double() * sinv.double()) @ (layer.weight.double() * layer.weight_scale.double()).t()
    assert got.shape == (2, 16, 128) and got.dtype == torch.bfloat16 and rel_err(got, want) < 4e-3
    for bad in (x8[..., :128], x8.transpose(0, 1)):  # too few features; not contiguous
        with pytest.raises(ValueError, match="contiguous \\[..., 256\\]"):
            layer.fp8_input(fp8ext.FP8Tensor(bad, None, sinv, fp8ext.E4M3))
    with pytest.raises(ValueError, match="E4M3 with one per-tensor scale"):
        layer.fp8_input(fp8ext.FP8Tensor(x8, None, sinv.expand(2), fp8ext.E4M3))
    block = FP8InferenceLinear.from_linear(nn.Linear(256, 128).to(torch.bfloat16), "block128", "dynamic")
    with pytest.raises(ValueError, match="block128 weights"):
        block.fp8_input(fp8ext.FP8Tensor(x8, None, sinv, fp8ext.E4M3))


@pytest.mark.parametrize("weights, limit", [("tensor", 0.501), ("channel", 0.52), ("block128", 0.52)])
def test_weight_memory_is_about_half_of_bf16(weights, limit):
    model, batches, _ = model_and_data()
    bf16 = sum(m.weight.numel() * 2 for m in inference.quantizable_linears(model).values())
    inference.quantize_model(model, weights, "dynamic")
    fp8 = sum(m.weight.numel() + m.weight_scale.numel() * 4 for m in model.modules()
              if isinstance(m, FP8InferenceLinear))
    assert fp8 <= limit * bf16, f"{fp8 / bf16:.3f} of bf16"


def test_calibration_records_the_max_abs_input_of_each_linear():
    model, batches, _ = model_and_data()
    amaxes = inference.calibrate(model, batches, progress=False)
    assert set(amaxes) == set(inference.quantizable_linears(model)) and model.fp8_calibration == amaxes
    with torch.no_grad():  # independently: the first block's QKV projection sees attn_norm(embed(ids))
        want = max(model.blocks[0].attn_norm(model.embed(b)).float().abs().max().item() for b in batches)
    assert amaxes["blocks.0.attn.qkv_proj"] == want


def test_fp8_inference_linear_matches_a_float64_product_of_its_own_operands():
    torch.manual_seed(1)
    lin = nn.Linear(256, 128).to(torch.bfloat16)
    x = torch.randn(32, 256, dtype=torch.bfloat16)
    layer = FP8InferenceLinear.from_linear(lin, "channel", "static", input_amax=x.float().abs().max().item())
    xq = fp8ext.quantize(x, fp8ext.E4M3, 1 / layer.input_scale.item())
    want = (xq.double() * layer.input_scale.double()) @ (layer.weight.double() * layer.weight_scale.double()).t() \
        + layer.bias.double()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 4e-3
    assert rel_err(got, lin(x).float()) < 0.06


@pytest.mark.parametrize("weights, activations", SCHEMES)
def test_checkpoint_round_trip_is_bit_exact_in_the_compressed_tensors_layout(tmp_path, weights, activations):
    model, batches, ids = model_and_data(cfg=BLOCK_CFG if weights == "block128" else CFG)
    inference.calibrate(model, batches, progress=False)
    inference.quantize_model(model, weights, activations)
    out = model(ids)
    inference.save_quantized(model, tmp_path)
    loaded = inference.load_quantized(tmp_path, factory, device="cpu")
    assert torch.equal(loaded(ids), out)
    a, b = model.state_dict(), loaded.state_dict()
    assert set(a) == set(b)
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                                                  y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), k

    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    w, act = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (8, "float", True, False)
    assert w["strategy"] == {"tensor": "tensor", "channel": "channel", "block128": "block"}[weights]
    assert (act["num_bits"], act["type"], act["dynamic"]) == (8, "float", activations == "dynamic")
    assert act["strategy"] == ("tensor" if activations == "static" else "group" if weights == "block128" else "token")
    assert "lm_head" in qc["ignore"] and "model.embed_tokens" in qc["ignore"]  # Llama's names

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        meta = json.loads(f.metadata()["fp8ext"])["layers"]
        name = "model.layers.0.mlp.gate_proj"  # the first half of blocks.0.ffn.w13
        assert f.get_slice(f"{name}.weight").get_dtype() == "F8_E4M3"
        scale_shape = list(f.get_slice(f"{name}.weight_scale").get_shape())
        assert scale_shape == {"tensor": [1], "channel": [384, 1], "block128": [3, 2]}[weights]
        assert (f"{name}.input_scale" in keys) == (activations == "static")
        assert meta[name]["format"] == "E4M3" and meta[name]["weights"] == weights
        if activations == "static":
            assert meta[name]["input_amax"] == model.fp8_calibration["blocks.0.ffn.w13"]


def test_refusals_name_what_is_missing(tmp_path):
    model, batches, ids = model_and_data()
    with pytest.raises(ValueError, match="static activations need calibration"):
        inference.quantize_model(model, "channel", "static")
    with pytest.raises(ValueError, match="block128 weights take dynamic activations only"):
        inference.quantize_model(model, "block128", "static")
    with pytest.raises(ValueError, match="weights must be one of"):
        inference.quantize_model(model, "row", "dynamic")
    with pytest.raises(ValueError, match="batches is empty"):
        inference.calibrate(model, [], progress=False)
    with pytest.raises(ValueError, match="not quantized"):
        inference.save_quantized(model, tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        inference.load_quantized(tmp_path, factory)
    bad = Transformer(CFG)
    with torch.no_grad():
        bad.blocks[1].ffn_norm.weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"blocks.1.ffn.w13.*NaN or Inf"):
        inference.calibrate(bad, batches, progress=False)


def test_trained_model_from_a_training_checkpoint_quantizes_and_keeps_its_loss(tmp_path):
    from fp8ext.train import cli
    from fp8ext.train.data import batch, load_corpus
    run = tmp_path / "run"
    cli.main(["--preset", "tiny", "--batch_size", "8", "--seq_len", "64", "--max_steps", "60", "--lr", "3e-3",
              "--eval_every", "60", "--eval_batches", "2", "--no_progress", "--out_dir", str(run)])
    model = Transformer(preset("tiny"))
    model.load_state_dict(torch.load(run / "checkpoint.pt", weights_only=True)["model"])
    corpus = load_corpus()
    calib = [batch(corpus.train, 8, 64, seed=123, step=i)[0] for i in range(4)]
    x, y = batch(corpus.val, 16, 64, seed=5, step=0)
    with torch.no_grad():
        ref = model(x, y)[1].item()
        inference.calibrate(model, calib, progress=False)
        inference.quantize_model(model, "channel", "dynamic", out_dtype=torch.float32)
        fp8 = model(x, y)[1].item()
    assert abs(fp8 - ref) < 0.02 * ref, f"validation loss {ref:.4f} -> {fp8:.4f} in FP8"


def test_command_line_quantizes_a_training_run_and_compares_perplexity(tmp_path, capsys):
    from fp8ext.inference.__main__ import main
    from fp8ext.train import cli
    run = tmp_path / "run"
    cli.main(["--preset", "tiny", "--max_steps", "40", "--lr", "3e-3", "--eval_every", "40", "--eval_batches", "2",
              "--no_progress", "--out_dir", str(run)])
    main(["quantize", "--checkpoint", str(run), "--calib_batches", "3", "--weights", "channel", "--activations",
          "static", "--out", str(tmp_path / "fp8"), "--device", "cpu"])
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["fp8ext_source"]["training_checkpoint"].endswith("checkpoint.pt")
    capsys.readouterr()
    main(["eval", "--model", str(tmp_path / "fp8"), "--eval_batches", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    lines = {l.split(":")[0].strip(): l for l in out.splitlines()}
    assert "bf16" in lines and "fp8" in lines and "vs bf16: perplexity" in out
    bf16, fp8 = (float(lines[k].split("loss ")[1].split()[0]) for k in ("bf16", "fp8"))
    assert abs(fp8 - bf16) < 0.02 * bf16


class Odd(nn.Module):
    """Linears FP8 cannot take (24 is not a multiple of 16), a transposed (non-contiguous) input, a bias."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 48), nn.Linear(48, 24), nn.Linear(24, 32)

    def forward(self, x):
        return self.c(self.b(self.a(x.transpose(0, 1))))


def test_layers_left_in_high_precision_are_listed_as_ignored(tmp_path):
    torch.manual_seed(0)
    model = Odd()
    x = torch.randn(32, 4, 32).transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.warns(UserWarning, match="stays in high precision"):
        inference.calibrate(model, [x], progress=False)  # non-contiguous inputs to the first layer
    with pytest.warns(UserWarning):
        inference.quantize_model(model, "tensor", "static", out_dtype=torch.float32)
    assert model.fp8_quantization["layers"] == ["a"] and {"b", "c"} <= set(model.fp8_quantization["ignored_modules"])
    assert model(x).dtype == torch.float32, "a float32 output with a bias (kept in bfloat16 for cuBLASLt)"
    inference.save_quantized(model, tmp_path)
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert {"b", "c"} <= set(qc["ignore"])


def test_dynamic_quantization_with_a_partial_calibration_does_not_fail():
    model, batches, ids = model_and_data()
    calib = inference.calibrate(model, batches, progress=False)
    calib.pop("blocks.0.attn.qkv_proj")
    inference.quantize_model(model, "channel", "dynamic", calibration=calib)
    assert "blocks.0.attn.qkv_proj" not in model.fp8_quantization["input_amax"]
    assert torch.isfinite(model(ids)).all()


def test_tied_weights_are_saved_once_and_tied_again(tmp_path):
    model, batches, ids = model_and_data()
    model.lm_head.weight = model.embed.weight  # tied output head
    inference.quantize_model(model, "channel", "dynamic")
    out = model(ids)
    inference.save_quantized(model, tmp_path)
    loaded = inference.load_quantized(tmp_path, factory, device="cpu")
    assert loaded.lm_head.weight is loaded.embed.weight and torch.equal(loaded(ids), out)


def test_loading_into_a_model_the_file_does_not_fit_names_the_missing_tensors(tmp_path):
    model, _, _ = model_and_data()
    inference.quantize_model(model, "tensor", "dynamic")
    inference.save_quantized(model, tmp_path)
    with pytest.raises(ValueError, match=r"holds no \['model.layers.2"):
        inference.load_quantized(tmp_path, lambda c: Transformer(TransformerConfig(**{**c, "n_layers": 3})),
                                 device="cpu")


def test_dequantizing_packed_bytes_as_fp4_codes_is_an_error():
    packed = fp8ext.pack_fp4(torch.tensor([1, 15], dtype=torch.uint8))
    with pytest.raises(ValueError, match="below 16.*unpack_fp4"):
        fp8ext.dequantize(packed, fmt=fp8ext.E2M1)
