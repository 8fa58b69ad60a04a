"""What vLLM's loader requires of an FP8 compressed-tensors checkpoint of a Llama-architecture model, written as
checks on the directory. vLLM cannot be installed on a machine without a GPU, so these requirements were read
from its source (vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:
_is_fp8_w8a8, _get_scheme_from_parts, the kv-cache method; schemes/compressed_tensors_w8a8_fp8.py;
vllm/model_executor/models/llama.py: load_weights and its stacked_params_mapping):

- config.json: `architectures` names a class vLLM's registry has (LlamaForCausalLM, MistralForCausalLM,
  Qwen2ForCausalLM here); quantization_config has quant_method "compressed-tensors" and an activation-quantization
  format ("float-quantized").
- FP8 W8A8 (_is_fp8_w8a8): weights 8-bit float, symmetric, static, strategy tensor, channel or block; input
  activations dynamic (any strategy) or static symmetric per tensor. Block weights ([128, 128]) need dynamic
  activations.
- Tensors by Llama's parameter names; q/k/v_proj and gate/up_proj are loaded into one fused layer each
  (stacked_params_mapping): all parts of a fused layer must share one scheme, so an `ignore` list holds all of
  them or none (vLLM raises otherwise). Per-tensor scales of the parts may differ (vLLM requantizes to the
  largest); per-channel scales are concatenated; block scales stack by block rows, so each part's rows must be a
  multiple of the block.
- weight F8_E4M3; weight_scale float32, [1] or [] per tensor, [out, 1] per channel, [ceil(out/128),
  ceil(in/128)] per block; input_scale one element, for static activations only.
- lm_head is a ParallelLMHead, not a linear layer: it is never quantized and must stay in high precision.
- kv_cache_scheme: 8-bit float, symmetric, strategy "tensor" or "attn_head"; each attention layer's
  `self_attn.k_scale` / `v_scale` (remapped to `self_attn.attn.k_scale`) with one element or one per KV head
  ([n_kv], or [n_kv, 1, 1] flattened).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from typing import Dict, List, Tuple

ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_LAYER = r"model\.layers\.\d+"
NAMES = [re.compile(p) for p in (
    r"model\.embed_tokens\.weight", r"model\.norm\.weight", r"lm_head\.weight",
    _LAYER + r"\.(input|post_attention)_layernorm\.weight",
    _LAYER + r"\.self_attn\.(q|k|v|o)_proj\.(weight|weight_scale|input_scale|bias)",
    _LAYER + r"\.mlp\.(gate|up|down)_proj\.(weight|weight_scale|input_scale)",
    _LAYER + r"\.self_attn\.(k|v)_scale")]


def headers(d: pathlib.Path) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Every tensor's (safetensors dtype, shape) in the directory, sharded or not."""
    from safetensors import safe_open
    files = [d / "model.safetensors"]
    if (d / "model.safetensors.index.json").is_file():
        files = [d / f for f in sorted(set(json.loads((d / "model.safetensors.index.json").read_text())
                                               ["weight_map"].values()))]
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def problems(d) -> List[str]:
    """Every way the directory departs from what vLLM's Llama loader reads; [] when it meets all of it."""
    d = pathlib.Path(d)
    cfg = json.loads((d / "config.json").read_text())
    bad = []
    if not set(cfg.get("architectures") or []) & ARCHITECTURES:
        bad.append(f"architectures {cfg.get('architectures')} is not one of {sorted(ARCHITECTURES)}")
    qc = cfg.get("quantization_config") or {}
    if qc.get("quant_method") != "compressed-tensors" or qc.get("format") != "float-quantized":
        bad.append(f"quantization_config: quant_method {qc.get('quant_method')!r} format {qc.get('format')!r}")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
        bad.append(f"expected one config group targeting Linear, got {groups}")
        return bad
    w, a = groups[0]["weights"], groups[0].get("input_activations")
    if not (w["num_bits"] == 8 and w["type"] == "float" and w["symmetric"] and not w["dynamic"]
            and w["strategy"] in ("tensor", "channel", "block")):
        bad.append(f"weights scheme not FP8 W8A8 for vLLM: {w}")
    if a is None or a["num_bits"] != 8 or a["type"] != "float" or not (
            a["dynamic"] or (a["strategy"] == "tensor" and a["symmetric"])):
        bad.append(f"input activations not FP8 dynamic or static per-tensor symmetric: {a}")
    if w["strategy"] == "block" and (w.get("block_structure") != [128, 128] or not a["dynamic"]):
        bad.append(f"block weights need block_structure [128, 128] and dynamic activations: {w}, {a}")
    tensors = headers(d)
    for name in tensors:
        if not any(p.fullmatch(name) for p in NAMES):
            bad.append(f"{name}: not a parameter of vLLM's Llama")
    if tensors.get("lm_head.weight", ("BF16",))[0].startswith("F8"):
        bad.append("lm_head.weight is FP8: vLLM's lm_head is never quantized")
    ignore = set(qc.get("ignore") or [])
    layers = sorted({k[:-len(".weight")] for k, (dt, _) in tensors.items() if dt == "F8_E4M3"})
    for name in layers:
        dt, shape = tensors[name + ".weight"]
        if name in ignore:
            bad.append(f"{name} is quantized but listed in ignore")
        scale = tensors.get(name + ".weight_scale")
        if scale is None or scale[0] != "F32":
            bad.append(f"{name}.weight_scale: {scale} (needs F32)")
            continue
        want = {"tensor": [(1,), ()], "channel": [(shape[0], 1)],
                "block": [(math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))]}[w["strategy"]]
        if scale[1] not in want:
            bad.append(f"{name}.weight_scale shape {scale[1]}, vLLM reads {want}")
        inp = tensors.get(name + ".input_scale")
        if (inp is not None) != (not a["dynamic"]) or (inp is not None and math.prod(inp[1]) != 1):
            bad.append(f"{name}.input_scale {inp} with {'dynamic' if a['dynamic'] else 'static'} activations")
    by_block: Dict[str, set] = {}
    for k in tensors:
        m = re.fullmatch(r"(" + _LAYER + r"\.(?:self_attn|mlp))\.(\w+_proj)\.weight", k)
        if m:
            by_block.setdefault(m.group(1), set()).add(m.group(2))
    for block, projs in by_block.items():
        for fused, parts in FUSED.items():
            names = [f"{block}.{p}" for p in parts if p in projs]
            if not names:
                continue
            if len(names) != len(parts):
                bad.append(f"{block}: {fused} needs all of {parts}, found {sorted(projs)}")
            states = {n in ignore or tensors[n + ".weight"][0] != "F8_E4M3" for n in names}
            if len(states) > 1:
                bad.append(f"{block}: the parts of {fused} must be quantized alike (vLLM fuses them): {names}")
            if w["strategy"] == "block" and any(tensors[n + ".weight"][1][0] % 128 for n in names):
                bad.append(f"{block}: block scales of {fused} stack only when each part's rows are a multiple of 128")
    kv = qc.get("kv_cache_scheme")
    kv_keys = [k for k in tensors if re.fullmatch(_LAYER + r"\.self_attn\.(k|v)_scale", k)]
    if kv is not None:
        if not (kv.get("num_bits") == 8 and kv.get("type") == "float" and kv.get("symmetric")
                and kv.get("strategy") in ("tensor", "attn_head")):
            bad.append(f"kv_cache_scheme not FP8 per tensor / per head: {kv}")
        n_kv = cfg.get("num_key_value_heads") or cfg.get("num_attention_heads")
        n_layers = cfg.get("num_hidden_layers")
        if len(kv_keys) != 2 * n_layers:
            bad.append(f"kv_cache_scheme set but {len(kv_keys)} k_scale/v_scale tensors for {n_layers} layers")
        for k in kv_keys:
            dt, shape = tensors[k]
            if dt != "F32" or math.prod(shape) not in (1, n_kv):
                bad.append(f"{k}: {dt} {shape}, vLLM reads float32 with 1 or {n_kv} elements")
    elif kv_keys:
        bad.append(f"k_scale/v_scale tensors without a kv_cache_scheme: {kv_keys[:2]}")
    return bad
