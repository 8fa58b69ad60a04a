"""What autograd keeps for backward in one decoder layer of a Hugging Face LlamaForCausalLM: bf16 next to fp8ext.

    python benchmarks/saved_activations.py                 # small Llama (hidden 256), bf16 / fp8ext delayed / current
    python benchmarks/saved_activations.py --width 1b      # the 1B model's widths (2048 / 8192, heads 16/8), 1 layer
    python benchmarks/saved_activations.py --json out.json --variants bf16 fp8ext-delayed

One eager forward runs under torch.autograd.graph.saved_tensors_hooks; every saved tensor is recorded with the
module that was running when it was saved (module forward hooks keep the stack). The autograd graph is then
walked from the loss, reading each node's saved tensors, to learn which op (autograd node) saved which tensor.
Storages are counted once (untyped_storage().data_ptr()): a tensor saved by several consumers (q/k/v's shared
input in bf16) is charged to the first one and listed as shared by the others. Parameters are left out (they
exist anyway). Bytes are the storage's own size, so a view keeps its whole buffer alive and is charged for it.
Classes: fp8 (float8 dtypes, and fp8ext's uint8 saved buffers), bf16/fp16, fp32; fp8ext's FP8 copy of a weight
(W8^T, its size independent of the tokens) is its own column, "fp8 W".
--tokens N scales the activation bytes (everything but "fp8 W") to N tokens: an estimate for a bigger batch.
CPU-only, seconds; no speed claims. Needs transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

VARIANTS = ["bf16", "fp8ext-delayed", "fp8ext-current"]
COMPILED = ["bf16-compiled", "fp8ext-compiled", "fp8ext-recast-compiled", "fp8ext-current-recast-compiled",
            "torchao-compiled"]
WIDTHS = {"small": dict(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2),
          "1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8)}
COLUMNS = ["fp8", "fp8 W", "bf16", "fp32", "other"]


def build(variant: str, width: str, layers: int, seq_len: int):
    """(model, context factory) of `variant`: the HF Llama in bf16, with fp8ext's convert_to_fp8 (lm_head kept in
    bf16, as benchmarks/bench_hf.py does) under fp8_autocast for the fp8ext variants."""
    import contextlib

    from transformers import LlamaConfig, LlamaForCausalLM

    import fp8ext
    cfg = LlamaConfig(**WIDTHS[width], num_hidden_layers=layers, vocab_size=512, max_position_embeddings=seq_len,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    blocks_only = lambda layer, name: "lm_head" not in name  # noqa: E731
    context = contextlib.nullcontext
    if variant.startswith("fp8ext"):
        recipe = fp8ext.Float8CurrentScaling() if "current" in variant else fp8ext.DelayedScaling()
        fp8ext.convert_to_fp8(model, filter_fn=blocks_only)
        if variant.endswith("compiled"):
            fp8ext.prepare_fp8(model, recipe, recast_in_backward="recast" in variant)
        context = lambda: fp8ext.fp8_autocast(enabled=True, fp8_recipe=recipe)  # noqa: E731
    elif variant.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                   module_filter_fn=blocks_only)
    return (torch.compile(model) if variant.endswith("compiled") else model), context


class Recorder:
    """Saved tensors of one forward: id -> (tensor, module path, pack order); later id -> autograd node name."""

    def __init__(self, model: torch.nn.Module):
        self.saved, self.op, self.stack = {}, {}, ["<root>"]
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(lambda m, a, name=name: self._enter(name)))
            self.handles.append(mod.register_forward_hook(lambda m, a, o: self._leave()))
        self.node = None

    def _enter(self, name: str) -> None:  # hooks return None: a returned value would replace the module's args
        self.stack.append(name)

    def _leave(self) -> None:
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> int:
        key = len(self.saved)
        self.saved[key] = (t, self.stack[-1])
        return key

    def unpack(self, key: int) -> torch.Tensor:
        if self.node is not None:
            self.op.setdefault(key, self.node)
        return self.saved[key][0]

    def name_ops(self, root) -> None:
        """Walks the autograd graph from `root`, reading every node's saved tensors (which calls unpack)."""
        todo, seen = [root], set()
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            self.node = node.name()
            if hasattr(node, "saved_tensors"):  # a Python autograd.Function's ctx
                node.saved_tensors
            for attr in dir(node):
                if attr.startswith("_saved_"):
                    getattr(node, attr)
            self.node = None
            todo.extend(fn for fn, _ in node.next_functions)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def kind_of(t: torch.Tensor) -> str:
    """The byte class of a saved tensor: fp8 (float8 dtypes; uint8 is how fp8ext's one-call path saves its FP8
    bytes), bf16 (bf16/fp16), fp32, or other."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8):
        return "fp8"
    if t.dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    return "fp32" if t.dtype == torch.float32 else "other"


def weight_bytes(t: torch.Tensor, module: torch.nn.Module, tokens: int) -> int:
    """How many of t's storage bytes are an FP8 copy of `module`'s weight (fp8ext's W8^T): a [in, out] FP8 tensor
    (the composed path; x8^T is [in, tokens], told apart when tokens != out), or the tail of the one-call path's
    uint8 buffer (scale_invs, x8^T, then W8^T)."""
    w = getattr(module, "weight", None)
    if w is None or kind_of(t) != "fp8" or type(module).__name__ != "FP8Linear":
        return 0
    if t.dtype == torch.uint8 and t.untyped_storage().nbytes() > w.numel():
        return w.numel()
    is_w = tuple(t.shape) == (w.shape[1], w.shape[0]) and tokens != w.shape[0]
    return t.untyped_storage().nbytes() if is_w else 0


def where(path: str):
    """(layer index or None, the module path inside the layer) of a module path such as model.layers.3.mlp.up_proj."""
    parts = path.split(".")
    if len(parts) >= 3 and parts[:2] == ["model", "layers"]:
        return int(parts[2]), ".".join(parts[3:]) or "(layer)"
    return None, path


def measure(variant: str, args) -> dict:
    """One forward of `variant`; {"layers": per-layer rows averaged over the layers, "outside": bytes outside the
    decoder layers, "tokens": tokens of the forward}."""
    model, context = build(variant, args.width, args.layers, args.seq_len)
    modules = dict(model.named_modules())
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator()
                           .manual_seed(1))
    with context():  # one step first: the steady state (fp8ext's fast path starts on the second call)
        model(input_ids=tokens, labels=tokens).loss.backward()
    model.zero_grad(set_to_none=True)
    rec = Recorder(model)
    with context(), torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
        loss = model(input_ids=tokens, labels=tokens).loss
    rec.close()
    rec.name_ops(loss.grad_fn)
    rows, outside, owner = defaultdict(lambda: dict.fromkeys(COLUMNS, 0)), 0, {}
    for key, (t, path) in rec.saved.items():  # pack order: the first saver of a storage pays for it
        layer, sub = where(path)
        name = (sub, rec.op.get(key, "?"))
        ptr = t.untyped_storage().data_ptr()
        if ptr in rec.params or t.untyped_storage().nbytes() == 0:
            continue
        if ptr in owner:
            first = owner[ptr]
            if first[0] is not None and layer == first[0] and first[1] != name:
                rows[first[1]].setdefault("shared", set()).add(f"{name[0]}:{name[1]}")
            continue
        owner[ptr] = (layer, name)
        nbytes = t.untyped_storage().nbytes()
        if layer is None:
            outside += nbytes
            continue
        w = weight_bytes(t, modules[path], tokens.numel())
        rows[name]["fp8 W"] += w
        rows[name][kind_of(t)] += nbytes - w
    n = args.layers
    out = []
    for (sub, op), r in rows.items():
        row = {"module": sub, "op": op, **{c: r[c] / n for c in COLUMNS}}
        row["shared with"] = ", ".join(sorted(r.get("shared", ())))
        out.append(row)
    return {"layers": out, "outside": outside, "tokens": args.batch * args.seq_len}


def saved_by_shape(variant: str, args, layers: int) -> dict:
    """{(class, dtype, shape): bytes} saved by a forward of `variant` with `layers` layers (storages once, parameters
    left out), after one warm-up step (compilation happens there)."""
    model, context = build(variant, args.width, layers, args.seq_len)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator()
                           .manual_seed(1))
    with context():
        model(input_ids=tokens, labels=tokens).loss.backward()
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = (kind_of(t), str(t.dtype).removeprefix("torch."), tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=tokens, labels=tokens).loss
    del loss
    out = defaultdict(int)
    for kind, dtype, shape, nbytes in seen.values():
        out[(kind, dtype, shape)] += nbytes
    return out


def measure_compiled(variant: str, args) -> dict:
    """Per-layer saved bytes of a compiled `variant`: inside the compiled graph no module runs, so a layer's share
    is what a 2-layer model saves beyond a 1-layer one; grouped by dtype and shape (the op is not known)."""
    one, two = saved_by_shape(variant, args, 1), saved_by_shape(variant, args, 2)
    rows = []
    for key in sorted(set(one) | set(two), key=str):
        diff = two.get(key, 0) - one.get(key, 0)
        if diff:
            kind, dtype, shape = key
            rows.append({"module": f"{dtype} {list(shape)}", "op": "compiled", **dict.fromkeys(COLUMNS, 0),
                         kind: diff, "shared with": ""})
    outside = 2 * sum(one.values()) - sum(two.values())  # the 1-layer model less one layer
    return {"layers": rows, "outside": outside, "tokens": args.batch * args.seq_len}


def scaled(result: dict, tokens: int) -> dict:
    """result with its activation bytes (every column but "fp8 W") scaled to `tokens` tokens."""
    f = tokens / result["tokens"]
    rows = [{**r, **{c: r[c] * (1 if c == "fp8 W" else f) for c in COLUMNS}} for r in result["layers"]]
    return {"layers": rows, "outside": result["outside"] * f, "tokens": tokens}


def totals(result: dict) -> dict:
    t = {c: sum(r[c] for r in result["layers"]) for c in COLUMNS}
    t["total"] = sum(t.values())
    return t


def report(results: dict, unit: str) -> None:
    from fp8ext._bench import table
    div = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    fmt = {c: "{:.2f}" for c in COLUMNS + ["total"]}
    for variant, res in results.items():
        rows = sorted(res["layers"], key=lambda r: (r["module"], r["op"]))
        for r in rows:
            r["total"] = sum(r[c] for c in COLUMNS)
        shown = [{**r, **{c: r[c] / div for c in COLUMNS + ["total"]}} for r in rows]
        tot = totals(res)
        shown.append({"module": "TOTAL per layer", "op": "", **{c: v / div for c, v in tot.items()}})
        print(f"\n{variant}: saved for backward per decoder layer, {unit} ({res['tokens']} tokens; "
              f"outside the layers {res['outside'] / div:.2f} {unit})")
        print(table(shown, ["module", "op"] + COLUMNS + ["total", "shared with"], fmt))
    print(f"\nper layer, {unit}:")
    summary = [{"variant": v, **{c: x / div for c, x in totals(r).items()}} for v, r in results.items()]
    print(table(summary, ["variant"] + COLUMNS + ["total"], fmt))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS + COMPILED,
                    help=f"eager: {' '.join(VARIANTS)}; compiled (slow: inductor on the CPU): {' '.join(COMPILED)}")
    ap.add_argument("--width", default="small", choices=sorted(WIDTHS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=None, help="scale activation bytes to this many tokens")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    results = {v: (measure_compiled if v in COMPILED else measure)(v, args) for v in args.variants}
    if args.tokens:
        results = {v: scaled(r, args.tokens) for v, r in results.items()}
    biggest = max(totals(r)["total"] for r in results.values())
    report(results, "KiB" if biggest < 64 * 2**20 else "MiB" if biggest < 64 * 2**30 else "GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
