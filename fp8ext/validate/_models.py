"""Whole models: the dense transformer of fp8ext.models.transformer in FP8 and in bf16 (a two-layer block stack,
a few training steps, and FP8 inference with per-channel weights)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch

from .. import inference
from .._bench import bench_ms, cuda_memory, rounds
from ..core.recipe import CurrentScaling
from ..models.transformer import Transformer, default_recipe, preset

from ._linear import rel_error
from ._run import Run

MIB = 2**20


@dataclass(frozen=True)
class Size:
    """A model preset (with overrides) and the batch of tokens it runs on."""

    preset: str
    batch: int
    seq: int
    n_layers: int = 0  # 0: the preset's

    def config(self):
        return preset(self.preset, **({"n_layers": self.n_layers} if self.n_layers else {}))

    @property
    def text(self) -> str:
        layers = f", {self.n_layers} layers" if self.n_layers else ""
        return f"preset {self.preset}{layers}, {self.batch} x {self.seq} tokens"


def size(run: Run, purpose: str) -> Size:
    """The model a section runs: small on a CPU, a real layer size on a GPU (smaller with --quick)."""
    if not run.on_gpu:
        return Size("tiny", 4, 64)
    if run.quick:
        return Size("small", 4, 512, n_layers=2)
    return {"block": Size("llama8b-2l", 2, 2048), "train": Size("small", 8, 1024),
            "inference": Size("llama8b-2l", 1, 2048)}[purpose]


def _model_and_tokens(run: Run, sz: Size):
    torch.manual_seed(0)
    cfg = sz.config()
    model = Transformer(cfg, device=run.device)
    ids = torch.randint(0, cfg.vocab_size, (sz.batch, sz.seq + 1), device=run.device)
    return model, ids[:, :-1], ids[:, 1:]


def _autocast(run: Run):
    """bf16 compute on a GPU (float32 master weights), float32 on a CPU, as fp8ext.train does."""
    return torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=run.on_gpu)


def _loss(run: Run, model, x, y, fp8: bool, recipe=None):
    with _autocast(run):
        return model(x, y, fp8=fp8, fp8_recipe=recipe or default_recipe())[1]


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().double() for p in model.blocks.parameters() if p.grad is not None])


# ---------------------------------------------------------------------------------------------------- block
def check_block(run: Run) -> None:
    sz = size(run, "block") if not run.on_gpu else Size("small", 2, 256, n_layers=2)
    model, x, y = _model_and_tokens(run, sz)
    hp = copy.deepcopy(model)
    l8, lh = _loss(run, model, x, y, True), _loss(run, hp, x, y, False)
    l8.backward()
    lh.backward()
    diff = abs(l8.item() - lh.item()) / abs(lh.item())
    run.check("block", "FP8 loss of a 2-layer transformer within 1% of the high-precision loss", diff <= 0.01,
              value=diff, limit=0.01, unit="relative difference", shape=sz.text)
    g8, gh = _grads(model), _grads(hp)
    cos = float(g8 @ gh / (g8.norm() * gh.norm()))
    run.check("block", "FP8 gradients of the blocks point the way high-precision ones do (cosine similarity)",
              cos >= 0.9, value=cos, limit=0.9, unit="cosine similarity (>= limit)", shape=sz.text)
    run.measure("block", "gradients' relative error vs high precision", rel_error(g8, gh), "relative",
                case="blocks' parameters", precision="fp8ext FP8", shape=sz.text)
    run.trace("block", "transformer forward and backward", {
        "FP8": lambda: _loss(run, model, x, y, True).backward(), "high precision": lambda: _loss(run, hp, x, y,
                                                                                                 False).backward()})
    run.note("block", "Correctness: the same random-initialised model and tokens, with the blocks' linear layers "
                      "in FP8 and in high precision (bf16 on a GPU, float32 on a CPU).")


def speed_block(run: Run) -> None:
    if run.speed_skipped("block", "step time and GPU memory of the transformer blocks in FP8 against bf16"):
        return
    sz = size(run, "block")
    model, x, y = _model_and_tokens(run, sz)
    recipe = default_recipe()
    steps = {"bf16": (lambda: _loss(run, model, x, y, False), lambda loss: loss.backward()),
             "fp8ext FP8": (lambda: _loss(run, model, x, y, True, recipe), lambda loss: loss.backward())}
    impls = {name: (lambda f=f, b=b: b(f())) for name, (f, b) in steps.items()}
    for fn in impls.values():
        fn()
    t = rounds(impls, reps=5 if not run.quick else 10)
    for name, (ms, _, _) in t.items():
        run.measure("block", "step time (forward + backward)", ms, "ms", case="2-layer transformer",
                    precision=name, shape=sz.text)
        run.measure("block", "tokens per second", sz.batch * sz.seq / ms * 1e3, "tokens/s",
                    case="2-layer transformer", precision=name, shape=sz.text)
        for kind, b in cuda_memory(*steps[name]).items():
            run.measure("block", f"GPU memory {kind}", b / MIB, "MiB", case="2-layer transformer", precision=name,
                        shape=sz.text)
    run.measure("block", "speedup vs bf16", t["bf16"][0] / t["fp8ext FP8"][0], "x", case="transformer step",
                shape=sz.text)
    run.trace("block", "transformer step", impls)
    model.zero_grad(set_to_none=True)
    del model
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------- train
def _train_steps(run: Run, model, x, y, fp8: bool, n: int):
    """n AdamW steps on one batch; returns the losses (one synchronisation, at the end)."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    recipe = default_recipe()
    losses = []
    for _ in range(n):
        loss = _loss(run, model, x, y, fp8, recipe)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [v.item() for v in losses]


def check_train(run: Run) -> None:
    sz = size(run, "train") if not run.on_gpu else Size("small", 4, 256, n_layers=2)
    model, x, y = _model_and_tokens(run, sz)
    hp = copy.deepcopy(model)
    n = 8
    f8 = _train_steps(run, model, x, y, True, n)
    h = _train_steps(run, hp, x, y, False, n)
    run.check("train", f"FP8 training lowers the loss over {n} AdamW steps on one batch", f8[-1] < 0.9 * f8[0],
              value=f8[-1] / f8[0], limit=0.9, unit="last loss / first loss", shape=sz.text)
    diff = abs(f8[-1] - h[-1]) / h[-1]
    run.check("train", f"FP8 loss after {n} steps within 10% of high precision's", diff <= 0.10, value=diff,
              limit=0.10, unit="relative difference", shape=sz.text)
    for precision, losses in (("fp8ext FP8", f8), ("high precision", h)):
        run.measure("train", f"loss after {n} steps", losses[-1], "nats per token", case="memorise one batch",
                    precision=precision, shape=sz.text)
    run.trace("train", "one training step", {"FP8 step": lambda: _train_steps(run, model, x, y, True, 1),
                                             "high-precision step": lambda: _train_steps(run, hp, x, y, False, 1)})


def speed_train(run: Run) -> None:
    if run.speed_skipped("train", "tokens per second of training steps in FP8 against bf16"):
        return
    sz = size(run, "train")
    steps, kept = {}, []
    for precision, fp8 in (("bf16", False), ("fp8ext FP8", True)):
        model, x, y = _model_and_tokens(run, sz)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        kept.append((model, opt))

        def step(model=model, opt=opt, x=x, y=y, fp8=fp8, recipe=default_recipe()):
            _loss(run, model, x, y, fp8, recipe).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[precision] = step
    for fn in steps.values():
        fn()
    t = rounds(steps, reps=5 if run.quick else 10)  # interleaved: one model's step, then the other's
    for precision, (ms, _, _) in t.items():
        run.measure("train", "tokens per second", sz.batch * sz.seq / ms * 1e3, "tokens/s",
                    case="training step with AdamW", precision=precision, shape=sz.text)
    run.measure("train", "speedup vs bf16", t["bf16"][0] / t["fp8ext FP8"][0], "x", case="training step",
                shape=sz.text)
    run.trace("train", "training step", steps)
    del kept, steps
    torch.cuda.empty_cache()
    run.note("train", "Training steps: forward and backward under torch.autocast(bfloat16) with float32 master "
                      "weights, then fused AdamW; the bf16 and FP8 models' steps interleaved over three rounds.")


# ---------------------------------------------------------------------------------------------------- inference
def _quantized(model):
    q = copy.deepcopy(model)
    inference.quantize_model(q, weights="channel", activations="dynamic", progress=False)
    return q


def _linear_weight_bytes(model) -> int:
    """Bytes of the weights (and weight scales) of the blocks' linear layers."""
    total = 0
    for name, t in list(model.blocks.named_parameters()) + list(model.blocks.named_buffers()):
        if name.endswith(("weight", "weight_scale")) and "norm" not in name:
            total += t.numel() * t.element_size()
    return total


def check_inference(run: Run) -> None:
    sz = size(run, "inference") if not run.on_gpu else Size("small", 2, 256, n_layers=2)
    model, x, _ = _model_and_tokens(run, sz)
    model = model.to(torch.bfloat16) if run.on_gpu else model
    q = _quantized(model)
    with torch.no_grad():
        want, got = model(x), q(x)
        # the same model through the training path's FP8Linear, per-tensor scales from the current amax
        train_path = model(x, fp8=True, fp8_recipe=CurrentScaling())
    err, err_train = rel_error(got, want), rel_error(train_path, want)
    for precision, e in (("fp8ext FP8 inference, per channel", err), ("fp8ext FP8Linear, per tensor", err_train)):
        run.measure("inference", "logits' relative error vs the unquantized model", e, "relative",
                    case="forward", precision=precision, shape=sz.text)
    run.check("inference", "logits of the per-channel FP8 model within 25% (relative) of the unquantized model's",
              err <= 0.25, value=err, limit=0.25, unit="relative error", shape=sz.text)
    run.check("inference", "per-channel FP8 inference's error at most 1.25x that of FP8Linear's per-tensor "
                           "forward", err <= 1.25 * err_train, value=err / err_train, limit=1.25,
              unit="error / FP8Linear's error", shape=sz.text)
    layers = inference.quantizable_linears(model).values()
    hp_bytes = sum(m.weight.numel() for m in layers) * 2
    expected = sum(m.weight.numel() + 4 * m.out_features for m in layers)  # 1 byte a weight, a float32 a row
    fp8_bytes = _linear_weight_bytes(q)
    for precision, b in (("bf16", hp_bytes), ("fp8ext FP8", fp8_bytes)):
        run.measure("inference", "weight memory of the linear layers", b / MIB, "MiB", case="blocks' weights",
                    precision=precision, shape=sz.text)
    run.check("inference", "FP8 weights take one byte each plus one float32 scale per output channel",
              fp8_bytes <= expected, value=fp8_bytes / hp_bytes, limit=expected / hp_bytes,
              unit="FP8 bytes / bf16 bytes", shape=sz.text)
    with torch.no_grad():
        run.trace("inference", "forward", {"FP8 model": lambda: q(x), "unquantized model": lambda: model(x)})


def speed_inference(run: Run) -> None:
    if run.speed_skipped("inference", "forward latency of the per-channel FP8 model against bf16"):
        return
    sz = size(run, "inference")
    model, x, _ = _model_and_tokens(run, sz)
    model = model.to(torch.bfloat16)
    q = _quantized(model)
    cases = {"prefill": x, "one token (decode-sized)": x[:1, :1]}
    with torch.no_grad():
        for case, ids in cases.items():
            shape = replace(sz, batch=ids.shape[0], seq=ids.shape[1]).text
            impls = {"bf16": lambda ids=ids: model(ids), "fp8ext FP8": lambda ids=ids: q(ids)}
            t = {name: bench_ms(fn, reps=20) for name, fn in impls.items()}
            for name, ms in t.items():
                run.measure("inference", "forward latency", ms, "ms", case=case, precision=name, shape=shape)
            run.measure("inference", "speedup vs bf16", t["bf16"] / t["fp8ext FP8"], "x", case=f"forward, {case}",
                        shape=shape)
            run.trace("inference", f"forward {case}", impls)
    del model, q
    torch.cuda.empty_cache()
    run.note("inference", "fp8ext.inference.quantize_model(weights='channel', activations='dynamic'): E4M3 weights "
                          "with one scale per output channel, activations cast per call; embeddings, norms, "
                          "attention and the output head stay in bf16.")
