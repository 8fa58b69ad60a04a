"""FP8 attention in a Hugging Face model through transformers' attention registry (fp8ext.register_hf_attention):
the registered function is transformers' SDPA attention except under a recipe with fp8_dpa=True, where each layer's
attention runs fp8ext's FP8 engine (the CPU emulation here), also when gradient checkpointing recomputes it."""
import pytest
import torch

import fp8ext
from conftest import requires_cuda

transformers = pytest.importorskip("transformers")


def tiny_llama(attn_implementation: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config._attn_implementation = attn_implementation  # as from_pretrained(..., attn_implementation=...) sets it
    return transformers.LlamaForCausalLM(config).eval()


def loss_and_grads(model, ids, recipe=None, mask=None):
    model.zero_grad()
    with fp8ext.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def test_registered_name_is_sdpa_without_fp8_dpa(fp8_attention_calls):
    assert fp8ext.register_hf_attention() == "fp8ext"
    ours, sdpa = tiny_llama("fp8ext"), tiny_llama("sdpa")
    for recipe in (None, fp8ext.DelayedScaling()):
        a, b = loss_and_grads(ours, IDS, recipe), loss_and_grads(sdpa, IDS, recipe)
        assert torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1])), recipe
    assert fp8_attention_calls == []


def test_fp8_dpa_runs_each_layer_in_fp8_also_when_checkpointing_recomputes_it(fp8_attention_calls):
    fp8ext.register_hf_attention()
    model = tiny_llama("fp8ext")
    recipe = fp8ext.DelayedScaling(fp8_dpa=True)
    base = loss_and_grads(model, IDS)
    loss, grads = loss_and_grads(model, IDS, recipe)
    assert len(fp8_attention_calls) == 2 and all(kw["is_causal"] for kw in fp8_attention_calls), "one per layer"
    assert loss != base[0] and abs(loss - base[0]) < 0.02 * base[0], (loss, base[0])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    fp8_attention_calls.clear()
    loss_ckpt, grads_ckpt = loss_and_grads(model, IDS, recipe)
    assert len(fp8_attention_calls) == 4, "the recomputed forward ran FP8 attention again, outside the fp8_autocast"
    assert torch.equal(loss_ckpt, loss) and all(torch.equal(x, y) for x, y in zip(grads_ckpt, grads))


def test_fp8_mha_is_refused_in_a_hugging_face_model(fp8_attention_calls):
    fp8ext.register_hf_attention()
    model = tiny_llama("fp8ext")
    with torch.no_grad(), pytest.raises(NotImplementedError, match="fp8_mha=True .*transformers calls itself"):
        with fp8ext.fp8_autocast(fp8_recipe=fp8ext.DelayedScaling(fp8_mha=True)):
            model(input_ids=IDS)
    assert fp8_attention_calls == []


def test_a_padding_mask_reaches_the_engine_as_a_bool_mask(fp8_attention_calls):
    fp8ext.register_hf_attention()
    model = tiny_llama("fp8ext")
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0  # left padding in the second sequence
    loss, _ = loss_and_grads(model, IDS, fp8ext.Float8CurrentScaling(fp8_dpa=True), mask)
    assert torch.isfinite(loss) and len(fp8_attention_calls) == 2
    assert not any(kw["is_causal"] for kw in fp8_attention_calls), "the padded batch's mask is given, not is_causal"


def test_a_plain_causal_batch_gets_no_mask_also_where_transformers_would_build_one(monkeypatch, fp8_attention_calls):
    # Under torch.compile (on torch < 2.14, where it cannot tell compiling from exporting) transformers decides not to
    # skip the causal mask and builds it as a tensor; cuDNN's FP8 attention takes it only as is_causal.
    from transformers import masking_utils
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    name = fp8ext.register_hf_attention()
    assert sdpa_mask(batch_size=2, q_length=24, kv_length=24) is not None, "transformers builds the mask here"
    ours = ALL_MASK_ATTENTION_FUNCTIONS[name]
    assert ours(batch_size=2, q_length=24, kv_length=24) is None
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, :5] = False
    for kw in (dict(attention_mask=padding), dict(q_offset=3, kv_length=27), dict(allow_is_causal_skip=False),
               dict(local_size=8)):
        args = dict(batch_size=2, q_length=24, kv_length=24) | kw
        assert torch.equal(ours(**args), sdpa_mask(**args)), kw
    model = tiny_llama("fp8ext")
    loss, _ = loss_and_grads(model, IDS, fp8ext.DelayedScaling(fp8_dpa=True))
    assert torch.isfinite(loss) and len(fp8_attention_calls) == 2
    assert all(kw["is_causal"] for kw in fp8_attention_calls), "the causal batch runs with is_causal, no mask"


@requires_cuda
@pytest.mark.cuda
def test_a_compiled_llama_runs_fp8_attention_on_a_gpu(monkeypatch):
    pytest.importorskip("cudnn", reason="FP8 attention on a GPU needs NVIDIA's cudnn frontend")
    monkeypatch.setenv("NVTE_FP8_DPA_BWD", "0")  # head_dim 64: cuDNN's FP8 backward takes 128 only
    fp8ext.register_hf_attention()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "fp8ext"
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    recipe = fp8ext.DelayedScaling(fp8_dpa=True)
    eager, eager_grads = loss_and_grads(model, ids, recipe)
    compiled, grads = loss_and_grads(torch.compile(model), ids, recipe)
    assert torch.isfinite(compiled) and abs(compiled - eager) < 1e-2 * eager, (compiled, eager)
    for g, e in zip(grads, eager_grads):
        assert torch.isfinite(g).all() and (g.float() - e.float()).norm() <= 0.05 * e.float().norm() + 1e-6
