"""FP8 checkpoints in the compressed-tensors layout that vLLM and transformers load: fp8ext writes them, and reads
its own and those other tools write (llmcompressor's FP8_DYNAMIC, FP8 and FP8_BLOCK schemes, ...).

    save_quantized(model, "out/")          # out/model.safetensors + out/config.json
    model = load_quantized("out/", factory)   # factory(config_dict) -> the high-precision model's skeleton
    model = load_quantized("llmcompressor-fp8/")  # the skeleton built from config.json (transformers' architecture)

A Hugging Face transformers model's directory is one that transformers' from_pretrained loads (its config at the
top level of config.json, as save_pretrained writes it; compressed-tensors installed): tests/test_inference_
transformers.py loads it there and compares the logits with fp8ext's.

model.safetensors holds every tensor of the state dict: for each FP8 layer `weight` (F8_E4M3), `weight_scale`
(F32: [1] per tensor, [out, 1] per channel, [ceil(out/128), ceil(in/128)] per block) and, for static
activations, `input_scale` ([1]); the other modules' tensors as they are. Scales dequantize (x = q * scale).
Its header's metadata keeps fp8ext's own record: the format, layout, schemes and the calibrated amax of each
layer (the seed of an amax history, were the model fine-tuned in FP8 again). config.json holds the model's
config and `quantization_config` (quant_method "compressed-tensors", format "float-quantized"). fp8ext's own
Transformer is written as a Llama checkpoint (Llama's tensor names, q/k/v and gate/up as separate layers, a
LlamaConfig plus `fp8ext_model_config`): see fp8ext.inference.llama.

FP8 KV cache: when quantize_model set calibrated K/V scales, each attention layer's `k_scale` and `v_scale`
(F32 [n_kv_heads], dequantizing: amax / 448 of that head's K after RoPE, and of its V) are in the file under
the attention module's name (`model.layers.N.self_attn.k_scale` in a Llama checkpoint, fp8ext's
Transformer's included), quantization_config's `kv_cache_scheme` is {num_bits 8, type float,
symmetric, dynamic false, strategy "attn_head"} (one scale per KV head: what vLLM reads for per-head scales;
vLLM backends that take one scale per layer use the largest), and the metadata keeps the K/V amaxes.

A checkpoint another tool wrote has no fp8ext record in its metadata: load_quantized takes each layer's scheme
from config.json's quantization_config (config_groups: weights per tensor, channel or 128 x 128 block; inputs static
per tensor or dynamic per token / 128-group; `ignore`) and the tensors (each F8_E4M3 `X.weight` with an
`X.weight_scale`), and reads scales as other tools write them: F32, BF16 or F16; [1] or [] per tensor, [out, 1] or
[out] per channel; k_scale / v_scale [n_kv_heads], [n_kv_heads, 1, 1], [1] or []. They are kept as float32 in
fp8ext's shapes (a per-tensor KV scale repeated over the heads). Schemes fp8ext cannot compute (integer, E5M2 or
group-wise weights, other block sizes, weight-only FP8, zero points) are refused naming the file and the key.

A save writes every file into a hidden folder in the output folder first and renames them into place once all
are complete, so that a save that fails never costs the previous checkpoint (`staged`, `write_json`).

Loading builds the model on the meta device (no memory), swaps in the FP8 layers, and takes the tensors from
the file straight to the target device (safetensors reads them into device memory without a CPU copy of the
whole model).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any, Callable, Dict, Iterator, Optional, Union

import torch
from torch import nn

from .. import __version__
from ..train.checkpoint import fsync
from . import llama
from ._checks import (FOREIGN, KV_SCALES, LAYER_SCALES, OUT_DTYPES, WEIGHT_LAYOUT, check_against_model,
                      check_checkpoint, kv_heads, read_header, read_json, read_sharded_header, tied_parameters)
from .layers import FP8InferenceLinear, fuse_norms
from .quantize import _set_submodule

__all__ = ["save_quantized", "load_quantized", "quantization_config"]

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> file, as save_pretrained's
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportError("fp8ext.inference: save_quantized/load_quantized need safetensors: "
                          "pip install safetensors (or fp8ext[inference])") from None
    return st


def quantization_config(q: Dict[str, Any]) -> Dict[str, Any]:
    """compressed-tensors' quantization_config for fp8ext's schemes (q: model.fp8_quantization)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
               "block_structure": None, "observer": "minmax", "actorder": None,
               "strategy": {"tensor": "tensor", "channel": "channel", "block128": "block"}[q["weights"]]}
    if q["weights"] == "block128":
        weights["block_structure"] = [128, 128]
    if q["activations"] == "static":
        acts = {"strategy": "tensor", "dynamic": False, "group_size": None}
    elif q["weights"] == "block128":
        acts = {"strategy": "group", "dynamic": True, "group_size": 128}
    else:
        acts = {"strategy": "token", "dynamic": True, "group_size": None}
    acts.update(num_bits=8, type="float", symmetric=True, block_structure=None, observer=None if acts["dynamic"]
                else "minmax", actorder=None)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": q["ignored_modules"], "kv_cache_scheme": q.get("kv_cache_scheme")}


def save_quantized(model: nn.Module, out_dir: Union[str, pathlib.Path], config: Optional[Dict[str, Any]] = None, *,
                   max_shard_size: Union[int, str] = "5GB") -> pathlib.Path:
    """Writes out_dir/model.safetensors and out_dir/config.json for a model quantized by quantize_model.
    A Hugging Face transformers model's config goes to config.json's top level as save_pretrained writes it
    (model_type, architectures, the high-precision tensors' dtype), so that transformers' from_pretrained loads
    the directory. For other models `config` (the model's own config, e.g. dataclasses.asdict(model.cfg); by
    default model.cfg's fields when the model has a dataclass `cfg`) goes under config.json's `model_config`.
    Tensors beyond `max_shard_size` (bytes, or a string such as "5GB" or "500MiB") are split over files
    model-00001-of-0000N.safetensors with model.safetensors.index.json, as save_pretrained does.
    fp8ext's own Transformer is written as a Llama checkpoint (fp8ext.inference.llama), which transformers and vLLM
    load as LlamaForCausalLM.

    The files are written into a hidden folder in out_dir and moved over the previous checkpoint's only once all
    are complete (`staged`): a save that fails (a full disk, Ctrl-C) leaves out_dir as it was; files in out_dir
    that are not a checkpoint's (weights, shards, index, config.json) are left alone."""
    if llama.is_fp8ext_transformer(model):
        return llama.save(model, out_dir, config, max_shard_size=max_shard_size)
    q = quantization_of(model)
    _warn_partly_quantized_fusions(q)
    _safetensors()  # a clear ImportError before anything is gathered
    if config is None and hasattr(model, "cfg"):
        import dataclasses
        config = dataclasses.asdict(model.cfg) if dataclasses.is_dataclass(model.cfg) else None
    tensors, tied, seen = {}, {}, {}
    for k, v in model.state_dict(keep_vars=True).items():
        if not isinstance(v, torch.Tensor):
            continue
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype)
        if key in seen:  # a tied weight (e.g. the output head sharing the embedding): stored once
            tied[k] = seen[key]
            continue
        seen[key] = k
        tensors[k] = v.detach().contiguous().cpu()
    layers = {n: layer_record(model, q, n) for n in q["layers"]}
    hf_config = getattr(model, "config", None)
    if config is None and callable(getattr(hf_config, "to_diff_dict", None)):
        cfg = _transformers_config(model, hf_config, tensors)
    else:
        cfg = {"architectures": [type(model).__name__], "model_config": config or {}, "torch_dtype": "bfloat16"}
    cfg["quantization_config"] = quantization_config(q)
    with staged(out_dir) as tmp:
        write_tensors(tensors, tmp, {"layers": layers, "tied": tied, "kv_cache": q.get("kv_amax") or {}},
                      max_shard_size)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    return pathlib.Path(out_dir)


def quantization_of(model: nn.Module) -> Dict[str, Any]:
    """model.fp8_quantization (set by quantize_model), or the ValueError that says the model is not quantized."""
    q = getattr(model, "fp8_quantization", None)
    if q is None:
        raise ValueError("save_quantized: the model is not quantized: run fp8ext.inference.quantize_model first")
    return q


def layer_record(model: nn.Module, q: Dict[str, Any], name: str) -> Dict[str, Any]:
    """fp8ext's metadata record of the quantized layer `name` (q: model.fp8_quantization)."""
    return {"format": "E4M3", "layout": WEIGHT_LAYOUT, "weights": q["weights"], "activations": q["activations"],
            "input_amax": q["input_amax"].get(name),
            "out_dtype": str(model.get_submodule(name).out_dtype).replace("torch.", "")}


# layers vLLM loads fused into one (its Llama-family loaders' stacked_params_mapping): quantized all alike or not at all
FUSED_IN_VLLM = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _warn_partly_quantized_fusions(q: Dict[str, Any]) -> None:
    """A warning when an `ignore` list kept some parts of a layer vLLM fuses (q/k/v_proj, gate/up_proj) in high
    precision and quantized the others: transformers loads such a checkpoint, vLLM refuses it."""
    import warnings
    quantized, kept = set(q["layers"]), set(q.get("ignored_modules") or [])
    for parts in FUSED_IN_VLLM:
        parents = sorted({n.rpartition(".")[0] for n in quantized if n.rpartition(".")[2] in parts})
        for parent in parents:
            siblings = [f"{parent}.{p}" if parent else p for p in parts]
            if any(s in kept for s in siblings):
                warnings.warn(f"save_quantized: {', '.join(s for s in siblings if s in quantized)} quantized but "
                              f"{', '.join(s for s in siblings if s in kept)} kept in high precision: vLLM loads "
                              "these layers as one and refuses the checkpoint (transformers loads it); ignore all "
                              "of them or none", stacklevel=3)


def _bytes(size: Union[int, str]) -> int:
    """max_shard_size in bytes: an int, or a number with a unit (KB, MB, GB; KiB, MiB, GiB)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    if isinstance(size, str):
        text = size.strip().upper().replace(" ", "")
        for unit in sorted(_UNITS, key=len, reverse=True):
            number = text[:-len(unit)]
            if text.endswith(unit) and number.replace(".", "", 1).isdigit() and float(number) > 0:
                return int(float(number) * _UNITS[unit])
    raise ValueError(f"save_quantized(): max_shard_size must be a positive number of bytes or a size such as '5GB', "
                     f"got {size!r}")


def write_tensors(tensors: Dict[str, torch.Tensor], out_dir: Union[str, pathlib.Path], record: Dict[str, Any],
                  max_shard_size: Union[int, str]) -> pathlib.Path:
    """out_dir (made if missing; the folder `staged` gives, when saving) with model.safetensors, or shards of at
    most max_shard_size bytes (a larger tensor alone in its shard) and the index; fp8ext's `record` in the
    header's metadata. Returns out_dir as a Path."""
    st = _safetensors()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt", "producer": f"fp8ext {__version__}", "fp8ext": json.dumps(record)}
    limit = _bytes(max_shard_size)
    shards, size = [[]], 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nbytes
    if len(shards) == 1:
        st.save_file(tensors, str(out / WEIGHTS_FILE), metadata=meta)
        return out
    weight_map = {}
    for i, names in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        st.save_file({k: tensors[k] for k in names}, str(out / name), metadata=meta)
        weight_map.update(dict.fromkeys(names, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out


def _checkpoint_files(d: pathlib.Path) -> list:
    """The files of a checkpoint in `d` that a save replaces or removes: weights, shards, index, config.json."""
    return [d / WEIGHTS_FILE, d / INDEX_FILE, d / "config.json", *sorted(d.glob("model-*-of-*.safetensors"))]


@contextlib.contextmanager
def staged(out_dir: Union[str, pathlib.Path]) -> Iterator[pathlib.Path]:
    """A new, empty hidden folder in out_dir (made if missing), on out_dir's file system, to write a checkpoint's
    files into. When the block ends, the files are flushed to the disk and moved into out_dir, each by one rename
    (os.replace) over the file of that name, config.json last; then the checkpoint files of an earlier save that
    the new one does not have (other shards, an index or model.safetensors) are removed. out_dir's other files are
    left alone. If the block raises (a full disk, a quota, Ctrl-C), the folder is removed (and out_dir too, if
    this made it); if a rename fails, the files already moved are put back (the previous ones were kept as hard
    links until then): a failed save never costs the previous checkpoint."""
    out = pathlib.Path(out_dir)
    for existing in (out, *out.parents):  # the nearest part of out_dir that exists must be a folder
        if existing.exists():
            if not existing.is_dir():
                raise NotADirectoryError(f"save_quantized: {existing} exists and is not a folder"
                                         + ("" if existing == out else f" (so {out} cannot be one)"))
            break
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".fp8ext-partial-", dir=out))
    done = False
    try:
        yield tmp
        new = sorted(tmp.iterdir(), key=lambda f: (f.name == "config.json", f.name))  # config.json last
        for f in new:
            fsync(f)
        _swap_in(new, out, tmp)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if made and not done:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if empty


def _swap_in(new: list, out: pathlib.Path, tmp: pathlib.Path) -> None:
    """staged's last step: the files `new` (in tmp) renamed into out, the previous checkpoint's other files removed;
    on any failure the previous files are put back from links to them kept in tmp/.previous."""
    previous = tmp / ".previous"
    previous.mkdir()
    old = [f for f in _checkpoint_files(out) if f.exists()]
    for f in old:  # a second name for each previous file (no copy), to put back
        try:
            os.link(f, previous / f.name)
        except OSError:  # a file system without hard links
            shutil.copy2(f, previous / f.name)
    stale = [f for f in old if not (tmp / f.name).exists()]
    moved = []
    try:
        for f in new:
            os.replace(f, out / f.name)
            moved.append(f.name)
        for f in stale:
            f.unlink(missing_ok=True)
        fsync(out)
    except BaseException:
        for name in [*moved, *(f.name for f in stale)]:  # best effort: the error that stopped the save is raised
            with contextlib.suppress(OSError):
                if (previous / name).exists():
                    os.replace(previous / name, out / name)
                else:
                    (out / name).unlink(missing_ok=True)
        raise


def write_json(path: Union[str, pathlib.Path], value: Any) -> None:
    """path as indented JSON, written beside it first and renamed over it (os.replace) once complete and flushed
    to the disk: a failed write leaves the file as it was."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, "x") as f:
            f.write(json.dumps(value, indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _transformers_config(model: nn.Module, hf_config, tensors: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """config.json of a Hugging Face transformers model, as its save_pretrained writes it (model_type, its fields
    at the top level), with the architecture and the dtype of the tensors kept in high precision: what
    from_pretrained needs to rebuild the model around the quantized layers."""
    cfg = {k: v for k, v in hf_config.to_diff_dict().items() if k != "quantization_config"}
    dtype = high_precision_dtype(tensors)
    cfg.update(architectures=[type(model).__name__], dtype=dtype, torch_dtype=dtype)
    return cfg


def high_precision_dtype(tensors: Dict[str, torch.Tensor]) -> str:
    """config.json's dtype: that of most elements of the tensors kept in high precision ("bfloat16" if none)."""
    counts: Dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.is_floating_point() and t.element_size() > 1:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return str(max(counts, key=counts.get) if counts else torch.bfloat16).replace("torch.", "")


def load_quantized(model_dir: Union[str, pathlib.Path],
                   model_or_factory: Union[nn.Module, Callable[[dict], nn.Module], None] = None,
                   device: Union[str, torch.device, None] = None) -> nn.Module:
    """An FP8 compressed-tensors checkpoint (model.safetensors, or shards with model.safetensors.index.json, and
    config.json): one saved by save_quantized, or one another tool wrote (llmcompressor's FP8_DYNAMIC, FP8,
    FP8_BLOCK schemes, ...), whose quantized layers and schemes are then taken from config.json's
    quantization_config and the tensors in the file (see fp8ext.inference._checks.record_from_config).

    `model_or_factory` is the high-precision model's skeleton, or a callable config_dict -> skeleton (called
    under the meta device, so its weights take no memory). None (the default) builds it from config.json:
    fp8ext's Transformer for its own `model_config` layout (architectures ["Transformer"]), else the
    transformers architecture config.json names (fp8ext.inference.hf.from_config; needs transformers). The
    skeleton's linear layers named in the file become FP8InferenceLinear; every tensor is read from the file onto
    `device` (default: cuda when available). Scales are read as float32 in the shapes FP8InferenceLinear keeps
    ([1], [out, 1], blocks; KV-cache scales [n_kv_heads]) whatever shape and dtype the file gives them; buffers
    that no file holds (rotary tables, transformers' inv_freq) are computed again on `device`.

    The checkpoint is checked before anything is built from it (fp8ext.inference._checks): config.json's fields
    (fp8ext's transformer's config against the blocks in the file), the record of each quantized layer, every
    tensor's dtype and shape against its layer's scheme and the model, every scale finite and positive. A file
    that fails raises ValueError (TypeError for a value of the wrong type) naming the file and the key.

    A directory holding fp8ext's Transformer as a Llama checkpoint (config.json's fp8ext_model_config) loads
    back into fp8ext's Transformer (fp8ext.inference.llama); there `model_or_factory` may be None."""
    _safetensors()  # a clear ImportError before anything is read
    d = pathlib.Path(model_dir)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"load_quantized: {d / 'config.json'} is missing")
    if not (d / WEIGHTS_FILE).is_file() and not (d / INDEX_FILE).is_file():
        raise FileNotFoundError(f"load_quantized: {d} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    cfg = read_json(d / "config.json")
    if llama.is_fp8ext_llama(cfg):  # fp8ext's Transformer written as a Llama checkpoint
        return llama.load(d, cfg, model_or_factory, device)
    qc = fp8_quantization_config(cfg, d)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    header = checkpoint_header(d)
    record = check_checkpoint(d / "config.json", cfg, header)
    model = _fp8_skeleton(model_or_factory, cfg, d, header, record)
    check_against_model(header, model, record)
    _assign_state(model, header, record, device)
    _place_buffers(model, header, device)
    fuse_norms(model)
    model.fp8_quantization = loaded_quantization(record["layers"], qc, qc.get("ignore", []),
                                                 record.get("kv_cache", {}))
    return model.eval()


def loaded_quantization(layers: Dict[str, dict], qc: Dict[str, Any], ignored, kv_amax) -> Dict[str, Any]:
    """model.fp8_quantization of a loaded model, as quantize_model sets it: the schemes (of the first layer), the
    layers' records, config.json's quantization_config `qc`, the names kept in high precision and the K/V amaxes."""
    first = next(iter(layers.values()))
    return {"weights": first["weights"], "activations": first["activations"], "ignore": [],
            "ignored_modules": ignored, "layers": sorted(layers),
            "input_amax": {n: s["input_amax"] for n, s in layers.items() if s["input_amax"]},
            "kv_cache_scheme": qc.get("kv_cache_scheme"), "kv_amax": kv_amax}


def load_state(model: nn.Module, state: Dict[str, torch.Tensor], path: pathlib.Path) -> None:
    """state into `model` (assigned: the meta tensors are replaced); ValueError when the file at `path` lacks a
    tensor the model needs."""
    missing = [k for k in model.load_state_dict(state, strict=False, assign=True).missing_keys
               if not k.endswith("_extra_state")]  # high-precision fp8ext.Linear layers' FP8 state is not saved
    if missing:
        raise ValueError(f"load_quantized: {path} holds no {missing[:5]} for this model")


def fp8_quantization_config(cfg: dict, d: pathlib.Path) -> dict:
    """config.json's quantization_config, which must be an FP8 compressed-tensors one: a ValueError (TypeError for
    a value of the wrong type) naming d/config.json and the key otherwise."""
    path = d / "config.json"
    if "quantization_config" not in cfg:
        raise ValueError(f"load_quantized: {path}: has no quantization_config; fp8ext reads FP8 compressed-tensors "
                         "checkpoints (quant_method 'compressed-tensors', format 'float-quantized')")
    qc = cfg["quantization_config"]
    if not isinstance(qc, dict):
        raise TypeError(f"load_quantized: {path}: quantization_config must be a JSON object, got "
                        f"{type(qc).__name__} {qc!r:.60}")
    for key, want in (("quant_method", "compressed-tensors"), ("format", "float-quantized")):
        v = qc.get(key)
        if v != want:
            raise (TypeError if v is not None and not isinstance(v, str) else ValueError)(
                f"load_quantized: {path}: quantization_config.{key} is {v!r:.60}; fp8ext reads FP8 "
                f"compressed-tensors checkpoints ({key} {want!r})")
    return qc


def checkpoint_header(d: pathlib.Path):
    """The safetensors header of a checkpoint directory: model.safetensors's, or its shards' through the index."""
    return read_header(d / WEIGHTS_FILE) if (d / WEIGHTS_FILE).is_file() else read_sharded_header(d / INDEX_FILE)


def _fp8_skeleton(model_or_factory, cfg: dict, d: pathlib.Path, header, record: dict) -> nn.Module:
    """load_quantized's model before any tensor is read: the skeleton (given, from the factory under the meta
    device, or from config.json) with FP8InferenceLinear (on meta) for every quantized layer of the record and
    the places for KV-cache scales; record["tied"] filled for another tool's file."""
    if model_or_factory is None:
        model_or_factory = _default_factory(cfg, d)
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
    else:
        with torch.device("meta"):
            model = model_or_factory(_model_config(cfg))
    from .hf import add_kv_scale_buffers
    add_kv_scale_buffers(model)  # a transformers model's places for KV-cache scales (nothing for other models)
    if record.get("source") == FOREIGN:  # another tool's file: the model's shared parameters say what is tied
        record["tied"] = tied_parameters(header, model)
    for name, spec in record["layers"].items():
        lin = _linear_of(model, name, header.path)
        _set_submodule(model, name, FP8InferenceLinear(
            lin.in_features, lin.out_features, bias=lin.bias is not None, weights=spec["weights"],
            activations=spec["activations"], device="meta", out_dtype=OUT_DTYPES[spec.get("out_dtype", "bfloat16")]))
    return model


def _assign_state(model: nn.Module, header, record: dict, device: torch.device) -> None:
    """The checked file's tensors into `model` on `device` (scales in FP8InferenceLinear's shapes, KV-cache scales
    into unset buffers, tied parameters tied again); ValueError when the file lacks a tensor the model needs."""
    layers, tied = record["layers"], record.get("tied", {})
    state = aligned(read_tensors(header, device))
    _conform_scales(model, layers, state)
    for alias, target in tied.items():
        state[alias] = state[target]
    for key in [k for k in state if k.endswith((".k_scale", ".v_scale"))]:  # FP8 KV-cache scales (checked above)
        mod_name, _, leaf = key.rpartition(".")
        mod = model.get_submodule(mod_name)
        if getattr(mod, leaf) is None:  # an unset buffer (the model as built): give it the file's tensor
            setattr(mod, leaf, state[key])
    load_state(model, state, header.path)
    for alias, target in tied.items():  # re-tie: one Parameter, as in the saved model
        mod_a, _, name_a = alias.rpartition(".")
        mod_t, _, name_t = target.rpartition(".")
        setattr(model.get_submodule(mod_a), name_a, getattr(model.get_submodule(mod_t), name_t))


def _place_buffers(model: nn.Module, header, device: torch.device) -> None:
    """Buffers no file holds (non-persistent ones, e.g. rotary tables) computed again on `device`, or moved there."""
    for n in [n for n, _ in model.named_buffers()]:
        t = model.get_buffer(n)  # looked up again: _rebuild_buffer may have replaced its module
        if t.is_meta or t.device != device:
            if not _rebuild_buffer(model, n, device):
                if t.is_meta:
                    raise ValueError(f"load_quantized: {n} is not in {header.path} and cannot be recomputed")
                mod, _, leaf = n.rpartition(".")
                setattr(model.get_submodule(mod) if mod else model, leaf, t.to(device))


def read_tensors(header, device) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint `header` describes (its file or its shards), read onto `device`."""
    st = _safetensors()
    state: Dict[str, torch.Tensor] = {}
    for path in sorted(set(header.files.values())):
        state.update(st.load_file(str(path), device=str(device)))
    return state


def aligned(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The tensors contiguous and 16-byte aligned, as cuBLASLt wants its operands (safetensors aligns tensors in a
    file to 8 bytes only); copies only those that are not."""
    return {k: v if v.data_ptr() % 16 == 0 and v.is_contiguous() else v.contiguous().clone()
            for k, v in state.items()}


def _default_factory(cfg: Dict[str, Any], d: pathlib.Path) -> Callable[[dict], nn.Module]:
    """The skeleton's factory when load_quantized is given none: fp8ext's Transformer for its own config layout,
    else the transformers architecture of config.json."""
    if cfg.get("architectures") == ["Transformer"] and "model_config" in cfg:
        from ..models.transformer import Transformer, TransformerConfig
        return lambda model_config: Transformer(TransformerConfig(**model_config))
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError(f"load_quantized: {d / 'config.json'} describes a transformers model "
                          f"(architectures {cfg.get('architectures')!r}); building it needs transformers: pip install "
                          "transformers, or pass the model or a factory") from None
    from .hf import from_config
    return from_config


def _conform_scales(model: nn.Module, layers: Dict[str, Any], state: Dict[str, torch.Tensor]) -> None:
    """The file's scales in float32 and in the shapes the model keeps (checked to fit by check_against_model):
    weight_scale / input_scale reshaped to the FP8 layer's buffers ([] -> [1], [out] -> [out, 1]); KV-cache
    scales one per KV head (a single per-tensor scale repeated over the heads): [n_kv_heads, 1, 1] on a
    transformers model's attention, [n_kv_heads] on fp8ext's."""
    for name in layers:
        mod = model.get_submodule(name)
        for leaf in LAYER_SCALES:
            key = f"{name}.{leaf}"
            if key in state and getattr(mod, leaf, None) is not None:
                state[key] = state[key].to(torch.float32).reshape(getattr(mod, leaf).shape)
    from .hf import attention_modules
    hf_attention = attention_modules(model)
    for key in [k for k in state if k.rpartition(".")[2] in KV_SCALES]:
        s = state[key].to(torch.float32).reshape(-1)
        mod_name = key.rpartition(".")[0]
        heads = kv_heads(model, model.get_submodule(mod_name))
        s = s.expand(heads).contiguous() if s.numel() == 1 and heads else s
        # transformers attention keeps [n_kv_heads, 1, 1] (compressed-tensors' shape), fp8ext's [n_kv_heads]
        state[key] = s.reshape(-1, 1, 1) if mod_name in hf_attention else s


def _model_config(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """What a factory gets: the model's own config, under `model_config` (fp8ext's layout) or at the top level
    (a Hugging Face transformers model's), without quantization_config."""
    if "model_config" in cfg:
        return cfg["model_config"]
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


def _linear_of(model: nn.Module, name: str, path: pathlib.Path) -> nn.Module:
    """The skeleton's linear layer `name`, which the file's layer of that name replaces."""
    try:
        lin = model.get_submodule(name)
    except AttributeError:
        lin = None
    if not hasattr(lin, "in_features") or not hasattr(lin, "out_features"):
        raise ValueError(f"load_quantized: {path}: the quantized layer {name!r} is not a linear layer of this "
                         f"model ({type(model).__name__})")
    return lin


def _rebuild_buffer(model: nn.Module, name: str, device) -> bool:
    """Non-persistent buffers the model can recompute: fp8ext's transformer's rotary tables, and the buffers of a
    transformers module that holds nothing a checkpoint stores (a rotary embedding's inv_freq): the module is
    built again from its config on `device`, as the model built it."""
    if name in ("rope_cos", "rope_sin") and hasattr(model, "cfg"):
        from ..models.transformer import rope_tables
        cos, sin = rope_tables(model.cfg, device)
        model.rope_cos, model.rope_sin = cos, sin
        return True
    parent, _, leaf = name.rpartition(".")
    mod = model.get_submodule(parent) if parent else model
    config = getattr(mod, "config", None)
    if mod is model or config is None or mod.state_dict() or any(True for _ in mod.parameters()):
        return False
    try:
        with torch.device(device):
            fresh = type(mod)(config)
    except TypeError:
        return False
    if not isinstance(getattr(fresh, leaf, None), torch.Tensor) or fresh.get_buffer(leaf).is_meta:
        return False
    owner, _, child = parent.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, child, fresh.train(mod.training))
    return True
