"""FP8 attention in a Hugging Face model through transformers' attention registry (fp8ext.register_hf_attention):
the registered function is transformers' SDPA attention except under a recipe with fp8_dpa=True, where each layer's
attention runs fp8ext's FP8 engine (the CPU emulation here), also when gradient checkpointing recomputes it."""
import pytest
import torch

import fp8ext

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


def test_a_padding_mask_reaches_the_engine_as_a_bool_mask(fp8_attention_calls):
    fp8ext.register_hf_attention()
    model = tiny_llama("fp8ext")
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0  # left padding in the second sequence
    loss, _ = loss_and_grads(model, IDS, fp8ext.Float8CurrentScaling(fp8_dpa=True), mask)
    assert torch.isfinite(loss) and len(fp8_attention_calls) == 2
    assert not any(kw["is_causal"] for kw in fp8_attention_calls), "the padded batch's mask is given, not is_causal"
