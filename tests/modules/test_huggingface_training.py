"""A transformers model trained with fp8ext: gradient checkpointing in transformers' own switch, save_pretrained /
from_pretrained (plain transformers and an fp8ext-converted model), and training loops other code owns (Trainer,
accelerate) through convert_to_fp8(..., fp8_recipe=...)."""

import os

import pytest
import torch

import fp8ext

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

RECIPES = {
    "delayed": lambda: fp8ext.DelayedScaling(amax_history_len=4),
    "current": fp8ext.Float8CurrentScaling,
    "block": fp8ext.Float8BlockScaling,
    "rowwise": fp8ext.Float8RowwiseScaling,
}
CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(convert=True, **kwargs):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    return fp8ext.convert_to_fp8(model, **kwargs) if convert else model


def batches(n=4, batch=2, seq=32):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, CONFIG["vocab_size"], (batch, seq), generator=g) for _ in range(n)]


def hand_loop(model, recipe, data, lr=0.1):
    """The loop written for fp8ext: each forward inside fp8_autocast, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for ids in data:
        with fp8ext.fp8_autocast(fp8_recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def assert_same_parameters(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{what}: {name} differs (max {(p - q).abs().max().item():.3g})"


# ---- gradient checkpointing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}, {"use_reentrant": False}],
                         ids=["default", "reentrant", "non_reentrant"])
def test_gradient_checkpointing_enable_trains_bit_for_bit(recipe, kwargs):
    want = tiny_llama()
    want_losses = hand_loop(want, RECIPES[recipe](), batches(3))
    model = tiny_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert hand_loop(model, RECIPES[recipe](), batches(3)) == want_losses
    assert_same_parameters(model, want, f"gradient checkpointing {kwargs}, {recipe}")


# ---- save_pretrained / from_pretrained ---------------------------------------------------------------------------

def trained(steps=2):
    model = tiny_llama()
    hand_loop(model, fp8ext.DelayedScaling(amax_history_len=4), batches(steps))
    return model


def test_save_pretrained_sharded_loads_in_plain_transformers(tmp_path):
    """Sharded safetensors; plain transformers loads the high-precision weights with no missing or mismatched key
    (the FP8 layers' scaling states are its only unexpected keys)."""
    model = trained()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    plain, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(plain) is transformers.LlamaForCausalLM
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    fp8_layers = {n for n, m in model.named_modules() if isinstance(m, fp8ext.Linear)}
    assert set(info["unexpected_keys"]) == {f"{n}._extra_state" for n in fp8_layers}
    assert not any(isinstance(m, fp8ext.Linear) for m in plain.modules())
    assert_same_parameters(plain, model, "plain transformers' weights")


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_saved_fp8_model_resumes_bit_for_bit_after_load_fp8_state(tmp_path, sharded):
    """from_pretrained, convert_to_fp8 and load_fp8_state give the saved model's weights and scaling state: its
    next steps equal those of the model that saved it."""
    model = trained()
    model.save_pretrained(tmp_path, **({"max_shard_size": "100KB"} if sharded else {}))
    loaded = fp8ext.convert_to_fp8(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    names = fp8ext.load_fp8_state(loaded, str(tmp_path))
    assert sorted(names) == sorted(n for n, m in model.named_modules() if isinstance(m, fp8ext.Linear))
    for n in names:
        a, b = model.get_submodule(n).fp8_state(), loaded.get_submodule(n).fp8_state()
        for key in ("amax_history", "scale", "scale_inv"):
            assert torch.equal(a[key], b[key]), f"{n}: {key}"
    # The loaded model trains with a recipe that computes the same (reduce_amax matters across processes only) and has a
    # manager of its own.
    more = batches(4)[2:]
    losses = hand_loop(loaded, fp8ext.DelayedScaling(amax_history_len=4, reduce_amax=False), more)
    assert losses == hand_loop(model, fp8ext.DelayedScaling(amax_history_len=4), more)
    assert_same_parameters(loaded, model, "resumed")


def test_load_fp8_state_names_the_layers_that_do_not_match(tmp_path):
    trained().save_pretrained(tmp_path)
    kept = "model.layers.0.mlp.down_proj"
    other = fp8ext.convert_to_fp8(transformers.AutoModelForCausalLM.from_pretrained(tmp_path),
                                  filter_fn=lambda layer, name: name != kept)
    with pytest.raises(ValueError, match=rf"state of layers the model does not have: \['{kept}'\]"):
        fp8ext.load_fp8_state(other, str(tmp_path))
    assert kept not in fp8ext.load_fp8_state(other, str(tmp_path), strict=False)
    with pytest.raises(FileNotFoundError, match="has neither model.safetensors"):
        fp8ext.load_fp8_state(other, str(tmp_path / "nowhere"))


def test_a_malformed_scaling_state_raises_naming_the_layer():
    layer = fp8ext.Linear(32, 16)
    with pytest.raises(ValueError, match=r"FP8Linear\(32, 16\)\.set_extra_state: the FP8 scaling state must be an "
                                         r"int32 tensor \[3, 3 \+ amax history length\].*float32 tensor of shape \[3, 7\]"):
        layer.set_extra_state(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="got a str"):
        layer.set_extra_state("pickled bytes")


# ---- loops that other code owns --------------------------------------------------------------------------------

def test_a_recipe_given_to_convert_to_fp8_computes_every_call_in_fp8():
    """convert_to_fp8(..., fp8_recipe=r): each call as if inside fp8_autocast(fp8_recipe=r), bit for bit; an
    fp8_autocast around the call takes precedence; a forward that raises leaves no context behind."""
    want = tiny_llama()
    want_losses = hand_loop(want, fp8ext.DelayedScaling(amax_history_len=4), batches())
    r = fp8ext.DelayedScaling(amax_history_len=4)
    model = tiny_llama(fp8_recipe=r)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss  # no fp8_autocast here
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == want_losses
    assert_same_parameters(model, want, "convert_to_fp8(fp8_recipe=...)")
    ids = batches(1)[0]
    with fp8ext.fp8_autocast(enabled=False):
        high = model(input_ids=ids).logits
    fp8ext.convert_to_fp8(model, fp8_recipe=None)  # the recipe removed: plain calls compute in high precision
    assert torch.equal(model(input_ids=ids).logits, high)
    with pytest.raises(Exception):
        tiny_llama(fp8_recipe=r)(input_ids=torch.full((1, 4), 10_000))  # an index error inside the forward
    assert not fp8ext.is_fp8_enabled(), "the forward's fp8_autocast was left on raising"
    with pytest.raises(TypeError, match=r"convert_to_fp8\(\): fp8_recipe must be None or a recipe"):
        fp8ext.convert_to_fp8(tiny_llama(convert=False), fp8_recipe="delayed")


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def test_transformers_trainer_trains_like_the_hand_written_loop(tmp_path):
    """Trainer (SGD, constant learning rate, no clipping, batches in order) on a model converted with a recipe: the
    losses and weights of the hand-written loop, bit for bit, and a checkpoint folder that loads back with its FP8
    state."""
    data = batches(4)
    want = tiny_llama()
    want_losses = hand_loop(want, fp8ext.DelayedScaling(amax_history_len=4), data)
    model = tiny_llama(fp8_recipe=fp8ext.DelayedScaling(amax_history_len=4))
    losses = []

    class Recording(transformers.Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = model(**inputs).loss  # the model's mean, as the hand-written loop takes it
            losses.append(loss.item())
            return (loss, None) if return_outputs else loss

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0, logging_steps=1, report_to=[],
        use_cpu=True, save_strategy="steps", save_steps=4, dataloader_drop_last=True, seed=0)
    rows = [row for b in data for row in b]
    Recording(model=model, args=args, train_dataset=_Dataset(rows)).train()
    assert losses == want_losses
    assert_same_parameters(model, want, "Trainer")
    folder = tmp_path / "checkpoint-4"
    loaded = fp8ext.convert_to_fp8(transformers.AutoModelForCausalLM.from_pretrained(folder))
    assert len(fp8ext.load_fp8_state(loaded, str(folder))) == sum(isinstance(m, fp8ext.Linear) for m in model.modules())


def test_accelerate_trains_like_the_hand_written_loop():
    accelerate = pytest.importorskip("accelerate")
    data = batches(4)
    want = tiny_llama()
    want_losses = hand_loop(want, fp8ext.DelayedScaling(amax_history_len=4), data)
    model = tiny_llama(fp8_recipe=fp8ext.DelayedScaling(amax_history_len=4))
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for ids in data:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == want_losses
    assert_same_parameters(accelerator.unwrap_model(model), want, "accelerate")


def test_lightning_trains_like_the_hand_written_loop():
    lightning = pytest.importorskip("lightning")
    data = batches(4)
    want = tiny_llama()
    want_losses = hand_loop(want, fp8ext.DelayedScaling(amax_history_len=4), data)

    class Module(lightning.LightningModule):
        def __init__(self, model):
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, ids, index):
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.model.parameters(), lr=0.1)

    module = Module(tiny_llama(fp8_recipe=fp8ext.DelayedScaling(amax_history_len=4)))
    loader = torch.utils.data.DataLoader(torch.cat(data), batch_size=2, shuffle=False)
    lightning.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False).fit(module, loader)
    assert module.losses == want_losses
    assert_same_parameters(module.model, want, "Lightning")


def test_convert_to_fp8_keeps_the_output_head_in_high_precision_unless_asked():
    model = tiny_llama()
    assert type(model.lm_head) is torch.nn.Linear and model._fp8_kept_head == "lm_head"
    assert isinstance(model.model.layers[0].mlp.down_proj, fp8ext.Linear)
    head = tiny_llama(convert_head=True)
    assert isinstance(head.lm_head, fp8ext.Linear) and head._fp8_kept_head is None
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": True}))
    tied = fp8ext.convert_to_fp8(tied)
    assert type(tied.lm_head) is torch.nn.Linear and tied.lm_head.weight is tied.model.embed_tokens.weight
    # a model with no head: nothing kept back
    seq = fp8ext.convert_to_fp8(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))
    assert seq._fp8_kept_head is None and all(isinstance(m, fp8ext.Linear) for m in seq)
