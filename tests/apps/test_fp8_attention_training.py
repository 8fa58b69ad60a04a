"""FP8 attention in fp8ext's own transformer and training script: a recipe with fp8_dpa=True sends the blocks'
attention through fp8ext.DotProductAttention's FP8 engine (the CPU emulation here), in training and in checkpointed
reruns; without it the model computes exactly as before; `python -m fp8ext.train --fp8_attention` trains with it."""
import json

import pytest
import torch

import fp8ext
from fp8ext.models.transformer import Transformer, preset
from fp8ext.train import cli

RUN = ["--preset", "tiny", "--batch_size", "2", "--seq_len", "16", "--eval_batches", "1", "--no_progress",
       "--device", "cpu"]


def model_and_batch():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 256, (2, 17))
    return model, tokens


def loss_and_grads(model, tokens, recipe):
    model.zero_grad()
    _, loss = model(tokens[:, :-1], tokens[:, 1:], fp8=True, fp8_recipe=recipe)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fp8_dpa_sends_each_block_through_fp8_attention(fp8_attention_calls):
    model, tokens = model_and_batch()
    base, base_grads = loss_and_grads(model, tokens, fp8ext.DelayedScaling())
    assert fp8_attention_calls == [], "without fp8_dpa attention stays in high precision"
    loss, grads = loss_and_grads(model, tokens, fp8ext.DelayedScaling(fp8_dpa=True))
    n_layers = preset("tiny").n_layers
    assert len(fp8_attention_calls) == n_layers and all(kw["is_causal"] for kw in fp8_attention_calls)
    assert torch.isfinite(loss) and loss != base, "the attention computed in FP8"
    assert abs(loss - base) < 0.02 * base, f"FP8 attention's loss {loss:.4f} near high precision's {base:.4f}"
    assert grads.keys() == base_grads.keys() and all(torch.isfinite(g).all() for g in grads.values())


def test_fp8_attention_adds_no_parameters_and_no_checkpoint_entries():
    model, _ = model_and_batch()
    for block in model.blocks:
        assert isinstance(block.attn.core_attention, fp8ext.DotProductAttention)
        assert not list(block.attn.core_attention.parameters()) and not list(block.attn.core_attention.buffers())
    assert not any("core_attention" in k for k in model.state_dict()), "checkpoints are unchanged"


def test_train_script_with_fp8_attention(tmp_path, fp8_attention_calls):
    out = tmp_path / "run"
    cli.main(RUN + ["--use_fp8", "--fp8_attention", "--max_steps", "2", "--out_dir", str(out)])
    run = json.loads((out / "run.json").read_text())
    assert fp8_attention_calls, "the training steps ran FP8 attention"
    assert all(torch.isfinite(torch.tensor(v)) for v in [run["final_val_loss"]]), run


@pytest.mark.parametrize("extra", [["--fp8_attention"], ["--use_fp8", "--fp8_recipe", "block", "--fp8_attention"]],
                         ids=["without --use_fp8", "block recipe"])
def test_fp8_attention_needs_fp8_and_a_per_tensor_recipe(tmp_path, capsys, extra):
    with pytest.raises(SystemExit) as e:
        cli.main(RUN + ["--max_steps", "1", "--out_dir", str(tmp_path / "out")] + extra)
    assert e.value.code == 2 and "--fp8_attention needs --use_fp8" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, fp8_backward", [([], False), (["--fp8_attention_backward", "high_precision"], False),
                                                 (["--fp8_attention_backward", "fp8"], True)],
                         ids=["default", "high_precision", "fp8"])
def test_train_script_chooses_fp8_attentions_backward(tmp_path, fp8_attention_calls, extra, fp8_backward):
    cli.main(RUN + ["--use_fp8", "--fp8_attention", "--max_steps", "1", "--no_save", "--out_dir",
                    str(tmp_path / "run")] + extra)
    assert fp8_attention_calls and all(kw["fp8_backward"] is fp8_backward for kw in fp8_attention_calls)


def test_fp8_attention_backward_needs_fp8_attention(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(RUN + ["--use_fp8", "--fp8_attention_backward", "fp8", "--out_dir", str(tmp_path / "out")])
    assert e.value.code == 2 and "--fp8_attention_backward needs --fp8_attention" in capsys.readouterr().err
