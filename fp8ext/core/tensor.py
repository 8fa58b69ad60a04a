"""FP8Tensor and Quantizer: an FP8 operand as one object, and the cast that makes it for one tensor role.

FP8Tensor bundles what travels together through the casts and the GEMMs (Transformer Engine's
Float8TensorStorage, torchao's Float8TrainingTensor):
    data       the FP8 values [rows, cols], torch.float8_e4m3fn or torch.float8_e5m2
    data_t     their transposed copy [cols, rows], or None: cuBLASLt's FP8 GEMMs take only the "TN" layout, so
               the backward GEMMs read the transposed copies that the casts wrote in the same pass
    scale_inv  float32 on data's device, the factor that dequantizes (x ~ float(q) * scale_inv)
    fmt        the FP8Format
    layout     how scale_inv applies: TENSOR (one element), ROW ([rows]), BLOCK_1x128 ([rows, ceil(cols/128)]) or
               BLOCK_128x128 (see fp8ext.gemm)
    scale_inv_t  data_t's own scale_inv where the layout is not TENSOR (a row-wise or 1 x 128 scale of the
               transposed tensor is not the transpose of the tensor's: data_t is a cast of its own), else None
    scale      the per-tensor scale the cast multiplied by (a float32 tensor frozen at the cast), kept only when the
               caller asked (Quantizer.quantize(keep_scale=True)): with it the same bytes can be cast again from the
               high-precision tensor later (FP8Linear's backward recasts instead of saving FP8 copies), else None
A plain class with __slots__, not a torch.Tensor subclass: building one costs a few attribute stores and no
dispatch, which matters on a layer's host path.

A Quantizer is the cast of one tensor role (a layer's input, weight or output gradient): its format, its margin,
its scale layout and, per tensor, its scaling slot. One subclass per kind of scaling (Transformer Engine's names):
    Float8Quantizer                per tensor, by a scale held in a slot: an FP8ScalingManager's (delayed scaling: the
                                   cast reads the scale and records the tensor's amax there) or tensors of its own
    Float8CurrentScalingQuantizer  per tensor, by the tensor's own amax (current scaling)
    Float8BlockQuantizer           per 1 x 128 tile or 128 x 128 block, by each one's own amax (block scaling)
    Float8RowwiseQuantizer         per row, by each row's own amax (row-wise scaling)
Recipes make them (fp8ext.core.recipe: Recipe.make_quantizers); Quantizer(...) with the old arguments picks the
subclass. role_quantizers(recipe) gives, shared by all layers, the three Quantizers of a recipe that keeps no state.
This file holds no linear-layer logic (fp8ext/modules/linear.py, linear_plan.py) and no kernels
(fp8ext/core/casts.py, csrc/).
"""

from __future__ import annotations

from typing import Optional

import torch

from .formats import FP8Format
from .casts import amax as _amax
from .casts import cast_transpose, cast_transpose_dbias, quantize_blocks_t, scale_from_amax

__all__ = ["FP8Tensor", "Quantizer", "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer",
           "Float8RowwiseQuantizer", "TENSOR", "ROW", "BLOCK_1x128", "BLOCK_128x128", "role_quantizers"]

TENSOR, ROW, BLOCK_1x128, BLOCK_128x128 = "tensor", "row", "1x128", "128x128"
_to_dl = torch._C._to_dlpack


class FP8Tensor:
    """FP8 data with its transposed copy (or None), its scale_inv, its format and its scale layout (see above)."""

    __slots__ = ("data", "data_t", "scale_inv", "fmt", "layout", "scale_inv_t", "scale")

    def __init__(self, data: torch.Tensor, data_t: Optional[torch.Tensor], scale_inv: torch.Tensor, fmt: FP8Format,
                 layout: str = TENSOR, scale_inv_t: Optional[torch.Tensor] = None, *,
                 scale: Optional[torch.Tensor] = None):
        self.data, self.data_t, self.scale_inv, self.fmt, self.layout = data, data_t, scale_inv, fmt, layout
        self.scale_inv_t, self.scale = scale_inv_t, scale

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> "FP8Tensor":
        """The transposed operand: data and data_t swapped, with their scale_invs (a per-tensor scale applies to
        both)."""
        if self.data_t is None or (self.layout != TENSOR and self.scale_inv_t is None):
            raise ValueError("FP8Tensor.t(): needs the transposed copy (and its scale_inv unless the scale is "
                             "per tensor)")
        if self.layout == TENSOR:
            return FP8Tensor(self.data_t, self.data, self.scale_inv, self.fmt)
        return FP8Tensor(self.data_t, self.data, self.scale_inv_t, self.fmt, self.layout, self.scale_inv)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data times its per-tensor scale_inv in float32, rounded once to dtype (what fp8ext's dequantize kernel
        computes); per-tensor scales only."""
        if self.layout != TENSOR or self.scale_inv.numel() != 1:
            raise ValueError(f"FP8Tensor.dequantize(): takes a per-tensor scale, this one's layout is {self.layout} "
                             f"with {self.scale_inv.numel()} scales")
        return (self.data.float() * self.scale_inv.float().reshape(())).to(dtype)

    def __repr__(self) -> str:
        return (f"FP8Tensor({self.fmt.name}, shape={list(self.data.shape)}, transposed copy="
                f"{self.data_t is not None}, scale layout={self.layout}, device={self.data.device})")


class Quantizer:
    """The FP8 cast of one tensor role: format, margin (TE's exponent), scale layout and, per tensor, scaling slot.
    The base class of the four kinds (see the module docstring); a recipe of one's own may add a fifth by overriding
    quantize (and quantize_dbias where a pass can give the bias gradient too).

    Quantizer(fmt, margin, manager=None, slot=None, *, scale=None, amax=None, granularity=TENSOR, power_2_scale=False,
    amax_epsilon=0.0) makes the kind these arguments describe: a manager's slot or a scale tensor -> Float8Quantizer;
    per tensor without -> Float8CurrentScalingQuantizer; ROW -> Float8RowwiseQuantizer; 1 x 128 or 128 x 128 ->
    Float8BlockQuantizer. A manager slot's views are taken once; they stay valid until the manager's buffers are
    reallocated, which `current()` tells.
    """

    __slots__ = ("fmt", "margin", "scale", "amax", "capsules", "manager", "_slot", "_generation", "granularity",
                 "power_2_scale", "amax_epsilon")

    def __new__(cls, fmt=None, margin=0.0, manager=None, slot=None, *, scale=None, amax=None, granularity=TENSOR,
                **_):
        if cls is Quantizer:  # the kind the arguments describe
            if granularity == TENSOR:
                cls = Float8Quantizer if manager is not None or scale is not None else Float8CurrentScalingQuantizer
            else:
                cls = Float8RowwiseQuantizer if granularity == ROW else Float8BlockQuantizer
        return object.__new__(cls)

    def __init__(self, fmt: FP8Format, margin: float = 0.0, manager=None, slot: Optional[int] = None, *,
                 scale: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None,
                 granularity: str = TENSOR, power_2_scale: bool = False, amax_epsilon: float = 0.0):
        if granularity not in (TENSOR, ROW, BLOCK_1x128, BLOCK_128x128):
            raise ValueError(f"Quantizer: granularity must be one of {TENSOR!r}, {ROW!r}, {BLOCK_1x128!r}, "
                             f"{BLOCK_128x128!r}, got {granularity!r}")
        if granularity != TENSOR and (manager is not None or scale is not None or margin):
            raise ValueError(f"Quantizer: {granularity!r} scales come from each block's own amax: no scaling slot and "
                             f"no margin")
        self.fmt, self.margin, self.manager, self._slot = fmt, float(margin), manager, slot
        self.granularity, self.power_2_scale, self.amax_epsilon = granularity, bool(power_2_scale), float(amax_epsilon)
        if manager is None:
            self.scale, self.amax, self._generation = scale, amax, None
        else:
            self._generation = manager.generation
            self.scale, _, self.amax = manager.views(slot)
        # DLPack capsules of (scale, amax) for fp8ext._C's one-call paths, made once (C borrows a capsule and never
        # consumes it); valid while current()
        self.capsules = None if self.scale is None or self.amax is None else (_to_dl(self.scale), _to_dl(self.amax))

    def current(self) -> bool:
        """Whether the slot views are still the manager's (always, without a manager)."""
        return self.manager is None or self.manager.generation == self._generation

    def slot_views(self):
        """(scale, amax) of the slot as a cast uses it now: the quantizer's views, or fresh ones when the manager's
        buffers were reallocated since they were taken (in eager mode; a compiled graph keeps what it traced). A
        layer's backward runs after its forward, and other layers may register in between."""
        if self.manager is not None and not torch.compiler.is_compiling() and not self.current():
            scale, _, amax = self.manager.views(self._slot)
            return scale, amax
        return self.scale, self.amax

    def slot_capsules(self):
        """DLPack capsules (scale, amax) of slot_views(): `capsules`, or fresh ones when the views are stale."""
        if self.manager is None or self.manager.generation == self._generation:
            return self.capsules
        return tuple(_to_dl(t) for t in self.slot_views())

    def quantize(self, t2d: torch.Tensor, keep_scale: bool = False) -> FP8Tensor:
        """t2d [rows, cols] cast to FP8 with its transposed copy (the FP8Tensor's data_t), as this kind scales.
        keep_scale (per tensor only): the FP8Tensor keeps the scale it was cast with, for recast_t()."""
        raise NotImplementedError(f"{type(self).__name__}.quantize")

    def quantize_dbias(self, t2d: torch.Tensor):
        """(quantize(t2d), the float32 column sums of t2d): an output gradient's cast with its bias gradient (summed
        apart here; the per-tensor kinds take both from one pass)."""
        return self.quantize(t2d), t2d.sum(0, dtype=torch.float32)

    @staticmethod
    def recast_t(t2d: torch.Tensor, fmt: FP8Format, scale: torch.Tensor, scale_inv: torch.Tensor) -> FP8Tensor:
        """The transposed FP8 operand of an earlier per-tensor cast of t2d, made again from t2d with the scale that
        cast used (FP8Tensor.scale): the same bytes, no amax recorded (the first cast did)."""
        _, qt = cast_transpose(t2d, fmt, scale)
        return FP8Tensor(qt, None, scale_inv, fmt)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fmt.name}, {self.granularity} scales)"


class Float8Quantizer(Quantizer):
    """Per tensor, by the scale in its slot (delayed scaling: an FP8ScalingManager's; or scale/amax tensors of its
    own): cast_transpose in one pass, the tensor's amax recorded in the slot."""

    __slots__ = ()

    def _scale_for(self, t2d: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        return scale

    def quantize(self, t2d: torch.Tensor, keep_scale: bool = False) -> FP8Tensor:
        """t2d cast per tensor with its transposed copy in one pass (cast_transpose). keep_scale: the FP8Tensor keeps
        the scale it was cast with (a slot's scale copied, since the manager updates the slot in place)."""
        scale, amax = self.slot_views()
        kept = scale.clone() if keep_scale and scale is not None else None
        scale = self._scale_for(t2d, scale)
        scale_inv = torch.empty((), dtype=torch.float32, device=t2d.device)
        q, qt = cast_transpose(t2d, self.fmt, scale, amax_out=amax, scale_inv_out=scale_inv)
        kept = (kept if kept is not None else scale) if keep_scale else None
        return FP8Tensor(q, qt, scale_inv, self.fmt, scale=kept)

    def quantize_dbias(self, t2d: torch.Tensor):
        """(quantize(t2d), the float32 column sums of t2d) from one pass (cast_transpose_dbias)."""
        scale, amax = self.slot_views()
        scale = self._scale_for(t2d, scale)
        dev = t2d.device
        m, n = t2d.shape
        scale_inv = torch.empty((), dtype=torch.float32, device=dev)
        out = (torch.empty((m, n), dtype=self.fmt.torch_dtype, device=dev),
               torch.empty((n, m), dtype=self.fmt.torch_dtype, device=dev),
               torch.empty((n,), dtype=torch.float32, device=dev))
        q, qt, db = cast_transpose_dbias(t2d, self.fmt, scale, amax, scale_inv_out=scale_inv, out=out)
        return FP8Tensor(q, qt, scale_inv, self.fmt), db

    def __repr__(self) -> str:
        how = f"slot {self._slot}" if self.manager is not None else "own scale"
        return f"Float8Quantizer({self.fmt.name}, margin={self.margin}, {how})"


class Float8CurrentScalingQuantizer(Float8Quantizer):
    """Per tensor, by the tensor's own amax, computed on the device right before the cast (current scaling):
    scale = fmt.max / amax / 2**margin."""

    __slots__ = ()

    def _scale_for(self, t2d: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
        if scale is None:
            scale, _ = scale_from_amax(_amax(t2d), self.fmt, self.margin)
        return scale

    def __repr__(self) -> str:
        return f"Float8CurrentScalingQuantizer({self.fmt.name}, margin={self.margin})"


class Float8BlockQuantizer(Quantizer):
    """Per 1 x 128 tile or 128 x 128 block, by each one's own amax: t2d and its transpose each cast with their own
    scales (a 128 x 128 block's transposed copy is the cast's bytes transposed, with the block scales transposed)."""

    __slots__ = ()

    def quantize(self, t2d: torch.Tensor, keep_scale: bool = False) -> FP8Tensor:
        # both casts in one call (row counts here are multiples of 16: see linear_autograd._pad_rows); row-wise, a
        # column's scale needs the whole column, so its transposed cast takes passes of its own
        kind = self.granularity
        q, s, qt, st = quantize_blocks_t(t2d, self.fmt, kind, self.power_2_scale, self.amax_epsilon)
        return FP8Tensor(q, qt, s, self.fmt, kind, st)

    def __repr__(self) -> str:
        pow2 = ", power-of-two scales" if self.power_2_scale else ""
        return f"{type(self).__name__}({self.fmt.name}, {self.granularity} scales{pow2})"


class Float8RowwiseQuantizer(Float8BlockQuantizer):
    """Per row, by each row's own amax; the transposed copy is a cast of its own, one scale per column."""

    __slots__ = ()


_role_quantizers = {}  # recipe -> its (input, weight, grad_output) Quantizers: stateless, so shared by all layers


def role_quantizers(recipe):
    """The (input, weight, grad_output) Quantizers of an FP8 linear layer under a recipe that keeps no state across
    steps (recipe.make_quantizers(), made once per recipe and shared by every layer). A stateful recipe's quantizers
    hold a layer's slots: FP8Linear makes those."""
    q = _role_quantizers.get(recipe)
    if q is None:
        if recipe.stateful:
            raise TypeError(f"role_quantizers(): {type(recipe).__name__} keeps scaling state per layer (FP8Linear "
                            f"makes its quantizers)")
        q = _role_quantizers[recipe] = tuple(recipe.make_quantizers())
    return q
