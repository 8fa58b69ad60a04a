"""fp8ext's own Transformer saved as a Llama checkpoint, so that transformers (LlamaForCausalLM) and vLLM load it.

    save_quantized(model, "out/")          # model: fp8ext.models.transformer.Transformer, quantized
    load_quantized("out/")                 # back into fp8ext's Transformer (config.json's fp8ext_model_config)

fp8ext's decoder is a Llama: RMSNorm (gamma, not 1 + gamma), grouped-query attention without biases, RoPE in the
"rotate half" pairing with inv_freq = theta^(-2i/head_dim) (HF Llama's; no permutation of q/k rows is needed), a
SwiGLU MLP (w13 = [gate; up]: silu of the first half times the second), a final RMSNorm and an output head.
Only the names and the fusing differ:

    embed.weight                       model.embed_tokens.weight
    blocks.N.attn_norm.weight          model.layers.N.input_layernorm.weight
    blocks.N.attn.qkv_proj.*           model.layers.N.self_attn.{q,k,v}_proj.*   rows [h*hd | kv*hd | kv*hd]
    blocks.N.attn.o_proj.*             model.layers.N.self_attn.o_proj.*
    blocks.N.attn.{k,v}_scale          model.layers.N.self_attn.{k,v}_scale      FP8 KV cache, [n_kv_heads, 1, 1]
    blocks.N.ffn_norm.weight           model.layers.N.post_attention_layernorm.weight
    blocks.N.ffn.w13.*                 model.layers.N.mlp.{gate,up}_proj.*       rows [d_ff | d_ff]
    blocks.N.ffn.w2.*                  model.layers.N.mlp.down_proj.*
    norm.weight, lm_head.weight        model.norm.weight, lm_head.weight (absent when tied to the embedding)

A fused layer's parts take its weight rows; per-channel weight_scale [out, 1] splits with them; 128 x 128 block
scales split by block rows (each part's rows must then be a multiple of 128); a per-tensor weight_scale or a static
input_scale is copied to every part (vLLM re-fuses q/k/v and gate/up and takes the largest of the parts' scales, so
equal scales are exact). Loading back concatenates the parts and requires equal per-tensor scales.

config.json holds LlamaConfig's fields at the top level, quantization_config (its `ignore` in Llama names) and
`fp8ext_model_config` (fp8ext's TransformerConfig), from which load_quantized rebuilds fp8ext's model.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch import nn

from ..models.transformer import GroupedQueryAttention, SwiGLU, Transformer, TransformerBlock, TransformerConfig
from ..modules.normalization import RMSNorm
from . import files, quant_config
from ._checks import check_checkpoint, check_fits
from ._header import OUT_DTYPES
from .layers import FP8InferenceLinear, fuse_norms
from .quantize import _set_submodule

__all__ = ["CONFIG_KEY", "is_fp8ext_transformer", "is_fp8ext_llama", "save", "load", "llama_config", "llama_modules",
           "to_llama", "from_llama"]

CONFIG_KEY = "fp8ext_model_config"  # config.json's key for fp8ext's TransformerConfig
_KV = ("k_scale", "v_scale")


def is_fp8ext_transformer(model: nn.Module) -> bool:
    """Whether save_quantized writes `model` as a Llama checkpoint: fp8ext's Transformer (or a subclass, which
    save() refuses if it changes what the model computes)."""
    return isinstance(model, Transformer)


def is_fp8ext_llama(config: Dict[str, Any]) -> bool:
    """Whether config.json is that of fp8ext's Transformer saved as a Llama checkpoint."""
    return CONFIG_KEY in config


# ---- names -------------------------------------------------------------------------------------------------------

def llama_modules(cfg: TransformerConfig) -> Dict[str, List[str]]:
    """{fp8ext module name: its Llama module names}, one each, or the parts of a fused layer in row order."""
    out = {"embed": ["model.embed_tokens"], "norm": ["model.norm"], "lm_head": ["lm_head"],
           "blocks": ["model.layers"]}
    for i in range(cfg.n_layers):
        b, l = f"blocks.{i}", f"model.layers.{i}"
        out.update({b: [l], f"{b}.attn": [f"{l}.self_attn"], f"{b}.attn_norm": [f"{l}.input_layernorm"],
                    f"{b}.attn.o_proj": [f"{l}.self_attn.o_proj"], f"{b}.ffn_norm": [f"{l}.post_attention_layernorm"],
                    f"{b}.ffn": [f"{l}.mlp"], f"{b}.ffn.w13": [f"{l}.mlp.gate_proj", f"{l}.mlp.up_proj"],
                    f"{b}.ffn.w2": [f"{l}.mlp.down_proj"]})
        qkv = [f"{l}.self_attn.{p}_proj" for p in "qkv"]
        if cfg.fused_qkv:
            out[f"{b}.attn.qkv_proj"] = qkv
        else:
            out.update({f"{b}.attn.{p}_proj": [name] for p, name in zip("qkv", qkv)})
    return out


def _part_rows(cfg: TransformerConfig, module: str) -> Optional[List[int]]:
    """The output rows of each part of a fused layer (None for a layer that is not fused)."""
    if module.endswith(".attn.qkv_proj"):
        return [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]
    if module.endswith(".ffn.w13"):
        return [cfg.d_ff, cfg.d_ff]
    return None


def _llama_names(cfg: TransformerConfig, names, what: str) -> List[str]:
    mods = llama_modules(cfg)
    unknown = [n for n in names if n not in mods]
    if unknown:
        raise ValueError(f"save_quantized: {what} {unknown} have no Llama counterpart")
    return [m for n in names for m in mods[n]]


# ---- tensors -----------------------------------------------------------------------------------------------------

def _split(t: torch.Tensor, leaf: str, rows: List[int], scheme: Optional[str], key: str) -> List[torch.Tensor]:
    """A fused layer's tensor cut into its parts' (see the module docstring); scheme: the FP8 weight scheme, or
    None for a layer kept in high precision."""
    if leaf == "input_scale" or (leaf == "weight_scale" and scheme == "tensor"):
        return [t] + [t.clone() for _ in rows[1:]]  # separate tensors (safetensors refuses shared memory)
    if leaf == "weight_scale" and scheme == "block128":
        if any(r % 128 for r in rows):
            raise ValueError(f"save_quantized: {key} holds 128 x 128 block scales, but the layer's parts have "
                             f"{rows} rows; a Llama checkpoint stores them as separate layers, which needs "
                             f"multiples of 128: quantize with weights='channel' or weights='tensor' instead")
        rows = [r // 128 for r in rows]
    if leaf not in ("weight", "weight_scale"):
        raise ValueError(f"save_quantized: {key} has no Llama counterpart (Llama's linear layers have no bias)")
    return list(t.split(rows, dim=0))


def to_llama(state: Dict[str, torch.Tensor], cfg: TransformerConfig,
             schemes: Dict[str, Optional[str]]) -> Dict[str, torch.Tensor]:
    """fp8ext's state dict in Llama's names, fused layers split (works on meta tensors too). schemes: {fp8ext
    linear layer name: its FP8 weight scheme, None if high precision}."""
    mods = llama_modules(cfg)
    out = {}
    for key, t in state.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "_extra_state" or module not in mods:
            if leaf == "_extra_state":
                continue
            raise ValueError(f"save_quantized: {key} has no Llama counterpart")
        names, rows = mods[module], _part_rows(cfg, module)
        if leaf in _KV:  # per-KV-head scales as compressed-tensors' attention and llmcompressor shape them
            t = t.reshape(-1, 1, 1)
        parts = [t] if rows is None else _split(t, leaf, rows, schemes.get(module), key)
        out.update({f"{name}.{leaf}": p for name, p in zip(names, parts)})
    return out


def from_llama(state: Dict[str, torch.Tensor], cfg: TransformerConfig, schemes: Dict[str, Optional[str]],
               path: Union[str, pathlib.Path]) -> Dict[str, torch.Tensor]:
    """The inverse of to_llama: Llama-named tensors back in fp8ext's names, parts of a fused layer concatenated.
    Per-tensor scales of the parts must be equal (ValueError naming the file otherwise). Takes the tensors out of
    `state` as it goes, so that a part is freed once its fused tensor is made."""
    out = {}
    for module, names in llama_modules(cfg).items():
        rows = _part_rows(cfg, module)
        for leaf in ("weight", "weight_scale", "input_scale", *_KV):
            keys = [f"{n}.{leaf}" for n in names]
            if not all(k in state for k in keys):
                continue
            parts = [state.pop(k) for k in keys]
            if leaf in _KV:  # [n_kv, 1, 1] in the file, [n_kv] in fp8ext's attention
                parts = [p.reshape(-1) for p in parts]
            if rows is None:
                out[f"{module}.{leaf}"] = parts[0]
            elif leaf == "input_scale" or (leaf == "weight_scale" and schemes.get(module) == "tensor"):
                if not all(p.is_meta or torch.equal(p, parts[0]) for p in parts):
                    raise ValueError(f"load_quantized: {path}: {keys} differ ({[p.tolist() for p in parts]}); fp8ext's "
                                     f"fused {module} takes one per-tensor scale")
                out[f"{module}.{leaf}"] = parts[0]
            else:
                if leaf == "weight_scale" and schemes.get(module) == "block128" and any(r % 128 for r in rows):
                    raise ValueError(f"load_quantized: {path}: {keys} are 128 x 128 block scales of parts of {rows} "
                                     "rows; only parts of multiples of 128 rows can be fused again")
                out[f"{module}.{leaf}"] = torch.cat(parts, dim=0)
    return out


# ---- save --------------------------------------------------------------------------------------------------------

def _check_expressible(model: Transformer) -> None:
    """ValueError for anything LlamaForCausalLM would compute differently."""
    why = []
    if type(model).forward is not Transformer.forward:
        why.append(f"{type(model).__name__} overrides Transformer.forward")
    for i, block in enumerate(model.blocks):
        for name, mod, cls in (("", block, TransformerBlock), (".attn", block.attn, GroupedQueryAttention),
                               (".ffn", block.ffn, SwiGLU)):
            if type(mod).forward is not cls.forward:
                why.append(f"blocks.{i}{name} is a {type(mod).__name__} (Llama: {cls.__name__})")
    for name, mod in model.named_modules():
        if getattr(mod, "bias", None) is not None and isinstance(getattr(mod, "bias"), torch.Tensor):
            why.append(f"{name} has a bias")
        if name.endswith("norm"):
            if not isinstance(mod, RMSNorm) or getattr(mod, "zero_centered_gamma", False):
                why.append(f"{name} is not an RMSNorm with gamma = weight")
            elif mod.eps != model.cfg.norm_eps:
                why.append(f"{name}'s eps {mod.eps} is not the config's norm_eps {model.cfg.norm_eps}")
    if why:
        raise ValueError(f"save_quantized: this model cannot be written as a Llama checkpoint: {'; '.join(why[:5])}")


def _schemes(model: nn.Module) -> Dict[str, Optional[str]]:
    return {n: getattr(m, "weights", None) for n, m in model.named_modules() if isinstance(m, FP8InferenceLinear)}


def llama_config(cfg: TransformerConfig, *, tied: bool, dtype: str) -> Dict[str, Any]:
    """LlamaConfig's fields (what transformers' and vLLM's LlamaForCausalLM read) for fp8ext's config."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": tied,
            "dtype": dtype, "torch_dtype": dtype, CONFIG_KEY: dataclasses.asdict(cfg)}


def save(model: Transformer, out_dir: Union[str, pathlib.Path], config: Optional[Dict[str, Any]] = None, *,
         max_shard_size: Union[int, str]) -> pathlib.Path:
    """save_quantized for fp8ext's Transformer: the Llama checkpoint described in the module docstring."""
    q = quant_config.quantization_of(model)
    if config is not None and config != dataclasses.asdict(model.cfg):
        raise ValueError("save_quantized: fp8ext's Transformer is written as a Llama checkpoint whose config comes "
                         "from model.cfg; pass config=None (or model.cfg's fields)")
    _check_expressible(model)
    cfg = model.cfg
    state = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    tied = model.lm_head.weight is model.embed.weight or (
        model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr() and model.lm_head.weight.shape ==
        model.embed.weight.shape)
    if tied:
        state.pop("lm_head.weight")
    schemes = _schemes(model)
    if not cfg.fused_qkv:  # vLLM fuses q/k/v: they must be quantized (or kept) together, with one scheme
        for i in range(cfg.n_layers):
            kinds = {p: schemes.get(f"blocks.{i}.attn.{p}_proj", "high precision") for p in "qkv"}
            if len(set(kinds.values())) > 1:
                raise ValueError(f"save_quantized: blocks.{i}.attn's q/k/v projections are {kinds}; vLLM fuses "
                                 "them into one layer, so they must be quantized or ignored together")
    tensors = {k: v.contiguous().cpu() for k, v in to_llama(state, cfg, schemes).items()}
    mods = llama_modules(cfg)
    layers = {}
    for n in q["layers"]:
        spec = quant_config.layer_record(model, q, n)
        layers.update({name: dict(spec) for name in mods[n]})
    kv = {mods[n][0]: a for n, a in (q.get("kv_amax") or {}).items()}
    record = {"layers": layers, "tied": {"lm_head.weight": "model.embed_tokens.weight"} if tied else {},
              "kv_cache": kv}
    config_json = llama_config(cfg, tied=tied, dtype=quant_config.high_precision_dtype(tensors))
    ignored = _llama_names(cfg, q["ignored_modules"], "the modules kept in high precision")
    config_json["quantization_config"] = quant_config.quantization_config({**q, "ignored_modules": ignored})
    with files.staged(out_dir) as tmp:  # moved into out_dir only once every file is written
        files.write_tensors(tensors, tmp, record, max_shard_size)
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2))
    return pathlib.Path(out_dir)


# ---- load --------------------------------------------------------------------------------------------------------

def _fp8ext_config(config_path: pathlib.Path, config: Dict[str, Any], tensors) -> TransformerConfig:
    """config.json's fp8ext_model_config, checked (every field present, types, ranges, n_layers against the layers
    in the file)."""
    mc = config[CONFIG_KEY]
    if not isinstance(mc, dict):
        raise TypeError(f"load_quantized: {config_path}: {CONFIG_KEY} must be a JSON object, got {type(mc).__name__}")
    missing = [f.name for f in dataclasses.fields(TransformerConfig) if f.name not in mc]
    if missing:  # save() writes every field: a default would build another model than the file's
        raise ValueError(f"load_quantized: {config_path}: {CONFIG_KEY} has no {', '.join(missing)}")
    try:
        cfg = TransformerConfig(**mc)
    except (TypeError, ValueError) as e:
        raise type(e)(f"load_quantized: {config_path}: {CONFIG_KEY}: {e}") from None
    parts = [k.split(".") for k in tensors]
    found = sorted({int(p[2]) for p in parts if len(p) > 2 and p[:2] == ["model", "layers"] and p[2].isdigit()})
    if found != list(range(cfg.n_layers)):
        raise ValueError(f"load_quantized: {config_path}: {CONFIG_KEY} n_layers is {cfg.n_layers}, but the checkpoint "
                         f"holds the tensors of layers {found[:8]}{' ...' if len(found) > 8 else ''}")
    return cfg


def _check_tensors(path, tensors: Dict[str, Any], expected: Dict[str, torch.Tensor], exact: set) -> None:
    """The file's tensors (Llama names) against the model's, split as save would: each in its place with the
    same shape; the same dtype in FP8 layers, a high-precision float for high-precision tensors."""
    for key, (dtype, shape) in tensors.items():
        if key not in expected:
            raise ValueError(f"load_quantized: {path}: holds {key}, which fp8ext's Transformer has no place for")
        check_fits(path, key, dtype, shape, expected[key], key in exact)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"load_quantized: {path} holds no {missing[:5]} for this model")


def load(model_dir: pathlib.Path, config: Dict[str, Any],
         model_or_factory: Union[nn.Module, Callable[[dict], nn.Module], None],
         device: Union[str, torch.device, None]) -> Transformer:
    """load_quantized for a directory written by save(): fp8ext's Transformer (the given one, the factory's
    (called with fp8ext_model_config), or by default Transformer(TransformerConfig(**fp8ext_model_config))) with
    the checkpoint's FP8 layers, fused layers fused again."""
    files._safetensors()  # a clear ImportError before anything is read
    d = pathlib.Path(model_dir)
    qc = quant_config.fp8_quantization_config(config, d)
    if not (d / files.WEIGHTS_FILE).is_file() and not (d / files.INDEX_FILE).is_file():
        raise FileNotFoundError(f"load_quantized: {d} holds neither {files.WEIGHTS_FILE} nor {files.INDEX_FILE}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    header = files.checkpoint_header(d)
    record = check_checkpoint(d / "config.json", config, header)
    mc = _fp8ext_config(d / "config.json", config, header.tensors)
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
    else:
        with torch.device("meta"):
            model = (model_or_factory or (lambda c: Transformer(TransformerConfig(**c))))(dataclasses.asdict(mc))
    if not isinstance(model, Transformer):
        raise TypeError(f"load_quantized: {d} holds fp8ext's Transformer as a Llama checkpoint; the model (or the "
                        f"factory's) must be an fp8ext.models.transformer.Transformer, got {type(model).__name__}")
    cfg, mods = model.cfg, llama_modules(model.cfg)
    layers = _fused_records(record["layers"], mods, header.path)
    for name, spec in layers.items():
        lin = model.get_submodule(name)
        _set_submodule(model, name, FP8InferenceLinear(
            lin.in_features, lin.out_features, bias=False, weights=spec["weights"], activations=spec["activations"],
            device="meta", out_dtype=OUT_DTYPES[spec.get("out_dtype", "bfloat16")]))
    schemes = {n: s["weights"] for n, s in layers.items()}
    tied = record.get("tied", {})
    _check_against_skeleton(model, header, layers, mods, schemes, tied=bool(tied))
    state = files.aligned(from_llama(files.read_tensors(header, device), cfg, schemes, header.path))
    if tied:
        state["lm_head.weight"] = state["embed.weight"]
    for key in [k for k in state if k.endswith(_KV)]:
        mod_name, _, leaf = key.rpartition(".")
        setattr(model.get_submodule(mod_name), leaf, state[key])
    files.load_state(model, state, header.path)
    if tied:
        model.lm_head.weight = model.embed.weight
    from ..models.transformer import rope_tables
    model.rope_cos, model.rope_sin = rope_tables(cfg, device)
    fuse_norms(model)
    back = {name: module for module, names in mods.items() for name in names}
    ignored = sorted({back.get(n, n) for n in qc.get("ignore", [])})
    model.fp8_quantization = quant_config.loaded_quantization(
        layers, qc, ignored, {back.get(n, n): a for n, a in record.get("kv_cache", {}).items()})
    return model.eval()


def _fused_records(records: Dict[str, dict], mods: Dict[str, list], path) -> Dict[str, dict]:
    """fp8ext layer name -> its quantization record, from the records of its Llama parts (q/k/v, gate/up), which
    must agree but for input_amax (the largest is kept); ValueError for parts that disagree or are no layer."""
    layers = {}
    for module, names in mods.items():
        specs = [records.get(n) for n in names]
        if not any(specs):
            continue
        if not all(s is not None and {k: v for k, v in s.items() if k != "input_amax"} ==
                   {k: v for k, v in specs[0].items() if k != "input_amax"} for s in specs):
            raise ValueError(f"load_quantized: {path}: the layers {names} are fused in fp8ext's {module} "
                             f"and must be quantized alike; the metadata records {specs}")
        amax = [s["input_amax"] for s in specs if s.get("input_amax") is not None]
        layers[module] = {**specs[0], "input_amax": max(amax) if amax else None}
    unknown = sorted(set(records) - {n for m in layers for n in mods[m]})
    if unknown:
        raise ValueError(f"load_quantized: {path}: the quantized layers {unknown[:5]} are not layers of "
                         "fp8ext's Transformer")
    return layers


def _check_against_skeleton(model: Transformer, header, layers: Dict[str, dict], mods: Dict[str, list],
                            schemes: Dict[str, str], *, tied: bool) -> None:
    """Every tensor of the file against what the skeleton (with its FP8 layers) expects in Llama names."""
    cfg = model.cfg
    skeleton = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    if tied:
        skeleton.pop("lm_head.weight", None)
    expected = to_llama({k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in skeleton.items()},
                        cfg, schemes)
    for i in range(cfg.n_layers):
        if f"model.layers.{i}.self_attn.k_scale" in header.tensors:
            expected.update({f"model.layers.{i}.self_attn.{s}": torch.empty(cfg.n_kv_heads, 1, 1, device="meta")
                             for s in _KV})
    exact = {k for n in layers for m in mods[n] for k in expected if k.startswith(m + ".")}
    _check_tensors(header.path, header.tensors, expected, exact)
