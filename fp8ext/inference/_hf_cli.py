"""The Hugging Face transformers path of `python -m fp8ext.inference quantize --model DIR` and `eval`: a local
causal LM directory in, a compressed-tensors FP8 directory out (which transformers loads), and the two compared."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..train.data import batch, load_corpus
from . import calibrate, load_quantized, quantize_model, save_quantized
from ._header import read_json
from .files import write_json
from .hf import fp8_kv_cache, from_config

__all__ = ["HF_SEQ_LEN", "HFModelError", "is_hf_dir", "quantize_hf", "eval_hf"]

HF_SEQ_LEN = 512  # default calibration / evaluation length in tokens (capped by the model's context)


class HFModelError(ValueError):
    """A transformers model directory that cannot be used, with the option it came from."""


def is_hf_dir(d: pathlib.Path) -> bool:
    """Whether `d` holds a transformers model (config.json with a model_type), not an fp8ext checkpoint (fp8ext's
    Transformer written as a Llama checkpoint has a model_type too, and fp8ext_model_config)."""
    cfg = d / "config.json"
    if not cfg.is_file():
        return False
    config = read_json(cfg, who="--model")
    return "model_type" in config and "fp8ext_model_config" not in config


def _transformers():
    try:
        import transformers
    except ImportError:
        raise HFModelError("a transformers model directory needs transformers (and compressed-tensors to load "
                           "FP8 directories): pip install transformers compressed-tensors") from None
    return transformers


def _load_source(path: str, device: torch.device, option: str):
    """The high-precision causal LM of a local transformers directory (nothing is downloaded), in eval mode."""
    if not (pathlib.Path(path) / "config.json").is_file():
        raise HFModelError(f"{option}: {path!r} is not a transformers model directory (no config.json)")
    transformers = _transformers()
    # transformers' load report (a logged warning) lists an FP8 directory's k_scale / v_scale as UNEXPECTED where
    # compressed-tensors has no place for them (fp8ext.inference.hf): the report is silenced, and what matters in
    # it (weights the directory does not fill) is an error here
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                                        output_loading_info=True)
    except (OSError, ValueError, KeyError) as e:
        raise HFModelError(f"{option}: transformers cannot load {path}: {e}") from e
    finally:
        transformers.logging.set_verbosity(verbosity)
    unfilled = sorted(info.get("missing_keys") or []) + sorted(str(k[0] if isinstance(k, tuple) else k)
                                                                for k in info.get("mismatched_keys") or [])
    if unfilled:
        raise HFModelError(f"{option}: {path} does not fill {len(unfilled)} of {type(model).__name__}'s tensors "
                           f"(missing or of another shape: {unfilled[:3]}{' ...' if len(unfilled) > 3 else ''})")
    return model.to(device).eval()


def _tokenizer(*dirs: str):
    """The first of `dirs` whose tokenizer AutoTokenizer loads locally, or None."""
    transformers = _transformers()
    for d in dirs:
        try:
            return transformers.AutoTokenizer.from_pretrained(d, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _token_stream(data: torch.Tensor, tokenizer, vocab_size: int, option: str) -> torch.Tensor:
    """1-D int64 token ids of a byte corpus split: tokenized as UTF-8 text, or the bytes themselves as ids."""
    if tokenizer is not None:
        text = bytes(data.numpy()).decode("utf-8", errors="replace")
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if vocab_size < 256:
        raise HFModelError(f"{option}: the model has no tokenizer (AutoTokenizer found none) and its vocabulary "
                           f"({vocab_size} ids) cannot hold bytes as token ids (256)")
    return data.long()


def _text(data: Optional[str], model, tokenizer, option: str, seq: Optional[int]) -> Tuple[dict, int, str]:
    """({"train": ids, "val": ids}, sequence length, description) of the calibration / evaluation text."""
    corpus = load_corpus(data)
    ids = {k: _token_stream(getattr(corpus, k), tokenizer, model.config.vocab_size, option) for k in ("train", "val")}
    context = getattr(model.config, "max_position_embeddings", None) or HF_SEQ_LEN
    unit = "tokens" if tokenizer is not None else "bytes"
    return ids, seq or min(HF_SEQ_LEN, context), f"{corpus.description}; {unit}"


def quantize_hf(args) -> None:
    """quantize --model DIR: calibrate on the text, quantize, write args.out (with the source's tokenizer)."""
    device = torch.device(args.device or "cpu")  # checked by the command line
    model = _load_source(args.model, device, "--model")
    tokenizer = _tokenizer(args.model)
    ids, seq, description = _text(args.data, model, tokenizer, "--model", args.seq_len)
    batches = [batch(ids["train"], args.batch_size, seq, seed=10_007, step=i, device=device)[0]
               for i in range(args.calib_batches)]
    calibrate(model, batches)
    quantize_model(model, args.weights, args.activations)
    out = save_quantized(model, args.out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    info = json.loads((out / "config.json").read_text())
    info["fp8ext_source"] = {"model": str(pathlib.Path(args.model).resolve()), "calib_batches": args.calib_batches,
                             "seq_len": seq, "data": args.data, "tokens": "tokenizer" if tokenizer else "bytes"}
    write_json(out / "config.json", info)  # one rename: a failed write leaves the config.json saved above
    q = model.fp8_quantization
    print(f"quantized {len(q['layers'])} linear layers of {type(model).__name__} (weights {args.weights}, "
          f"activations {args.activations}), calibrated on {args.calib_batches} x {args.batch_size} x {seq} "
          f"{description.rpartition('; ')[2]}; FP8 KV-cache scales (per KV head) for {len(q['kv_amax'])} attention "
          f"layers; kept in high precision: {', '.join(q['ignored_modules'])}; wrote {out}")


@torch.no_grad()
def generate_hf(args, device: torch.device, report) -> None:
    """generate --model DIR for a transformers causal LM directory: fp8ext.inference.generate on the model, through
    transformers' caches (--kv_cache bf16: its DynamicCache; fp8: fp8_kv_cache's E4M3-rounded K/V; none: none), with
    --draft speculatively (make_draft of the model). The prompt goes through the directory's tokenizer (with its
    special tokens), or as bytes where it has none; the text is cut after the first end-of-sequence token."""
    from .generate import generate
    from .speculative import make_draft
    if args.cuda_graph == "on":
        raise HFModelError("--cuda_graph on: a transformers model's decode steps run eagerly here")
    model = _load_source(args.model, device, "--model")
    tokenizer = _tokenizer(args.model)
    if tokenizer is not None:
        prompt = torch.tensor([tokenizer(args.prompt)["input_ids"]], dtype=torch.long)
    else:
        prompt = _token_stream(torch.tensor(list(args.prompt.encode("utf-8")), dtype=torch.uint8), None,
                               model.config.vocab_size, "--model")[None]
    draft = None
    if args.draft:
        try:
            draft = make_draft(model, args.draft)
        except ValueError as e:  # a directory quantized by `quantize`: its linear layers hold FP8 weights
            raise HFModelError(f"--draft {args.draft}: {e}; give --model the high-precision directory (a quantized "
                               f"one's config.json names it under fp8ext_source.model)") from e
    ids, stats = generate(model, prompt.to(device), args.max_new_tokens, kv_cache=None if args.kv_cache == "none"
                          else args.kv_cache, temperature=args.temperature, seed=args.seed, draft=draft,
                          speculate=args.speculate)
    out = ids[0].tolist()
    eos = getattr(model.config, "eos_token_id", None)
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    end = next((i + 1 for i in range(prompt.shape[1], len(out)) if out[i] in eos), len(out))
    print(_detokenize(out[:end], tokenizer))
    report(args, stats, device)


def _detokenize(ids, tokenizer) -> str:
    """Text of token ids: by the tokenizer, else ids below 256 as UTF-8 bytes and others as <id>."""
    if tokenizer is not None:
        return tokenizer.decode(ids)
    out, run = [], []
    for i in ids + [None]:
        if i is not None and 0 <= i < 256:
            run.append(i)
            continue
        out.append(bytes(run).decode("utf-8", errors="replace"))
        run = []
        if i is not None:
            out.append(f"<{i}>")
    return "".join(out)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> float:
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()


def _decode_loss(model, x: torch.Tensor, y: torch.Tensor, cache) -> float:
    """Loss of `y` read one token per step through `cache` (transformers' own, or fp8_kv_cache)."""
    from .hf import cache_argument
    kw = {cache_argument(model): cache, "use_cache": True}  # "cache" in transformers 5.24, earlier past_key_values
    steps = [model(x[:, t:t + 1], **kw).logits for t in range(x.shape[1])]
    return _loss(torch.cat(steps, dim=1), y)


@torch.no_grad()
def eval_hf(args, d: pathlib.Path, src: Dict, device: torch.device) -> None:
    """eval --model DIR for a transformers FP8 directory: its loss next to its source model's, same batches."""
    reference = args.reference or src.get("model")
    if not reference or not isinstance(reference, str):
        raise HFModelError(f"--reference: {d / 'config.json'} names no source model to compare with "
                           "(fp8ext_source.model, which `quantize --model` writes); pass --reference with the "
                           "transformers model directory the model was quantized from")
    option = "--reference" if args.reference else f"{d / 'config.json'} (fp8ext_source.model)"
    ref = _load_source(reference, device, option)
    fp8 = load_quantized(d, from_config, device=device)
    tokenizer = _tokenizer(str(d), reference)
    if (tokenizer is None) != (src.get("tokens") == "bytes"):
        print(f"note: {d} was calibrated on {src.get('tokens', 'unknown')} but is evaluated on "
              f"{'bytes' if tokenizer is None else 'tokenizer'} ids")
    ids, seq, description = _text(args.data if args.data is not None else src.get("data"), fp8, tokenizer,
                                  "--model", args.seq_len or src.get("seq_len"))
    totals = {"reference": 0.0, "fp8": 0.0}
    items = range(args.eval_batches)
    if args.kv_cache:
        totals.update({"fp8, its dtype's KV cache": 0.0, "fp8, fp8 KV cache": 0.0})
        from tqdm.auto import tqdm
        items = tqdm(items, desc="eval (one token per step)", unit="batch")
    transformers = _transformers()
    scale_source = None
    for i in items:
        x, y = batch(ids["val"], args.batch_size, seq, seed=20_011, step=i, device=device)
        totals["reference"] += _loss(ref(x).logits, y)
        totals["fp8"] += _loss(fp8(x).logits, y)
        if args.kv_cache:
            totals["fp8, its dtype's KV cache"] += _decode_loss(fp8, x, y, transformers.DynamicCache(config=fp8.config))
            cache = fp8_kv_cache(fp8)
            totals["fp8, fp8 KV cache"] += _decode_loss(fp8, x, y, cache)
            scale_source = cache.scale_source
    n, q = args.eval_batches, fp8.fp8_quantization
    print(f"held-out loss over {n} x {args.batch_size} x {seq} ({description}); reference {ref.dtype}:")
    for name, total in totals.items():
        print(f"  {name:>25}: loss {total / n:.4f} nats/id, perplexity {math.exp(total / n):.4f}")
    print(f"  FP8 ({q['weights']} weights, {q['activations']} activations) vs reference: perplexity "
          f"{math.exp((totals['fp8'] - totals['reference']) / n) - 1:+.2%}")
    if args.kv_cache:
        diff = (totals["fp8, fp8 KV cache"] - totals["fp8, its dtype's KV cache"]) / n
        print(f"  FP8 KV cache ({scale_source} scales) vs the model dtype's, same FP8 model: perplexity "
              f"{math.exp(diff) - 1:+.2%}")
