"""The model side of fp8ext.adaptive (fp8ext/lowp/adaptive.py): the linear layers a plan covers, the batches, the
losses they give, and weights swapped in for a measurement and restored after it."""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, Iterable, Optional, Sequence

import torch
from torch import nn

from ..modules.ignore import ignored
from ..modules.linear import FP8Linear


def _linear_layers(model: nn.Module, layers: Optional[Sequence[str]], ignore: Sequence[str], fn: str
                   ) -> Dict[str, nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}(): model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(ignore, str) or not all(isinstance(i, str) for i in ignore):
        raise TypeError(f"{fn}(): ignore must be a sequence of module names, got {ignore!r}")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, FP8Linear))}
    if layers is not None:
        if isinstance(layers, str) or not all(isinstance(n, str) for n in layers):
            raise TypeError(f"{fn}(): layers must be a sequence of module names, got {layers!r}")
        unknown = [n for n in layers if n not in linears]
        if unknown:
            raise ValueError(f"{fn}(): layers names modules that are not linear layers of the model: {unknown}")
        out = {n: linears[n] for n in layers}
    else:
        out = {n: m for n, m in linears.items() if not ignored(n, ignore)}
    if not out:
        raise ValueError(f"{fn}(): the model has no linear layers to assign (ignore={list(ignore)})")
    for n, m in out.items():
        if m.weight.dim() != 2:
            raise ValueError(f"{fn}(): layer {n} has a weight of shape {list(m.weight.shape)}, not 2-D")
    return out


def _batches(batches, fn: str, arg: str) -> list:
    if isinstance(batches, (torch.Tensor, str, bytes)) or not isinstance(batches, Iterable):
        raise TypeError(f"{fn}(): {arg} must be an iterable of batches (a list of (inputs, targets) tuples, ...), "
                        f"got {type(batches).__name__}")
    out = list(batches)  # iterated once per pass: a generator is materialised
    if not out:
        raise ValueError(f"{fn}(): {arg} is empty")
    return out


def _batch_loss(model: nn.Module, b, loss_fn: Optional[Callable], fn: str) -> float:
    if loss_fn is not None:
        if not isinstance(b, (tuple, list)) or len(b) != 2:
            raise TypeError(f"{fn}(): with loss_fn, a batch must be (inputs, targets), got {type(b).__name__}"
                            + (f" of length {len(b)}" if isinstance(b, (tuple, list)) else ""))
        loss = loss_fn(model(b[0]), b[1])
    else:
        out = model(*b) if isinstance(b, (tuple, list)) else model(b)
        loss = out[-1] if isinstance(out, (tuple, list)) and len(out) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"{fn}(): the model's output is not a loss (a 0-d tensor, or a tuple ending with one); "
                        "pass loss_fn(outputs, targets) and batches of (inputs, targets)")
    value = float(loss.detach().float())
    if not math.isfinite(value):
        raise ValueError(f"{fn}(): the loss is {value} on a batch")
    return value


def _mean_loss(model, batches, loss_fn, fn) -> float:
    return sum(_batch_loss(model, b, loss_fn, fn) for b in batches) / len(batches)


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _weights_replaced(modules: Dict[str, nn.Module], new: Dict[str, torch.Tensor]):
    """Temporarily writes new[name] (cast to the parameter's dtype) into modules[name].weight."""
    saved = {}
    try:
        for n, w in new.items():
            p = modules[n].weight
            saved[n] = p.detach().clone()
            p.data.copy_(w.to(p.dtype))
        yield
    finally:
        for n, w in saved.items():
            modules[n].weight.data.copy_(w)
