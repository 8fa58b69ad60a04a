"""compressed-tensors' "re:" patterns in a checkpoint's quantization_config (targets, ignore) are matched as
re.match matches them, in time linear in the name: a pattern that makes Python's backtracking matcher run for
minutes ((a+)+$) is matched at once, and one that is not a regular expression in the strict sense (backreferences,
lookaround, flags) is refused naming config.json, the key and the pattern."""
import json
import random
import re
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8ext import inference
from fp8ext.inference._patterns import MAX_PATTERN_CHARS, compile_pattern
from fp8ext.models.transformer import Transformer, preset

# what compressed-tensors / llmcompressor recipes and checkpoints write in targets and ignore
REAL = [r".*lm_head", r"lm_head", r".*mlp.gate$", r"model.layers.\d+.mlp.gate", r".*self_attn.(q|k|v)_proj$",
        r"^model.layers.[0-9]+.mlp.experts.[0-9]+.(gate|up)_proj$", r"vision_tower.*", r"multi_modal_projector.*",
        r".*embed_tokens", r".*shared_expert_gate$", r".*block_sparse_moe.gate", r"visual.*", r".*mlp.down_proj$",
        r".*self_attn$", r".*\.mlp\.gate$", r""]
NAMES = ["lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.12.mlp.gate_proj",
         "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.qq_proj", "model.layers.1.self_attn",
         "model.layers.3.mlp.experts.7.up_proj", "model.layers.3.mlp.experts.7.down_proj", "vision_tower.blocks.0",
         "model.layers.0.block_sparse_moe.gate", "model.layers.0.mlp.shared_expert_gate", "", "a", "x\n"]


@pytest.mark.parametrize("pattern", REAL)
def test_the_patterns_checkpoints_carry_match_as_re_match_does(pattern):
    match = compile_pattern(pattern)
    assert [match(n) for n in NAMES] == [bool(re.match(pattern, n)) for n in NAMES]


def test_random_regular_expressions_match_as_re_match_does():
    rng = random.Random(0)
    atoms = ["a", "b", ".", "[ab]", "[^a]", r"\w", r"\d", r"\s", "x", "(a|b)", "(ab|a)", "(a*)", "(?:b+)", "[a-c_]"]
    repeats = ["", "*", "+", "?", "{1,2}", "{2}", "*?", "{0,}", "{,2}"]
    names = ["".join(rng.choice("ab._xc1 \n") for _ in range(rng.randint(0, 8))) for _ in range(300)]
    for _ in range(400):
        pattern = "".join(rng.choice(atoms) + rng.choice(repeats) for _ in range(rng.randint(1, 4))) + \
            rng.choice(["", "$", r"\Z", r"\b", r"\B"])
        match = compile_pattern(pattern)
        for name in rng.sample(names, 30):
            assert match(name) == bool(re.match(pattern, name)), (pattern, name)


def test_a_pattern_that_backtracks_exponentially_in_re_is_matched_in_linear_time():
    match = compile_pattern("(a+)+$")
    start = time.perf_counter()
    assert not match("a" * 5000 + "!") and match("a" * 5000)
    assert time.perf_counter() - start < 1.0, "(a+)+$ on 5000 characters: linear time, well under a second"


@pytest.mark.parametrize("pattern, says", [
    (r"(a)\1", "backreference"), (r"(?=a)", "lookahead or lookbehind"), (r"(?<!a)b", "lookahead or lookbehind"),
    (r"(?i)lm_head", "flags"), (r"(?>a+)", "atomic group"), (r"a++", "possessive repeat"),
    (r"(a{100}){100}", "more than 2000 states"), ("a" * (MAX_PATTERN_CHARS + 1), "characters long"),
    (r"(", "not a regular expression")])
def test_patterns_that_are_not_plain_regular_expressions_are_refused_with_the_reason(pattern, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        compile_pattern(pattern)


def foreign_checkpoint(d, extra_layer=None, ignore=("lm_head",), targets=("Linear",)):
    """A tiny fp8ext checkpoint without fp8ext's metadata record (read as another tool's: quantization_config's
    targets and ignore decide), with an extra F8_E4M3 layer of the given name when asked."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    inference.calibrate(model, [torch.randint(0, 256, (2, 16))], progress=False)
    inference.quantize_model(model, "channel", "dynamic", progress=False)
    inference.save_quantized(model, d)
    tensors = load_file(str(d / "model.safetensors"))
    if extra_layer is not None:
        tensors[f"{extra_layer}.weight"] = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        tensors[f"{extra_layer}.weight_scale"] = torch.ones(1)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = list(ignore)
    cfg["quantization_config"]["config_groups"]["group_0"]["targets"] = list(targets)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_an_ignore_pattern_that_backtracks_in_re_loads_at_once(tmp_path):
    """re.match("(a+)+$", "a" * 27 + "!") takes about 10 s (twice as long per character); the loader answers in
    well under a second, matching as re.match would."""
    d = foreign_checkpoint(tmp_path / "ckpt", extra_layer="a" * 27 + "!", ignore=["re:(a+)+$", "lm_head"])
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"the quantized layers \['a{27}!'\] are not layers of fp8ext's Transformer"):
        inference.load_quantized(d, device="cpu")  # not ignored (no match): a layer the model does not have
    assert time.perf_counter() - start < 2.0
    shutil.rmtree(d)
    d = foreign_checkpoint(tmp_path / "ckpt", extra_layer="a" * 27, ignore=["re:(a+)+$", "lm_head"])
    with pytest.raises(ValueError, match=r"a{27}\.weight is F8_E4M3, but quantization_config's ignore names a{27}"):
        inference.load_quantized(d, device="cpu")  # matched: an FP8 layer its ignore list keeps in high precision


def test_a_checkpoint_with_the_usual_patterns_still_loads(tmp_path):
    d = foreign_checkpoint(tmp_path / "ckpt", ignore=["re:.*lm_head", "re:.*embed_tokens$"],
                           targets=[r"re:.*self_attn.(q|k|v|o)_proj$", r"re:model.layers.\d+.mlp.*"])
    model = inference.load_quantized(d, device="cpu")
    assert len(model.fp8_quantization["layers"]) == 8


@pytest.mark.parametrize("key, pattern", [("quantization_config.ignore[1]", r"re:(a)\1"),
                                          ("quantization_config.config_groups.group_0.targets[0]", "re:(?=model).*")])
def test_a_pattern_it_cannot_match_safely_is_refused_naming_the_file_the_key_and_the_pattern(tmp_path, key, pattern):
    in_ignore = key.endswith("ignore[1]")
    d = foreign_checkpoint(tmp_path / "ckpt", ignore=["lm_head", pattern] if in_ignore else ["lm_head"],
                           targets=["Linear"] if in_ignore else [pattern])
    with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'}: {key} {pattern!r}: it uses a")):
        inference.load_quantized(d, device="cpu")


def test_many_names_cost_each_distinct_step_once(monkeypatch):
    """A pattern with large state sets ("(.*a){160}") against many long names: the steps are cached as a lazy DFA, so
    the automaton's closures are computed once per distinct (state set, character, anchor context), not once per
    character of every name (1,000 names x 200 characters would be 200,000)."""
    from fp8ext.inference import _patterns
    calls = []
    real = _patterns._Automaton._closure
    monkeypatch.setattr(_patterns._Automaton, "_closure", lambda self, *a: calls.append(1) or real(self, *a))
    _patterns.compile_pattern.cache_clear()
    match = _patterns.compile_pattern("(.*a){160}")
    names = [f"model.layers.{i}.mlp.gate_proj" + "ab" * (70 + i % 100) for i in range(1000)]
    got = [match(n) for n in names]
    # (.*a){160}: at least 160 a's (re.match itself backtracks for minutes on these names)
    assert got == [n.count("a") >= 160 for n in names] and any(got) and not all(got)
    assert len(calls) < 20000, f"{len(calls)} closures for 1,000 names"
