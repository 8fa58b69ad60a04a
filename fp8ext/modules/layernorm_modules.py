"""LayerNormLinear and LayerNormMLP with Transformer Engine's names, arguments and parameter names.

    ln_qkv = fp8ext.LayerNormLinear(4096, 6144, normalization="RMSNorm", bias=False)
    mlp = fp8ext.LayerNormMLP(4096, 14336, normalization="RMSNorm", activation="swiglu", bias=False)

A LayerNormLinear is norm(x) followed by a linear layer; a LayerNormMLP is norm(x) -> fc1 -> activation -> fc2.
The linear layers are fp8ext.Linear (FP8 inside fp8_autocast, high precision outside), the norms fp8ext.RMSNorm /
LayerNorm. Parameters carry TE's names (layer_norm_weight, layer_norm_bias, weight, bias; fc1_weight, fc1_bias,
fc2_weight, fc2_bias), so state dicts of TE's modules load here and the other way round. TE's FP8 metadata
(`_extra_state`) is not read: the FP8 scaling state starts fresh after loading a TE checkpoint.

On a GPU, inside fp8_autocast with delayed scaling, RMSNorm and SwiGLU are computed inside the FP8 cast of the next
GEMM's input, as TE's fused kernels do: the norm's or the activation's high-precision output is never written
(fp8ext.modules.fused_linear; the same bytes as the separate steps, each output rounded to the input's dtype before its
cast). In LayerNormMLP's backward (RMSNorm, SwiGLU, fc1 without bias) SwiGLU's gradient is likewise computed inside
the cast of fc1's output gradient (TE's dswiglu + cast_transpose); RMSNorm's backward is one kernel. LayerNorm, the
other activations, current scaling and return_layernorm_output=True run the steps separately: the norm, the
activation (SwiGLU still one kernel each way on a GPU), then FP8Linear's cast.

Activations (TE's): "gelu" (tanh approximation, as TE's), "relu", "silu", and the gated "swiglu", "geglu",
"reglu", whose fc1 has 2 * ffn_hidden_size outputs: act(first half) * second half.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import fused
from .fused_linear import RMSNORM, SWIGLU, fused_input_linear, fused_mlp, has_hooks
from .linear import FP8Linear
from .normalization import LayerNorm, RMSNorm

__all__ = ["LayerNormLinear", "LayerNormMLP"]

_NORMS = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu, "silu": F.silu,
    "swiglu": F.silu, "geglu": lambda x: F.gelu(x, approximate="tanh"), "reglu": F.relu,
}
_GATED = ("swiglu", "geglu", "reglu")


def _norm(who, normalization, size, eps, zero_centered_gamma, params_dtype, device):
    if normalization not in _NORMS:
        raise ValueError(f"{who}: normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return _NORMS[normalization](size, eps=eps, zero_centered_gamma=zero_centered_gamma, params_dtype=params_dtype,
                                 device=device)


class _TENamedParameters(nn.Module):
    """State dicts under Transformer Engine's flat parameter names: `_TE_NAMES` maps a TE name to this module's
    own (e.g. "fc1_weight" -> "fc1.weight"). TE's `_extra_state` (its FP8 metadata) is dropped on load."""

    _TE_NAMES: dict = {}

    def __init__(self):
        super().__init__()
        self._register_state_dict_hook(type(self)._to_te_names)
        self._register_load_state_dict_pre_hook(self._from_te_names, with_module=False)

    @staticmethod
    def _to_te_names(module, state_dict, prefix, local_metadata):
        for te_name, own in module._TE_NAMES.items():
            if prefix + own in state_dict:
                state_dict[prefix + te_name] = state_dict.pop(prefix + own)
        return state_dict

    def _from_te_names(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for te_name, own in self._TE_NAMES.items():
            if prefix + te_name in state_dict:
                state_dict[prefix + own] = state_dict.pop(prefix + te_name)
        state_dict.pop(prefix + "_extra_state", None)  # TE's FP8 metadata: fp8ext keeps its own per linear layer

    def __getattr__(self, name):
        te_names = type(self)._TE_NAMES
        if name in te_names:  # module.fc1_weight etc., as TE's attributes
            obj = self
            for part in te_names[name].split("."):
                obj = getattr(obj, part)
            return obj
        return super().__getattr__(name)

    def _fusable_gamma(self, inp) -> Optional[torch.Tensor]:
        """The float32 gamma of the module's RMSNorm, for the paths that compute the norm inside the next FP8 cast
        (fp8ext.modules.fused_linear, which decides whether the call is one it takes); None where they cannot run:
        LayerNorm, return_layernorm_output=True (the norm's output is wanted), torch.compile tracing, or forward hooks
        on the norm (the fused path does not call it as a module)."""
        norm = self.layer_norm
        if self.return_layernorm_output or torch.compiler.is_compiling() or not isinstance(norm, RMSNorm) \
                or not isinstance(inp, torch.Tensor) or len(norm.normalized_shape) != 1 or has_hooks(norm):
            return None
        return norm.gamma(torch.float32)


class LayerNormLinear(_TENamedParameters):
    """y = Linear(norm(x)) (see the module docstring). Arguments as TE's: in_features, out_features, eps, bias,
    normalization ("LayerNorm" or "RMSNorm"), return_layernorm_output (also return norm(x)), zero_centered_gamma,
    params_dtype, device, init_method, return_bias, fuse_wgrad_accumulation; TE's parallelism arguments only at
    their defaults (as fp8ext.Linear). Returns y, or a tuple (y[, bias][, norm(x)]) in TE's order."""

    _TE_NAMES = {"layer_norm_weight": "layer_norm.weight", "layer_norm_bias": "layer_norm.bias",
                 "weight": "linear.weight", "bias": "linear.bias"}

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True,
                 normalization: str = "LayerNorm", return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None, device=None,
                 init_method=None, return_bias: bool = False, fuse_wgrad_accumulation: bool = False, **te_kwargs):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.normalization, self.return_layernorm_output = normalization, bool(return_layernorm_output)
        self.return_bias = bool(return_bias)
        self.layer_norm = _norm("LayerNormLinear", normalization, in_features, eps, zero_centered_gamma,
                                params_dtype, device)
        self.linear = FP8Linear(in_features, out_features, bias=bias, device=device, params_dtype=params_dtype,
                                init_method=init_method, return_bias=return_bias,
                                fuse_wgrad_accumulation=fuse_wgrad_accumulation, **te_kwargs)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        gamma = self._fusable_gamma(inp)
        if gamma is not None:  # the norm inside the linear layer's input cast, where that path runs
            out = fused_input_linear(self.linear, RMSNORM, inp, gamma, self.layer_norm.eps, is_first_microbatch)
            if out is not None:
                return out
        ln = self.layer_norm(inp)
        out = self.linear(ln, is_first_microbatch=is_first_microbatch)
        if not self.return_layernorm_output:
            return out
        return (*out, ln) if self.return_bias else (out, ln)


class LayerNormMLP(_TENamedParameters):
    """y = fc2(act(fc1(norm(x)))) (see the module docstring). Arguments as TE's: hidden_size, ffn_hidden_size,
    eps, bias, normalization, activation, return_layernorm_output, zero_centered_gamma, params_dtype, device,
    init_method (fc1), output_layer_init_method (fc2), return_bias (fc2's bias returned, not added),
    fuse_wgrad_accumulation."""

    _TE_NAMES = {"layer_norm_weight": "layer_norm.weight", "layer_norm_bias": "layer_norm.bias",
                 "fc1_weight": "fc1.weight", "fc1_bias": "fc1.bias", "fc2_weight": "fc2.weight",
                 "fc2_bias": "fc2.bias"}

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, bias: bool = True,
                 normalization: str = "LayerNorm", activation: str = "gelu", return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None, device=None,
                 init_method=None, output_layer_init_method=None, return_bias: bool = False,
                 fuse_wgrad_accumulation: bool = False, **te_kwargs):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"LayerNormMLP: activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        self.return_layernorm_output, self.return_bias = bool(return_layernorm_output), bool(return_bias)
        self.layer_norm = _norm("LayerNormMLP", normalization, hidden_size, eps, zero_centered_gamma, params_dtype,
                                device)
        fc1_out = 2 * ffn_hidden_size if activation in _GATED else ffn_hidden_size
        common = dict(device=device, params_dtype=params_dtype, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
        self.fc1 = FP8Linear(hidden_size, fc1_out, bias=bias, init_method=init_method, **common, **te_kwargs)
        self.fc2 = FP8Linear(ffn_hidden_size, hidden_size, bias=bias, init_method=output_layer_init_method,
                             return_bias=return_bias, **common, **te_kwargs)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        gamma, eps = self._fusable_gamma(inp), self.layer_norm.eps
        if gamma is not None and self.activation == "swiglu":
            # the whole MLP as one node: norm, SwiGLU and SwiGLU's gradient inside the FP8 casts (where it runs)
            out = fused_mlp(self.fc1, self.fc2, inp, gamma, eps, is_first_microbatch)
            if out is not None:
                return out
        ln = None  # the norm's output, made here unless the norm runs inside fc1's input cast
        h = None if gamma is None else fused_input_linear(self.fc1, RMSNORM, inp, gamma, eps, is_first_microbatch)
        if h is None:
            ln = self.layer_norm(inp)
            h = self.fc1(ln, is_first_microbatch=is_first_microbatch)
        # SwiGLU computed inside fc2's input cast, where that path runs
        out = fused_input_linear(self.fc2, SWIGLU, h, is_first_microbatch=is_first_microbatch) \
            if self.activation == "swiglu" else None
        if out is None:
            act = _ACTIVATIONS[self.activation]
            if self.activation == "swiglu" and fused.train_available(h, h.shape[-1] // 2) and (
                    fused.TRAINING or not torch.is_grad_enabled()):
                h = fused.swiglu(h)  # on a GPU: one kernel forward, one backward (rounded once, as TE's)
            elif self.activation in _GATED:
                gate, up = h.chunk(2, dim=-1)
                h = act(gate) * up
            else:
                h = act(h)
            out = self.fc2(h, is_first_microbatch=is_first_microbatch)
        if not self.return_layernorm_output:
            return out
        return (*out, ln) if self.return_bias else (out, ln)
