"""Checks of a quantized checkpoint, made by load_quantized before it builds a model or reads a weight.

A file is described by its safetensors header (fp8ext/inference/_header.py reads it and config.json without
trusting them: read_header, read_json): each tensor's dtype (as safetensors spells it: "F8_E4M3", "F32", ...) and
shape, read without the data, and the header's metadata. Of the data only the scales are read (small tensors), to
refuse any that is not finite and positive. Each refusal is a ValueError (a TypeError for a value of the wrong
type) naming the file and the tensor or key.

fp8ext's own files carry a record of each quantized layer in the header's metadata ('fp8ext'); config.json's
quantization_config (what transformers and vLLM read) must agree with it (_check_own_config). A compressed-tensors
checkpoint another tool wrote (llmcompressor, ...) has none: record_from_config derives it from config.json's
quantization_config (config_groups, ignore) and the tensors in the file (every `X.weight` in F8_E4M3 with an
`X.weight_scale` is a quantized layer; "re:" patterns in targets and ignore are matched in time linear in the name,
fp8ext.inference._patterns). Both are in fp8ext/inference/_config_checks.py. Such files are read with the shapes
and dtypes other tools write: scales in F32, BF16 or F16; per-tensor scales [1] or [] (a scalar), per-channel
[out, 1] or [out]; KV-cache scales [n_kv_heads], [n_kv_heads, 1, 1], [1] or []. fp8ext's own files keep the strict
layout: F32, [1], [out, 1], [n_kv_heads].

    header = read_header(path)                              # fp8ext.inference._header
    record = check_checkpoint(config_path, config, header)  # before the model is built
    ...build the skeleton on the meta device, swap in the FP8 layers...
    check_against_model(header, model, record)              # every tensor fits its place, before reading data

Amaxes in the record must be finite, >= 0 and within float32's range.

Reading the tensors and building the model is fp8ext.inference.export's job, not this module's.
"""

from __future__ import annotations

import pathlib
from typing import Any, Dict, Tuple

import torch
from torch import nn

from ._config_checks import _check_own_config, _patterns, record_from_config
from ._header import (_F32_MAX, _HIGH_PRECISION, _SCALE_DTYPES, _ST_DTYPES, FOREIGN, FORMATS, KV_SCALES,
                      LAYER_SCALES, OUT_DTYPES, WEIGHT_LAYOUT, Header, _fail, parse_json)
from .layers import _check_schemes


def _amax(path, key: str, v) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _fail(path, f"{key} must be a number, got {type(v).__name__} {v!r}", TypeError)
    if not 0 <= v <= _F32_MAX:  # compared exactly, without converting an integer to a float (which can overflow)
        shown = f"an integer of {len(str(abs(v)))} digits" if isinstance(v, int) and abs(v) > 10**20 else v
        raise _fail(path, f"{key} must be finite, >= 0 and at most {_F32_MAX:.6g} (float32's largest), got {shown}")


def _record(h: Header) -> Dict[str, Any]:
    if "fp8ext" not in h.metadata:
        raise _fail(h.path, "the metadata holds no 'fp8ext' record (not written by fp8ext's save_quantized)")
    record = parse_json(h.metadata["fp8ext"], h.path, "metadata 'fp8ext'")
    if not isinstance(record, dict):
        raise _fail(h.path, f"metadata 'fp8ext' must be a JSON object, got {type(record).__name__}", TypeError)
    for key, default in (("layers", None), ("tied", {}), ("kv_cache", {})):
        if not isinstance(record.get(key, default), dict):
            raise _fail(h.path, f"metadata 'fp8ext' {key!r} must be a JSON object, got {record.get(key)!r}", TypeError)
    if not record["layers"]:
        raise _fail(h.path, "metadata 'fp8ext' lists no quantized layers ('layers' is empty)")
    return record


def _check_layer(h: Header, name: str, spec, scale_dtypes: Tuple[str, ...] = ("F32",)) -> None:
    key = f"metadata 'fp8ext' layers[{name!r}]"
    if not isinstance(spec, dict):
        raise _fail(h.path, f"{key} must be a JSON object, got {spec!r}", TypeError)
    missing = [f for f in ("format", "weights", "activations") if f not in spec]
    if missing:
        raise _fail(h.path, f"{key} has no {missing}")
    if spec["format"] not in FORMATS:
        raise _fail(h.path, f"{key}['format'] must be one of {sorted(FORMATS)}, got {spec['format']!r}")
    if spec.get("layout", WEIGHT_LAYOUT) != WEIGHT_LAYOUT:
        raise _fail(h.path, f"{key}['layout'] must be {WEIGHT_LAYOUT!r}, got {spec['layout']!r}")
    _check_schemes(spec["weights"], spec["activations"], f"load_quantized: {h.path}: {key}")
    out_dtype = spec.get("out_dtype", "bfloat16")  # files written before out_dtype was recorded: bfloat16
    if not isinstance(out_dtype, str) or out_dtype not in OUT_DTYPES:
        raise _fail(h.path, f"{key}['out_dtype'] must be one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")
    if spec.get("input_amax") is not None:
        _amax(h.path, f"{key}['input_amax']", spec["input_amax"])
    w = f"{name}.weight"
    if w not in h.tensors:
        raise _fail(h.path, f"holds no {w} for the quantized layer {name!r}")
    dtype, shape = h.tensors[w]
    if dtype != FORMATS[spec["format"]] or len(shape) != 2:
        raise _fail(h.path, f"{w} is {dtype} {list(shape)}; format {spec['format']} takes a 2-d "
                            f"{FORMATS[spec['format']]} [out_features, in_features]")
    for leaf, wanted in (("weight_scale", True), ("input_scale", spec["activations"] == "static")):
        t = f"{name}.{leaf}"
        if wanted and t not in h.tensors:
            raise _fail(h.path, f"holds no {t} ({spec['weights']} weights, {spec['activations']} activations)")
        if not wanted and t in h.tensors:
            raise _fail(h.path, f"holds {t}, but the layer's activations are {spec['activations']}")
        if wanted and h.tensors[t][0] not in scale_dtypes:
            raise _fail(h.path, f"{t} is {h.tensors[t][0]}; scales are {' / '.join(scale_dtypes)}")


def _check_kv(h: Header, record: Dict[str, Any]) -> None:
    for name, amax in record.get("kv_cache", {}).items():
        for leaf in ("k_amax", "v_amax"):
            values = amax.get(leaf) if isinstance(amax, dict) else None
            if not isinstance(values, list):
                raise _fail(h.path, f"metadata 'fp8ext' kv_cache[{name!r}][{leaf!r}] must be a list, got {values!r}",
                            TypeError)
            for i, v in enumerate(values):
                _amax(h.path, f"metadata 'fp8ext' kv_cache[{name!r}][{leaf!r}][{i}]", v)
    for key, (dtype, shape) in h.tensors.items():
        mod, _, leaf = key.rpartition(".")
        if leaf in KV_SCALES:
            other = f"{mod}.{'v_scale' if leaf == 'k_scale' else 'k_scale'}"
            if record.get("source") == FOREIGN:
                if dtype not in _SCALE_DTYPES or len(shape) > 3 or len(_squeezed(shape)) > 1:
                    raise _fail(h.path, f"{key} is {dtype} {list(shape)}; KV-cache scales are F32, BF16 or F16 "
                                        f"[n_kv_heads], [n_kv_heads, 1, 1], [1] or []")
            elif dtype != "F32" or not (len(shape) == 1 or (len(shape) == 3 and list(shape[1:]) == [1, 1])):
                raise _fail(h.path, f"{key} is {dtype} {list(shape)}; KV-cache scales are F32 [n_kv_heads] or "
                                    f"[n_kv_heads, 1, 1]")
            if h.tensors.get(other, (None, None))[1] != shape:
                raise _fail(h.path, f"{key} is {list(shape)} but {other} is "
                                    f"{list(h.tensors[other][1]) if other in h.tensors else 'absent'}")


def _check_tied(h: Header, tied: Dict[str, Any]) -> None:
    for alias, target in tied.items():
        if not isinstance(target, str):
            raise _fail(h.path, f"metadata 'fp8ext' tied[{alias!r}] must be a tensor name, got {target!r}", TypeError)
        if target not in h.tensors or alias in h.tensors:
            raise _fail(h.path, f"metadata 'fp8ext' ties {alias} to {target}: the file must hold {target} "
                                f"and not {alias}")


def _check_scale_values(h: Header, layers: Dict[str, Any]) -> None:
    from safetensors import safe_open
    keys = [k for k in h.tensors if k.rpartition(".")[2] in KV_SCALES]
    keys += [f"{n}.{leaf}" for n in layers for leaf in ("weight_scale", "input_scale") if f"{n}.{leaf}" in h.tensors]
    for path in sorted({h.files[k] for k in keys}):
        with safe_open(str(path), framework="pt") as f:
            for k in (k for k in keys if h.files[k] == path):
                s = f.get_tensor(k)
                bad = s[~(torch.isfinite(s) & (s > 0))]
                if bad.numel():
                    raise _fail(h.path, f"{k} must be finite and positive (scales dequantize: x = q * scale), "
                                        f"got {bad[0].item()}")


def _check_model_config(config_path: pathlib.Path, config: Dict[str, Any], h: Header) -> None:
    """fp8ext's transformer's config (other models' configs only their factory knows): field types and ranges,
    and n_layers against the blocks whose tensors the file holds, before the factory builds anything."""
    mc = config.get("model_config", {})
    if not isinstance(mc, dict):
        raise _fail(config_path, f"model_config must be a JSON object, got {type(mc).__name__}", TypeError)
    if config.get("architectures") != ["Transformer"]:
        return
    from ..models.transformer import TransformerConfig
    try:
        cfg = TransformerConfig(**mc)
    except (TypeError, ValueError) as e:
        raise _fail(config_path, f"model_config: {e}", type(e)) from None
    parts = [k.split(".") for k in h.tensors]
    blocks = sorted({int(p[1]) for p in parts if len(p) > 1 and p[0] == "blocks" and p[1].isdigit()})
    if blocks != list(range(cfg.n_layers)):
        raise _fail(config_path, f"model_config n_layers is {cfg.n_layers}, but {h.path} holds the tensors of "
                                 f"blocks {blocks[:8]}{' ...' if len(blocks) > 8 else ''}")


def check_checkpoint(config_path: pathlib.Path, config: Dict[str, Any], h: Header) -> Dict[str, Any]:
    """Everything that can be checked before a model exists: config.json's fields, the metadata's record of each
    quantized layer (derived from quantization_config when the file has no fp8ext metadata: record_from_config),
    each layer's tensors' dtypes, the scales' values. Returns the record (layers, tied, kv_cache; "source" is
    FOREIGN for a derived one)."""
    qc = config.get("quantization_config", {})
    if not isinstance(qc, dict) or not isinstance(qc.get("ignore", []), list) or not isinstance(
            qc.get("kv_cache_scheme") or {}, dict):
        raise _fail(config_path, "quantization_config must be a JSON object whose 'ignore' is a list and "
                                 "'kv_cache_scheme' an object or null", TypeError)
    ignore = _patterns(config_path, "quantization_config.ignore", qc.get("ignore", []))
    foreign = "fp8ext" not in h.metadata
    record = record_from_config(config_path, config, h) if foreign else _record(h)
    for name, spec in record["layers"].items():
        _check_layer(h, name, spec, _SCALE_DTYPES if foreign else ("F32",))
    if not foreign:
        _check_own_config(config_path, qc, ignore, h, record)
    _check_tied(h, record.get("tied", {}))
    _check_kv(h, record)
    _check_scale_values(h, record["layers"])
    _check_model_config(config_path, config, h)
    return record


def check_against_model(h: Header, model: nn.Module, record: Dict[str, Any]) -> None:
    """Each tensor of the file (and each tied alias) against its place in `model` (the skeleton, FP8 layers
    swapped in): same shape; the same dtype in FP8 layers and wherever the model's tensor is not a high-precision
    float; a high-precision float elsewhere (it is loaded as it is stored). KV-cache scales go to attention
    modules that have k_scale / v_scale, one per KV head. In a derived record (another tool's file) a scale fits
    when its dimensions other than 1s are the model's ([] for [1], [out] for [out, 1]; one KV scale for all
    heads too): the loader reshapes it."""
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    foreign = record.get("source") == FOREIGN
    entries = dict(h.tensors)
    entries.update({alias: h.tensors[target] for alias, target in record.get("tied", {}).items()})
    for key, (dtype, shape) in entries.items():
        mod_name, _, leaf = key.rpartition(".")
        if key not in state and leaf in KV_SCALES:
            _check_kv_place(h, model, key, shape, foreign)
            continue
        if key not in state:
            raise _fail(h.path, f"holds {key}, which {type(model).__name__} has no place for")
        if foreign and mod_name in record["layers"] and leaf in LAYER_SCALES:  # dtype checked by _check_layer
            if _squeezed(shape) != _squeezed(state[key].shape):
                spec = record["layers"][mod_name]
                raise _fail(h.path, f"{key} is {list(shape)}; the model's {key} ({spec['weights']} weights, "
                                    f"{spec['activations']} activations) is {list(state[key].shape)} (or the same "
                                    f"without its dimensions of size 1)")
            continue
        spec = record["layers"].get(mod_name)
        scheme = f" ({spec['weights']} weights, {spec['activations']} activations)" if spec else ""
        check_fits(h.path, key, dtype, shape, state[key], spec is not None, scheme)


def check_fits(path, key: str, dtype: str, shape, want: torch.Tensor, exact: bool, scheme: str = "") -> None:
    """The file's tensor `key` (safetensors dtype and shape) against the model's tensor in its place: the same
    shape; the same dtype where `exact` (an FP8 layer's tensor) or where the model's tensor is not a high-precision
    float; a high-precision float elsewhere (it is loaded as it is stored). scheme: the layer's, for the message."""
    if list(shape) != list(want.shape):
        raise _fail(path, f"{key} is {list(shape)}; the model's {key}{scheme} is {list(want.shape)}")
    want_dtype = _ST_DTYPES.get(want.dtype, str(want.dtype))
    exact = exact or want_dtype not in _HIGH_PRECISION
    if (exact and dtype != want_dtype) or (not exact and dtype not in _HIGH_PRECISION):
        raise _fail(path, f"{key} is {dtype}; the model's {key} takes "
                          f"{want_dtype if exact else ' / '.join(_HIGH_PRECISION)}")


def _check_kv_place(h: Header, model: nn.Module, key: str, shape, foreign: bool = False) -> None:
    mod_name, _, leaf = key.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        mod = None
    if mod is None or not hasattr(mod, leaf):
        raise _fail(h.path, f"holds KV-cache scales {key} but {mod_name} "
                            f"({type(mod).__name__ if mod is not None else 'absent'}) has no {leaf}")
    heads = kv_heads(model, mod)
    if foreign:
        if heads is not None and _squeezed(shape) not in ([], [heads]):
            raise _fail(h.path, f"{key} is {list(shape)}; {mod_name} has {heads} KV heads: one scale each "
                                f"([{heads}] or [{heads}, 1, 1]) or one for all ([1] or [])")
    elif heads is not None and list(shape) not in ([heads], [heads, 1, 1]):
        raise _fail(h.path, f"{key} is {list(shape)}; {mod_name} has {heads} KV heads, one scale each ([{heads}] or "
                            f"[{heads}, 1, 1])")


def kv_heads(model: nn.Module, attention: nn.Module):
    """The number of KV heads of an attention module: fp8ext's (cfg.n_kv_heads) or a transformers model's
    (config.num_key_value_heads); None when neither says."""
    heads = getattr(getattr(attention, "cfg", None), "n_kv_heads", None)
    if heads is None:
        config = getattr(attention, "config", None) or getattr(model, "config", None)
        heads = getattr(config, "num_key_value_heads", None)
    return heads if isinstance(heads, int) else None


def _squeezed(shape) -> list:
    """A shape without its dimensions of size 1: [] for [] and [1], [out] for [out, 1] and [out]."""
    return [d for d in shape if d != 1]


def tied_parameters(h: Header, model: nn.Module) -> Dict[str, str]:
    """{alias: name in the file} for the parameters `model` shares between names (a tied output head) of which
    the file holds one name: what fp8ext's record says in 'tied', for a file without it."""
    names: Dict[int, list] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    tied = {}
    for group in names.values():
        held = [n for n in group if n in h.tensors]
        if held:
            tied.update({n: held[0] for n in group if n not in h.tensors})
    return tied
