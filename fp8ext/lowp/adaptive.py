"""Adaptive weight precision: one storage format per linear layer, chosen from measured sensitivities so that
the weights fit a byte budget with the least loss.

    plan = fp8ext.adaptive.assign_precision(model, calib_batches, budget=0.35)   # 35 % of the bf16 bytes
    print(plan.summary())               # per layer: format, bytes, its measured loss increase
    plan.apply(model)                   # weights replaced by their quantized-and-dequantized values

Layer-based strategy, in three steps:
1. Sensitivity. For every linear layer l and every candidate format F, the model is evaluated on
   `calib_batches` with only l's weight replaced by fake_quantize_weight(w_l, F), every other layer as given;
   s(l, F) = loss(l in F) - loss(as given). That is len(layers) * len(formats) passes over the batches (a
   progress bar counts them); a format that leaves the weight unchanged (bf16 on a model trained in bf16)
   costs no pass and has s = 0.
2. Assignment. The loss of a mixed assignment is predicted as loss(as given) + sum_l s(l, F_l) (layers assumed
   independent, which holds to first order for small perturbations). Minimising sum_l max(s(l, F_l), 0) with
   sum_l bytes(l, F_l) <= budget is a multiple-choice knapsack, solved exactly by dynamic programming over the
   byte axis: the bytes are counted in units of the greatest common divisor of all candidate sizes, so the
   table is exact as long as it has at most `max_cells` cells. Larger problems use units of budget /
   max_cells with every size rounded up: the plan still fits the budget and loses at most
   len(layers) units of it against the optimum (`plan.exact` says which). A negative s (quantization noise
   that happened to lower the calibration loss) counts as 0: a format is never preferred to bf16 because of
   noise, and among equal sums the plan with more bytes wins, so a budget that fits everything in bf16 keeps
   everything in bf16. A greedy (upgrade the layer with the best loss saved per byte) is simpler but can
   miss the optimum when sizes differ; the exact table costs milliseconds for hundreds of layers.
3. Measurement. The chosen plan is applied and the loss measured (on `eval_batches`, default the calibration
   batches), next to the prediction.

`budget`: an int is bytes; a float in (0, 1] is a fraction of the bf16 bytes of the layers considered. Bytes
count the weight matrices of those layers and their scales only (biases, embeddings and norms are not part
of it). Sizes of an [N, K] weight (bits per weight in brackets):

    bf16        2 N K                          (16)
    fp8         N K + 4 N    E4M3, one float32 scale 448 / amax per output row     (8 + 32 / K)
    fp8_tensor  N K + 4      E4M3, one float32 scale for the tensor                 (8)
    mxfp8       N K + N K / 32         E4M3 in MX blocks of 32, E8M0 scales         (8.25)
    mxfp6       3 N K / 4 + N K / 32   E3M2 in MX blocks of 32                      (6.25)
    mxfp6_e2m3  3 N K / 4 + N K / 32   E2M3 in MX blocks of 32                      (6.25)
    fp6_tensor  ceil(3 N K / 4) + 4    E3M2, one float32 scale max / amax           (6)
    mxfp4       N K / 2 + N K / 32     E2M1 in MX blocks of 32                      (4.25)
    nvfp4       N K / 2 + N K / 16 + 4 E2M1 in blocks of 16, E4M3 block scales      (4.5)
    fp4_tensor  ceil(N K / 2) + 4      E2M1, one float32 scale 6 / amax             (4)

MX formats need K to be a multiple of 32 (NVFP4: 16); a layer where a format does not apply simply does not
get that format. Embeddings and the output head are skipped by default (`ignore`, the inference pipeline's
DEFAULT_IGNORE).

Batches and losses: without `loss_fn` a batch is passed as model(*batch) (a tuple or list) or model(batch),
and the output must be the loss (a 0-d tensor) or a tuple ending with it (fp8ext's Transformer:
model(ids, targets) -> (logits, loss)). With `loss_fn`, a batch is (inputs, targets) and the loss is
loss_fn(model(inputs), targets). Perplexities are exp(mean loss), meaningful when the loss is a mean
cross-entropy in nats.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..core.formats import E2M1, E3M2, E2M3, E4M3
from ..inference.quantize import DEFAULT_IGNORE, _ignored
from ..modules.linear import FP8Linear
from ..ops.mx import dequantize_mx, dequantize_nvfp4, quantize_mx, quantize_nvfp4
from ..ops import dequantize, quantize

__all__ = ["WEIGHT_FORMATS", "BITS_PER_WEIGHT", "DEFAULT_FORMATS", "fake_quantize_weight", "weight_bytes",
           "format_applies", "measure_sensitivity", "assign_precision", "uniform_plan", "plot_tradeoff",
           "Sensitivity", "PrecisionPlan", "Tradeoff"]

# nominal bits per weight (the per-row and per-tensor float32 scales come on top, see weight_bytes)
BITS_PER_WEIGHT: Dict[str, float] = {
    "bf16": 16.0, "fp8": 8.0, "fp8_tensor": 8.0, "mxfp8": 8.25, "mxfp6": 6.25, "mxfp6_e2m3": 6.25,
    "fp6_tensor": 6.0, "mxfp4": 4.25, "nvfp4": 4.5, "fp4_tensor": 4.0,
}
WEIGHT_FORMATS: Tuple[str, ...] = tuple(BITS_PER_WEIGHT)
DEFAULT_FORMATS: Tuple[str, ...] = ("mxfp4", "mxfp6", "fp8", "bf16")
_BLOCK = {"mxfp8": 32, "mxfp6": 32, "mxfp6_e2m3": 32, "mxfp4": 32, "nvfp4": 16}
_MX_ELEM = {"mxfp8": E4M3, "mxfp6": E3M2, "mxfp6_e2m3": E2M3, "mxfp4": E2M1}
_TENSOR_ELEM = {"fp8_tensor": E4M3, "fp6_tensor": E3M2, "fp4_tensor": E2M1}

Budget = Union[int, float]


def _check_fmt(fmt, fn: str, arg: str = "fmt") -> str:
    if not isinstance(fmt, str) or fmt not in BITS_PER_WEIGHT:
        raise ValueError(f"{fn}(): {arg} must be one of {list(WEIGHT_FORMATS)}, got {fmt!r}")
    return fmt


def _check_shape(shape, fn: str) -> Tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{fn}(): a weight must be 2-D [out_features, in_features] and non-empty, got shape "
                         f"{list(shape)}")
    return shape


def format_applies(shape: Sequence[int], fmt: str) -> bool:
    """Whether `fmt` can store a weight of this shape: MX formats need in_features % 32 == 0, NVFP4 % 16."""
    n, k = _check_shape(shape, "format_applies")
    return k % _BLOCK.get(_check_fmt(fmt, "format_applies"), 1) == 0


def weight_bytes(shape: Sequence[int], fmt: str) -> int:
    """Bytes of an [N, K] weight stored in `fmt`, its scales included (table in the module docstring)."""
    fn = "weight_bytes"
    n, k = _check_shape(shape, fn)
    _check_fmt(fmt, fn)
    if not format_applies((n, k), fmt):
        raise ValueError(f"{fn}(): {fmt} needs in_features to be a multiple of {_BLOCK[fmt]}, got shape {[n, k]}")
    nk = n * k
    return {
        "bf16": 2 * nk,
        "fp8": nk + 4 * n,
        "fp8_tensor": nk + 4,
        "mxfp8": nk + nk // 32,
        "mxfp6": 3 * nk // 4 + nk // 32,
        "mxfp6_e2m3": 3 * nk // 4 + nk // 32,
        "fp6_tensor": -(-3 * nk // 4) + 4,
        "mxfp4": nk // 2 + nk // 32,
        "nvfp4": nk // 2 + nk // 16 + 4,
        "fp4_tensor": -(-nk // 2) + 4,
    }[fmt]


@torch.no_grad()
def fake_quantize_weight(w: torch.Tensor, fmt: str, *, scale_rule: str = "floor") -> torch.Tensor:
    """The weight `w` [N, K] stored in `fmt` and read back: quantized, then dequantized to float32 (w's shape
    and device). Formats (see the module docstring): "bf16" (w rounded to bfloat16), "fp8" (E4M3, scale
    448 / amax per output row, as fp8ext.quantize_rowwise), "fp8_tensor" / "fp6_tensor" / "fp4_tensor"
    (E4M3 / E3M2 / E2M1 with one float32 scale max / amax), "mxfp8" / "mxfp6" / "mxfp6_e2m3" / "mxfp4"
    (fp8ext.quantize_mx with E4M3 / E3M2 / E2M3 / E2M1, blocks of 32 along K, `scale_rule` "floor" or
    "rceil") and "nvfp4" (fp8ext.quantize_nvfp4). Rounding is fp8ext's (round to nearest even, saturating).
    The block formats run on the CPU; a CUDA weight is copied there and the result copied back."""
    fn = "fake_quantize_weight"
    if not isinstance(w, torch.Tensor) or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}(): w must be a float32, bfloat16 or float16 tensor, got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    _check_fmt(fmt, fn)
    _check_shape(w.shape, fn)
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"{fn}(): scale_rule must be 'floor' or 'rceil', got {scale_rule!r}")
    if not format_applies(w.shape, fmt):
        raise ValueError(f"{fn}(): {fmt} needs in_features (w.shape[1]) to be a multiple of {_BLOCK[fmt]}, got "
                         f"shape {list(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError(f"{fn}(): w holds NaN or Inf")
    device = w.device
    x = w.detach().float().cpu().contiguous()
    if fmt == "bf16":
        out = x.to(torch.bfloat16).float()
    elif fmt == "fp8":
        amax = x.abs().amax(dim=1)
        scale = torch.where(amax > 0, torch.tensor(E4M3.max, dtype=torch.float32) / amax, torch.ones_like(amax))
        q = quantize((x * scale[:, None]).contiguous(), E4M3, 1.0)  # the product in float32, then E4M3
        out = dequantize(q, 1.0, torch.float32) * (1.0 / scale)[:, None]
    elif fmt in _TENSOR_ELEM:
        f = _TENSOR_ELEM[fmt]
        amax = x.abs().amax()
        scale = (torch.tensor(f.max, dtype=torch.float32) / amax if amax > 0
                 else torch.ones((), dtype=torch.float32)).reshape(1)
        q = quantize(x, f, scale)
        out = dequantize(q, 1.0 / scale, torch.float32, fmt=None if f is E4M3 else f)
    elif fmt in _MX_ELEM:
        f = _MX_ELEM[fmt]
        out = dequantize_mx(*quantize_mx(x, f, 32, scale_rule), f, 32)
    else:  # nvfp4
        out = dequantize_nvfp4(*quantize_nvfp4(x))
    return out.to(device)


# ----------------------------------------------------------------------------------------------------------------
# the model side: layers, batches, losses


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
        out = {n: m for n, m in linears.items() if not _ignored(n, ignore)}
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


# ----------------------------------------------------------------------------------------------------------------
# sensitivities and plans


@dataclass
class Sensitivity:
    """Losses of the model with one layer at a time in each format (step 1 of the module docstring).
    losses[layer][fmt] is the mean calibration loss with only that layer in fmt; base_loss is the loss as
    given; shapes[layer] the weight's [N, K]. Formats that do not apply to a layer are absent from its dict."""

    base_loss: float
    losses: Dict[str, Dict[str, float]]
    shapes: Dict[str, Tuple[int, int]]
    formats: Tuple[str, ...]
    scale_rule: str = "floor"

    @property
    def layers(self) -> List[str]:
        return list(self.losses)

    def delta(self, layer: str, fmt: str) -> float:
        """s(layer, fmt): the loss increase with only that layer in fmt."""
        return self.losses[layer][fmt] - self.base_loss

    def bf16_bytes(self) -> int:
        return sum(weight_bytes(s, "bf16") for s in self.shapes.values())

    def budget_bytes(self, budget: Budget) -> int:
        """`budget` in bytes: an int as is, a float in (0, 1] as that fraction of the bf16 bytes."""
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"budget must be bytes (an int) or a fraction of the bf16 bytes (a float in (0, 1]), "
                            f"got {budget!r}")
        if isinstance(budget, float):
            if not (0.0 < budget <= 1.0):
                raise ValueError(f"budget: a float is a fraction of the bf16 bytes and must be in (0, 1], got "
                                 f"{budget} (give bytes as an int)")
            return int(math.floor(budget * self.bf16_bytes()))
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        return int(budget)

    def plan(self, budget: Budget, *, max_cells: int = 100_000) -> "PrecisionPlan":
        """The assignment with the least summed sensitivity whose bytes fit `budget` (step 2)."""
        if isinstance(max_cells, bool) or not isinstance(max_cells, int) or max_cells < 16:
            raise ValueError(f"plan(): max_cells must be an int >= 16, got {max_cells!r}")
        cap = self.budget_bytes(budget)
        names = self.layers
        options = [[(f, weight_bytes(self.shapes[n], f), max(self.delta(n, f), 0.0)) for f in self.losses[n]]
                   for n in names]
        least = sum(min(b for _, b, _ in opts) for opts in options)
        if least > cap:
            raise ValueError(f"budget of {cap:,} bytes is below the smallest assignment of these formats "
                             f"({least:,} bytes, every layer in its smallest format)")
        choice, exact = _knapsack([[(b, c) for _, b, c in opts] for opts in options], cap, max_cells)
        assignment = {n: options[i][j][0] for i, (n, j) in enumerate(zip(names, choice))}
        return self._plan_of(assignment, cap, exact)

    def uniform(self, fmt: str) -> "PrecisionPlan":
        """Every layer in `fmt` (a ValueError names the layers where it does not apply)."""
        _check_fmt(fmt, "uniform")
        missing = [n for n in self.layers if fmt not in self.losses[n]]
        if missing:
            raise ValueError(f"uniform(): {fmt} was not measured for (or does not apply to) layers {missing}")
        return self._plan_of({n: fmt for n in self.layers}, None, True)

    def _plan_of(self, assignment, budget_bytes, exact) -> "PrecisionPlan":
        predicted = self.base_loss + sum(self.delta(n, f) for n, f in assignment.items())
        return PrecisionPlan(assignment=assignment,
                             layer_bytes={n: weight_bytes(self.shapes[n], f) for n, f in assignment.items()},
                             shapes=dict(self.shapes), budget_bytes=budget_bytes, bf16_bytes=self.bf16_bytes(),
                             base_loss=self.base_loss, predicted_loss=predicted, exact=exact,
                             sensitivity=self, scale_rule=self.scale_rule)

    def table(self) -> str:
        """Markdown: the loss increase of each layer in each format."""
        lines = ["| layer | shape | " + " | ".join(self.formats) + " |",
                 "|---|---|" + "---:|" * len(self.formats)]
        for n in self.layers:
            cells = [f"{self.delta(n, f):+.4f}" if f in self.losses[n] else "n/a" for f in self.formats]
            lines.append(f"| {n} | {self.shapes[n][0]}x{self.shapes[n][1]} | " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _knapsack(options: List[List[Tuple[int, float]]], cap: int, max_cells: int) -> Tuple[List[int], bool]:
    """Multiple-choice knapsack: one option (bytes, cost) per group, sum of bytes <= cap, least summed cost;
    among (nearly) equal costs the most bytes. Returns (index per group, exact): exact when the table's unit
    is the gcd of the sizes (at most max_cells cells); otherwise sizes are rounded up to units of
    cap / max_cells, which keeps the result within cap and within (number of groups) units of the optimum."""
    # bytes above each group's smallest option: the all-smallest choice costs 0 units, so rounding sizes up in
    # the coarse table can never make a budget that fits the smallest choice infeasible
    base = [min(b for b, _ in opts) for opts in options]
    options = [[(b - b0, c) for b, c in opts] for opts, b0 in zip(options, base)]
    cap -= sum(base)
    if cap < 0:
        raise ValueError("budget: no assignment fits")
    g = reduce(math.gcd, [b for opts in options for b, _ in opts], 0) or 1
    exact = cap // g <= max_cells
    unit = g if exact else -(-cap // max_cells)
    slots = cap // unit
    inf = float("inf")
    cost = torch.zeros(slots + 1, dtype=torch.float64)  # best cost using at most c units (nothing chosen yet)
    size = torch.zeros(slots + 1, dtype=torch.float64)  # bytes of that best
    picks = []
    for opts in options:
        best_c = torch.full_like(cost, inf)
        best_b = torch.full_like(size, -1.0)
        pick = torch.full((slots + 1,), -1, dtype=torch.int64)
        for j, (b, c) in enumerate(opts):
            u = -(-b // unit)
            if u > slots:
                continue
            cand_c = torch.full_like(cost, inf)
            cand_b = torch.full_like(size, -1.0)
            cand_c[u:] = cost[:slots + 1 - u] + c
            cand_b[u:] = size[:slots + 1 - u] + b
            tol = 1e-12 + 1e-9 * torch.minimum(cand_c.abs(), best_c.abs()).nan_to_num(posinf=0.0)
            tie = (cand_c - best_c).abs().nan_to_num(nan=inf) <= tol
            better = (cand_c < best_c - tol) | (tie & (cand_b > best_b))
            better &= torch.isfinite(cand_c)
            best_c = torch.where(better, cand_c, best_c)
            best_b = torch.where(better, cand_b, best_b)
            pick = torch.where(better, torch.full_like(pick, j), pick)
        cost, size = best_c, best_b
        picks.append(pick)
    if not math.isfinite(float(cost[slots])):
        raise ValueError("budget: no assignment fits")  # plan() checks this first; kept as a safeguard
    choice, c = [], slots
    for opts, pick in zip(reversed(options), reversed(picks)):
        j = int(pick[c])
        choice.append(j)
        c -= -(-opts[j][0] // unit)
    return choice[::-1], exact


@dataclass
class PrecisionPlan:
    """One format per layer. layer_bytes and total_bytes count weights and scales (weight_bytes);
    predicted_loss = base_loss + summed sensitivities; measured_loss is set by measure() (and by
    assign_precision). `exact`: the assignment is the optimum of the summed sensitivities (see _knapsack)."""

    assignment: Dict[str, str]
    layer_bytes: Dict[str, int]
    shapes: Dict[str, Tuple[int, int]]
    budget_bytes: Optional[int]
    bf16_bytes: int
    base_loss: float
    predicted_loss: float
    exact: bool = True
    measured_loss: Optional[float] = None
    sensitivity: Optional[Sensitivity] = field(default=None, repr=False)
    scale_rule: str = "floor"

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes.values())

    @property
    def fraction(self) -> float:
        """total_bytes / the bf16 bytes of the same layers."""
        return self.total_bytes / self.bf16_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.total_bytes / sum(n * k for n, k in self.shapes.values())

    @property
    def predicted_perplexity(self) -> float:
        return math.exp(self.predicted_loss)

    @property
    def measured_perplexity(self) -> Optional[float]:
        return None if self.measured_loss is None else math.exp(self.measured_loss)

    def counts(self) -> Dict[str, int]:
        """{format: number of layers in it}."""
        out: Dict[str, int] = {}
        for f in self.assignment.values():
            out[f] = out.get(f, 0) + 1
        return out

    def _modules(self, model: nn.Module, fn: str) -> Dict[str, nn.Module]:
        mods = dict(model.named_modules())
        missing = [n for n in self.assignment if n not in mods]
        if missing:
            raise ValueError(f"{fn}(): the model has no layers {missing} (a plan applies to the model it was made for)")
        bad = [n for n in self.assignment if tuple(mods[n].weight.shape) != tuple(self.shapes[n])]
        if bad:
            raise ValueError(f"{fn}(): the weights of {bad} do not have the plan's shapes")
        return {n: mods[n] for n in self.assignment}

    def fake_weights(self, model: nn.Module) -> Dict[str, torch.Tensor]:
        """{layer: its weight in the plan's format, dequantized (float32)}."""
        mods = self._modules(model, "fake_weights")
        return {n: fake_quantize_weight(mods[n].weight, f, scale_rule=self.scale_rule)
                for n, f in self.assignment.items()}

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """with plan.applied(model): ... runs with the fake-quantized weights, restored afterwards."""
        with _weights_replaced(self._modules(model, "applied"), self.fake_weights(model)):
            yield model

    def apply(self, model: nn.Module, backend: str = "fake") -> nn.Module:
        """Applies the plan in place and returns the model. backend="fake": every weight is replaced by its
        quantized-and-dequantized value (in the parameter's dtype; the layers stay what they are).
        backend="weight_only": every layer not in bf16 is replaced by fp8ext.WeightOnlyLinear.from_linear(layer,
        fmt) (weight-only inference, a CUDA kernel for decode on a GPU; the per-tensor formats have no such
        layer), and the bf16 layers are left as they are (the model's dtype decides)."""
        if backend == "fake":
            mods = self._modules(model, "apply")
            with torch.no_grad():
                for n, w in self.fake_weights(model).items():
                    mods[n].weight.data.copy_(w.to(mods[n].weight.dtype))
            return model
        if backend != "weight_only":
            raise ValueError(f"apply(): backend must be 'fake' or 'weight_only', got {backend!r}")
        import fp8ext
        wol = getattr(fp8ext, "WeightOnlyLinear", None)
        if wol is None:
            raise RuntimeError("apply(backend='weight_only') needs fp8ext.WeightOnlyLinear, which this version "
                               "does not have; use backend='fake'")
        per_tensor = sorted({f for f in self.assignment.values() if f in _TENSOR_ELEM})
        if per_tensor:
            raise ValueError(f"apply(backend='weight_only'): WeightOnlyLinear has no per-tensor formats {per_tensor}")
        mods = self._modules(model, "apply")
        for n, f in self.assignment.items():
            if f == "bf16":
                continue
            parent, _, leaf = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, wol.from_linear(mods[n], f))
        return model

    def measure(self, model: nn.Module, batches, loss_fn: Optional[Callable] = None) -> float:
        """The mean loss over `batches` with the plan applied (weights restored afterwards); also stored as
        measured_loss."""
        batches = _batches(batches, "measure", "batches")
        with _eval_mode(model), self.applied(model):
            self.measured_loss = _mean_loss(model, batches, loss_fn, "measure")
        return self.measured_loss

    def summary(self) -> str:
        """Markdown: per layer format, bytes, loss increase alone; then the totals."""
        lines = ["| layer | shape | format | bytes | loss increase alone |", "|---|---|---|---:|---:|"]
        for n, f in self.assignment.items():
            d = self.sensitivity.delta(n, f) if self.sensitivity is not None else float("nan")
            lines.append(f"| {n} | {self.shapes[n][0]}x{self.shapes[n][1]} | {f} | {self.layer_bytes[n]:,} | "
                         f"{d:+.4f} |")
        lines.append("")
        budget = "" if self.budget_bytes is None else f" of a budget of {self.budget_bytes:,}"
        lines.append(f"{self.total_bytes:,} bytes{budget} ({self.fraction:.1%} of bf16, "
                     f"{self.bits_per_weight:.2f} bits per weight); loss {self.base_loss:.4f} as given, "
                     f"predicted {self.predicted_loss:.4f}"
                     + ("" if self.measured_loss is None else f", measured {self.measured_loss:.4f}"))
        return "\n".join(lines)


def _check_formats(formats, fn: str) -> Tuple[str, ...]:
    if isinstance(formats, str) or not isinstance(formats, Iterable):
        raise TypeError(f"{fn}(): formats must be a sequence of format names, got {formats!r}")
    formats = tuple(formats)
    if not formats:
        raise ValueError(f"{fn}(): formats is empty")
    for f in formats:
        _check_fmt(f, fn, "formats")
    if len(set(formats)) != len(formats):
        raise ValueError(f"{fn}(): formats has repeats: {list(formats)}")
    return formats


def measure_sensitivity(model: nn.Module, calib_batches, formats: Sequence[str] = DEFAULT_FORMATS, *,
                        loss_fn: Optional[Callable] = None, layers: Optional[Sequence[str]] = None,
                        ignore: Sequence[str] = DEFAULT_IGNORE, scale_rule: str = "floor",
                        progress: bool = True) -> Sensitivity:
    """Step 1: the calibration loss with each layer alone in each format (the model is left as it was)."""
    fn = "measure_sensitivity"
    formats = _check_formats(formats, fn)
    mods = _linear_layers(model, layers, ignore, fn)
    batches = _batches(calib_batches, fn, "calib_batches")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"{fn}(): loss_fn must be callable(outputs, targets), got {type(loss_fn).__name__}")
    if scale_rule not in ("floor", "rceil"):
        raise ValueError(f"{fn}(): scale_rule must be 'floor' or 'rceil', got {scale_rule!r}")
    shapes = {n: tuple(m.weight.shape) for n, m in mods.items()}
    for n, s in shapes.items():
        if not any(format_applies(s, f) for f in formats):
            raise ValueError(f"{fn}(): none of formats {list(formats)} applies to layer {n} (shape {list(s)}); "
                             "add 'bf16' or leave the layer out (ignore=...)")
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=sum(format_applies(s, f) for s in shapes.values() for f in formats), desc="sensitivity",
                   unit="pass")
    losses: Dict[str, Dict[str, float]] = {}
    try:
        with _eval_mode(model):
            base = _mean_loss(model, batches, loss_fn, fn)
            for n, m in mods.items():
                losses[n] = {}
                for f in formats:
                    if not format_applies(shapes[n], f):
                        continue
                    wq = fake_quantize_weight(m.weight, f, scale_rule=scale_rule)
                    if torch.equal(wq.to(m.weight.dtype), m.weight.detach()):
                        losses[n][f] = base  # the format holds this weight exactly: nothing to run
                    else:
                        with _weights_replaced({n: m}, {n: wq}):
                            losses[n][f] = _mean_loss(model, batches, loss_fn, fn)
                    if bar is not None:
                        bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return Sensitivity(base_loss=base, losses=losses, shapes=shapes, formats=formats, scale_rule=scale_rule)


def assign_precision(model: nn.Module, calib_batches, budget: Budget, formats: Sequence[str] = DEFAULT_FORMATS, *,
                     loss_fn: Optional[Callable] = None, layers: Optional[Sequence[str]] = None,
                     ignore: Sequence[str] = DEFAULT_IGNORE, eval_batches=None, measure: bool = True,
                     sensitivity: Optional[Sensitivity] = None, scale_rule: str = "floor",
                     max_cells: int = 100_000, progress: bool = True) -> PrecisionPlan:
    """One format per linear layer from `formats`, the weights within `budget` (int: bytes; float in (0, 1]:
    fraction of the layers' bf16 bytes) with the least summed sensitivity; see the module docstring. The model
    is not changed: plan.apply(model) does that. `sensitivity` (from measure_sensitivity or an earlier plan's
    .sensitivity) skips step 1; measure=False skips step 3 (plan.measured_loss stays None)."""
    fn = "assign_precision"
    if sensitivity is None:
        sensitivity = measure_sensitivity(model, calib_batches, formats, loss_fn=loss_fn, layers=layers,
                                          ignore=ignore, scale_rule=scale_rule, progress=progress)
    elif not isinstance(sensitivity, Sensitivity):
        raise TypeError(f"{fn}(): sensitivity must be a Sensitivity (measure_sensitivity's result), got "
                        f"{type(sensitivity).__name__}")
    else:
        formats = _check_formats(formats, fn)
        missing = [f for f in formats if f not in sensitivity.formats]
        if missing:
            raise ValueError(f"{fn}(): formats {missing} were not measured in the given sensitivity "
                             f"({list(sensitivity.formats)})")
        if set(formats) != set(sensitivity.formats):
            sensitivity = Sensitivity(sensitivity.base_loss,
                                      {n: {f: v for f, v in d.items() if f in formats}
                                       for n, d in sensitivity.losses.items()},
                                      sensitivity.shapes, formats, sensitivity.scale_rule)
    plan = sensitivity.plan(budget, max_cells=max_cells)
    if measure:
        plan.measure(model, calib_batches if eval_batches is None else eval_batches, loss_fn)
    return plan


def uniform_plan(model: nn.Module, fmt: str, *, layers: Optional[Sequence[str]] = None,
                 ignore: Sequence[str] = DEFAULT_IGNORE, base_loss: float = float("nan"),
                 scale_rule: str = "floor") -> PrecisionPlan:
    """Every considered layer in `fmt`, without measuring sensitivities (plan.measure() gives its loss)."""
    fn = "uniform_plan"
    _check_fmt(fmt, fn)
    mods = _linear_layers(model, layers, ignore, fn)
    shapes = {n: tuple(m.weight.shape) for n, m in mods.items()}
    bad = [n for n, s in shapes.items() if not format_applies(s, fmt)]
    if bad:
        raise ValueError(f"{fn}(): {fmt} does not apply to layers {bad} (in_features must be a multiple of "
                         f"{_BLOCK.get(fmt)})")
    return PrecisionPlan(assignment={n: fmt for n in shapes},
                         layer_bytes={n: weight_bytes(s, fmt) for n, s in shapes.items()}, shapes=shapes,
                         budget_bytes=None, bf16_bytes=sum(weight_bytes(s, "bf16") for s in shapes.values()),
                         base_loss=base_loss, predicted_loss=float("nan"), scale_rule=scale_rule)


@dataclass
class Tradeoff:
    """plot_tradeoff's result: the uniform plans and the adaptive ones, all measured, and the plot's Axes."""

    uniform: Dict[str, PrecisionPlan]
    adaptive: List[PrecisionPlan]
    sensitivity: Sensitivity
    reference_loss: float
    ax: object = None

    def table(self) -> str:
        """Markdown: one row per plan: bytes, the predicted perplexity change (summed sensitivities, from the
        calibration batches) and the measured perplexity and its change, against the weights as given."""
        ref = math.exp(self.reference_loss)
        lines = ["| weights | layers per format | bytes | of bf16 | bits/weight | predicted vs as given | "
                 "measured ppl | measured vs as given |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        rows = [(f"uniform {f}", p) for f, p in self.uniform.items()]
        rows += [(f"adaptive, budget {p.budget_bytes / p.bf16_bytes:.0%}", p) for p in self.adaptive]
        for label, p in rows:
            counts = ", ".join(f"{f} {c}" for f, c in sorted(p.counts().items()))
            pred = "" if not math.isfinite(p.predicted_loss) else f"{math.exp(p.predicted_loss - p.base_loss) - 1:+.2%}"
            lines.append(f"| {label} | {counts} | {p.total_bytes:,} | {p.fraction:.1%} | {p.bits_per_weight:.2f} | "
                         f"{pred} | {p.measured_perplexity:.4f} | {p.measured_perplexity / ref - 1:+.2%} |")
        return "\n".join(lines)


def plot_tradeoff(model: nn.Module, calib_batches, budgets: Sequence[Budget] = (0.3, 0.35, 0.45, 0.6), *,
                  formats: Sequence[str] = DEFAULT_FORMATS, uniform: Sequence[str] = ("mxfp4", "mxfp6", "fp8", "bf16"),
                  eval_batches=None, loss_fn: Optional[Callable] = None, layers: Optional[Sequence[str]] = None,
                  ignore: Sequence[str] = DEFAULT_IGNORE, sensitivity: Optional[Sensitivity] = None,
                  scale_rule: str = "floor", progress: bool = True, ax=None, title: Optional[str] = None) -> Tradeoff:
    """Perplexity against weight bytes: every layer in each format of `uniform`, and the adaptive assignment
    (of `formats`) at each of `budgets`, all measured on `eval_batches` (default calib_batches; the
    sensitivities always come from calib_batches, and the predicted points are the measured perplexity of the
    weights as given times exp(summed sensitivities)). Draws on `ax` (a new figure without one; needs
    matplotlib) and returns a Tradeoff (tradeoff.table() is the same in markdown)."""
    fn = "plot_tradeoff"
    if isinstance(budgets, (int, float)) or not isinstance(budgets, Iterable):
        raise TypeError(f"{fn}(): budgets must be a sequence of budgets, got {budgets!r}")
    budgets = list(budgets)
    uniform = _check_formats(uniform, fn) if len(tuple(uniform)) else ()
    if sensitivity is None:
        sensitivity = measure_sensitivity(model, calib_batches, formats, loss_fn=loss_fn, layers=layers,
                                          ignore=ignore, scale_rule=scale_rule, progress=progress)
    evals = _batches(calib_batches if eval_batches is None else eval_batches, fn,
                     "calib_batches" if eval_batches is None else "eval_batches")
    with _eval_mode(model):
        reference = _mean_loss(model, evals, loss_fn, fn)
    plans_u = {}
    for f in uniform:
        p = uniform_plan(model, f, layers=sensitivity.layers, base_loss=sensitivity.base_loss, scale_rule=scale_rule)
        if f in sensitivity.formats:
            p = sensitivity.uniform(f)
        p.measure(model, evals, loss_fn)
        plans_u[f] = p
    plans_a = []
    for b in budgets:
        p = assign_precision(model, calib_batches, b, sensitivity.formats, sensitivity=sensitivity, measure=False)
        p.measure(model, evals, loss_fn)
        plans_a.append(p)
    result = Tradeoff(plans_u, plans_a, sensitivity, reference)
    result.ax = _draw_tradeoff(result, ax, title)
    return result


def _draw_tradeoff(result: Tradeoff, ax, title: Optional[str]):
    """plot_tradeoff's figure on `ax` (a new one without it): the uniform plans, the adaptive ones measured and
    predicted, and the reference perplexity. Returns the axes."""
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(6.4, 4.2))
    plans_u, plans_a, reference = result.uniform, result.adaptive, result.reference_loss
    scale, unit = _byte_unit(max([p.total_bytes for p in list(plans_u.values()) + plans_a] + [1]))
    if plans_u:
        xs = [p.total_bytes / scale for p in plans_u.values()]
        ys = [p.measured_perplexity for p in plans_u.values()]
        ax.plot(xs, ys, "o--", color="tab:gray", label="uniform")
        for f, x, y in zip(plans_u, xs, ys):
            ax.annotate(f, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if plans_a:
        ax.plot([p.total_bytes / scale for p in plans_a], [p.measured_perplexity for p in plans_a], "s-",
                color="tab:red", label="adaptive (measured)")
        # the prediction as a change: the reference perplexity times exp(summed sensitivities), so that it sits on
        # the same axis when the sensitivities come from other batches than the measurement
        ax.plot([p.total_bytes / scale for p in plans_a],
                [math.exp(reference + p.predicted_loss - p.base_loss) for p in plans_a], "x:",
                color="tab:red", alpha=0.6, label="adaptive (predicted)")
    ax.axhline(math.exp(reference), color="k", lw=0.8, alpha=0.5, label="weights as given")
    ax.set_xlabel(f"weight bytes of the {len(result.sensitivity.layers)} linear layers ({unit})")
    ax.set_ylabel("perplexity")
    ax.set_title(title or "Perplexity vs weight bytes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def _byte_unit(n: int) -> Tuple[float, str]:
    for scale, unit in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= 10 * scale:
            return float(scale), unit
    return 1.0, "bytes"
