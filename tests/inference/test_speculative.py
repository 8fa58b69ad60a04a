"""Speculative decoding (fp8ext.inference.speculative): the draft shares the target's embedding, norms and head
and holds the bytes its format says; greedy output is the target's, token for token, at batch 1 and above, over
bf16 and FP8 caches; sampling keeps the target's distribution (chi-square tests that a wrong acceptance rule
fails); errors name the argument; the command line prints the acceptance rate."""
import math
import re

import pytest
import torch
from torch import nn

from conftest import requires_cuda
from fp8ext import WeightOnlyLinear
from fp8ext.inference import generate, make_draft, quantize_model, save_quantized, speculative
from fp8ext.models.transformer import Transformer, TransformerConfig, preset
from fp8ext.weight_only import bits_per_weight

FORMATS = ["mxfp4", "nvfp4", "mxfp6", "fp8"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny and decoding runs thousands of small ops: with more threads than free cores, the
    waiting OpenMP threads made the greedy tests 50x slower on a loaded 2-core machine (13 s against 0.2 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(seed=0, **overrides):
    torch.manual_seed(seed)
    return Transformer(preset("tiny", **overrides)).eval()


def peaked(seed, vocab=8):
    """A one-layer model over `vocab` tokens whose next-token distributions are far from uniform (its head scaled
    up), so that two such models disagree clearly."""
    torch.manual_seed(seed)
    cfg = TransformerConfig(vocab_size=vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                            max_seq_len=16)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    return model


# --- the draft ---

@pytest.mark.parametrize("fmt", FORMATS)
def test_draft_shares_the_embedding_norms_and_head_and_replaces_the_blocks_linears(fmt):
    model = tiny()
    draft = make_draft(model, fmt)
    for name, p in model.named_parameters():
        if "norm" in name or name.startswith(("embed.", "lm_head.")):
            assert draft.get_parameter(name) is p, f"{name} is the target's own Parameter, not a copy"
    assert draft.rope_cos is model.rope_cos
    target_types = {n: type(m) for n, m in model.named_modules()}
    for name, m in draft.blocks.named_modules():
        if name.endswith(("qkv_proj", "o_proj", "w13", "w2")):
            assert isinstance(m, WeightOnlyLinear) and m.fmt == fmt, f"blocks.{name} is a {fmt} WeightOnlyLinear"
            assert target_types[f"blocks.{name}"] is not type(m), f"the target's blocks.{name} is left as it was"
    assert not any(isinstance(m, WeightOnlyLinear) for m in model.modules())


@pytest.mark.parametrize("fmt", FORMATS)
def test_draft_weights_take_the_bytes_of_their_format(fmt):
    model = tiny()
    draft = make_draft(model, fmt)
    layers = [m for m in draft.modules() if isinstance(m, WeightOnlyLinear)]
    assert len(layers) == 4 * model.cfg.n_layers
    for m in layers:
        bits = bits_per_weight(fmt, m.in_features) * m.in_features * m.out_features
        extra = 32 if fmt == "nvfp4" else 0  # NVFP4's one float32 scale per tensor, beyond its 4.5 bits per weight
        assert m.nbytes * 8 == bits + extra, f"{m}: {m.nbytes} bytes for {bits / 8} of codes and block scales"


@pytest.mark.parametrize("weights", ["tensor", "channel", "block128"])
def test_draft_of_an_fp8_checkpoint_packs_its_dequantized_weights(weights):
    model = tiny()
    w = model.blocks[0].ffn.w2.weight.detach().clone()
    direct = make_draft(model, "mxfp4").blocks[0].ffn.w2.dequantized_weight()
    quantize_model(model, weights, "dynamic", progress=False)
    via_fp8 = make_draft(model, "mxfp4").blocks[0].ffn.w2.dequantized_weight()
    err = lambda x: ((x - w).norm() / w.norm()).item()  # noqa: E731
    assert err(via_fp8) < 1.1 * err(direct), "MXFP4 of the E4M3 weight is as close to the weight as MXFP4 of it"


def test_draft_refuses_other_models_and_formats():
    with pytest.raises(ValueError, match="fmt must be one of"):
        make_draft(tiny(), "int4")
    with pytest.raises(TypeError, match="model must be fp8ext's Transformer"):
        make_draft(nn.Linear(4, 4))
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    with pytest.raises(TypeError, match="LlamaModel \\(model_type 'llama'\\) is a transformers model without an "
                                        "output head"):
        make_draft(hf.model)  # a causal LM's drafts: tests/inference/test_speculative_hf.py


# --- greedy: the target's output, token for token ---

@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_the_targets_for_every_k(kv_cache, batch):
    model = tiny()
    draft = make_draft(model, "mxfp4")
    prompt = torch.randint(0, 256, (batch, 6), generator=torch.Generator().manual_seed(batch))
    want, _ = generate(model, prompt, 24, kv_cache=kv_cache)
    rates = []
    for k in (1, 2, 4, 7):
        got, stats = generate(model, prompt, 24, kv_cache=kv_cache, draft=draft, speculate=k)
        assert torch.equal(got, want), f"k={k}: the target's greedy tokens"
        assert stats["acceptance_rate"] == stats["accepted"] / stats["proposed"] > 0
        rates.append((stats["acceptance_rate"], stats["acceptance_rate_per_sequence"]))
    assert min(r for r, _ in rates) < 1, f"some draft tokens rejected (corrections tested): {rates}"
    if batch > 1:
        assert any(each > r for r, each in rates), \
            f"sequences accepted different counts and rounds kept the batch's minimum: {rates}"


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_is_the_targets_on_the_gpu(kv_cache, batch):
    """On a GPU the target's check of k + 1 tokens and its one-token decode steps take different attention paths
    (over an FP8 cache: torch's attention over the dequantized cache, against the FP8 decode kernel); greedy output
    must still be the target's, token for token."""
    model = tiny().cuda()
    draft = make_draft(model, "mxfp4")
    prompt = torch.randint(0, 256, (batch, 6), generator=torch.Generator().manual_seed(batch)).cuda()
    want, _ = generate(model, prompt, 32, kv_cache=kv_cache)
    for k in (2, 4):
        got, stats = generate(model, prompt, 32, kv_cache=kv_cache, draft=draft, speculate=k)
        assert torch.equal(got, want), f"k={k}: first difference at {(got != want).nonzero()[:1].tolist()}"
        assert 0 < stats["acceptance_rate"] <= 1


@requires_cuda
@pytest.mark.cuda
def test_graphed_draft_steps_give_the_eager_drafts_tokens():
    """The draft's one-token steps as a CUDA graph propose what its eager steps propose: the same tokens, rounds
    and acceptance, with sampling too (the graph's logits are copied before the next replay overwrites them)."""
    model = tiny(d_model=256, d_ff=512).cuda().to(torch.bfloat16)  # every draft layer runs the weight-only kernel
    draft = make_draft(model, "nvfp4")
    prompt = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(5)).cuda()
    with pytest.raises(ValueError, match="cuda_graph=True with a draft needs each of its weight-only layers"):
        generate(tiny().cuda(), prompt, 4, kv_cache="fp8", draft=make_draft(tiny().cuda(), "nvfp4"), cuda_graph=True)
    for temperature in (0.0, 0.8):
        runs = [generate(model, prompt, 40, kv_cache="fp8", draft=draft, speculate=4, temperature=temperature,
                         seed=3, cuda_graph=graphed) for graphed in (False, True)]
        (eager, s_eager), (graphed, s_graphed) = runs
        assert s_graphed["cuda_graph"] and not s_eager["cuda_graph"]
        assert torch.equal(eager, graphed), f"temperature {temperature}"
        assert (s_eager["rounds"], s_eager["accepted"]) == (s_graphed["rounds"], s_graphed["accepted"])


@pytest.mark.parametrize("new", [1, 2, 5])
def test_greedy_short_outputs_and_extreme_drafts(new):
    """A draft that is the target (every token accepted: the bonus token each round) and an unrelated one (almost
    every token rejected: the correction each round) give the target's tokens too, for outputs shorter than k."""
    model, other = tiny(), tiny(seed=7)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    want, _ = generate(model, prompt, new, kv_cache="bf16")
    same, s1 = generate(model, prompt, new, kv_cache="bf16", draft=model, speculate=3)
    far, s2 = generate(model, prompt, new, kv_cache="bf16", draft=other, speculate=3)
    assert torch.equal(same, want) and torch.equal(far, want)
    if new > 1:
        assert s1["acceptance_rate"] == 1.0 and s2["acceptance_rate"] < 0.5
        assert s1["rounds"] == math.ceil(new / 4), "k accepted + 1 bonus token per round"


def test_stats_report_speed_and_caches():
    model = tiny()
    _, stats = generate(model, torch.zeros(1, 4, dtype=torch.long), 12, kv_cache="fp8",
                        draft=make_draft(model, "nvfp4"), speculate=4)
    assert stats["decode_tokens_per_s"] > 0 and stats["prefill_tokens_per_s"] > 0
    assert stats["cache_bytes"] == stats["draft_cache_bytes"] > 0 and stats["kv_scales"] == "prefill"
    assert stats["speculate"] == 4 and stats["cuda_graph"] is False


# --- sampling: the target's distribution ---

def chi2_limit(dof: int, z: float = 4.75) -> float:
    """The chi-square quantile at 1 - 1e-6 (z = 4.75 standard deviations), by Wilson and Hilferty's
    approximation (within 1 % for these degrees of freedom): a correct sampler exceeds it once in a million
    seeds."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> tuple:
    """(statistic, degrees of freedom) of observed tokens against probabilities; outcomes expected fewer than 5
    times are pooled into one."""
    counts = torch.bincount(tokens.flatten(), minlength=probs.numel()).double()
    expected = probs.flatten().double() * tokens.numel()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    return stat, int(keep.sum()) - 1


def hand_made():
    """Target probabilities p [1, 3, 6] (positions 0, 1 and the bonus) and a draft's q [1, 2, 6] unlike them."""
    p = torch.tensor([[[.40, .25, .15, .10, .06, .04], [.05, .05, .10, .20, .25, .35], [.30, .05, .30, .05, .25, .05]]])
    q = torch.tensor([[[.05, .10, .15, .20, .20, .30], [.30, .30, .20, .10, .05, .05]]])
    return p.double(), q.double()


def rule_statistics(n=200_000, seed=0):
    """Chi-square statistics of the tokens speculative sampling emits at positions 0, 1 and 2 (of n independent
    rounds, k = 2, hand-made distributions) against the target's p, through the functions generate uses."""
    p, q = hand_made()
    g = torch.Generator().manual_seed(seed)
    p, q = p.expand(n, -1, -1), q.expand(n, -1, -1)
    drafts = torch.stack([torch.multinomial(q[:, i], 1, generator=g)[:, 0] for i in range(2)], 1)
    accepted = speculative.accept_sampled(p, q, drafts, g)
    out = []
    for j in range(3):  # the rounds that reach position j: those that accepted j tokens or more
        rows = accepted >= j
        tokens = speculative.next_tokens(p[rows], q[rows], drafts[rows], accepted[rows], j=j, generator=g)
        out.append((*chi2(tokens, p[0, j]), int(rows.sum())))
    return out


def wrong_residual(p, q):
    return p  # draws a rejected position from p itself: the draft's favourites come out too often


def accept_all(p, q, drafts, generator):
    return torch.full(drafts.shape[:1], drafts.shape[1])  # the draft's tokens, distributed as q


def test_speculative_sampling_rule_keeps_the_targets_distribution():
    for j, (stat, dof, rows) in enumerate(rule_statistics()):
        assert rows > 30_000 and stat < chi2_limit(dof), f"position {j}: chi-square {stat:.1f} over {rows} rounds"


@pytest.mark.parametrize("name, wrong", [("residual", wrong_residual), ("accept_sampled", accept_all)])
def test_a_wrong_acceptance_rule_fails_the_same_test(monkeypatch, name, wrong):
    monkeypatch.setattr(speculative, name, wrong)
    stat, dof, _ = rule_statistics()[0]
    assert stat > 100 * chi2_limit(dof), f"chi-square {stat:.1f} for a rule that is known to be wrong"


def generated_statistics(batch=4000, seed=0):
    """Chi-square statistics of the first two tokens (jointly) and of the third that generate(temperature=1)
    draws with a draft unlike the target, over a batch of one prompt, against the target's own probabilities."""
    model, draft = peaked(0), peaked(1)
    prompt = torch.tensor([[3, 5]])
    ids, stats = generate(model, prompt.expand(batch, -1), 3, kv_cache="bf16", temperature=1.0, seed=seed,
                          draft=draft, speculate=2)
    with torch.no_grad():
        p0 = torch.softmax(model(prompt)[0, -1], -1)
        firsts = torch.cartesian_prod(torch.arange(8), torch.arange(8))  # every (t0, t1)
        p1 = torch.softmax(model(torch.cat([prompt.expand(8, -1), torch.arange(8)[:, None]], 1))[:, -1], -1)
        p2 = torch.softmax(model(torch.cat([prompt.expand(64, -1), firsts], 1))[:, -1], -1)
    joint = p0[:, None] * p1  # [t0, t1]
    third = (joint.reshape(64, 1) * p2).sum(0)
    pair = ids[:, 2] * 8 + ids[:, 3]
    return chi2(pair, joint), chi2(ids[:, 4], third), stats


def test_generate_samples_the_targets_distribution_with_a_poor_draft():
    (s01, d01), (s2, d2), stats = generated_statistics()
    assert stats["acceptance_rate_per_sequence"] < 0.7, "the draft disagrees often: rejections are tested"
    assert s01 < chi2_limit(d01), f"tokens 1 and 2 jointly: chi-square {s01:.1f} ({d01} dof)"
    assert s2 < chi2_limit(d2), f"token 3: chi-square {s2:.1f} ({d2} dof)"


def test_generate_with_a_wrong_rejection_rule_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(speculative, "residual", wrong_residual)
    (s01, d01), _, _ = generated_statistics()
    assert s01 > 5 * chi2_limit(d01), f"chi-square {s01:.1f} for a rule that is known to be wrong"


# --- errors and the command line ---

@pytest.mark.parametrize("kwargs, error", [
    ({"draft": "small"}, "draft must be fp8ext's Transformer"),
    ({"speculate": 2}, "speculate=2 needs a draft model"),
    ({"speculate": 0, "draft": True}, r"speculate \(draft tokens per round\) must be an int >= 1, got 0"),
    ({"kv_cache": None, "draft": True}, "kv_cache must be 'fp8' or 'bf16', got None"),
    ({"cuda_graph": True, "draft": True}, "cuda_graph=True needs kv_cache='fp8' on a GPU"),
    ({"draft": "vocab"}, r"the draft's vocabulary \(8 tokens\) must be the model's \(256\)"),
])
def test_misuse_is_refused_naming_the_argument(kwargs, error):
    model = tiny()
    drafts = {True: model, "vocab": peaked(0), "small": nn.Linear(4, 4)}
    kwargs = {k: drafts[v] if k == "draft" else v for k, v in kwargs.items()}
    with pytest.raises((ValueError, TypeError), match=error):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 4, **kwargs)


def test_command_line_prints_the_acceptance_rate(tmp_path, capsys):
    from fp8ext.inference.__main__ import main
    model = tiny()
    quantize_model(model, "channel", "dynamic", out_dtype=torch.float32, progress=False)
    save_quantized(model, tmp_path)
    main(["generate", "--model", str(tmp_path), "--prompt", "def f", "--max_new_tokens", "8", "--device", "cpu",
          "--kv_cache", "bf16", "--draft", "mxfp4", "--speculate", "3"])
    out = capsys.readouterr().out
    assert out.startswith("def f") and "mxfp4 draft, 3 tokens per round, acceptance rate" in out
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu", "--speculate", "2"])
    assert exit_.value.code == 1 and re.search("error: --speculate .* goes with --draft", capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu", "--draft", "fp8",
              "--kv_cache", "none"])
    assert exit_.value.code == 1 and "error: --draft needs a KV cache" in capsys.readouterr().err


@pytest.mark.parametrize("speculate", [None, 2])
def test_generate_runs_the_models_without_autograd(speculate):
    # on a GPU the decode kernels refuse inputs that need gradients; on any device no graph should be built
    model = tiny()
    draft = make_draft(model, "mxfp4") if speculate else None
    modes = []
    for m in (model,) if draft is None else (model, draft):
        m.register_forward_pre_hook(lambda module, args: modes.append(torch.is_grad_enabled()))
    generate(model, torch.randint(0, 256, (2, 4)), 5, kv_cache="bf16", draft=draft, speculate=speculate)
    assert modes and not any(modes), f"grad enabled in {sum(modes)} of {len(modes)} forwards"
