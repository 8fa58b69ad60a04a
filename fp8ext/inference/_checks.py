"""Checks of a quantized checkpoint, made by load_quantized before it builds a model or reads a weight.

A file is described by its safetensors header: each tensor's dtype (as safetensors spells it: "F8_E4M3", "F32",
...) and shape, read without the data, and the header's metadata. check_header reads the header's JSON itself
(within the 8-byte length and the file's size) and checks every entry, so that a malformed one is refused naming
the tensor or key at fault. Of the data only the scales are read (small
tensors), to refuse any that is not finite and positive. Each refusal is a ValueError (a TypeError for a value of
the wrong type) naming the file and the tensor or key.

fp8ext's own files carry a record of each quantized layer in the header's metadata ('fp8ext'); config.json's
quantization_config (what transformers and vLLM read) must agree with it (_check_own_config). A compressed-tensors
checkpoint another tool wrote (llmcompressor, ...) has none: record_from_config derives it from config.json's
quantization_config (config_groups, ignore) and the tensors in the file (every `X.weight` in F8_E4M3 with an
`X.weight_scale` is a quantized layer; "re:" patterns in targets and ignore are matched in time linear in the name,
fp8ext.inference._patterns). Such files are read with the shapes and dtypes other tools write: scales
in F32, BF16 or F16; per-tensor scales [1] or [] (a scalar), per-channel [out, 1] or [out]; KV-cache scales
[n_kv_heads], [n_kv_heads, 1, 1], [1] or []. fp8ext's own files keep the strict layout: F32, [1], [out, 1],
[n_kv_heads].

    header = read_header(path)
    record = check_checkpoint(config_path, config, header)  # before the model is built
    ...build the skeleton on the meta device, swap in the FP8 layers...
    check_against_model(header, model, record)              # every tensor fits its place, before reading data

JSON (config.json, an index, the metadata's record) is read by parse_json: nested at most MAX_JSON_DEPTH levels
(checked before it is parsed), no integer beyond float64's range; amaxes must be finite, >= 0 and within float32's.

Reading the tensors and building the model is fp8ext.inference.export's job, not this module's.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any, Dict, NamedTuple, Tuple

import torch
from torch import nn

from ._patterns import compile_pattern
from .layers import _check_schemes

OUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FORMATS = {"E4M3": "F8_E4M3"}  # the record's format -> the weight's dtype in the file
WEIGHT_LAYOUT = "row-major [out_features, in_features]"
KV_SCALES = ("k_scale", "v_scale")
LAYER_SCALES = ("weight_scale", "input_scale")
FOREIGN = "quantization_config"  # record["source"] of a record derived from config.json, not read from metadata
_SCALE_DTYPES = ("F32", "BF16", "F16")  # what other tools write scales in (read as float32)
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_HIGH_PRECISION = ("F64", "F32", "F16", "BF16")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header
_ST_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
            "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
            "I64": 64, "U64": 64, "F64": 64, "C64": 64}  # bits per element of each safetensors dtype
MAX_JSON_DEPTH = 64  # levels of arrays and objects in a checkpoint's JSON (config.json: about 4)
_JSON_SPECIAL = re.compile(r'[\[\]{}"\\]')
_F64_MAX = sys.float_info.max
_F32_MAX = float(torch.finfo(torch.float32).max)  # an amax beyond it cannot come from a float32 or bf16 tensor


class Header(NamedTuple):
    path: pathlib.Path  # the safetensors file, or a sharded checkpoint's index file
    metadata: Dict[str, str]
    tensors: Dict[str, Tuple[str, Tuple[int, ...]]]  # name -> (dtype, shape)
    files: Dict[str, pathlib.Path]  # name -> the file that holds it


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(path, what: str, exc=ValueError, who: str = "load_quantized"):
    return exc(f"{who}: {path}: {what}")


def json_depth(text: str) -> int:
    """How deeply arrays and objects nest in JSON text (brackets inside strings not counted), found in one pass
    over its brackets, quotes and backslashes, before the text is parsed."""
    depth = deepest = 0
    in_string, skip = False, -1
    for m in _JSON_SPECIAL.finditer(text):
        i, c = m.start(), m.group()
        if i == skip:
            continue
        if in_string:
            if c == "\\":
                skip = i + 1  # the escaped character
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def parse_json(text: str, path, what: str = "", who: str = "load_quantized") -> Any:
    """json.loads of text from the file `path` (`what`: where in the file, for messages), refusing with a
    ValueError naming the file what json cannot read or would need deep recursion for (more than MAX_JSON_DEPTH
    levels of arrays and objects), and integers beyond float64's range (which no number in a checkpoint's
    description can be, and which overflow wherever they are used as floats)."""
    where = f"{what} " if what else ""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise _fail(path, f"{where}nests arrays and objects {depth} deep; fp8ext reads at most {MAX_JSON_DEPTH} "
                          "levels", who=who)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; integers of more than 4300 digits
        raise _fail(path, f"{where}is not well-formed JSON ({e})", who=who) from None
    stack = [(value, what)]
    while stack:  # depth is bounded above: no recursion needed, none used
        v, key = stack.pop()
        if isinstance(v, dict):
            stack.extend((item, f"{key}[{k!r}]" if "." in k else f"{key}.{k}" if key else k) for k, item in v.items())
        elif isinstance(v, list):
            stack.extend((item, f"{key}[{i}]") for i, item in enumerate(v))
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > _F64_MAX:
            raise _fail(path, f"{key} is an integer of {len(str(abs(v)))} digits, beyond any float (at most "
                              f"{_F64_MAX:.4g})", who=who)
    return value


def read_json(path: pathlib.Path, who: str = "load_quantized") -> Dict[str, Any]:
    """A JSON file holding an object (config.json, an index), read as parse_json does."""
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise _fail(path, f"is not UTF-8 text ({e})", who=who) from None
    value = parse_json(text, path, who=who)
    if not isinstance(value, dict):
        raise _fail(path, f"must hold a JSON object, got {type(value).__name__}", TypeError, who=who)
    return value


def read_header(path: pathlib.Path) -> Header:
    """The safetensors header of the file `path`, checked by check_header before safetensors reads it."""
    from safetensors import SafetensorError, safe_open
    check_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
            return Header(path, f.metadata() or {}, tensors, dict.fromkeys(tensors, path))
    except SafetensorError as e:
        raise _fail(path, f"not a readable safetensors file ({e})") from None


def _header_text(path: pathlib.Path) -> Tuple[str, int]:
    """The JSON text of a safetensors file's header and the size of the data after it, read within the bounds the
    8-byte length and the file's size give."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _fail(path, f"not a safetensors file: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES:
            raise _fail(path, f"not a safetensors file: its header length is {n} bytes; safetensors headers are at "
                              f"most {MAX_HEADER_BYTES}")
        if n < 2 or n > size - 8:
            raise _fail(path, f"not a safetensors file (or truncated): its header length is {n} bytes; the file "
                              f"holds {size - 8} after the length")
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"its safetensors header is not UTF-8 text ({e})") from None
    return text, size - 8 - n


def _entry_problem(name: str, entry, data_size: int):
    """(exception class, what is wrong) with the header's entry of the tensor `name` (dtype, shape, data_offsets
    and the bytes they span), or None. Python integers: no shape or offset overflows."""
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    t = f"tensor {name!r}"
    if not isinstance(entry, dict):
        return TypeError, f"{t} must be a JSON object of dtype, shape and data_offsets, got {_short(entry)}"
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        return ValueError, f"{t} has no {', '.join(missing)}"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in _ST_BITS:
        return (ValueError if isinstance(dtype, str) else TypeError,
                f"{t} has the dtype {_short(dtype)}, not a safetensors dtype (F32, BF16, F8_E4M3, ...)")
    if not isinstance(shape, list) or not all(count(d) for d in shape):
        return (ValueError if isinstance(shape, list) else TypeError,
                f"{t} has the shape {_short(shape)}; a shape is a list of integers >= 0")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(count(o) for o in offsets)):
        return (ValueError if isinstance(offsets, list) else TypeError,
                f"{t} has the data_offsets {_short(offsets)}; they are [begin, end], integers >= 0")
    begin, end = offsets
    if end < begin or end > data_size:
        return ValueError, (f"{t} has the data_offsets [{begin}, {end}]; they must satisfy begin <= end <= "
                            f"{data_size} (the size of the file's data)")
    numel = 1
    for d in shape:
        numel *= d
    if numel * _ST_BITS[dtype] != (end - begin) * 8:
        return ValueError, (f"{t} is {dtype} {shape} ({numel * _ST_BITS[dtype] // 8} bytes) but its data_offsets "
                            f"[{begin}, {end}] span {end - begin} bytes")
    return None


def check_header(path: pathlib.Path) -> Dict[str, Any]:
    """The JSON header of the safetensors file `path`, read and checked without the data: an object of tensor
    entries (dtype, shape, data_offsets that agree with each other and tile the data without gaps or overlaps) and
    an optional __metadata__ of strings. A ValueError (TypeError for a value of the wrong type) names the file and
    the tensor or key at fault."""
    text, data_size = _header_text(path)
    header = parse_json(text, path, "the safetensors header")
    if not isinstance(header, dict):
        raise _fail(path, f"its safetensors header must be a JSON object, got {type(header).__name__}", TypeError)
    metadata = header.get("__metadata__", {})
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _fail(path, f"__metadata__ must be a JSON object of strings, got {_short(metadata)}", TypeError)
        for k, v in metadata.items():
            if not isinstance(v, str):
                raise _fail(path, f"__metadata__[{k!r}] must be a string, got {_short(v)}", TypeError)
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        problem = _entry_problem(name, entry, data_size)
        if problem:
            raise _fail(path, problem[1], problem[0])
        spans.append((*entry["data_offsets"], name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise _fail(path, f"tensors {n0!r} [{b0}, {e0}] and {n1!r} [{b1}, {e1}] overlap in the data")
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise _fail(path, f"bytes [{end}, {begin}] of the data belong to no tensor (before {name!r})")
        end = stop
    if end != data_size:
        raise _fail(path, f"the tensors span {end} bytes of data but the file holds {data_size} (truncated or with "
                          "bytes after the data?)")
    return header


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
