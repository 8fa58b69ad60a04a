"""FP8 recipes: how the FP8Linear layers inside an fp8_autocast scale their tensors.

Names and defaults are Transformer Engine's (transformer_engine.common.recipe), so TE code ports by
changing an import. A recipe is a frozen value: two equal recipes share one FP8ScalingManager.

    DelayedScaling        one scale per tensor, from the amax history of earlier steps (TE's default)
    CurrentScaling        one scale per tensor, from the tensor's own amax (TE's Float8CurrentScaling)
    Float8BlockScaling    one scale per 1 x 128 tile of activations and gradients and per 128 x 128 block of weights
                          (DeepSeek-V3's recipe, TE's Float8BlockScaling)
    Float8RowwiseScaling  one scale per row of each GEMM operand (torchao's "rowwise" recipe)
The last three need no state across steps: each cast scales by what it is casting.

Every recipe is a Recipe: a frozen dataclass that says, in one place, how each tensor role of a linear layer is
scaled, by making the layer's three Quantizers (fp8ext.core.tensor: a subclass per kind of scaling). Layers, the
fused paths, the graphs, the FSDP all-gather and the training script ask a recipe's quantizers and its `stateful`
flag, never its class, so a new recipe is one new class (docs/contributing.md, "How to add a recipe").
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from .formats import Format
from .tensor import (BLOCK_1x128, BLOCK_128x128, Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer,
                     Float8RowwiseQuantizer)

__all__ = ["Format", "Recipe", "DelayedScaling", "CurrentScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "Float8RowwiseScaling", "QParams", "MMParams"]


def _refuse_fp8_attention(recipe, dpa: bool) -> None:
    """Transformer Engine's attention fields: fp8_dpa (FP8 attention in fp8ext.DotProductAttention) is accepted where
    `dpa` says the recipe has it (per-tensor scales); fp8_mha=True (attention's FP8 output handed to the output
    projection) sets fp8_dpa=True, as TE does."""
    name = type(recipe).__name__
    if recipe.fp8_mha and not recipe.fp8_dpa and dpa:
        object.__setattr__(recipe, "fp8_dpa", True)  # TE: "Forcing fp8_dpa=True due to fp8_mha=True"
    if (recipe.fp8_dpa or recipe.fp8_mha) and not dpa:
        field = "fp8_mha" if recipe.fp8_mha else "fp8_dpa"
        raise NotImplementedError(f"{name}: {field}=True (FP8 attention) is not supported with this recipe; "
                                  f"fp8ext.DotProductAttention computes in FP8 under DelayedScaling or "
                                  f"Float8CurrentScaling with fp8_dpa=True (or fp8_mha=True)")


class Recipe:
    """The base of fp8ext's recipes. A subclass is a frozen dataclass (equal recipes share their scaling state) with
    an `fp8_format` field, and says how an FP8 linear layer scales its input, its weight and its output gradient:

        make_quantizers(manager=None, slots=None) -> (input, weight, grad_output) Quantizers
        stateful   False: each cast scales by what it casts, and one set of quantizers serves every layer
                   (make_quantizers() is called once per recipe); True: scales kept across steps in the recipe's
                   FP8ScalingManager (delayed scaling): each layer registers three slots, with role_formats(), and
                   make_quantizers(manager, slots) makes the quantizers over them

        per_tensor True: one scale per tensor in every role (prepare_fp8's recast_in_backward and FSDP's FP8
                   all-gather take only such recipes)

    Transformer Engine's fp8_dpa field (FP8 attention in fp8ext.DotProductAttention) is accepted as True by the
    per-tensor recipes, and so is fp8_mha (which sets fp8_dpa too: attention's FP8 output into the output
    projection, in inference; see DelayedScaling)."""

    stateful = False
    per_tensor = False  # one scale per tensor in every role (recast in backward and FSDP's FP8 all-gather need it)

    def role_formats(self):
        """The FP8 formats of (input, weight, grad_output): the forward's format for the first two."""
        return self.fp8_format.fwd, self.fp8_format.fwd, self.fp8_format.bwd

    def make_quantizers(self, manager=None, slots=None):
        raise NotImplementedError(f"{type(self).__name__}.make_quantizers: a recipe says how each tensor role is "
                                  f"scaled by making the layer's (input, weight, grad_output) Quantizers")


def check_recipe(recipe, where: str, none_ok: bool = False):
    """`recipe` if it is a Recipe (or None with none_ok), else the TypeError that names `where`."""
    if isinstance(recipe, Recipe) or (none_ok and recipe is None):
        return recipe
    if none_ok:
        raise TypeError(f"{where}: fp8_recipe must be None or a recipe (DelayedScaling, Float8CurrentScaling, "
                        f"Float8BlockScaling, Float8RowwiseScaling or another fp8ext.Recipe), got "
                        f"{type(recipe).__name__}")
    raise TypeError(f"{where}: fp8_recipe must be DelayedScaling or CurrentScaling (per tensor), Float8BlockScaling "
                    f"or Float8RowwiseScaling (or another fp8ext.Recipe), got {type(recipe).__name__}")


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor's scale comes from the amax of earlier steps.

    scale = fmt.max / amax / 2**margin, with amax the largest value in the tensor's history of the last
    `amax_history_len` steps ("max") or the last step's ("most_recent"). When amax is 0 the previous scale
    is kept; when a step's amax is NaN or Inf (an overflow) the scale shrinks by `backoff_factor` (the
    loss-scaling rule; TE keeps the scale instead) and that entry never counts as a maximum.
    A negative entry (only a corrupted or hand-written state has one) counts as 0, without backoff.
    Scales are recomputed every `interval` steps, for all tensors in one fused kernel. reduce_amax: with
    an fp8_group, the amaxes are max-reduced across it before the update. fp8_format: Format.HYBRID (E4M3
    forward, E5M2 gradients, the default) or Format.E4M3; pure E5M2 training is refused, as TE does.
    fp8_dpa=True: fp8ext.DotProductAttention computes in FP8 (with current scales of its own, as
    fp8ext.ops.attention_fp8 says). fp8_mha=True sets fp8_dpa=True as well, and in inference (a model quantized by
    fp8ext.inference.quantize_model, under torch.no_grad()) fp8ext's transformer hands attention's FP8 output to
    the output projection without a bf16 round trip; with RoPE between the QKV projection and attention, Q, K and V
    are cast after it (Transformer Engine's MultiheadAttention does the same). fp8ext's transformer refuses it in
    training and under torch.compile, a Hugging Face model always; fp8ext.DotProductAttention alone computes as
    with fp8_dpa, its output in FP8 only when called with fp8_output=True (as TE's).
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
    stateful = per_tensor = True  # class attributes (not annotated: not fields)

    def make_quantizers(self, manager=None, slots=None):
        """Per tensor, by the scales in the layer's three slots of `manager` (a Float8Quantizer each)."""
        return tuple(Float8Quantizer(f, self.margin, manager, s) for f, s in zip(self.role_formats(), slots))

    def __post_init__(self):
        _refuse_fp8_attention(self, dpa=True)
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
class CurrentScaling(Recipe):
    """Current (just-in-time) scaling: each tensor's scale comes from its own amax, computed on the device
    right before it is cast (one extra pass over the tensor): scale = fmt.max / amax / 2**margin.
    fp8_dpa=True: fp8ext.DotProductAttention computes in FP8 (fp8ext.ops.attention_fp8); fp8_mha=True as in
    DelayedScaling."""

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    per_tensor = True

    def make_quantizers(self, manager=None, slots=None):
        """Per tensor, each by its own amax (a Float8CurrentScalingQuantizer each)."""
        return tuple(Float8CurrentScalingQuantizer(f, self.margin) for f in self.role_formats())

    def __post_init__(self):
        _refuse_fp8_attention(self, dpa=True)
        if self.fp8_format is Format.E5M2:
            raise ValueError("CurrentScaling: pure E5M2 training is not supported; use Format.HYBRID or Format.E4M3")
        if not (0 <= self.margin < 64):
            raise ValueError(f"CurrentScaling: margin must be in [0, 64), got {self.margin!r}")


Float8CurrentScaling = CurrentScaling  # Transformer Engine's name


def _check_epsilon(eps, name: str) -> None:
    """amax_epsilon: a number in [0, the float32 maximum] (the casts take it as a float32)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps <= 3.4028234663852886e38:
        raise ValueError(f"{name}: amax_epsilon must be a finite number >= 0 that fits a float32, got {eps!r}")


@dataclass(frozen=True)
class QParams:
    """How one tensor role of Float8BlockScaling computes its scales (Transformer Engine's QParams): power_2_scale
    rounds each scale down to a power of two (then scale_inv is exact); amax_epsilon raises each block's amax to at
    least that value before the scale is computed."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self):
        _check_epsilon(self.amax_epsilon, "QParams")


@dataclass(frozen=True)
class MMParams:
    """GEMM options of one of Float8BlockScaling's GEMMs (Transformer Engine's MMParams). Block-scaled FP8 GEMMs
    accumulate in full precision on Hopper (cuBLASLt has no fast accumulation with block scales), so only
    use_split_accumulator=True is accepted."""

    use_split_accumulator: bool = True


# Transformer Engine's switch for float32 (not power-of-two) block scales, read the way TE reads it
_BLOCK_POW2 = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1"


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """Block scaling (DeepSeek-V3's recipe; Transformer Engine's Float8BlockScaling with its names and defaults):
    every FP8 cast scales each block of the tensor by that block's own amax, scale = fmt.max / amax (a power of two
    by default), computed as the tensor is cast; nothing is kept across steps.

    x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 for 1 x 128 tiles (128 consecutive values of
    a row), 2 for 128 x 128 blocks; defaults 1 (input), 2 (weight), 1 (output gradient). Each GEMM reads its
    operands tiled along the dimension it contracts, so a 1 x 128-tiled tensor that a backward GEMM reads
    transposed is cast a second time, from the high-precision tensor, in tiles along the other dimension (as TE
    does: the FP8 tensor and its transpose are not the same numbers); a 128 x 128 block serves both. cuBLASLt on
    Hopper takes 128 x 128 scales on the weight's side only, so fp8ext accepts x_block_scaling_dim=1 and
    grad_block_scaling_dim=1. fp8_format: Format.E4M3 (the default: every tensor E4M3) or Format.HYBRID (output
    gradients E5M2). fp8_quant_fwd_inp / fp8_quant_fwd_weight / fp8_quant_bwd_grad: QParams per role
    (power_2_scale True by default; NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 makes it False, as in TE).
    fp8_gemm_fprop / fp8_gemm_dgrad / fp8_gemm_wgrad: MMParams, split accumulation only. fp8_dpa / fp8_mha (FP8
    attention) are accepted only as False (FP8 attention needs DelayedScaling or Float8CurrentScaling).
    Layers need in_features and out_features that are multiples of 16 (as with every recipe); tiles at the edges
    of a dimension that is not a multiple of 128 are partial.
    """

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = QParams(power_2_scale=_BLOCK_POW2)
    fp8_quant_fwd_weight: QParams = QParams(power_2_scale=_BLOCK_POW2)
    fp8_quant_bwd_grad: QParams = QParams(power_2_scale=_BLOCK_POW2)
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = MMParams()
    fp8_gemm_dgrad: MMParams = MMParams()
    fp8_gemm_wgrad: MMParams = MMParams()
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def make_quantizers(self, manager=None, slots=None):
        """Per 1 x 128 tile or 128 x 128 block of each role, as its *_block_scaling_dim says (Float8BlockQuantizer)."""
        roles = ((self.x_block_scaling_dim, self.fp8_quant_fwd_inp),
                 (self.w_block_scaling_dim, self.fp8_quant_fwd_weight),
                 (self.grad_block_scaling_dim, self.fp8_quant_bwd_grad))
        return tuple(Float8BlockQuantizer(f, 0, granularity=BLOCK_1x128 if dim == 1 else BLOCK_128x128,
                                          power_2_scale=qp.power_2_scale, amax_epsilon=qp.amax_epsilon)
                     for f, (dim, qp) in zip(self.role_formats(), roles))

    def __post_init__(self):
        name = "Float8BlockScaling"
        _refuse_fp8_attention(self, dpa=False)
        _check_format(self.fp8_format, name)
        for field in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, field) not in (1, 2):
                raise ValueError(f"{name}: {field} must be 1 (1 x 128 tiles) or 2 (128 x 128 blocks), got "
                                 f"{getattr(self, field)!r}")
        for field in ("x_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, field) == 2:
                raise NotImplementedError(f"{name}: {field}=2 is not supported by fp8ext: cuBLASLt on Hopper takes "
                                          f"128 x 128 scales only on the weight's side of a GEMM; use 1")
        for field in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            if not isinstance(getattr(self, field), QParams):
                raise TypeError(f"{name}: {field} must be a fp8ext.recipe.QParams, got {getattr(self, field)!r}")
        for field in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            mm = getattr(self, field)
            if not isinstance(mm, MMParams) or not mm.use_split_accumulator:
                raise ValueError(f"{name}: {field} must be MMParams(use_split_accumulator=True): block-scaled FP8 "
                                 f"GEMMs accumulate in full precision, got {mm!r}")


@dataclass(frozen=True)
class Float8RowwiseScaling(Recipe):
    """Row-wise scaling (torchao's "rowwise" recipe): every GEMM operand is cast with one scale per row along the
    dimension the GEMM contracts, scale = fmt.max / max|row| (a power of two with power_2_scale, torchao's
    round_scales_to_power_of_2, the default), computed as the tensor is cast; nothing is kept across steps. A
    tensor that a backward GEMM reads transposed (the input, the weight and the output gradient each are) is cast a
    second time, from the high-precision tensor, with one scale per column.
    fp8_format: Format.E4M3 (the default, as torchao's rowwise casts gradients to E4M3 too) or Format.HYBRID.
    amax_epsilon: each row's amax is raised to at least this first. The forward GEMM uses fast accumulation (as
    torchao's and fp8ext's per-tensor recipes do), the backward GEMMs do not. fp8_dpa / fp8_mha accepted only as
    False (FP8 attention needs DelayedScaling or Float8CurrentScaling). Name: Transformer Engine has no row-wise
    recipe; this follows TE's Float8*Scaling names."""

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def make_quantizers(self, manager=None, slots=None):
        """Per row of each role (Float8RowwiseQuantizer)."""
        return tuple(Float8RowwiseQuantizer(f, 0, granularity="row", power_2_scale=self.power_2_scale,
                                            amax_epsilon=self.amax_epsilon) for f in self.role_formats())

    def __post_init__(self):
        _refuse_fp8_attention(self, dpa=False)
        _check_format(self.fp8_format, "Float8RowwiseScaling")
        _check_epsilon(self.amax_epsilon, "Float8RowwiseScaling")


def _check_format(fmt, name: str) -> None:
    if not isinstance(fmt, Format):
        raise TypeError(f"{name}: fp8_format must be a fp8ext.Format, got {fmt!r}")
    if fmt is Format.E5M2:
        raise ValueError(f"{name}: pure E5M2 training is not supported (as in Transformer Engine); use Format.E4M3 "
                         f"or Format.HYBRID")


RECIPES = (DelayedScaling, CurrentScaling, Float8BlockScaling, Float8RowwiseScaling)
