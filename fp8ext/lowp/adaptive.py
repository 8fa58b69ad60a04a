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

The parts live beside this module and their names are importable from here: the formats, their bytes and
fake_quantize_weight (weight_formats.py), the layers, batches and losses (evaluation.py), Sensitivity,
PrecisionPlan and the knapsack (plan.py); this module measures, assigns and plots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..modules.ignore import DEFAULT_IGNORE
from .evaluation import _batches, _eval_mode, _linear_layers, _mean_loss, _weights_replaced
from .plan import Budget, PrecisionPlan, Sensitivity, _knapsack  # noqa: F401 (tests call _knapsack here)
from .weight_formats import (_BLOCK, BITS_PER_WEIGHT, DEFAULT_FORMATS, WEIGHT_FORMATS, _check_fmt, _check_formats,
                             fake_quantize_weight, format_applies, weight_bytes)

__all__ = ["WEIGHT_FORMATS", "BITS_PER_WEIGHT", "DEFAULT_FORMATS", "fake_quantize_weight", "weight_bytes",
           "format_applies", "measure_sensitivity", "assign_precision", "uniform_plan", "plot_tradeoff",
           "Sensitivity", "PrecisionPlan", "Tradeoff"]


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
