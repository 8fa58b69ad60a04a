"""The sensitivities and plans of fp8ext.adaptive (fp8ext/lowp/adaptive.py): Sensitivity (the measured loss of each
layer alone in each format), the byte-budget assignment over them (a multiple-choice knapsack, _knapsack) and
PrecisionPlan (one format per layer: its bytes, predicted and measured loss, applied to a model)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .evaluation import _batches, _eval_mode, _mean_loss, _weights_replaced
from .weight_formats import _TENSOR_ELEM, _check_fmt, fake_quantize_weight, weight_bytes
from .weight_only import WeightOnlyLinear

__all__ = ["Budget", "Sensitivity", "PrecisionPlan"]

Budget = Union[int, float]


@dataclass
class Sensitivity:
    """Losses of the model with one layer at a time in each format (step 1 of fp8ext.adaptive's docstring).
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
        per_tensor = sorted({f for f in self.assignment.values() if f in _TENSOR_ELEM})
        if per_tensor:
            raise ValueError(f"apply(backend='weight_only'): WeightOnlyLinear has no per-tensor formats {per_tensor}")
        mods = self._modules(model, "apply")
        for n, f in self.assignment.items():
            if f == "bf16":
                continue
            parent, _, leaf = n.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, WeightOnlyLinear.from_linear(mods[n], f))
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
