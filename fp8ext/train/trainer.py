"""The training loop of `python -m fp8ext.train` (arguments: fp8ext/train/cli.py).

One optimizer step: grad_accum_steps micro-batches, each a forward under torch.autocast(bfloat16) on a GPU
(float32 on a CPU) with the blocks' linear layers in FP8 when --use_fp8 is given, then gradient clipping and
AdamW. The host waits for the device only every `log_every` steps (to read the losses), at evaluations and
at checkpoints, never inside a step. Several processes (torchrun, on one node or several) train data-parallel:
DDP, or FSDP2 with --fsdp; FP8 amaxes are max-reduced across all ranks, so every rank holds the same scales.
--activation_checkpointing recomputes each block's activations in the backward (all of them, or all but the
matrix products' and attention's outputs) instead of keeping them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import time
from argparse import Namespace
from dataclasses import asdict
from typing import Optional

import torch
import torch.distributed as dist

from ..models.transformer import Transformer, preset
from ..modules.attention import DotProductAttention
from ..core.build import VERSION, build_info, cuda_available
from ..core.context import fp8_autocast, get_scaling_manager
from ..modules.convert import prepare_fp8
from ..modules.fsdp import enable_fp8_all_gather
from ..ops import fused
from ..core.recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, Float8RowwiseScaling, Format
from . import checkpoint
from .data import batch, load_corpus
from .parallel import (check_fp8_all_gather, checkpoint_blocks, checkpointed_blocks, precompute_fp8_scales,
                       release_meshes, wrap)

__all__ = ["train", "peak_bf16_flops"]

# Dense bf16 tensor-core peaks (FLOP/s), for MFU. FP8 runs are measured against the same bf16 peak.
_PEAKS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12}


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAKS.items() if k in name), None)


def _setup_distributed(device_arg: Optional[str]):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    want = device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(want)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local if world > 1 else torch.cuda.current_device())
    owned = world > 1 and not dist.is_initialized()
    if owned:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return device, rank, world, owned


def _check_fp8(device: torch.device, rank: int) -> None:
    """No silent fallback: FP8 asked for on a GPU that cannot run it is an error."""
    if device.type == "cuda":
        if not cuda_available():
            raise RuntimeError("--use_fp8: this build of fp8ext has no CUDA kernels "
                               f"({build_info()['no_cuda_reason']}); rebuild with FP8EXT_CUDA=1")
        cc = torch.cuda.get_device_capability(device)
        if cc < (9, 0):
            raise RuntimeError(f"--use_fp8: {torch.cuda.get_device_name(device)} (compute capability "
                               f"{cc[0]}.{cc[1]}) has no FP8 tensor cores that fp8ext runs on (Hopper, sm_90); "
                               "train without --use_fp8")
    elif rank == 0:
        print("FP8 on the CPU: emulated (exact FP8 casts, float32 matrix products), for correctness, not speed")


def _recipe(args):
    dpa = getattr(args, "fp8_attention", False)  # the options checked that the recipe is per-tensor then
    if args.fp8_recipe == "current":
        return CurrentScaling(fp8_format=Format.HYBRID, fp8_dpa=dpa)
    if args.fp8_recipe == "block":
        return Float8BlockScaling()
    if args.fp8_recipe == "rowwise":
        return Float8RowwiseScaling()
    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=args.amax_history_len, amax_compute_algo="max",
                          fp8_dpa=dpa)


def _optimizer(model, args, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                             fused=device.type == "cuda")


def _lr(step: int, args) -> float:
    warmup = max(1, min(100, args.max_steps // 10))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, args.max_steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _fp8_scope(fwd_kw):
    """The forward's fp8_autocast, entered here around the (possibly compiled) model rather than inside it: the
    scale update that runs when the outermost context is entered stays out of torch.compile's graph, and the
    model's own context then inherits this one (no graph break)."""
    if not fwd_kw["fp8"]:
        return contextlib.nullcontext()
    return fp8_autocast(fp8_recipe=fwd_kw["fp8_recipe"], fp8_group=fwd_kw["fp8_group"])


@torch.no_grad()
def _evaluate(model, corpus, args, device, fwd_kw, rank, world) -> float:
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(args.eval_batches):
        x, y = batch(corpus.val, args.batch_size, args.seq_len, args.seed + 7919, 0, i, rank, device)
        with _autocast(device), _fp8_scope(fwd_kw):
            total += model(x, y, **fwd_kw)[1].float()
    model.train()
    if world > 1:
        dist.all_reduce(total)
    return (total / (args.eval_batches * world)).item()


def _fp8_state_check(recipe, device, world) -> dict:
    """How many FP8 tensors are scaled, and (with several ranks) whether every rank holds the same scales."""
    if not recipe.stateful:
        return {}
    mgr = get_scaling_manager(recipe, device)
    out = {"fp8_scaled_tensors": mgr.num_slots}
    if world > 1:
        mine = torch.cat([mgr.scale, mgr.scale_inv])
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        out["fp8_scales_equal_across_ranks"] = all(torch.equal(e, every[0]) for e in every)
    return out


def train(args: Namespace) -> dict:
    """Trains as the arguments say; writes OUT_DIR/run.json, metrics.jsonl and checkpoint.pt; returns the summary."""
    device, rank, world, owned = _setup_distributed(args.device)
    try:
        return _train(args, device, rank, world)
    finally:
        if owned and dist.is_initialized():  # a process group left to the interpreter's exit can abort it
            dist.destroy_process_group()
        release_meshes(drop_groups=owned)  # a caller's own process group stays as it is


def _train(args: Namespace, device: torch.device, rank: int, world: int) -> dict:
    if args.use_fp8:
        _check_fp8(device, rank)
    fused_before = fused.TRAINING
    fused.TRAINING = not getattr(args, "no_fused_kernels", False)
    try:
        return _train_loop(args, device, rank, world)
    finally:
        fused.TRAINING = fused_before


def _train_loop(args: Namespace, device: torch.device, rank: int, world: int) -> dict:
    corpus, raw, model, opt, recipe, start = _build(args, device, world)
    fwd_kw = dict(fp8=args.use_fp8, fp8_recipe=recipe, fp8_group=dist.group.WORLD if world > 1 else None)
    out = pathlib.Path(args.out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_stale_tmp(out)
    info = _run_info(args, raw, corpus, device, rank, world, start)
    precision = info["precision"]
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum_steps * world
    flops_per_token, peak = raw.flops_per_token(args.seq_len), peak_bf16_flops(device)
    metrics = _open_metrics(out, args, start) if rank == 0 else None
    log_every = max(1, min(10, args.max_steps // 30))
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=args.max_steps, initial=start, desc=precision, unit="step", dynamic_ncols=True)
    pending, t_last, rates, val_loss = [], time.perf_counter(), [], None
    end = min(args.max_steps, start + args.stop_after) if args.stop_after else args.max_steps
    for step in range(start, end):
        pending.append((step, *_train_step(model, opt, corpus, args, step, rank, world, device, fwd_kw)))
        done = step + 1
        evaluate = done % args.eval_every == 0 or done == args.max_steps
        if done % log_every == 0 or evaluate or done == end:
            if world > 1:  # the mean loss over ranks, one collective for the logged steps
                stacked = torch.stack([p[2] for p in pending])
                dist.all_reduce(stacked)
                losses = (stacked / world).tolist()
            else:
                losses = torch.stack([p[2] for p in pending]).tolist()  # waits for the device
            rate = tokens_per_step * len(pending) / (time.perf_counter() - t_last)
            rates.append(rate)
            val_loss = _evaluate(model, corpus, args, device, fwd_kw, rank, world) if evaluate else None
            mfu = flops_per_token * rate / (peak * world) if peak else None
            if rank == 0:
                _log_rows(metrics, bar, pending, losses, done, rate=rate, mfu=mfu, val_loss=val_loss)
            pending, t_last = [], time.perf_counter()  # evaluation time is not training time
        if args.save_every and not args.no_save and done % args.save_every == 0 and done != end:
            t_save = time.perf_counter()
            checkpoint.save(args.out_dir, raw, opt, done, vars(args))
            t_last += time.perf_counter() - t_save  # saving is not training time; the steps before it are
    if bar is not None:
        bar.close()
    if not args.no_save and (start < end or not (out / checkpoint.CHECKPOINT_NAME).exists()):
        checkpoint.save(args.out_dir, raw, opt, end, vars(args))
    return _finish(args, info, recipe, device, rank, world, rates=rates, val_loss=val_loss, end=end, out=out,
                   metrics=metrics)


def _build(args: Namespace, device: torch.device, world: int):
    """(corpus, the model, the model as trained (DDP/FSDP2-wrapped), optimizer, FP8 recipe, first step)."""
    corpus = load_corpus(args.data)
    shortest = min(corpus.train.numel(), corpus.val.numel())
    if shortest <= args.seq_len + 1:
        part = "validation" if corpus.val.numel() == shortest else "training"
        raise ValueError(f"--seq_len {args.seq_len}: the {part} text of {corpus.description.split(': ')[0]} has "
                         f"{shortest} bytes, too few for a sequence of seq_len + 1 bytes; use a shorter --seq_len "
                         "or more --data")
    base = preset(args.preset, fused_qkv=not args.separate_qkv)
    cfg = preset(args.preset, fused_qkv=not args.separate_qkv, max_seq_len=max(base.max_seq_len, args.seq_len))
    torch.manual_seed(args.seed)
    raw = Transformer(cfg, device=device)
    if getattr(args, "fp8_attention", False):  # FP8 attention's backward: high precision unless asked for in FP8
        for m in raw.modules():
            if isinstance(m, DotProductAttention):
                m.fp8_backward = getattr(args, "fp8_attention_backward", None) == "fp8"
    recipe = _recipe(args)
    if args.use_fp8 and args.compile:  # every FP8 slot now: a compiled forward never registers one (a graph break)
        prepare_fp8(raw, recipe)
    if args.fp8_all_gather:
        check_fp8_all_gather(args)
        if world > 1:  # (one process gathers nothing)
            enable_fp8_all_gather(raw, recipe)  # before fully_shard (wrap)
    checkpoint_blocks(raw, args.activation_checkpointing)
    model = wrap(raw, args, device, world)
    opt = _optimizer(model, args, device)
    start = 0
    if args.resume:
        start = checkpoint.load(args.resume, raw, opt, max_steps=args.max_steps, run_args=vars(args))["step"]
    precompute_fp8_scales(model, args, world)
    return corpus, raw, model, opt, recipe, start


def _run_info(args: Namespace, raw, corpus, device: torch.device, rank: int, world: int, start: int) -> dict:
    """What run.json records of the run's set-up; printed in one line (rank 0)."""
    precision = "fp8" if args.use_fp8 else ("bf16" if device.type == "cuda" else "fp32")
    info = {"args": vars(args), "config": asdict(raw.cfg), "device": str(device), "world_size": world,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "precision": precision, "parameters": raw.num_parameters(), "corpus": corpus.description,
            "torch": torch.__version__, "fp8ext": VERSION, "start_step": start,
            # which of fp8ext's fused kernels ran (a GPU, fp8ext built with CUDA): RMSNorm, RoPE and SwiGLU, eager
            # or compiled (as torch ops there)
            "fused_kernels": ([] if not (fused.TRAINING and device.type == "cuda" and cuda_available())
                              else ["rms_norm", "rope", "swiglu"]),
            # --activation_checkpointing, and how many blocks its wrapper holds (each one, or none)
            "activation_checkpointing": args.activation_checkpointing,
            # --fp8_all_gather in force: FSDP2 over several processes gathered the FP8 layers' weights in FP8
            "fp8_all_gather": bool(args.fp8_all_gather and args.fsdp and world > 1),
            "checkpointed_blocks": checkpointed_blocks(raw)}
    if rank != 0:
        return info
    ac = args.activation_checkpointing
    print(f"fp8ext.train: preset {args.preset} ({info['parameters'] / 1e6:.1f}M parameters), {precision}"
          f"{' (' + args.fp8_recipe + ' scaling)' if args.use_fp8 else ''}, {info['device_name']} x {world}"
          f"{', FSDP2' if args.fsdp and world > 1 else ', DDP' if world > 1 else ''}"
          f"{' with FP8 all-gather' if info['fp8_all_gather'] else ''}{', compiled' if args.compile else ''}{'' if ac == 'none' else ', activation checkpointing ' + ac}"
          f"; {corpus.description}")
    return info


def _open_metrics(out: pathlib.Path, args: Namespace, start: int):
    """metrics.jsonl for writing: a new one, or on resume the old one without the rows past the checkpoint."""
    if args.resume and (out / "metrics.jsonl").is_file():
        kept = [line for line in (out / "metrics.jsonl").read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= start]
        (out / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    return open(out / "metrics.jsonl", "a" if args.resume else "w")


def _train_step(model, opt, corpus, args: Namespace, step: int, rank: int, world: int, device: torch.device,
                fwd_kw: dict):
    """One optimizer step over args.grad_accum_steps micro-batches: (lr, the step's mean loss on the device)."""
    lr = _lr(step, args)
    for g in opt.param_groups:
        g["lr"] = lr
    step_loss = torch.zeros((), device=device)
    for micro in range(args.grad_accum_steps):
        x, y = batch(corpus.train, args.batch_size, args.seq_len, args.seed, step, micro, rank, device)
        last = micro == args.grad_accum_steps - 1
        sync = model.no_sync() if world > 1 and not args.fsdp and not last else contextlib.nullcontext()
        mb = {} if args.grad_accum_steps == 1 else {"is_first_microbatch": micro == 0}
        with sync, _autocast(device), _fp8_scope(fwd_kw):
            loss = model(x, y, **fwd_kw, **mb)[1]
        (loss / args.grad_accum_steps).backward()
        step_loss += loss.detach() / args.grad_accum_steps
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    precompute_fp8_scales(model, args, world)
    return lr, step_loss


def _log_rows(metrics, bar, pending: list, losses: list, done: int, *, rate: float, mfu, val_loss) -> None:
    """One metrics.jsonl row per step of `pending` ((step, lr, loss) each), and the progress bar moved on."""
    for (s, l_r, _), value in zip(pending, losses):
        rec = {"step": s + 1, "loss": value, "lr": l_r, "tokens_per_s": rate, "mfu": mfu}
        if s + 1 == done and val_loss is not None:
            rec["val_loss"] = val_loss
        metrics.write(json.dumps(rec) + "\n")
    metrics.flush()
    if bar is not None:
        post = {"loss": f"{losses[-1]:.4f}", "tok/s": f"{rate:,.0f}"}
        if mfu is not None:
            post["MFU"] = f"{mfu:.1%}"
        if val_loss is not None:
            post["val"] = f"{val_loss:.4f}"
        bar.set_postfix(post, refresh=False)
        bar.update(len(pending))


def _finish(args: Namespace, info: dict, recipe, device: torch.device, rank: int, world: int, *, rates: list,
            val_loss, end: int, out: pathlib.Path, metrics) -> dict:
    """The run's summary (run.json, printed by rank 0): validation loss, median tokens/s after the first logged
    interval (warm-up, compilation), peak memory, the FP8 state check and graph breaks."""
    fp8_state = _fp8_state_check(recipe, device, world) if args.use_fp8 else {}
    steady = sorted(rates[1:] or rates)  # the first interval holds the warm-up (and compilation)
    summary = {**info, "final_val_loss": val_loss, "tokens_per_s": steady[len(steady) // 2] if steady else None,
               "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
               **fp8_state}
    if args.compile:  # a graph break in the model's forward can silently cost most of what compiling gains
        from torch._dynamo.utils import counters
        summary["graph_breaks"] = sum(counters["graph_break"].values())
    if rank == 0:
        metrics.close()
        (out / "run.json").write_text(json.dumps(summary, indent=1, default=str))
        vl = "n/a" if val_loss is None else f"{val_loss:.4f}"
        tps = "n/a" if summary["tokens_per_s"] is None else f"{summary['tokens_per_s']:,.0f}"
        breaks = f", {summary['graph_breaks']} graph breaks" if args.compile else ""
        print(f"fp8ext.train: {info['precision']} {'done' if end == args.max_steps else 'stopped'} at step {end}: "
              f"validation loss {vl}, {tps} tokens/s (median after warm-up{breaks}); {out}")
    return summary
