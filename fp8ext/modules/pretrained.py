"""load_fp8_state: the FP8 scaling state of a folder written by transformers' save_pretrained (or Trainer), loaded into
a model converted with convert_to_fp8.

A model trained with fp8ext saves like any transformers model: `model.save_pretrained(folder)` writes the
high-precision weights under the architecture's own names, and each FP8 layer's scaling state as one int32 tensor
`<layer>._extra_state` (FP8Linear.get_extra_state). Plain transformers loads the folder without fp8ext (it lists
the `_extra_state` tensors as unexpected keys and ignores them); a model converted again with convert_to_fp8 takes
its scaling state back with load_fp8_state, so that its next step scales as the saved run's would have.
"""

from __future__ import annotations

import json
import os
from typing import List

from torch import nn

__all__ = ["load_fp8_state"]

_SUFFIX = "._extra_state"


def _weight_files(folder: str) -> List[str]:
    """The folder's safetensors files: those the sharded index names, or model.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"load_fp8_state: {index} is not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"load_fp8_state: {index}: weight_map must map tensor names to file names")
        names = sorted(set(weight_map.values()))
        for name in names:
            if os.path.basename(name) != name:
                raise ValueError(f"load_fp8_state: {index} names a file outside the folder: {name!r}")
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"load_fp8_state: {folder} has neither model.safetensors nor model.safetensors.index.json")


def load_fp8_state(model: nn.Module, folder: str, strict: bool = True) -> List[str]:
    """Loads the `<layer>._extra_state` tensors of a save_pretrained folder (safetensors, single or sharded) into
    the FP8 layers of `model` (converted with convert_to_fp8, the names as when it was saved) and returns the names
    of the layers loaded. strict=True: every FP8 layer of the model must have its state in the folder, and every
    state in the folder a layer in the model (a ValueError names those that do not)."""
    from safetensors import safe_open  # the inference extra (pip install safetensors), as fp8ext's checkpoints
    from .linear import FP8Linear
    layers = {name: m for name, m in model.named_modules() if isinstance(m, FP8Linear)}
    loaded, unknown = [], []
    for path in _weight_files(folder):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if not key.endswith(_SUFFIX):
                    continue
                name = key[: -len(_SUFFIX)]
                if name not in layers:
                    unknown.append(name)
                    continue
                layers[name].set_extra_state(f.get_tensor(key))
                loaded.append(name)
    missing = sorted(set(layers) - set(loaded))
    if strict and (missing or unknown):
        raise ValueError(f"load_fp8_state: {folder} does not match the model's FP8 layers: no state for "
                         f"{missing or 'none'}; state of layers the model does not have: {sorted(unknown) or 'none'}")
    return loaded
