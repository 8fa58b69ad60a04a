"""config.json's quantization_config checked for load_quantized (fp8ext/inference/_checks.py): its config groups'
schemes as fp8ext computes them, its targets and `ignore` patterns ("re:" ones matched in time linear in the name,
fp8ext.inference._patterns), against fp8ext's own record; and, for a checkpoint another tool wrote, the record
derived from it and the tensors in the file (record_from_config)."""

from __future__ import annotations

import pathlib
from typing import Any, Dict, Tuple

from ._header import FOREIGN, OUT_DTYPES, WEIGHT_LAYOUT, Header, _fail, _short
from ._patterns import compile_pattern
from .layers import _check_schemes


def _fp8_args(config_path, key: str, args) -> Dict[str, Any]:
    """One compressed-tensors QuantizationArgs of config.json: 8-bit symmetric float (E4M3) or a ValueError."""
    if not isinstance(args, dict):
        raise _fail(config_path, f"{key} must be a JSON object, got {args!r}", TypeError)
    for field, want, what in (("type", "float", "float (FP8) quantization"), ("num_bits", 8, "8 bits"),
                              ("symmetric", True, "symmetric scales (no zero point)")):
        if args.get(field, want) != want:
            raise _fail(config_path, f"{key}.{field} is {args.get(field)!r}; fp8ext reads {what} only")
    return args


def _group_schemes(config_path, gkey: str, group) -> Tuple[str, str]:
    """fp8ext's (weights, activations) for a config group of quantization_config, or a ValueError naming it."""
    if not isinstance(group, dict):
        raise _fail(config_path, f"{gkey} must be a JSON object, got {group!r}", TypeError)
    if group.get("format") not in (None, "float-quantized"):
        raise _fail(config_path, f"{gkey}.format is {group['format']!r}; fp8ext reads 'float-quantized'")
    if group.get("output_activations") is not None:
        raise _fail(config_path, f"{gkey}.output_activations is set; fp8ext quantizes no layer outputs")
    w = _fp8_args(config_path, f"{gkey}.weights", group.get("weights"))
    strategy = w.get("strategy", "tensor")
    if w.get("dynamic"):
        raise _fail(config_path, f"{gkey}.weights.dynamic is {w['dynamic']!r}; FP8 weights have stored scales")
    if strategy == "block":
        if list(w.get("block_structure") or []) != [128, 128]:
            raise _fail(config_path, f"{gkey}.weights.block_structure is {w.get('block_structure')!r}; fp8ext reads "
                                     "128 x 128 blocks ([128, 128]) only")
        weights = "block128"
    elif strategy in ("tensor", "channel"):
        weights = strategy
    else:
        raise _fail(config_path, f"{gkey}.weights.strategy is {strategy!r}; fp8ext reads 'tensor', 'channel' and "
                                 "'block' (128 x 128) weights")
    a = group.get("input_activations")
    if a is None:
        raise _fail(config_path, f"{gkey}.input_activations is null (weight-only FP8); fp8ext's FP8 layers "
                                 "quantize their inputs (static or dynamic)")
    a = _fp8_args(config_path, f"{gkey}.input_activations", a)
    strategy = a.get("strategy", "tensor")
    if not a.get("dynamic"):
        if strategy != "tensor":
            raise _fail(config_path, f"{gkey}.input_activations.strategy is {strategy!r}; static input scales are "
                                     "per tensor")
        activations = "static"
    elif strategy == "token" or (strategy == "group" and a.get("group_size") == 128 and weights == "block128"):
        activations = "dynamic"  # per token; with block weights per 1 x 128 group, as FP8InferenceLinear does
    else:
        raise _fail(config_path, f"{gkey}.input_activations is dynamic with strategy {strategy!r} (group_size "
                                 f"{a.get('group_size')!r}); fp8ext reads dynamic activations per token, or per "
                                 "128-group with 128 x 128 block weights")
    _check_schemes(weights, activations, f"load_quantized: {config_path}: {gkey}")
    return weights, activations


def _patterns(config_path, key: str, entries: list) -> list:
    """compressed-tensors' targets / ignore entries, each a module name, "re:<regex>" or the class name "Linear",
    as (entry, matcher or None). A regex is matched as re.match does, in time linear in the name
    (fp8ext.inference._patterns: config.json may come from anyone, and re backtracks); one it cannot match that
    way, or that is not a regex, is a ValueError naming the file, the key and the pattern."""
    out = []
    for i, pat in enumerate(entries):
        if not isinstance(pat, str):
            raise _fail(config_path, f"{key}[{i}] must be a string (a module name, 're:' and a regular expression, "
                                     f"or 'Linear'), got {pat!r}", TypeError)
        matcher = None
        if pat.startswith("re:"):
            try:
                matcher = compile_pattern(pat[3:])
            except ValueError as e:
                shown = pat if len(pat) <= 80 else pat[:60] + f"... ({len(pat)} characters)"
                raise _fail(config_path, f"{key}[{i}] {shown!r}: {e}") from None
        out.append((pat, matcher))
    return out


def _matches(name: str, patterns: list) -> bool:
    """Whether any of _patterns' entries names the module `name` ("Linear": every quantized layer here is a linear
    layer; the model built later confirms it)."""
    return any(pat == "Linear" or pat == name or (matcher is not None and matcher(name)) for pat, matcher in patterns)


def _config_schemes(config_path, qc: Dict[str, Any]) -> Dict[str, Tuple[list, Tuple[str, str]]]:
    """{group name: (its targets as _patterns gives them, fp8ext's (weights, activations) for it)} of
    quantization_config's config_groups, or a ValueError naming the file and the key."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _fail(config_path, f"quantization_config.config_groups must be a non-empty JSON object, got "
                                 f"{_short(groups)}")
    schemes = {}
    for gname, group in groups.items():
        gkey = f"quantization_config.config_groups.{gname}"
        targets = group.get("targets") if isinstance(group, dict) else None
        if not isinstance(targets, list) or not targets:
            raise _fail(config_path, f"{gkey}.targets must be a non-empty list, got {targets!r}")
        schemes[gname] = (_patterns(config_path, f"{gkey}.targets", targets),
                          _group_schemes(config_path, gkey, group))
    return schemes


def _check_own_config(config_path, qc: Dict[str, Any], ignore: list, h: Header, record: Dict[str, Any]) -> None:
    """quantization_config of a file with fp8ext's record (what transformers and vLLM read) against that record:
    each quantized layer targeted by a config group of the same schemes and not named by `ignore` (_patterns)."""
    schemes = _config_schemes(config_path, qc)
    for name, spec in sorted(record["layers"].items()):
        if _matches(name, ignore):
            raise _fail(config_path, f"quantization_config.ignore names {name}, which {h.path} holds quantized")
        found = [g for g, (targets, _) in schemes.items() if _matches(name, targets)]
        if not found:
            raise _fail(config_path, f"no quantization_config.config_groups entry targets {name}, which {h.path} "
                                     "holds quantized")
        (weights, activations), recorded = schemes[found[0]][1], (spec.get("weights"), spec.get("activations"))
        gkey = f"quantization_config.config_groups.{found[0]}"
        if weights != recorded[0]:
            raise _fail(config_path, f"{gkey}.weights.strategy gives {weights} weights, but {h.path} holds {name} "
                                     f"with {recorded[0]} weights (as its weight_scale shows)")
        if activations != recorded[1]:
            raise _fail(config_path, f"{gkey}.input_activations gives {activations} activations, but {h.path} "
                                     f"holds {name} with {recorded[1]} activations")


def record_from_config(config_path: pathlib.Path, config: Dict[str, Any], h: Header) -> Dict[str, Any]:
    """The record of a compressed-tensors checkpoint without fp8ext's metadata (written by another tool):
    each `X.weight` of the file in F8_E4M3 with an `X.weight_scale` is a quantized layer, whose schemes come from
    the config group that targets it (weights: strategy tensor, channel, block [128, 128]; input activations:
    static per tensor, dynamic per token or per 128-group) and whose output dtype is config.json's dtype (or
    torch_dtype; float32 when neither is given, as transformers builds it). Anything fp8ext cannot compute
    exactly (integer or E5M2 weights, other block sizes, group weights, weight-only FP8, zero points) is a
    ValueError naming the file and the key."""
    qc = config["quantization_config"]
    schemes = _config_schemes(config_path, qc)
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in OUT_DTYPES:
        raise _fail(config_path, f"dtype is {dtype!r}; fp8ext's FP8 layers compute in {sorted(OUT_DTYPES)}")
    kv = qc.get("kv_cache_scheme")
    if kv:
        _fp8_args(config_path, "quantization_config.kv_cache_scheme", kv)
        if kv.get("dynamic") or kv.get("strategy", "tensor") not in ("tensor", "attn_head"):
            raise _fail(config_path, f"quantization_config.kv_cache_scheme is {kv.get('strategy')!r} "
                                     f"(dynamic {kv.get('dynamic')!r}); fp8ext reads static 'tensor' and "
                                     "'attn_head' KV-cache scales")
    ignore = _patterns(config_path, "quantization_config.ignore", qc.get("ignore", []))
    layers = {}
    for key, (st_dtype, _) in sorted(h.tensors.items()):
        name, _, leaf = key.rpartition(".")
        if leaf == "weight_scale" and h.tensors.get(f"{name}.weight", ("",))[0] not in ("F8_E4M3", "F8_E5M2"):
            raise _fail(h.path, f"holds {key} but {name}.weight is "
                                f"{h.tensors[name + '.weight'][0] if name + '.weight' in h.tensors else 'absent'}; "
                                "a quantized layer's weight is F8_E4M3")
        if leaf != "weight" or st_dtype not in ("F8_E4M3", "F8_E5M2"):
            continue
        if st_dtype == "F8_E5M2":
            raise _fail(h.path, f"{key} is F8_E5M2; compressed-tensors' float-quantized weights are F8_E4M3")
        if f"{name}.weight_scale" not in h.tensors:
            raise _fail(h.path, f"holds the F8_E4M3 weight {key} but no {name}.weight_scale")
        if f"{name}.weight_zero_point" in h.tensors or f"{name}.input_zero_point" in h.tensors:
            raise _fail(h.path, f"holds a zero point for {name}; fp8ext reads symmetric scales only")
        if _matches(name, ignore):
            raise _fail(h.path, f"{key} is F8_E4M3, but quantization_config's ignore names {name}")
        found = [g for g, (targets, _) in schemes.items() if _matches(name, targets)]
        if not found:
            raise _fail(h.path, f"{key} is F8_E4M3, but no quantization_config.config_groups entry targets {name}")
        weights, activations = schemes[found[0]][1]
        layers[name] = {"format": "E4M3", "layout": WEIGHT_LAYOUT, "weights": weights, "activations": activations,
                        "input_amax": None, "out_dtype": dtype}
    if not layers:
        raise _fail(h.path, "holds no quantized layer (an F8_E4M3 X.weight with its X.weight_scale) and no "
                            "'fp8ext' metadata")
    return {"layers": layers, "tied": {}, "kv_cache": {}, "source": FOREIGN}
