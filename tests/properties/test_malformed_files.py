"""Files built malformed on purpose, from small genuine checkpoints changed one way each (a table per kind of file):
every one is refused with a clear exception that names the file (and the tensor or key where one is at fault),
under a time and memory bound (prop_support.bounded): never a crash, a hang, a huge allocation or a silent success.

- model.safetensors (load_quantized): the 8-byte header length, the JSON header (UTF-8, an object, offsets, dtypes,
  shapes against the byte ranges, overlaps) and fp8ext's metadata record; refusals are ValueError / TypeError
  (docs/inference.md: "raises ValueError (TypeError for a value of the wrong type) naming the file and the key").
- config.json: its JSON, fp8ext_model_config's fields (types, ranges, 1e400, NaN, missing keys) and
  quantization_config, both for fp8ext's own checkpoint and for another tool's (no fp8ext record: the layers' schemes
  come from quantization_config alone).
- model.safetensors.index.json of a sharded checkpoint: weight_map naming files outside the folder (which exist, so
  that following the name would succeed), missing shards, non-objects, tensors in the wrong shard.
- a training checkpoint.pt (fp8ext.train.checkpoint.read): empty, truncated, garbage, a corrupt zip, and pickles that
  would run code, refused without running it (a marker file the code would create stays absent).
Cases that fail today because of a library bug are marked xfail(strict=True) with the bug in one line.
"""

import io
import json
import pathlib
import pickle
import shutil
import struct
import zipfile

import pytest
import torch
from torch import nn

from fp8ext import inference
from fp8ext.models.transformer import Transformer, TransformerConfig
from fp8ext.train import checkpoint
from prop_support import bounded

safetensors_torch = pytest.importorskip("safetensors.torch")

CFG = TransformerConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=32)
W = "model.layers.0.mlp.down_proj.weight"  # the tensor the per-tensor header mutations change
FAILED = pytest.fail.Exception  # what pytest.raises raises when nothing was raised (a silent success)


def xfail(reason, raises=None):
    return pytest.mark.xfail(strict=True, reason=reason, raises=raises)


# ---- genuine bases ---------------------------------------------------------------------------------------------

class Toy(nn.Module):
    """A model that is not fp8ext's Transformer: its checkpoint goes through load_quantized's generic path."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{name: directory} of genuine checkpoints: fp8ext's Transformer as one file ("llama") and in shards
    ("sharded"), a Toy model as another tool writes it, without fp8ext's record ("foreign"), and a training run's
    directory ("train", checkpoint.pt of FP8Linear layers after an FP8 step)."""
    import fp8ext
    root = tmp_path_factory.mktemp("bases")
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    inference.calibrate(model, [torch.randint(0, 64, (2, 16))], progress=False)
    inference.quantize_model(model, "channel", "static")
    inference.save_quantized(model, root / "llama")
    inference.save_quantized(model, root / "sharded", max_shard_size=2000)
    toy = Toy().eval()
    inference.calibrate(toy, [torch.randn(4, 32)], progress=False)
    inference.quantize_model(toy, "channel", "static")
    inference.save_quantized(toy, root / "foreign")
    path = str(root / "foreign" / "model.safetensors")
    safetensors_torch.save_file(safetensors_torch.load_file(path), path, metadata={"format": "pt"})  # no record
    cfg = json.loads((root / "foreign" / "config.json").read_text())
    (root / "foreign" / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    net = nn.Sequential(fp8ext.FP8Linear(16, 16), fp8ext.FP8Linear(16, 16))
    opt = torch.optim.AdamW(net.parameters())
    with fp8ext.fp8_autocast(enabled=True, fp8_recipe=fp8ext.DelayedScaling()):
        net(torch.randn(16, 16)).sum().backward()
    opt.step()
    (root / "train").mkdir()
    checkpoint.save(str(root / "train"), net, opt, 1, {"preset": "tiny", "data": None, "lr": 1e-3})
    return root


@pytest.fixture
def copy_of(bases, tmp_path):
    def copy(name):
        d = tmp_path / name
        shutil.copytree(bases / name, d)
        return d
    return copy


def load(d):
    """load_quantized of a copy of a base (the foreign one, a Toy, with its factory)."""
    return inference.load_quantized(d, (lambda c: Toy()) if d.name == "foreign" else None, device="cpu")


def refused(call, path, *keys, exc=(ValueError, TypeError)):
    """call() raises `exc` within the bounds, its message naming `path` and each of `keys` (a tuple: one of them)."""
    with bounded(what=f"reading {pathlib.Path(path).name}"):
        with pytest.raises(exc) as info:
            call()
    msg = str(info.value)
    assert str(path) in msg, f"the {type(info.value).__name__} does not name the file {path}: {msg}"
    for key in keys:
        assert any(k in msg for k in (key if isinstance(key, tuple) else (key,))), \
            f"the {type(info.value).__name__} does not name {key!r}: {msg}"
    return info.value


@pytest.mark.parametrize("name", ["llama", "sharded", "foreign"])
def test_the_genuine_bases_load(copy_of, name):
    d = copy_of(name)
    with bounded():
        load(d)


def test_the_genuine_training_checkpoint_reads(bases):
    path, state = checkpoint.read(str(bases / "train"))
    assert state["step"] == 1 and any(k.endswith("_extra_state") for k in state["model"])


# ---- model.safetensors -----------------------------------------------------------------------------------------

def st_parts(raw: bytes):
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def st_bytes(header=None, data=b"", *, length=None, text=None):
    """A safetensors file: the 8-byte little-endian header length (`length`, else the header's), the header (`text`
    bytes, else `header` as JSON), the data."""
    text = json.dumps(header).encode() if text is None else text
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def entry(change):
    """A mutation of the header's JSON: change(header, data) edits a copy in place."""
    def mutate(raw):
        header, data = st_parts(raw)
        change(header, data)
        return st_bytes(header, data)
    return mutate


def _set(key, field, value):
    return entry(lambda h, d: h[key].__setitem__(field, value(h, d) if callable(value) else value))


def _first(h):
    return min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def _record(change):
    def edit(h, d):
        h["__metadata__"]["fp8ext"] = change(h["__metadata__"]["fp8ext"])
    return entry(edit)


SAFETENSORS = [  # (id, mutation of the file's bytes, the key the message must name)
    ("empty", lambda raw: b"", None),
    ("length-only-4-bytes", lambda raw: raw[:4], None),
    ("truncated-in-the-header", lambda raw: raw[:8 + struct.unpack("<Q", raw[:8])[0] // 2], None),
    ("truncated-in-the-data", lambda raw: raw[:-100], None),
    ("one-byte-short", lambda raw: raw[:-1], None),
    ("one-byte-long", lambda raw: raw + b"\0", None),
    ("header-length-larger-than-the-file", lambda raw: st_bytes(*st_parts(raw), length=len(raw)), None),
    ("header-length-2**64-1", lambda raw: st_bytes(*st_parts(raw), length=2**64 - 1), None),
    ("header-length-negative-as-int64", lambda raw: st_bytes(*st_parts(raw), length=2**63), None),
    ("header-length-100MiB", lambda raw: st_bytes(*st_parts(raw), length=100 << 20), None),
    ("header-length-0", lambda raw: st_bytes(*st_parts(raw), length=0), None),
    ("header-not-utf8", lambda raw: st_bytes(text=json.dumps(st_parts(raw)[0]).encode().replace(
        b'"F32"', b'"F\xff2"', 1), data=st_parts(raw)[1]), None),
    ("header-a-json-list", lambda raw: st_bytes(text=b"[1, 2, 3]", data=st_parts(raw)[1]), None),
    ("header-a-json-number", lambda raw: st_bytes(text=b"5", data=st_parts(raw)[1]), None),
    ("header-json-cut", lambda raw: st_bytes(text=json.dumps(st_parts(raw)[0]).encode()[:-2], data=st_parts(raw)[1]),
     None),
    ("header-deeply-nested", lambda raw: st_bytes(text=b"[" * 100000 + b"]" * 100000, data=st_parts(raw)[1]), None),
    ("end-before-start", entry(lambda h, d: h[_first(h)].__setitem__("data_offsets",
                                                                     h[_first(h)]["data_offsets"][::-1])),
     "lm_head.weight"),
    ("negative-offset", _set(W, "data_offsets", lambda h, d: [-8, h[W]["data_offsets"][1]]), W),
    ("offset-past-2**64", _set(W, "data_offsets", lambda h, d: [h[W]["data_offsets"][0], 2**64 + 5]), W),
    ("offset-past-the-data", _set(W, "data_offsets", lambda h, d: [h[W]["data_offsets"][0], len(d) + 64]), W),
    ("dtype-unknown-F9", _set(W, "dtype", "F9"), W),
    ("dtype-torch-spelling", _set(W, "dtype", "float32"), W),
    ("dtype-a-number", _set(W, "dtype", 7), W),
    ("dtype-U8-for-an-fp8-weight", _set(W, "dtype", "U8"), W),
    ("shape-twice-the-bytes", _set(W, "shape", lambda h, d: [2 * h[W]["shape"][0], h[W]["shape"][1]]), W),
    ("shape-negative", _set(W, "shape", lambda h, d: [-h[W]["shape"][0], h[W]["shape"][1]]), W),
    ("shape-overflowing", _set(W, "shape", [2**40, 2**40]), W),
    ("shape-a-string", _set(W, "shape", "32x32"), W),
    ("ranges-overlap", _set(W, "data_offsets", lambda h, d: [h["lm_head.weight"]["data_offsets"][0] + 512,
                                                             h["lm_head.weight"]["data_offsets"][0] + 512 + 1024]),
     (W, "lm_head.weight")),  # inside lm_head.weight's bytes, W's own size (a unique start: a deterministic order)
    ("tensor-entry-not-an-object", entry(lambda h, d: h.__setitem__(W, [1, 2])), W),
    ("tensor-entry-without-offsets", entry(lambda h, d: h[W].pop("data_offsets")), W),
    ("metadata-a-list", entry(lambda h, d: h.__setitem__("__metadata__", [1])), "__metadata__"),
    ("metadata-value-a-number", entry(lambda h, d: h["__metadata__"].__setitem__("fp8ext", 5)), "fp8ext"),
    ("record-cut", _record(lambda r: r[:-7]), "fp8ext"),
    ("record-a-list", _record(lambda r: "[1]"), "fp8ext"),
    ("record-deeply-nested-list", _record(lambda r: "[" * 100000 + "]" * 100000), "fp8ext"),
    ("record-deeply-nested-object", _record(lambda r: '{"layers":' * 5000 + "1" + "}" * 5000), "fp8ext"),
    ("record-input-amax-NaN", _record(lambda r: r.replace('"input_amax": ', '"input_amax": NaN, "x": ', 1)),
     "input_amax"),
    ("record-input-amax-1e400", _record(lambda r: r.replace('"input_amax": ', '"input_amax": 1e400, "x": ', 1)),
     "input_amax"),
    ("record-layers-a-string", _record(lambda r: json.dumps({**json.loads(r), "layers": "all"})), "layers"),
    ("record-format-a-number", _record(lambda r: r.replace('"format": "E4M3"', '"format": 4', 1)), "format"),
]
SAFETENSORS_BUGS = {}


@pytest.mark.parametrize("mutate, key", [pytest.param(m, k, id=i, marks=SAFETENSORS_BUGS.get(i, ()))
                                         for i, m, k in SAFETENSORS])
def test_a_malformed_safetensors_file_is_refused_naming_it(copy_of, mutate, key):
    d = copy_of("llama")
    path = d / "model.safetensors"
    path.write_bytes(mutate(path.read_bytes()))
    refused(lambda: load(d), path, *([key] if key else []))


# ---- config.json -----------------------------------------------------------------------------------------------

def cfg_json(change):
    def mutate(text):
        c = json.loads(text)
        change(c)
        return json.dumps(c).encode()
    return mutate


def cfg_text(old, new):
    """A textual replacement in the config's compact JSON (for what json.dumps cannot write: NaN spelt so, 1e400)."""
    def mutate(text):
        text = json.dumps(json.loads(text))
        assert old in text, old
        return text.replace(old, new, 1).encode()
    return mutate


def model_cfg(key, value):
    return cfg_json(lambda c: c["fp8ext_model_config"].__setitem__(key, value))


def quant_cfg(change):
    return cfg_json(lambda c: change(c["quantization_config"]))


def group(change):
    return quant_cfg(lambda q: change(q["config_groups"]["group_0"]))


CONFIG = [  # (id, mutation of fp8ext's own checkpoint's config.json text, the key the message must name)
    ("empty", lambda t: b"", None),
    ("not-utf8", lambda t: b'{"a": "\xff\xfe"}', None),
    ("json-cut", lambda t: t[:-3].encode(), None),
    ("a-json-list", lambda t: b"[1, 2]", None),
    ("json-null", lambda t: b"null", None),
    ("deeply-nested-list", lambda t: b"[" * 100000 + b"]" * 100000, None),
    ("deeply-nested-object", lambda t: b'{"a":' * 100000 + b"1" + b"}" * 100000, None),
    ("deeply-nested-value", cfg_text('"fp8ext_model_config": {',
                                     '"fp8ext_model_config": {"deep": ' + "[" * 50000 + "]" * 50000 + ", "), None),
    ("norm_eps-1e400", cfg_text('"norm_eps": 1e-06', '"norm_eps": 1e400'), "norm_eps"),
    ("rope_theta-NaN", cfg_text('"rope_theta": 10000.0, "norm_eps"', '"rope_theta": NaN, "norm_eps"'), "rope_theta"),
    ("rope_theta-Infinity", cfg_text('"rope_theta": 10000.0, "norm_eps"', '"rope_theta": -Infinity, "norm_eps"'),
     "rope_theta"),
    ("d_model-a-string", model_cfg("d_model", "32"), "d_model"),
    ("n_layers-a-float", model_cfg("n_layers", 1.0), "n_layers"),
    ("n_layers-10**400", model_cfg("n_layers", 10**400), "n_layers"),
    ("n_layers-1e400", cfg_text('"n_layers": 1', '"n_layers": 1e400'), "n_layers"),
    ("n_layers-0", model_cfg("n_layers", 0), "n_layers"),
    ("max_seq_len-2**40", model_cfg("max_seq_len", 2**40), "max_seq_len"),
    ("vocab_size-2**40", model_cfg("vocab_size", 2**40), "vocab_size"),
    ("n_heads-null", model_cfg("n_heads", None), "n_heads"),
    ("fused_qkv-a-string", model_cfg("fused_qkv", "yes"), "fused_qkv"),
    ("unknown-key", model_cfg("n_layres", 1), "n_layres"),
    ("missing-d_model", cfg_json(lambda c: c["fp8ext_model_config"].pop("d_model")), "d_model"),
    ("model-config-a-list", cfg_json(lambda c: c.__setitem__("fp8ext_model_config", [1])), "fp8ext_model_config"),
    ("model-config-null", cfg_json(lambda c: c.__setitem__("fp8ext_model_config", None)), "fp8ext_model_config"),
    ("no-quantization_config", cfg_json(lambda c: c.pop("quantization_config")), "quantization_config"),
    ("quantization_config-a-list", cfg_json(lambda c: c.__setitem__("quantization_config", [1])),
     "quantization_config"),
    ("quantization_config-a-string", cfg_json(lambda c: c.__setitem__("quantization_config", "fp8")),
     "quantization_config"),
    ("quant_method-gptq", quant_cfg(lambda q: q.__setitem__("quant_method", "gptq")), "quant_method"),
    ("format-a-number", quant_cfg(lambda q: q.__setitem__("format", 8)), "format"),
    ("ignore-a-string", quant_cfg(lambda q: q.__setitem__("ignore", "lm_head")), "ignore"),
    ("ignore-holding-a-list", quant_cfg(lambda q: q.__setitem__("ignore", [["lm_head"]])), "ignore"),
    ("kv_cache_scheme-a-list", quant_cfg(lambda q: q.__setitem__("kv_cache_scheme", [1])), "kv_cache_scheme"),
    ("config_groups-missing", quant_cfg(lambda q: q.pop("config_groups")), "config_groups"),
    ("weights-num_bits-4", group(lambda g: g["weights"].__setitem__("num_bits", 4)), "num_bits"),
    ("weights-strategy-tensor-for-channel-scales", group(lambda g: g["weights"].__setitem__("strategy", "tensor")),
     "strategy"),
]
CONFIG_BUGS = {}


@pytest.mark.parametrize("mutate, key", [pytest.param(m, k, id=i, marks=CONFIG_BUGS.get(i, ()))
                                         for i, m, k in CONFIG])
def test_a_malformed_config_json_is_refused_naming_it(copy_of, mutate, key):
    d = copy_of("llama")
    path = d / "config.json"
    path.write_bytes(mutate(path.read_text()))
    refused(lambda: load(d), path, *([key] if key else []))


FOREIGN = [  # (id, mutation of another tool's checkpoint's config.json text: its quantization_config is the record,
    #            the key the message must name[, the file it must name when not config.json])
    ("config_groups-missing", quant_cfg(lambda q: q.pop("config_groups")), "config_groups"),
    ("config_groups-a-list", quant_cfg(lambda q: q.__setitem__("config_groups", [1])), "config_groups"),
    ("config_groups-empty", quant_cfg(lambda q: q.__setitem__("config_groups", {})), "config_groups"),
    ("group-a-string", quant_cfg(lambda q: q["config_groups"].__setitem__("group_0", "x")), "group_0"),
    ("targets-a-string", group(lambda g: g.__setitem__("targets", "Linear")), "targets"),
    ("targets-empty", group(lambda g: g.__setitem__("targets", [])), "targets"),
    ("weights-missing", group(lambda g: g.pop("weights")), "weights"),
    ("weights-a-list", group(lambda g: g.__setitem__("weights", [8])), "weights"),
    ("num_bits-a-string", group(lambda g: g["weights"].__setitem__("num_bits", "8")), "num_bits"),
    ("num_bits-4", group(lambda g: g["weights"].__setitem__("num_bits", 4)), "num_bits"),
    ("num_bits-1e400", cfg_text('"num_bits": 8', '"num_bits": 1e400'), "num_bits"),
    ("num_bits-NaN", cfg_text('"num_bits": 8', '"num_bits": NaN'), "num_bits"),
    ("type-int", group(lambda g: g["weights"].__setitem__("type", "int")), "type"),
    ("symmetric-false", group(lambda g: g["weights"].__setitem__("symmetric", False)), "symmetric"),
    ("strategy-row", group(lambda g: g["weights"].__setitem__("strategy", "row")), "strategy"),
    ("strategy-a-number", group(lambda g: g["weights"].__setitem__("strategy", 3)), "strategy"),
    ("strategy-tensor-for-channel-scales", group(lambda g: g["weights"].__setitem__("strategy", "tensor")),
     "down.weight_scale", "model.safetensors"),  # the config and the file disagree: naming either is clear
    ("block_structure-64", group(lambda g: g["weights"].update(strategy="block", block_structure=[64, 64])),
     "block_structure"),
    ("input-dynamic-a-string", group(lambda g: g["input_activations"].__setitem__("dynamic", "yes")), "dynamic"),
    ("input-strategy-channel", group(lambda g: g["input_activations"].__setitem__("strategy", "channel")),
     "input_activations"),
    ("input_activations-a-list", group(lambda g: g.__setitem__("input_activations", [1])), "input_activations"),
    ("output_activations-set", group(lambda g: g.__setitem__("output_activations", dict(g["weights"]))),
     "output_activations"),
    ("dtype-float8", cfg_json(lambda c: c.__setitem__("torch_dtype", "float8_e4m3fn")), "dtype"),
    ("kv_cache_scheme-dynamic", quant_cfg(lambda q: q.__setitem__(
        "kv_cache_scheme", {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True})), "kv_cache_scheme"),
    ("ignore-names-a-quantized-layer", quant_cfg(lambda q: q.__setitem__("ignore", ["up"])), "up.weight",
     "model.safetensors"),
]
FOREIGN_BUGS = {}


@pytest.mark.parametrize("mutate, key, named", [pytest.param(m, k, (*f, "config.json")[0], id=i,
                                                             marks=FOREIGN_BUGS.get(i, ())) for i, m, k, *f in FOREIGN])
def test_a_foreign_checkpoints_malformed_quantization_config_is_refused_naming_it(copy_of, mutate, key, named):
    d = copy_of("foreign")
    path = d / "config.json"
    path.write_bytes(mutate(path.read_text()))
    refused(lambda: load(d), d / named, key)


# ---- model.safetensors.index.json ------------------------------------------------------------------------------

def index(change):
    """A mutation of the sharded checkpoint: change(index_dict, directory) edits the index (and may add files)."""
    def mutate(d):
        p = d / "model.safetensors.index.json"
        ix = json.loads(p.read_text())
        change(ix, d)
        p.write_text(json.dumps(ix))
    return mutate


def _shard(ix):
    return sorted(set(ix["weight_map"].values()))[0]


def _moved(where):
    """weight_map's first shard renamed to `where(d, name)` (relative to the folder), the file itself copied there
    (a genuine shard: following the name would load it)."""
    def change(ix, d):
        old = _shard(ix)
        new = where(d, old)
        target = (d / new)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(d / old, target)
        ix["weight_map"] = {k: (new if v == old else v) for k, v in ix["weight_map"].items()}
    return change


def _raw(text):
    def mutate(d):
        (d / "model.safetensors.index.json").write_bytes(text)
    return mutate


INDEX = [  # (id, mutation of the sharded directory, the key or file name the message must name)
    ("parent-folder", index(_moved(lambda d, n: f"../{n}")), "../"),
    ("absolute-path", index(_moved(lambda d, n: str(d.parent / "elsewhere" / n))), "elsewhere"),
    ("sub-folder", index(_moved(lambda d, n: f"sub/{n}")), "sub/"),
    ("dot-dot", index(lambda ix, d: ix["weight_map"].__setitem__(next(iter(ix["weight_map"])), "..")), ".."),
    ("missing-shard", index(lambda ix, d: ix["weight_map"].__setitem__(next(iter(ix["weight_map"])),
                                                                         "model-99999-of-99999.safetensors")),
     "model-99999-of-99999.safetensors"),
    ("weight_map-a-list", index(lambda ix, d: ix.__setitem__("weight_map", [1])), "weight_map"),
    ("weight_map-a-string", index(lambda ix, d: ix.__setitem__("weight_map", "model.safetensors")), "weight_map"),
    ("weight_map-null", index(lambda ix, d: ix.__setitem__("weight_map", None)), "weight_map"),
    ("weight_map-missing", index(lambda ix, d: ix.pop("weight_map")), "weight_map"),
    ("weight_map-empty", index(lambda ix, d: ix.__setitem__("weight_map", {})), "weight_map"),
    ("file-name-a-number", index(lambda ix, d: ix["weight_map"].__setitem__(next(iter(ix["weight_map"])), 1)),
     "weight_map"),
    ("tensor-in-the-wrong-shard", index(lambda ix, d: ix["weight_map"].__setitem__(
        W, next(v for v in sorted(set(ix["weight_map"].values())) if v != ix["weight_map"][W]))), W),
    ("tensor-no-shard-holds", index(lambda ix, d: ix["weight_map"].__setitem__("model.extra.weight", _shard(ix))),
     "model.extra.weight"),
    ("tensor-left-out", index(lambda ix, d: ix["weight_map"].pop(W)), W),
    ("index-empty", _raw(b""), None),
    ("index-not-utf8", _raw(b'{"weight_map": {"\xff": 1}}'), None),
    ("index-a-list", _raw(b"[]"), None),
    ("index-deeply-nested", _raw(b'{"weight_map": ' + b"[" * 100000 + b"]" * 100000 + b"}"), None),
]
INDEX_BUGS = {}


@pytest.mark.parametrize("mutate, key", [pytest.param(m, k, id=i, marks=INDEX_BUGS.get(i, ()))
                                         for i, m, k in INDEX])
def test_a_malformed_shard_index_is_refused_naming_it(copy_of, mutate, key):
    d = copy_of("sharded")
    mutate(d)
    refused(lambda: load(d), d / "model.safetensors.index.json", *([key] if key else []))


def test_a_truncated_shard_is_refused_naming_the_shard(copy_of):
    d = copy_of("sharded")
    shard = d / _shard(json.loads((d / "model.safetensors.index.json").read_text()))
    shard.write_bytes(shard.read_bytes()[:-3])
    refused(lambda: load(d), shard)


# ---- training checkpoint.pt ------------------------------------------------------------------------------------

class Touch:
    """Unpickling it creates the marker file: what a crafted checkpoint could do instead (run any code)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


class Exec(Touch):
    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


class System(Touch):
    def __reduce__(self):
        import os
        return os.system, (f"touch '{self.marker}'",)


def _rest():
    return {"optimizer": {}, "step": 1, "args": {"preset": "tiny", "data": None, "lr": 1e-3},
            "rng": {"torch": torch.get_rng_state(), "cuda": None}}


def _saved(obj, zip_format=True):
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=zip_format)
    return buf.getvalue()


def code(kind, zip_format=True):
    return lambda good, marker: _saved({"model": kind(marker), **_rest()}, zip_format)


def raw_pickle(kind):
    return lambda good, marker: pickle.dumps({"model": kind(marker), **_rest()}, protocol=2)


def rezip(change):
    """The genuine zip with each member's bytes changed by change(name, data) (None leaves the member out)."""
    def mutate(good, marker):
        zin, buf = zipfile.ZipFile(io.BytesIO(good)), io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = change(info.filename, zin.read(info.filename))
                if data is not None:
                    zout.writestr(info, data)
        return buf.getvalue()
    return mutate


def _storage(name):
    return "/data/" in name and name.rsplit("/", 1)[-1].isdigit()


def _deep_pickle(good, marker):
    n = 20000  # lists nested 20000 deep, built by opcodes (the pickler itself would recurse)
    return rezip(lambda name, data: b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."
                 if name.endswith("data.pkl") else data)(good, marker)


CHECKPOINTS = [  # (id, make(genuine bytes, marker path) -> the file's bytes)
    ("empty", lambda good, marker: b""),
    *[(f"truncated-to-{n}", (lambda n: lambda good, marker: good[:n] if n >= 0 else good[:len(good) + n])(n))
      for n in (1, 10, 100, 1000, -1000, -100, -1)],
    ("truncated-to-half", lambda good, marker: good[:len(good) // 2]),
    ("garbage-bytes", lambda good, marker: bytes(range(256)) * 40),
    ("json", lambda good, marker: b'{"model": {}, "step": 1}'),
    ("zeros", lambda good, marker: bytes(len(good))),
    ("zip-code-pathlib-touch", code(Touch)),
    ("zip-code-exec", code(Exec)),
    ("zip-code-os-system", code(System)),
    ("legacy-format-code", code(Touch, zip_format=False)),
    ("plain-pickle-code", raw_pickle(Exec)),
    ("plain-pickle-protocol-0-code", lambda good, marker: pickle.dumps({"model": System(marker)}, protocol=0)),
    ("storage-shorter-than-its-tensor", rezip(lambda n, d: d[:4] if _storage(n) and len(d) > 8 else d)),
    ("storage-missing", rezip(lambda n, d: None if _storage(n) else d)),
    ("data.pkl-missing", rezip(lambda n, d: None if n.endswith("data.pkl") else d)),
    ("data.pkl-truncated", rezip(lambda n, d: d[:len(d) // 2] if n.endswith("data.pkl") else d)),
    ("data.pkl-garbage", rezip(lambda n, d: b"\x80\x02garbage" if n.endswith("data.pkl") else d)),
    ("data.pkl-deeply-nested", _deep_pickle),
    ("format-version-99", rezip(lambda n, d: b"99\n" if n.endswith("/version") else d)),
    ("a-list", lambda good, marker: _saved([1, 2])),
    ("a-tensor", lambda good, marker: _saved(torch.ones(2))),
    ("a-dict-without-the-keys", lambda good, marker: _saved({"model": {}})),
]
CHECKPOINT_BUGS = {}


@pytest.mark.parametrize("make", [pytest.param(m, id=i, marks=CHECKPOINT_BUGS.get(i, ())) for i, m in CHECKPOINTS])
def test_a_malformed_training_checkpoint_is_refused_naming_it_without_running_code(bases, tmp_path, make):
    marker = tmp_path / "code_ran"
    path = tmp_path / "run" / checkpoint.CHECKPOINT_NAME
    path.parent.mkdir()
    path.write_bytes(make((bases / "train" / checkpoint.CHECKPOINT_NAME).read_bytes(), marker))
    try:
        refused(lambda: checkpoint.read(str(tmp_path / "run")), path, exc=checkpoint.CheckpointError)
    finally:
        assert not marker.exists(), "reading the checkpoint ran code from it"


def test_a_missing_training_checkpoint_is_a_file_not_found_error_naming_it(tmp_path):
    refused(lambda: checkpoint.read(str(tmp_path)), tmp_path / checkpoint.CHECKPOINT_NAME, exc=FileNotFoundError)
