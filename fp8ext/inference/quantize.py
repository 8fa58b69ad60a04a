"""Calibration and model quantization for FP8 inference.

    amaxes = fp8ext.inference.calibrate(model, batches)            # max|input| of every linear, high precision
    fp8ext.inference.quantize_model(model, weights="channel", activations="static")   # in place

Calibration also records, for every attention layer that offers a `kv_observer` hook (fp8ext's
GroupedQueryAttention) and every attention layer of a Hugging Face transformers model (through the cache it
updates after RoPE; see fp8ext.inference.hf), the per-KV-head max|K| (after RoPE) and max|V|; quantize_model turns
them into the FP8 KV cache's dequantizing scales (amax / 448, one per KV head) held by the attention modules as
`k_scale` / `v_scale`, which save_quantized writes and KVCache.from_model / generate use.

Layer policy (the usual one for FP8 serving): the linear layers of the network compute in FP8; the modules
named in `ignore` (by default the output head and embeddings), norms, attention's softmax and RoPE stay in high
precision. Linear layers whose dimensions are not multiples of 16 stay too, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, Optional, Sequence

import torch
from torch import nn

from ..core.formats import E4M3
from ..modules.ignore import DEFAULT_IGNORE, ignored
from ..modules.linear import FP8Linear
from ..ops import amax as _amax
from . import hf
from .layers import FP8InferenceLinear, _check_schemes, fuse_norms

__all__ = ["calibrate", "quantize_model", "DEFAULT_IGNORE", "quantizable_linears", "kv_scales_from_amax",
           "set_kv_cache_scales", "KV_CACHE_SCHEME"]

def quantizable_linears(model: nn.Module, ignore: Sequence[str] = DEFAULT_IGNORE) -> Dict[str, nn.Linear]:
    """{qualified name: module} of the nn.Linear and fp8ext.Linear layers that FP8 inference replaces."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, FP8Linear)) and not ignored(name, ignore):
            if m.in_features % 16 or m.out_features % 16:
                warnings.warn(f"quantize_model: {name} ({m.in_features} -> {m.out_features}) stays in high "
                              "precision: FP8 GEMMs need dimensions that are multiples of 16", stacklevel=3)
                continue
            out[name] = m
    return out


def _kv_attention_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """{name: module} of the attention layers whose K/V calibrate records: those that offer the kv_observer hook
    (fp8ext's GroupedQueryAttention) and a transformers model's (fp8ext.inference.hf.attention_modules)."""
    found = {n: m for n, m in model.named_modules() if hasattr(type(m), "kv_observer")}
    found.update(hf.attention_modules(model))
    return found


def kv_scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Dequantizing FP8 KV-cache scales from per-head amaxes: amax / 448 (compressed-tensors' convention), 1 for
    a head that saw only zeros. float32, the shape of amax."""
    a = amax.detach().float()
    return torch.where(a > 0, a / E4M3.max, torch.ones_like(a))


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable, *, forward: Optional[Callable] = None,
              ignore: Sequence[str] = DEFAULT_IGNORE, progress: bool = True) -> Dict[str, float]:
    """Runs `model` in high precision over `batches` and records max|input| of every quantizable linear layer.

    A batch is passed as model(batch), or model(*batch) for a tuple, or forward(model, batch) when given. The
    amaxes accumulate on the device (no host synchronisation per batch); the result, {layer name: amax}, is
    also kept as `model.fp8_calibration` for quantize_model. NaN or Inf in an input is an error naming the layer.

    Attention layers with a `kv_observer` hook (fp8ext's GroupedQueryAttention) and the attention layers of a
    Hugging Face transformers model also have the per-KV-head max|K| (after RoPE) and max|V| recorded (the
    latter where they call cache.update(k, v, layer_idx), as transformers' Llama, Mistral and Qwen2 do, whatever
    `forward` runs the model: calibrate wraps the cache each one receives), kept as `model.fp8_kv_calibration` =
    {attention module name: {"k_amax": [n_kv_heads] float32, "v_amax": ...}} (CPU tensors) for quantize_model's
    KV-cache scales. The hooks are removed afterwards.
    """
    layers = quantizable_linears(model, ignore)
    if not layers:
        raise ValueError("calibrate: the model has no linear layers to calibrate")
    running: Dict[str, torch.Tensor] = {}
    kv_running: Dict[str, list] = {}

    def hook(name):
        def record(module, args):
            a = _amax(args[0].detach().contiguous())
            running[name] = a if name not in running else torch.maximum(running[name], a)
        return record

    def kv_hook(name):
        def observe(k, v):  # [batch, n_kv_heads, seq, head_dim] each; per-head amax, on the device
            ka, va = (t.detach().abs().amax(dim=(0, 2, 3)).float() for t in (k, v))
            prev = kv_running.get(name)
            kv_running[name] = [ka, va] if prev is None else [torch.maximum(prev[0], ka), torch.maximum(prev[1], va)]
        return observe

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    attns = {n: m for n, m in model.named_modules() if hasattr(type(m), "kv_observer")}
    for n, m in attns.items():
        m.kv_observer = kv_hook(n)
    was_training = model.training
    model.eval()
    try:
        with hf.record_kv(hf.attention_modules(model), kv_hook) as skipped:
            if skipped:
                warnings.warn(f"calibrate: the attention layers {skipped} take no cache argument; their K/V are "
                              "not recorded (no FP8 KV-cache scales for them)", stacklevel=3)
            _run_batches(model, batches, forward, progress)
    finally:
        for h in handles:
            h.remove()
        for m in attns.values():
            del m.kv_observer  # back to the class's None: no cost when not calibrating
        model.train(was_training)
    model.fp8_calibration, model.fp8_kv_calibration = _calibration_results(layers, running, kv_running)
    return model.fp8_calibration


def _run_batches(model: nn.Module, batches: Iterable, forward: Optional[Callable], progress: bool) -> None:
    """calibrate's pass over the batches: model(batch), model(*batch) or forward(model, batch), with a bar."""
    items = batches
    if progress:
        from tqdm.auto import tqdm
        items = tqdm(batches, desc="calibrating", unit="batch")
    count = 0
    for b in items:
        if forward is not None:
            forward(model, b)
        elif isinstance(b, (tuple, list)):
            model(*b)
        else:
            model(b)
        count += 1
    if count == 0:
        raise ValueError("calibrate: batches is empty")


def _calibration_results(layers, running: Dict[str, torch.Tensor], kv_running: Dict[str, list]):
    """({layer: amax}, {attention: {"k_amax", "v_amax"}}) read back once, after checking every layer saw input and
    nothing recorded is NaN or Inf."""
    missing = [n for n in layers if n not in running]
    if missing:
        raise ValueError(f"calibrate: these layers saw no input: {missing}")
    result = {n: float(v) for n, v in running.items()}  # one synchronisation, at the end
    bad = [n for n, v in result.items() if not (v == v and v != float("inf"))]
    if bad:
        raise ValueError(f"calibrate: the inputs of {bad} held NaN or Inf")
    kv = {n: {"k_amax": k.cpu(), "v_amax": v.cpu()} for n, (k, v) in kv_running.items()}
    bad = [n for n, d in kv.items() if not all(bool(torch.isfinite(t).all()) for t in d.values())]
    if bad:
        raise ValueError(f"calibrate: the keys or values of {bad} held NaN or Inf")
    return result, kv


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


# compressed-tensors' kv_cache_scheme for fp8ext's FP8 KV cache: E4M3, symmetric, static, one scale per KV head
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "attn_head",
                   "group_size": None, "block_structure": None, "observer": "minmax", "actorder": None}


@torch.no_grad()
def set_kv_cache_scales(model: nn.Module, kv_calibration: Optional[Dict[str, Dict[str, torch.Tensor]]] = None,
                        *, fn: str = "set_kv_cache_scales") -> Dict[str, Dict[str, list]]:
    """Gives every attention layer of `model` its FP8 KV-cache scales from calibrated amaxes (`kv_calibration`,
    default model.fp8_kv_calibration from calibrate()): `k_scale` / `v_scale` buffers, [n_kv_heads] float32,
    amax / 448. quantize_model calls it; called alone it serves a model whose weights stay in high precision
    with an FP8 cache. Returns {attention module name: {"k_amax": [...], "v_amax": [...]}}."""
    kv_calib = kv_calibration if kv_calibration is not None else getattr(model, "fp8_kv_calibration", None)
    if not kv_calib:
        raise ValueError(f"{fn}: no calibrated K/V amaxes: run fp8ext.inference.calibrate(model, batches) first")
    attns = _kv_attention_modules(model)
    hf_attention = hf.attention_modules(model)
    missing = [n for n in attns if n not in kv_calib]
    if missing or not attns:
        raise ValueError(f"{fn}: no calibrated K/V amax for the attention layers {missing or '(none)'}; "
                         "calibrate again" + (", or pass kv_cache_scales=False" if fn == "quantize_model" else ""))
    out = {}
    for n, m in attns.items():
        device = next(iter(m.parameters()), next(iter(m.buffers()), torch.empty(0))).device
        ka, va = (torch.as_tensor(kv_calib[n][key], dtype=torch.float32).reshape(-1) for key in ("k_amax", "v_amax"))
        heads = getattr(getattr(m, "cfg", None), "n_kv_heads", ka.numel())
        if ka.numel() != heads or va.numel() != heads:
            raise ValueError(f"{fn}: kv_calibration[{n!r}] holds {ka.numel()} / {va.numel()} amaxes for "
                             f"{heads} KV heads")
        # a transformers module's buffers are [n_kv_heads, 1, 1], the shape compressed-tensors' attention
        # broadcasts over K/V [batch, n_kv_heads, seq, head_dim] (and llmcompressor writes); fp8ext's are 1-d
        shape = (-1, 1, 1) if n in hf_attention else (-1,)
        m.register_buffer("k_scale", kv_scales_from_amax(ka).reshape(shape).to(device))
        m.register_buffer("v_scale", kv_scales_from_amax(va).reshape(shape).to(device))
        out[n] = {"k_amax": ka.tolist(), "v_amax": va.tolist()}
    return out


_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@torch.no_grad()
def quantize_model(model: nn.Module, weights: str = "channel", activations: str = "dynamic", *,
                   calibration: Optional[Dict[str, float]] = None, ignore: Sequence[str] = DEFAULT_IGNORE,
                   out_dtype: Optional[torch.dtype] = None, kv_cache_scales: bool = True,
                   kv_calibration: Optional[Dict[str, Dict[str, torch.Tensor]]] = None,
                   progress: bool = True) -> nn.Module:
    """Replaces every quantizable linear layer of `model` (in place) by an FP8InferenceLinear holding only the
    E4M3 weight and its scales; the high-precision weights are released. Static activations take the input
    amaxes of `calibration` (default: model.fp8_calibration from calibrate()). Returns the model; its
    `fp8_quantization` attribute records the schemes and the ignored modules (save_quantized writes it).
    out_dtype: the dtype the FP8 layers return; by default each layer's weight dtype (float32, bfloat16 or
    float16; bfloat16 for any other), so the model computes in the dtype it had.

    kv_cache_scales: when K/V amaxes were calibrated (`kv_calibration`, default model.fp8_kv_calibration from
    calibrate()), every attention layer gets `k_scale` / `v_scale` buffers, [n_kv_heads] float32, amax / 448
    (dequantizing), the FP8 KV cache's scales, and the checkpoint declares kv_cache_scheme (8-bit float,
    symmetric, static, strategy "attn_head": one scale per KV head).

    progress: a progress bar over the layers (packing a large model's weights on a CPU takes minutes)."""
    _check_schemes(weights, activations, "quantize_model")
    calib = calibration if calibration is not None else getattr(model, "fp8_calibration", None)
    kv_calib = kv_calibration if kv_calibration is not None else getattr(model, "fp8_kv_calibration", None)
    layers = quantizable_linears(model, ignore)
    if activations == "static":
        if calib is None:
            raise ValueError("quantize_model: static activations need calibration: run "
                             "fp8ext.inference.calibrate(model, batches) first or pass calibration=")
        missing = [n for n in layers if n not in calib]
        if missing:
            raise ValueError(f"quantize_model: no calibrated amax for {missing}")
    # linears that stay in high precision (ignored, or dimensions FP8 GEMMs cannot take): checkpoints list them
    kept = {n for n, m in model.named_modules() if n and (ignored(n, ignore) or (
        isinstance(m, (nn.Linear, FP8Linear)) and n not in layers))}
    kv_scheme, kv_amax = None, {}
    if kv_cache_scales and kv_calib:
        kv_amax = set_kv_cache_scales(model, kv_calib, fn="quantize_model")
        kv_scheme = KV_CACHE_SCHEME
    items = layers.items()
    if progress:
        from tqdm.auto import tqdm
        items = tqdm(items, desc="quantizing", unit="layer", total=len(layers))
    for name, lin in items:
        amax = calib.get(name) if calib else None
        dtype = out_dtype or (lin.weight.dtype if lin.weight.dtype in _OUT_DTYPES else torch.bfloat16)
        _set_submodule(model, name, FP8InferenceLinear.from_linear(lin, weights, activations, amax, dtype))
    fuse_norms(model)  # norms that feed an FP8 layer write its E4M3 input directly (on a GPU, without gradients)
    model.fp8_quantization = {"weights": weights, "activations": activations, "ignore": list(ignore),
                              "ignored_modules": sorted(kept), "layers": sorted(layers),
                              "input_amax": {n: calib[n] for n in layers if n in calib} if calib else {},
                              "kv_cache_scheme": kv_scheme, "kv_amax": kv_amax}
    return model
