"""A quantized checkpoint's format constants, and its JSON and safetensors headers read safely (fp8ext.inference's
load checks, fp8ext/inference/_checks.py, start here).

A file is described by its safetensors header: each tensor's dtype (as safetensors spells it: "F8_E4M3", "F32",
...) and shape, read without the data, and the header's metadata. check_header reads the header's JSON itself
(within the 8-byte length and the file's size) and checks every entry, so that a malformed one is refused naming
the tensor or key at fault.

JSON (config.json, an index, the metadata's record) is read by parse_json: nested at most MAX_JSON_DEPTH levels
(checked before it is parsed), no integer beyond float64's range.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from typing import Any, Dict, NamedTuple, Tuple

import torch

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
