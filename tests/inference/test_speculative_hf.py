"""Speculative decoding of transformers causal LMs: make_draft copies a LlamaForCausalLM with its decoder's linear
layers in the draft format and everything else shared; generate(model, prompt, n, draft=draft, speculate=k) gives
the model's own greedy output (transformers' generate, through its DynamicCache or fp8_kv_cache), token for token,
and with temperature > 0 the model's distribution."""
import pytest
import torch

from fp8ext import WeightOnlyLinear
from fp8ext.inference import generate, make_draft
from fp8ext.inference.hf import cache_argument, fp8_kv_cache
from test_speculative import chi2, chi2_limit

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, attn_implementation="sdpa", bos_token_id=None, eos_token_id=None,
             pad_token_id=None)  # no end-of-sequence token: transformers' generate then makes every token asked for


def llama(seed=0, vocab=64, layers=2, head_scale=1.0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, **SIZES)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


def own_greedy(model, prompt, n, kv_cache):
    """transformers' greedy generate, through its DynamicCache or through fp8_kv_cache (prefill scales)."""
    extra = {cache_argument(model): fp8_kv_cache(model, scales="prefill")} if kv_cache == "fp8" else {}
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, **extra)
    assert out.shape[1] == prompt.shape[1] + n
    return out


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8", None])
def test_generate_without_a_draft_is_transformers_own_greedy(kv_cache):
    """generate(hf_model, ...) decodes through transformers' caches (or none): its own greedy tokens."""
    model = llama()
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    want = own_greedy(model, prompt, 16, "bf16" if kv_cache is None else kv_cache)
    got, stats = generate(model, prompt, 16, kv_cache=kv_cache, kv_scales="prefill")
    assert torch.equal(got, want)
    assert stats["cuda_graph"] is False and (stats["cache_bytes"] > 0) == (kv_cache is not None)
    assert stats["kv_scales"] == ("prefill" if kv_cache == "fp8" else None)


def test_a_sliding_window_model_rolls_its_cache_back_past_the_window():
    """Mistral with a window of 8 positions, 20 new tokens: the rounds roll back caches whose layers dropped
    positions past the window; greedy output is transformers' own, with and without a draft."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, num_hidden_layers=2, sliding_window=8, **SIZES)
    model = transformers.MistralForCausalLM(cfg).eval()
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(6))
    want = own_greedy(model, prompt, 20, "bf16")
    assert torch.equal(generate(model, prompt, 20, kv_cache="bf16")[0], want)
    for k in (1, 3):
        got, stats = generate(model, prompt, 20, kv_cache="bf16", draft=make_draft(model, "mxfp4"), speculate=k)
        assert torch.equal(got, want), f"k={k}"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "mxfp6", "fp8"])
def test_draft_of_a_llama_shares_all_but_the_decoders_linear_layers(fmt):
    model = llama()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    draft = make_draft(model, fmt)
    assert type(draft) is type(model) and draft.draft_format == fmt
    assert all(isinstance(draft.get_submodule(n), WeightOnlyLinear) for n in names), "every decoder projection"
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in names), "the target is left unchanged"
    assert draft.lm_head.weight is model.lm_head.weight and draft.model.embed_tokens.weight is \
        model.model.embed_tokens.weight and draft.model.norm.weight is model.model.norm.weight
    assert all(d.input_layernorm.weight is t.input_layernorm.weight
               for d, t in zip(draft.model.layers, model.model.layers))
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits, draft(ids).logits
    assert got.shape == want.shape and not torch.equal(got, want)
    assert (got - want).abs().max() < 0.5 * want.abs().max(), "the draft computes the same model, less precisely"


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_the_models_own_for_every_k(kv_cache, batch):
    model = llama()
    draft = make_draft(model, "mxfp4")
    prompt = torch.randint(0, 64, (batch, 5), generator=torch.Generator().manual_seed(batch))
    want = own_greedy(model, prompt, 20, kv_cache)
    rates = []
    for k in (1, 2, 4, 7):
        got, stats = generate(model, prompt, 20, kv_cache=kv_cache, kv_scales="prefill", draft=draft, speculate=k)
        assert torch.equal(got, want), f"k={k}: transformers' own greedy tokens"
        assert stats["kv_cache"] == kv_cache and stats["cache_bytes"] > 0 and stats["draft_cache_bytes"] > 0
        assert stats["cuda_graph"] is False and stats["proposed"] > 0
        rates.append(stats["acceptance_rate"])
    assert min(rates) < 1, f"some draft tokens rejected (corrections and cache roll-back tested): {rates}"


def test_sampling_keeps_the_models_distribution_with_a_poor_draft():
    """The first two tokens (jointly) that generate(temperature=1) draws with a draft unlike the model, over a
    batch of one prompt, against the model's own probabilities (chi-square at 1 - 1e-6)."""
    model, draft = llama(0, vocab=8, layers=1, head_scale=30.0), llama(1, vocab=8, layers=1, head_scale=30.0)
    prompt = torch.tensor([[3, 5]])
    batch = 3000
    ids, stats = generate(model, prompt.expand(batch, -1), 3, kv_cache="bf16", temperature=1.0, draft=draft,
                          speculate=2)  # the first round proposes 2 tokens (tokens 1 and 2 below)
    with torch.no_grad():
        p0 = torch.softmax(model(prompt).logits[0, -1].double(), -1)
        p1 = torch.softmax(model(torch.cat([prompt.expand(8, -1), torch.arange(8)[:, None]], 1)).logits[:, -1]
                           .double(), -1)
    joint = p0[:, None] * p1
    assert stats["acceptance_rate_per_sequence"] < 0.8, "the draft disagrees often: rejections are tested"
    stat, dof = chi2(ids[:, 2] * 8 + ids[:, 3], joint)
    assert stat < chi2_limit(dof), f"tokens 1 and 2 jointly: chi-square {stat:.1f} ({dof} dof)"


def test_misuse_with_transformers_models_is_refused():
    model = llama()
    prompt = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="the draft must be a transformers causal LM too"):
        generate(model, prompt, 4, draft=torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="cuda_graph=True is not available with transformers models"):
        generate(model, prompt, 4, draft=make_draft(model, "fp8"), cuda_graph=True)
    with pytest.raises(ValueError, match=r"the draft's vocabulary \(8 tokens\) must be the model's \(64\)"):
        generate(model, prompt, 4, draft=llama(vocab=8, layers=1))
    with pytest.raises(ValueError, match="kv_overflow='nvfp4' is not available with transformers models"):
        generate(model, prompt, 4, kv_overflow="nvfp4", kv_budget_bytes=1000)
    with pytest.raises(ValueError, match="kv_cache must be 'fp8', 'bf16' or None, got 'int8'"):
        generate(model, prompt, 4, kv_cache="int8")
    with pytest.raises(ValueError, match="kv_cache must be 'fp8' or 'bf16', got 'int8'"):
        generate(model, prompt, 4, kv_cache="int8", draft=make_draft(model, "fp8"))
    with pytest.raises(TypeError, match="without an output head"):
        make_draft(model.model)
    stateful = llama()
    stateful._is_stateful = True  # as Mamba and the hybrid models declare themselves
    with pytest.raises(TypeError, match="keeps a recurrent state"):
        make_draft(stateful)
    packed = llama()
    packed.model.layers[0].mlp.up_proj.weight.data = packed.model.layers[0].mlp.up_proj.weight.data.to(
        torch.float8_e4m3fn)  # as another library's FP8 checkpoint holds it
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj \(Linear\) holds torch.float8_e4m3fn weights"):
        make_draft(packed)


def test_a_wrong_rejection_rule_fails_the_same_sampling_test(monkeypatch):
    from fp8ext.inference import speculative
    monkeypatch.setattr(speculative, "residual", lambda p, q: p)  # a rejected position drawn from p itself
    with pytest.raises(AssertionError, match="chi-square"):
        test_sampling_keeps_the_models_distribution_with_a_poor_draft()


def test_command_line_decodes_a_transformers_directory_with_and_without_a_draft(tmp_path, capsys):
    """generate --model DIR (save_pretrained's, no tokenizer: bytes as ids) prints the model's greedy text and,
    with --draft, the same text and the acceptance rate."""
    from fp8ext.inference.__main__ import main
    model = llama(vocab=300)  # ids past 255 print as <id> (no tokenizer: bytes as ids)
    model.save_pretrained(tmp_path / "llama")
    base = ["generate", "--model", str(tmp_path / "llama"), "--prompt", "def f(", "--max_new_tokens", "12",
            "--device", "cpu"]
    out = {}
    for name, extra in [("plain", ["--kv_cache", "bf16"]), ("fp8 cache", []),  # fp8: the default
                        ("draft", ["--draft", "mxfp4", "--speculate", "3", "--kv_cache", "bf16"]),
                        ("draft, fp8 cache", ["--draft", "fp8", "--kv_cache", "fp8"])]:
        assert main(base + extra) == 0
        out[name] = capsys.readouterr().out
    text = lambda o: o.split("\n--\n")[0]  # noqa: E731
    assert text(out["draft"]) == text(out["plain"]) and text(out["draft"]).startswith("def f(")
    assert text(out["draft, fp8 cache"]) == text(out["fp8 cache"])
    assert "speculative decoding: mxfp4 draft, 3 tokens per round, acceptance rate" in out["draft"]
    assert "KV cache fp8" in out["fp8 cache"] and "prefill scales" in out["fp8 cache"]
    assert "speculative decoding" not in out["plain"]


def test_command_line_text_of_ids_without_a_tokenizer():
    from fp8ext.inference._hf_cli import _detokenize
    assert _detokenize([100, 101, 300, 102, 0xC3, 0xA9, 256], None) == "de<300>f\u00e9<256>"
