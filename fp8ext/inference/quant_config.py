"""What an FP8 checkpoint says about its quantization (fp8ext.inference.export's format): compressed-tensors'
quantization_config in config.json (what vLLM and transformers read), fp8ext's record of each layer, the model's
fp8_quantization (set by quantize_model, and again on loading), and config.json's other fields for a transformers
model."""

from __future__ import annotations

import pathlib
from typing import Any, Dict

import torch
from torch import nn

from ._header import WEIGHT_LAYOUT

__all__ = ["quantization_config", "quantization_of", "layer_record", "FUSED_IN_VLLM", "high_precision_dtype",
           "loaded_quantization", "fp8_quantization_config"]


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


def loaded_quantization(layers: Dict[str, dict], qc: Dict[str, Any], ignored, kv_amax) -> Dict[str, Any]:
    """model.fp8_quantization of a loaded model, as quantize_model sets it: the schemes (of the first layer), the
    layers' records, config.json's quantization_config `qc`, the names kept in high precision and the K/V amaxes."""
    first = next(iter(layers.values()))
    return {"weights": first["weights"], "activations": first["activations"], "ignore": [],
            "ignored_modules": ignored, "layers": sorted(layers),
            "input_amax": {n: s["input_amax"] for n, s in layers.items() if s["input_amax"]},
            "kv_cache_scheme": qc.get("kv_cache_scheme"), "kv_amax": kv_amax}


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
