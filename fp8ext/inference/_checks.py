"""Checks of a quantized checkpoint, made by load_quantized before it builds a model or reads a weight.

A file is described by its safetensors header: each tensor's dtype (as safetensors spells it: "F8_E4M3", "F32",
...) and shape, read without the data, and the header's metadata. Of the data only the scales are read (small
tensors), to refuse any that is not finite and positive. Each refusal is a ValueError (a TypeError for a value of
the wrong type) naming the file and the tensor or key.

    header = read_header(path)
    record = check_checkpoint(config_path, config, header)  # before the model is built
    ...build the skeleton on the meta device, swap in the FP8 layers...
    check_against_model(header, model, record)              # every tensor fits its place, before reading data

Reading the tensors and building the model is fp8ext.inference.export's job, not this module's.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Dict, NamedTuple, Tuple

import torch
from torch import nn

from .layers import _check_schemes

OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FORMATS = {"E4M3": "F8_E4M3"}  # the record's format -> the weight's dtype in the file
WEIGHT_LAYOUT = "row-major [out_features, in_features]"
KV_SCALES = ("k_scale", "v_scale")
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_HIGH_PRECISION = ("F64", "F32", "F16", "BF16")


class Header(NamedTuple):
    path: pathlib.Path  # the safetensors file, or a sharded checkpoint's index file
    metadata: Dict[str, str]
    tensors: Dict[str, Tuple[str, Tuple[int, ...]]]  # name -> (dtype, shape)
    files: Dict[str, pathlib.Path]  # name -> the file that holds it


def _fail(path, what: str, exc=ValueError):
    return exc(f"load_quantized: {path}: {what}")


def read_json(path: pathlib.Path) -> Dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"not well-formed JSON ({e})") from None
    if not isinstance(value, dict):
        raise _fail(path, f"must hold a JSON object, got {type(value).__name__}", TypeError)
    return value


def read_header(path: pathlib.Path) -> Header:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
            return Header(path, f.metadata() or {}, tensors, dict.fromkeys(tensors, path))
    except SafetensorError as e:
        raise _fail(path, f"not a readable safetensors file ({e})") from None


def read_sharded_header(index: pathlib.Path) -> Header:
    """The headers of a sharded checkpoint's files as one: `index` is its model.safetensors.index.json
    ({"metadata": {...}, "weight_map": {tensor: file}}, as save_pretrained writes it). Each file must be a plain
    name in the index's folder and hold exactly the tensors the map gives it; the metadata is the first file's
    that holds fp8ext's record (else the first file's)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise _fail(index, "weight_map must be a non-empty JSON object of tensor name -> file name")
    names = sorted(set(weight_map.values()))
    for name in names:
        if pathlib.PurePath(name).name != name or name in (".", ".."):
            raise _fail(index, f"weight_map names the file {name!r}; shards must be files in the index's folder")
        if not (index.parent / name).is_file():
            raise _fail(index, f"weight_map names {name}, which is missing")
    shards = [read_header(index.parent / name) for name in names]
    tensors, files = {}, {}
    for h in shards:
        for k, spec in h.tensors.items():
            if weight_map.get(k) != h.path.name:
                raise _fail(index, f"{h.path.name} holds {k}, which weight_map puts in {weight_map.get(k)!r}")
            tensors[k], files[k] = spec, h.path
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise _fail(index, f"weight_map lists {absent[:5]}, which no shard holds")
    metadata = next((h.metadata for h in shards if "fp8ext" in h.metadata), shards[0].metadata)
    return Header(index, metadata, tensors, files)


def _amax(path, key: str, v) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _fail(path, f"{key} must be a number, got {type(v).__name__} {v!r}", TypeError)
    if not (math.isfinite(v) and v >= 0):
        raise _fail(path, f"{key} must be finite and >= 0, got {v}")


def _record(h: Header) -> Dict[str, Any]:
    if "fp8ext" not in h.metadata:
        raise _fail(h.path, "the metadata holds no 'fp8ext' record (not written by fp8ext's save_quantized)")
    try:
        record = json.loads(h.metadata["fp8ext"])
    except json.JSONDecodeError as e:
        raise _fail(h.path, f"metadata 'fp8ext' is not well-formed JSON ({e})") from None
    if not isinstance(record, dict):
        raise _fail(h.path, f"metadata 'fp8ext' must be a JSON object, got {type(record).__name__}", TypeError)
    for key, default in (("layers", None), ("tied", {}), ("kv_cache", {})):
        if not isinstance(record.get(key, default), dict):
            raise _fail(h.path, f"metadata 'fp8ext' {key!r} must be a JSON object, got {record.get(key)!r}", TypeError)
    if not record["layers"]:
        raise _fail(h.path, "metadata 'fp8ext' lists no quantized layers ('layers' is empty)")
    return record


def _check_layer(h: Header, name: str, spec) -> None:
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
        if wanted and h.tensors[t][0] != "F32":
            raise _fail(h.path, f"{t} is {h.tensors[t][0]}; scales are F32")


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
            if dtype != "F32" or len(shape) != 1:
                raise _fail(h.path, f"{key} is {dtype} {list(shape)}; KV-cache scales are F32 [n_kv_heads]")
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
    quantized layer, each layer's tensors' dtypes, the scales' values. Returns the record (layers, tied,
    kv_cache)."""
    qc = config.get("quantization_config", {})
    if not isinstance(qc, dict) or not isinstance(qc.get("ignore", []), list) or not isinstance(
            qc.get("kv_cache_scheme") or {}, dict):
        raise _fail(config_path, "quantization_config must be a JSON object whose 'ignore' is a list and "
                                 "'kv_cache_scheme' an object or null", TypeError)
    record = _record(h)
    for name, spec in record["layers"].items():
        _check_layer(h, name, spec)
    _check_tied(h, record.get("tied", {}))
    _check_kv(h, record)
    _check_scale_values(h, record["layers"])
    _check_model_config(config_path, config, h)
    return record


def check_against_model(h: Header, model: nn.Module, record: Dict[str, Any]) -> None:
    """Each tensor of the file (and each tied alias) against its place in `model` (the skeleton, FP8 layers
    swapped in): same shape; the same dtype in FP8 layers and wherever the model's tensor is not a high-precision
    float; a high-precision float elsewhere (it is loaded as it is stored). KV-cache scales go to attention
    modules that have k_scale / v_scale, one per KV head."""
    state = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    entries = dict(h.tensors)
    entries.update({alias: h.tensors[target] for alias, target in record.get("tied", {}).items()})
    for key, (dtype, shape) in entries.items():
        mod_name, _, leaf = key.rpartition(".")
        if key not in state and leaf in KV_SCALES:
            _check_kv_place(h, model, key, shape)
            continue
        if key not in state:
            raise _fail(h.path, f"holds {key}, which {type(model).__name__} has no place for")
        want = _ST_DTYPES.get(state[key].dtype, str(state[key].dtype))
        if list(shape) != list(state[key].shape):
            spec = record["layers"].get(mod_name)
            scheme = f" ({spec['weights']} weights, {spec['activations']} activations)" if spec else ""
            raise _fail(h.path, f"{key} is {list(shape)}; the model's {key}{scheme} is {list(state[key].shape)}")
        exact = mod_name in record["layers"] or want not in _HIGH_PRECISION
        if (exact and dtype != want) or (not exact and dtype not in _HIGH_PRECISION):
            raise _fail(h.path, f"{key} is {dtype}; the model's {key} takes "
                                f"{want if exact else ' / '.join(_HIGH_PRECISION)}")


def _check_kv_place(h: Header, model: nn.Module, key: str, shape) -> None:
    mod_name, _, leaf = key.rpartition(".")
    try:
        mod = model.get_submodule(mod_name)
    except AttributeError:
        mod = None
    if mod is None or not hasattr(mod, leaf):
        raise _fail(h.path, f"holds KV-cache scales {key} but {mod_name} "
                            f"({type(mod).__name__ if mod is not None else 'absent'}) has no {leaf}")
    heads = getattr(getattr(mod, "cfg", None), "n_kv_heads", None)
    if heads is not None and list(shape) != [heads]:
        raise _fail(h.path, f"{key} is {list(shape)}; {mod_name} has {heads} KV heads, one scale each")
