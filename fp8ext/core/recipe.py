"""FP8 recipes: how the FP8Linear layers inside an fp8_autocast scale their tensors.

Names and defaults are Transformer Engine's (transformer_engine.common.recipe), so TE code ports by
changing an import. A recipe is a frozen value: two equal recipes share one FP8ScalingManager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .formats import Format

__all__ = ["Format", "DelayedScaling", "CurrentScaling", "Float8CurrentScaling"]


def _refuse_fp8_attention(recipe) -> None:
    """Transformer Engine's fp8_dpa / fp8_mha switch attention itself to FP8, which fp8ext does not have."""
    for field in ("fp8_dpa", "fp8_mha"):
        if getattr(recipe, field):
            raise NotImplementedError(f"{type(recipe).__name__}: {field}=True (FP8 attention) is not supported by "
                                      f"fp8ext; leave it False (attention then runs in high precision)")


@dataclass(frozen=True)
class DelayedScaling:
    """Delayed scaling: each tensor's scale comes from the amax of earlier steps.

    scale = fmt.max / amax / 2**margin, with amax the largest value in the tensor's history of the last
    `amax_history_len` steps ("max") or the last step's ("most_recent"). When amax is 0 the previous scale
    is kept; when a step's amax is NaN or Inf (an overflow) the scale shrinks by `backoff_factor` (the
    loss-scaling rule; TE keeps the scale instead) and that entry never counts as a maximum.
    A negative entry (only a corrupted or hand-written state has one) counts as 0, without backoff.
    Scales are recomputed every `interval` steps, for all tensors in one fused kernel. reduce_amax: with
    an fp8_group, the amaxes are max-reduced across it before the update. fp8_format: Format.HYBRID (E4M3
    forward, E5M2 gradients, the default) or Format.E4M3; pure E5M2 training is refused, as TE does.
    fp8_dpa / fp8_mha (TE's FP8 attention) are accepted only as False.
    Note on margin: a multiplicative "margin 2.0" is margin=1 here (2**1).
    """

    margin: int = 0
    interval: int = 1
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    scaling_factor_compute_algo: Optional[Any] = None
    reduce_amax: bool = True
    backoff_factor: float = 0.5
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _refuse_fp8_attention(self)
        if not isinstance(self.fp8_format, Format):
            raise TypeError(f"DelayedScaling: fp8_format must be a fp8ext.Format, got {self.fp8_format!r}")
        if self.fp8_format is Format.E5M2:
            raise ValueError("DelayedScaling: pure E5M2 training is not supported (as in Transformer Engine); use "
                             "Format.HYBRID or Format.E4M3")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"DelayedScaling: amax_compute_algo must be 'max' or 'most_recent' (fp8ext updates "
                             f"every scale in one fused kernel, so callables are not supported), got "
                             f"{self.amax_compute_algo!r}")
        if self.scaling_factor_compute_algo is not None:
            raise ValueError("DelayedScaling: a custom scaling_factor_compute_algo is not supported; scales follow "
                             "scale = fmt.max / amax / 2**margin")
        if not (isinstance(self.amax_history_len, int) and 1 <= self.amax_history_len <= 16384):
            raise ValueError(f"DelayedScaling: amax_history_len must be an int in [1, 16384], got "
                             f"{self.amax_history_len!r}")
        if not (isinstance(self.interval, int) and self.interval >= 1):
            raise ValueError(f"DelayedScaling: interval must be a positive int, got {self.interval!r}")
        if not (0 <= self.margin < 64):
            raise ValueError(f"DelayedScaling: margin must be in [0, 64), got {self.margin!r}")
        if not (0 < self.backoff_factor <= 1):
            raise ValueError(f"DelayedScaling: backoff_factor must be in (0, 1], got {self.backoff_factor!r}")


@dataclass(frozen=True)
class CurrentScaling:
    """Current (just-in-time) scaling: each tensor's scale comes from its own amax, computed on the device
    right before it is cast (one extra pass over the tensor): scale = fmt.max / amax / 2**margin."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _refuse_fp8_attention(self)
        if self.fp8_format is Format.E5M2:
            raise ValueError("CurrentScaling: pure E5M2 training is not supported; use Format.HYBRID or Format.E4M3")
        if not (0 <= self.margin < 64):
            raise ValueError(f"CurrentScaling: margin must be in [0, 64), got {self.margin!r}")


Float8CurrentScaling = CurrentScaling  # Transformer Engine's name
