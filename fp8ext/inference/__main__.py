"""`python -m fp8ext.inference quantize|eval|generate`: FP8 inference for models trained with fp8ext.train.

    python -m fp8ext.inference quantize --checkpoint runs/x --calib_batches 16 --weights channel \\
        --activations static --out runs/x-fp8
    python -m fp8ext.inference eval --model runs/x-fp8 [--data FILE_OR_DIR]   # bf16 and FP8 perplexity side by side
    python -m fp8ext.inference eval --model runs/x-fp8 --kv_cache            # + decoding through bf16 / FP8 caches
    python -m fp8ext.inference generate --model runs/x-fp8 --prompt "def " --kv_cache fp8
    python -m fp8ext.inference generate --model runs/x-fp8 --prompt "def " --draft mxfp4 --speculate 4
    python -m fp8ext.inference quantize --model path/to/hf-llama --out llama-fp8 --activations static
    python -m fp8ext.inference eval --model llama-fp8 [--kv_cache]          # against the source it names

quantize reads a training checkpoint (a run directory or checkpoint.pt), calibrates on training text, packs the
weights and writes a compressed-tensors checkpoint (over one already in --out only once the new one is complete); it
runs on a CPU. eval loads the FP8 checkpoint and the training checkpoint it came from (config.json's fp8ext_source,
which quantize writes; else --reference) and prints both models' loss and perplexity on the same held-out batches;
with --kv_cache also the FP8 model's, reading the same text one token per step through a bf16 KV cache and an
FP8 one (its calibrated K/V scales, or scales from a one-token prefill when the checkpoint has none). generate
--draft FMT decodes speculatively: a copy of the model with FMT weights (make_draft) proposes --speculate tokens per
round, the model checks them in one forward (the same greedy output), and the acceptance rate is printed.
generate --model also takes a local transformers causal LM directory: with --draft it decodes speculatively through
transformers' KV caches (fp8ext.inference.speculative), without it by the model's own generate().

quantize --model takes a local Hugging Face transformers causal LM directory (Llama, Mistral, Qwen2, ...; nothing
is downloaded) instead: the text is tokenized with the directory's tokenizer (or read as bytes when it has none and
the vocabulary holds 256 ids), the directory written loads in transformers, and eval compares it with the source
directory; its --kv_cache decodes through transformers' cache and one rounding K/V to E4M3 (fp8ext.inference.hf).

A wrong argument, or a file that cannot be used, ends a command with one line on stderr naming it
("python -m fp8ext.inference eval: error: ..."); --debug shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from typing import List, Optional

import torch

from .._cli import (OneLineParser, add_debug, device_type, nonnegative_float, nonnegative_int, one_line_errors,
                    positive_int, usable_device)
from ..models.transformer import PRESETS, Transformer, TransformerConfig, preset
from ..train.checkpoint import CheckpointError, read
from ..train.data import batch, load_corpus
from ..lowp.weight_only import WEIGHT_ONLY_FORMATS
from . import calibrate, decode_loss, load_quantized, model_kv_scales, quantize_model, save_quantized
from ._header import read_json
from ._hf_cli import HF_SEQ_LEN, eval_hf as _eval_hf, generate_hf as _generate_hf, is_hf_dir
from ._hf_cli import quantize_hf as _quantize_hf
from .files import write_json
from .layers import ACTIVATION_SCHEMES, WEIGHT_SCHEMES
from .speculative import make_draft


def _training_model(checkpoint: str, device, option: str) -> tuple:
    """(bf16 model, training arguments, checkpoint file) of an fp8ext.train checkpoint, read safely
    (fp8ext.train.checkpoint.read); `option` says where the path came from, for errors. The arguments and every
    tensor's shape are checked against the model they describe, built on the meta device, before the model is
    built for real: a file whose arguments name a larger model than its tensors fails without allocating it."""
    p, state = read(checkpoint, option)
    a = state["args"]
    cfg = _training_config(a, p, option)
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    _check_training_state(state["model"], skeleton, a, p, option)
    model = Transformer(cfg)
    model.load_state_dict(state["model"])
    return model.to(device, torch.bfloat16).eval(), a, str(p)


def _training_config(a, p: pathlib.Path, option: str) -> TransformerConfig:
    """The model config a training checkpoint's arguments give (preset, separate_qkv, seq_len), checked."""
    if not isinstance(a, dict):
        raise CheckpointError(f"{option}: {p}: 'args' must be a dict of the run's arguments, got {type(a).__name__}")
    name, seq = a.get("preset"), a.get("seq_len")
    if not isinstance(name, str) or name not in PRESETS:
        raise CheckpointError(f"{option}: {p}: args['preset'] is {name!r}; fp8ext.train's presets are "
                              f"{', '.join(sorted(PRESETS))}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        raise CheckpointError(f"{option}: {p}: args['seq_len'] must be an integer >= 1, got {seq!r}")
    try:
        return preset(name, fused_qkv=not a.get("separate_qkv", False), max_seq_len=max(PRESETS[name].max_seq_len, seq))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{option}: {p}: args: {e}") from None


def _check_training_state(sd, skeleton: Transformer, a: dict, p: pathlib.Path, option: str) -> None:
    """The checkpoint's model tensors against the model its arguments describe (on the meta device): the same
    names and shapes."""
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{option}: {p}: 'model' must be a state dict of tensors")
    want = skeleton.state_dict()
    for k, v in sd.items():
        if k in want and tuple(v.shape) != tuple(want[k].shape):
            raise CheckpointError(f"{option}: {p}: {k} is {list(v.shape)}, but the model of its arguments (preset "
                                  f"{a['preset']!r}) has {k} {list(want[k].shape)}")
    unknown = [k for k in sd if k not in want]
    missing = [k for k in want if k not in sd and not k.endswith("_extra_state")]
    if unknown or missing:
        raise CheckpointError(f"{option}: {p}: its model tensors are not those of preset {a['preset']!r}: "
                              + "; ".join(f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}" for what, names in
                                          (("unexpected", unknown), ("missing", missing)) if names))


def _device(text: Optional[str], default: str) -> torch.device:
    """--device (or `default` when not given): cpu, or a CUDA device this torch can use."""
    return usable_device(text, default)


def _auto() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _int_field(value, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
    return value


def _quantize(args) -> None:
    device = _device(args.device, "cpu")
    if args.model is not None:
        return _quantize_hf(args)
    model, train_args, path = _training_model(args.checkpoint, device, "--checkpoint")
    corpus = load_corpus(args.data if args.data is not None else train_args.get("data"))
    seq = args.seq_len or train_args["seq_len"]
    _check_seq_len(seq, model, "--seq_len" if args.seq_len else f"{path} (args['seq_len'])")
    batches = [batch(corpus.train, args.batch_size, seq, seed=10_007, step=i, device=device)[0]
               for i in range(args.calib_batches)]
    calibrate(model, batches)
    quantize_model(model, args.weights, args.activations)
    out = save_quantized(model, args.out)
    info = json.loads((out / "config.json").read_text())
    info["fp8ext_source"] = {"training_checkpoint": path, "calib_batches": args.calib_batches, "seq_len": seq,
                             "data": args.data if args.data is not None else train_args.get("data")}
    write_json(out / "config.json", info)  # one rename: a failed write leaves the config.json saved above
    kv = len(model.fp8_quantization.get("kv_amax") or {})
    print(f"quantized {len(model.fp8_quantization['layers'])} linear layers (weights {args.weights}, activations "
          f"{args.activations}), calibrated on {args.calib_batches} x {args.batch_size} x {seq} tokens; "
          f"FP8 KV-cache scales (per KV head) for {kv} attention layers; "
          f"kept in high precision: {', '.join(model.fp8_quantization['ignored_modules'])}; wrote {out}")


def _check_seq_len(seq: int, model: Transformer, where: str) -> None:
    if seq > model.cfg.max_seq_len:
        raise ValueError(f"{where}: sequences of {seq} tokens are longer than the model's context "
                         f"(max_seq_len {model.cfg.max_seq_len})")


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@torch.no_grad()
def _eval(args) -> None:
    device = _device(args.device, _auto())
    d = pathlib.Path(args.model)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"--model: {d} holds no config.json (a directory written by `quantize`)")
    src = read_json(d / "config.json", who="--model").get("fp8ext_source", {})
    if not isinstance(src, dict):
        raise TypeError(f"--model: {d / 'config.json'}: fp8ext_source must be a JSON object, got {src!r}")
    if is_hf_dir(d):
        return _eval_hf(args, d, src, device)
    reference = args.reference or src.get("training_checkpoint")
    if not reference or not isinstance(reference, str):
        raise ValueError(f"--reference: {d / 'config.json'} names no training checkpoint to compare with "
                         "(fp8ext_source.training_checkpoint, which `quantize` writes); pass --reference with the "
                         "training checkpoint (a run directory or checkpoint.pt) the model was quantized from")
    option = "--reference" if args.reference else f"{d / 'config.json'} (fp8ext_source.training_checkpoint)"
    ref, train_args, _ = _training_model(reference, device, option)
    fp8 = load_quantized(d, lambda c: Transformer(TransformerConfig(**c)), device=device).to(device)
    corpus = load_corpus(args.data if args.data is not None else src.get("data"))
    if args.seq_len:
        seq, where = args.seq_len, "--seq_len"
    elif src.get("seq_len") is not None:
        seq, where = _int_field(src["seq_len"], f"{d / 'config.json'}: fp8ext_source.seq_len"), \
            f"{d / 'config.json'} (fp8ext_source.seq_len)"
    else:
        seq, where = train_args["seq_len"], f"{option} (args['seq_len'])"
    for m in (ref, fp8):
        _check_seq_len(seq, m, where)
    # the reference's name says the dtype it computes in: its weights' (bf16), or autocast's on a GPU
    name = "bf16" if device.type == "cuda" else _SHORT.get(next(ref.parameters()).dtype, "reference")
    totals = {name: 0.0, "fp8": 0.0}
    if args.kv_cache:
        totals.update({"fp8, bf16 KV cache": 0.0, "fp8, fp8 KV cache": 0.0})
    from tqdm.auto import tqdm
    for i in tqdm(range(args.eval_batches), desc="eval" + (" (+ one token per step)" if args.kv_cache else ""),
                  unit="batch"):
        x, y = batch(corpus.val, args.batch_size, seq, seed=20_011, step=i, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            totals[name] += ref(x, y)[1].item()
            totals["fp8"] += fp8(x, y)[1].item()
            if args.kv_cache:  # one token per step through the cache (a one-token prompt)
                totals["fp8, bf16 KV cache"] += decode_loss(fp8, x, y, kv_cache="bf16")
                totals["fp8, fp8 KV cache"] += decode_loss(fp8, x, y, kv_cache="fp8")
    q = fp8.fp8_quantization
    print(f"held-out loss over {args.eval_batches} x {args.batch_size} x {seq} bytes ({corpus.description}):")
    for label, total in totals.items():
        loss = total / args.eval_batches
        print(f"  {label:>5}: loss {loss:.4f} nats/byte, perplexity {math.exp(loss):.4f}")
    change = totals["fp8"] / totals[name] - 1
    print(f"  FP8 ({q['weights']} weights, {q['activations']} activations) vs {name}: perplexity "
          f"{math.exp((totals['fp8'] - totals[name]) / args.eval_batches) - 1:+.2%}, loss {change:+.2%}")
    if args.kv_cache:
        scales = "calibrated" if model_kv_scales(fp8) is not None else "from the prefill"
        diff = (totals["fp8, fp8 KV cache"] - totals["fp8, bf16 KV cache"]) / args.eval_batches
        print(f"  FP8 KV cache ({scales} scales) vs bf16 KV cache, same FP8 model: perplexity "
              f"{math.exp(diff) - 1:+.2%}")


def _check_generate_options(args, device: torch.device) -> None:
    """Option combinations generate cannot run, refused with the options named (before the model is loaded)."""
    if not args.prompt:
        raise ValueError("--prompt is empty; generation starts from at least one token")
    if args.cuda_graph == "on" and (device.type != "cuda" or args.kv_cache != "fp8" or args.draft):
        raise ValueError(f"--cuda_graph on needs --kv_cache fp8 on a GPU and no --draft, got --kv_cache "
                         f"{args.kv_cache} on {device}" + (f" with --draft {args.draft}" if args.draft else ""))
    if args.speculate is not None and args.draft is None:
        raise ValueError(f"--speculate (draft tokens per round) goes with --draft, got --speculate {args.speculate} "
                         "and no --draft")
    if args.draft and args.kv_cache == "none":
        raise ValueError("--draft needs a KV cache to roll back (--kv_cache fp8 or bf16), got --kv_cache none")


@torch.no_grad()
def _generate(args) -> None:
    from .generate import generate
    device = _device(args.device, _auto())
    _check_generate_options(args, device)
    if is_hf_dir(pathlib.Path(args.model)):
        return _generate_hf(args, device, _report)
    model = load_quantized(args.model, lambda c: Transformer(TransformerConfig(**c)), device=device).to(device)
    prompt = torch.tensor([list(args.prompt.encode("utf-8"))], dtype=torch.long, device=device)
    if prompt.shape[1] + args.max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(f"--max_new_tokens {args.max_new_tokens}: the prompt ({prompt.shape[1]} bytes) and the new "
                         f"tokens exceed the model's context (max_seq_len {model.cfg.max_seq_len})")
    draft = make_draft(model, args.draft) if args.draft else None
    ids, stats = generate(model, prompt, args.max_new_tokens, kv_cache=None if args.kv_cache == "none" else
                          args.kv_cache, temperature=args.temperature, seed=args.seed,
                          cuda_graph={"auto": None, "on": True, "off": False}[args.cuda_graph], draft=draft,
                          speculate=args.speculate)
    print(bytes(ids[0].tolist()).decode("utf-8", errors="replace"))
    _report(args, stats, device)


def _report(args, stats: dict, device: torch.device) -> None:
    """generate's speed, cache and (with --draft) acceptance lines."""
    dec, pre = stats["decode_tokens_per_s"], stats["prefill_tokens_per_s"]
    speed = f"prefill {pre:,.0f} tokens/s, decode {'n/a' if dec is None else f'{dec:,.1f}'} tokens/s" \
        if pre is not None else f"generate() {dec:,.1f} new tokens/s, prefill included"
    print(f"--\n{speed}, KV cache {args.kv_cache}: "
          f"{stats['cache_bytes'] / 2**20:.2f} MiB" + (f", {stats['kv_scales']} scales" if stats["kv_scales"] else "")
          + f" ({device}{', decode steps as a CUDA graph' if stats['cuda_graph'] else ''})")
    if args.draft:
        rate = stats["acceptance_rate"]
        print(f"speculative decoding: {args.draft} draft, {stats['speculate']} tokens per round, acceptance rate "
              f"{'n/a' if rate is None else f'{rate:.1%}'} ({stats['accepted']} of {stats['proposed']} draft tokens "
              f"kept, {stats['rounds']} rounds)")


def parser() -> argparse.ArgumentParser:
    """The command line's parser (tests/project/test_docs.py parses the documented commands with it)."""
    p = OneLineParser(prog="python -m fp8ext.inference", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="calibrate, pack and export a training checkpoint or a transformers model")
    source = q.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="an fp8ext.train run directory or checkpoint.pt")
    source.add_argument("--model", help="a local Hugging Face transformers causal LM directory (save_pretrained's)")
    q.add_argument("--calib_batches", type=positive_int, default=16)
    q.add_argument("--weights", choices=WEIGHT_SCHEMES, default="channel")
    q.add_argument("--activations", choices=ACTIVATION_SCHEMES, default="dynamic")
    q.add_argument("--out", required=True, help="the directory to write (a checkpoint already there is replaced "
                   "once the new one is complete)")
    e = sub.add_parser("eval", help="perplexity of the FP8 model next to the high-precision one")
    e.add_argument("--model", required=True, help="a directory written by `quantize`")
    e.add_argument("--reference", default=None, help="the training checkpoint, or the transformers model directory "
                   "(default: the one config.json's fp8ext_source names, which `quantize` writes)")
    e.add_argument("--eval_batches", type=positive_int, default=16)
    e.add_argument("--kv_cache", action="store_true",
                   help="also decode the held-out text one token per step through a bf16 and an FP8 KV cache")
    g = sub.add_parser("generate", help="generate text from a prompt with a bf16 or FP8 KV cache")
    g.add_argument("--model", required=True, help="a directory written by `quantize`, or a local transformers "
                   "causal LM directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max_new_tokens", type=nonnegative_int, default=64)
    g.add_argument("--kv_cache", choices=["fp8", "bf16", "none"], default="fp8")
    g.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0: greedy")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cuda_graph", choices=["auto", "on", "off"], default="auto",
                   help="decode steps as one CUDA graph replayed per token (auto: with an FP8 cache on a GPU)")
    g.add_argument("--draft", choices=WEIGHT_ONLY_FORMATS, default=None,
                   help="speculative decoding with a copy of the model whose blocks' weights are in this format")
    g.add_argument("--speculate", type=positive_int, default=None,
                   help="draft tokens per round with --draft (default 4)")
    g.add_argument("--device", type=device_type, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if there is one)")
    for s in (q, e):
        s.add_argument("--data", default=None, help="text file or directory (default: the training run's data)")
        s.add_argument("--batch_size", type=positive_int, default=8)
        s.add_argument("--seq_len", type=positive_int, default=None,
                       help=f"default: the training run's (a transformers model: {HF_SEQ_LEN} or its context)")
        s.add_argument("--device", type=device_type, default=None,
                       help="cpu, cuda or cuda:N (default: quantize cpu, eval cuda if there is one)")
    for s in (q, e, g):
        add_debug(s)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    # a failure is one line "python -m fp8ext.inference COMMAND: error: ..." naming the option or the file
    # (the whole traceback with --debug)
    with one_line_errors(f"{p.prog} {args.command}", args.debug):
        {"quantize": _quantize, "eval": _eval, "generate": _generate}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
