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

import json
import pathlib
from typing import Any, Callable, Dict, Optional, Union

import torch
from torch import nn

from . import llama
from ._checks import check_against_model, check_checkpoint, kv_heads, tied_parameters
from ._header import FOREIGN, KV_SCALES, LAYER_SCALES, OUT_DTYPES, read_json
# the files on disk (files.py) and the quantization records (quant_config.py): their names stay importable here
from .files import (INDEX_FILE, WEIGHTS_FILE, _safetensors, aligned, checkpoint_header, load_state,  # noqa: F401
                    read_tensors, staged, write_json, write_tensors)
from .layers import FP8InferenceLinear, fuse_norms
from .quant_config import (FUSED_IN_VLLM, _transformers_config, _warn_partly_quantized_fusions,  # noqa: F401
                           fp8_quantization_config, high_precision_dtype, layer_record, loaded_quantization,
                           quantization_config, quantization_of)
from .quantize import _set_submodule

__all__ = ["save_quantized", "load_quantized", "quantization_config"]


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


def load_quantized(model_dir: Union[str, pathlib.Path],
                   model_or_factory: Union[nn.Module, Callable[[dict], nn.Module], None] = None,
                   device: Union[str, torch.device, None] = None) -> nn.Module:
    """An FP8 compressed-tensors checkpoint (model.safetensors, or shards with model.safetensors.index.json, and
    config.json): one saved by save_quantized, or one another tool wrote (llmcompressor's FP8_DYNAMIC, FP8,
    FP8_BLOCK schemes, ...), whose quantized layers and schemes are then taken from config.json's
    quantization_config and the tensors in the file (see fp8ext.inference._config_checks.record_from_config).

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
