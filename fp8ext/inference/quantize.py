"""Calibration and model quantization for FP8 inference.

    amaxes = fp8ext.inference.calibrate(model, batches)            # max|input| of every linear, high precision
    fp8ext.inference.quantize_model(model, weights="channel", activations="static")   # in place

Layer policy (the usual one for FP8 serving): the linear layers of the network compute in FP8; the modules
named in `ignore` (by default the output head and embeddings), norms, attention's softmax and RoPE stay in high
precision. Linear layers whose dimensions are not multiples of 16 stay too, with a warning.
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, Optional, Sequence

import torch
from torch import nn

from ..linear import FP8Linear
from ..ops import amax as _amax
from .layers import FP8InferenceLinear, _check_schemes

__all__ = ["calibrate", "quantize_model", "DEFAULT_IGNORE", "quantizable_linears"]

DEFAULT_IGNORE = ("lm_head", "embed", "embed_tokens", "output")


def _ignored(name: str, ignore: Sequence[str]) -> bool:
    return any(name == i or name.endswith("." + i) or name.startswith(i + ".") for i in ignore)


def quantizable_linears(model: nn.Module, ignore: Sequence[str] = DEFAULT_IGNORE) -> Dict[str, nn.Linear]:
    """{qualified name: module} of the nn.Linear and fp8ext.Linear layers that FP8 inference replaces."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, FP8Linear)) and not _ignored(name, ignore):
            if m.in_features % 16 or m.out_features % 16:
                warnings.warn(f"quantize_model: {name} ({m.in_features} -> {m.out_features}) stays in high "
                              "precision: FP8 GEMMs need dimensions that are multiples of 16", stacklevel=3)
                continue
            out[name] = m
    return out


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable, *, forward: Optional[Callable] = None,
              ignore: Sequence[str] = DEFAULT_IGNORE, progress: bool = True) -> Dict[str, float]:
    """Runs `model` in high precision over `batches` and records max|input| of every quantizable linear layer.

    A batch is passed as model(batch), or model(*batch) for a tuple, or forward(model, batch) when given. The
    amaxes accumulate on the device (no host synchronisation per batch); the result, {layer name: amax}, is
    also kept as `model.fp8_calibration` for quantize_model. NaN or Inf in an input is an error naming the layer.
    """
    layers = quantizable_linears(model, ignore)
    if not layers:
        raise ValueError("calibrate: the model has no linear layers to calibrate")
    running: Dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            a = _amax(args[0].detach().contiguous())
            running[name] = a if name not in running else torch.maximum(running[name], a)
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in layers.items()]
    was_training = model.training
    model.eval()
    try:
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
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [n for n in layers if n not in running]
    if missing:
        raise ValueError(f"calibrate: these layers saw no input: {missing}")
    result = {n: float(v) for n, v in running.items()}  # one synchronisation, at the end
    bad = [n for n, v in result.items() if not (v == v and v != float("inf"))]
    if bad:
        raise ValueError(f"calibrate: the inputs of {bad} held NaN or Inf")
    model.fp8_calibration = result
    return result


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


@torch.no_grad()
def quantize_model(model: nn.Module, weights: str = "channel", activations: str = "dynamic", *,
                   calibration: Optional[Dict[str, float]] = None, ignore: Sequence[str] = DEFAULT_IGNORE,
                   out_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replaces every quantizable linear layer of `model` (in place) by an FP8InferenceLinear holding only the
    E4M3 weight and its scales; the high-precision weights are released. Static activations take the input
    amaxes of `calibration` (default: model.fp8_calibration from calibrate()). Returns the model; its
    `fp8_quantization` attribute records the schemes and the ignored modules (save_quantized writes it)."""
    _check_schemes(weights, activations, "quantize_model")
    calib = calibration if calibration is not None else getattr(model, "fp8_calibration", None)
    layers = quantizable_linears(model, ignore)
    if activations == "static":
        if calib is None:
            raise ValueError("quantize_model: static activations need calibration: run "
                             "fp8ext.inference.calibrate(model, batches) first or pass calibration=")
        missing = [n for n in layers if n not in calib]
        if missing:
            raise ValueError(f"quantize_model: no calibrated amax for {missing}")
    # linears that stay in high precision (ignored, or dimensions FP8 GEMMs cannot take): checkpoints list them
    kept = {n for n, m in model.named_modules() if n and (_ignored(n, ignore) or (
        isinstance(m, (nn.Linear, FP8Linear)) and n not in layers))}
    for name, lin in layers.items():
        amax = calib.get(name) if calib else None
        _set_submodule(model, name, FP8InferenceLinear.from_linear(lin, weights, activations, amax, out_dtype))
    model.fp8_quantization = {"weights": weights, "activations": activations, "ignore": list(ignore),
                              "ignored_modules": sorted(kept), "layers": sorted(layers),
                              "input_amax": {n: calib[n] for n in layers if n in calib} if calib else {}}
    return model
