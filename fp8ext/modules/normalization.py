"""RMSNorm and LayerNorm with Transformer Engine's names, arguments and parameters.

`import fp8ext as te; te.LayerNorm(1024, zero_centered_gamma=True)` builds what transformer_engine.pytorch
(2.x) builds: parameters `weight` (and `bias`) as nn.LayerNorm / nn.RMSNorm name them, so state dicts
move between the three. The arithmetic is torch's: F.layer_norm / F.rms_norm in float32 (float64 for
float64 input), gradients by autograd; on a GPU, RMSNorm runs fp8ext's fused kernels instead (fp8ext.fused:
rms_norm without gradients, rms_norm_train forward and backward with them), the same definition. Nothing here
is computed in FP8.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import fused as _fused
from ..core.context import activation_dtype

__all__ = ["LayerNorm", "RMSNorm"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _shape_of(who: str, normalized_shape, hidden_size) -> tuple[int, ...]:
    """normalized_shape as a tuple of positive ints; `hidden_size` is Transformer Engine's older name for it."""
    if hidden_size is not None:
        if normalized_shape is not None:
            raise TypeError(f"{who}: give normalized_shape or hidden_size (its older name), not both")
        warnings.warn(f"{who}: hidden_size has been renamed normalized_shape, as in torch.nn.LayerNorm",
                      DeprecationWarning, stacklevel=4)
        normalized_shape = hidden_size
    if normalized_shape is None:
        raise TypeError(f"{who}: normalized_shape is required")
    shape = tuple(normalized_shape) if isinstance(normalized_shape, Iterable) else (normalized_shape,)
    if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(f"{who}: normalized_shape must be a positive int or a non-empty sequence of them, "
                         f"got {normalized_shape!r}")
    return shape


class _Normalization(nn.Module):
    """What RMSNorm and LayerNorm share: arguments (documented on RMSNorm), parameters, initialisation and
    input checks. Subclasses set _has_bias and define forward."""

    _has_bias: bool = False

    def __init__(self, normalized_shape: Union[int, Iterable[int], None] = None, eps: float = 1e-5,
                 sequence_parallel: Optional[bool] = None, params_dtype: Optional[torch.dtype] = None,
                 zero_centered_gamma: bool = False, device: Union[torch.device, str, None] = None, *,
                 dtype: Optional[torch.dtype] = None, hidden_size: Optional[int] = None,
                 sm_margin: Union[int, dict] = 0) -> None:
        super().__init__()
        who = type(self).__name__
        if sequence_parallel:
            raise NotImplementedError(f"{who}: sequence_parallel=True needs tensor/sequence parallelism, which "
                                      "fp8ext does not have; leave it None or False")
        if params_dtype is not None and dtype is not None:
            raise TypeError(f"{who}: give params_dtype or dtype (its newer name), not both")
        if not isinstance(sm_margin, (int, dict)):
            raise TypeError(f"{who}: sm_margin must be an int or a dict, got {type(sm_margin).__name__}")
        if eps < 0:
            raise ValueError(f"{who}: eps must be >= 0, got {eps}")
        self.normalized_shape: tuple[int, ...] = _shape_of(who, normalized_shape, hidden_size)
        self.eps: float = float(eps)
        self.zero_centered_gamma: bool = bool(zero_centered_gamma)
        # Megatron-LM reads this flag; only None and False get here.
        self.sequence_parallel: Optional[bool] = sequence_parallel
        if dtype is None:
            dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        if self._has_bias:
            self.bias = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        if not self.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        """weight = 1 (0 with zero_centered_gamma, where the scale is 1 + weight), bias = 0.

        Parameters on the meta device are first given storage on torch's default device, as Transformer
        Engine gives them storage on the current CUDA device: build with device="meta", then call this to
        initialise. `defer_init` is Transformer Engine's deprecated switch (True: do nothing).
        """
        if defer_init is not None:
            warnings.warn("reset_parameters(defer_init=...) is deprecated: build with device='meta' instead",
                          DeprecationWarning, stacklevel=2)
            if defer_init:
                return
        for name, p in list(self.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(self, name, nn.Parameter(torch.empty_like(p, device=torch.get_default_device()),
                                                 requires_grad=p.requires_grad))
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self._has_bias:
                self.bias.zero_()

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """float32 (float64 for float64 input) after checking that x can be normalised by this module."""
        who = f"{type(self).__name__}.forward()"
        if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
            got = f"{str(x.dtype).removeprefix('torch.')} on {x.device}" if isinstance(x, torch.Tensor) \
                else type(x).__name__
            raise TypeError(f"{who}: input must be a float32, bfloat16, float16 or float64 tensor, got {got}")
        n = len(self.normalized_shape)
        if x.dim() < n or tuple(x.shape[-n:]) != self.normalized_shape:
            raise ValueError(f"{who}: input of shape {tuple(x.shape)} does not end in normalized_shape "
                             f"{self.normalized_shape}")
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def gamma(self, dtype: torch.dtype) -> torch.Tensor:
        """The scale applied after normalising: weight, or 1 + weight with zero_centered_gamma (added in
        `dtype`, so that a bfloat16 weight near 0 keeps its precision)."""
        w = self.weight.to(dtype)
        return 1 + w if self.zero_centered_gamma else w


class RMSNorm(_Normalization):
    r"""Root-mean-square normalisation over the last len(normalized_shape) dimensions, as
    transformer_engine.pytorch.RMSNorm:

        y = x / sqrt(mean(x^2) + eps) * gamma,   gamma = weight   (1 + weight with zero_centered_gamma)

    Computed in float32 whatever the input's dtype (float64 for float64 input); the output has the input's
    dtype, or the autocast dtype inside torch.autocast (as Transformer Engine's).

    Args:
        normalized_shape: size of the normalised dimensions: an int or a sequence of ints.
        eps: added to the mean square before the square root.
        sequence_parallel: accepted as None or False only; True raises NotImplementedError (fp8ext has no
            tensor or sequence parallelism).
        params_dtype: dtype of `weight` (default torch.get_default_dtype()). `dtype` is the same, under
            Transformer Engine 2.x's newer name; give one of the two.
        zero_centered_gamma: store gamma - 1 in `weight` (initialised to 0), so that weight decay pulls the
            scale towards 1 rather than 0.
        device: device of the parameters; None is torch's default device (Transformer Engine's default is
            the current CUDA device). "meta" defers initialisation to reset_parameters().
        hidden_size: Transformer Engine's deprecated name for normalized_shape (DeprecationWarning).
        sm_margin: Transformer Engine's number of SMs to leave free for other kernels; accepted and
            ignored, since torch picks the launch shape here and the result does not depend on it.
    Any other keyword is a TypeError.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = self._compute_dtype(x)
        if self._fused_ok(x):  # inference on a GPU: one pass (fp8ext.fused.rms_norm), same definition
            return _fused.rms_norm(x, self.fused_gamma(), self.eps)
        if self._fused_train_ok(x):  # training on a GPU: one kernel each way, the output in the autocast dtype
            return _fused.rms_norm_train(x, self.gamma(torch.float32), self.eps, activation_dtype(x))
        return F.rms_norm(x.to(ct), self.normalized_shape, self.gamma(ct), self.eps).to(activation_dtype(x))

    def _fused_train_ok(self, x: torch.Tensor) -> bool:
        """Whether a forward with gradients can run fp8ext's training kernels (fp8ext.fused.rms_norm_train):
        fused.TRAINING, a gradient wanted, a one-dimensional normalized_shape of at most 8192, a CUDA tensor that
        is not float64 (under torch.compile too, as a torch op)."""
        return (_fused.TRAINING and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
                and len(self.normalized_shape) == 1 and self.normalized_shape[0] <= 8192
                and x.dtype != torch.float64 and _fused.train_available(x, self.normalized_shape[0]))

    def _fused_ok(self, x: torch.Tensor) -> bool:
        """Whether the forward pass can run fp8ext's fused kernel: no gradient wanted, a one-dimensional
        normalized_shape, a CUDA tensor of a 16-bit or float32 dtype kept by autocast."""
        return (not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
                and len(self.normalized_shape) == 1 and x.dtype != torch.float64
                and _fused.available(x, self.normalized_shape[0]) and activation_dtype(x) == x.dtype)

    def fused_gamma(self) -> torch.Tensor:
        """The float32 gamma of the fused kernel, made once and kept while the weight is unchanged."""
        w = self.weight
        vk = _fused.version_key(w)
        if vk is None:  # an inference tensor: no version counter to key a cache on
            with torch.no_grad():
                return self.gamma(torch.float32).detach().contiguous()
        key = (vk, w.device, w.dtype, self.zero_centered_gamma)
        cached = self.__dict__.get("_fused_gamma")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self.__dict__["_fused_gamma"] = (key, self.gamma(torch.float32).detach().contiguous())
        return cached[1]


class LayerNorm(_Normalization):
    r"""Layer normalisation over the last len(normalized_shape) dimensions, as
    transformer_engine.pytorch.LayerNorm:

        y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + bias,   gamma = weight   (1 + weight with
        zero_centered_gamma),   var the biased variance (divided by n, as torch.nn.LayerNorm)

    Computed in float32 whatever the input's dtype (float64 for float64 input); the output has the input's
    dtype, or the autocast dtype inside torch.autocast (as Transformer Engine's).

    The arguments are RMSNorm's (see there); `bias` has the shape and dtype of `weight` and starts at 0.
    With zero_centered_gamma=False the parameters mean what torch.nn.LayerNorm's mean; with True the
    state dict keys still match but `weight` holds gamma - 1.
    """

    _has_bias = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = self._compute_dtype(x)
        return F.layer_norm(x.to(ct), self.normalized_shape, self.gamma(ct), self.bias.to(ct),
                            self.eps).to(activation_dtype(x))
