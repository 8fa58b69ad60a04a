"""Bounded fuzz of every tensor op, fp8ext's public functions and the raw fp8ext._C bindings: valid arguments with
one or two replaced by wrong ones (Python junk such as None, str, lists, 10**400, negative ints; other dtypes, meta,
empty / 1-D / 3-D / 0-d, transposed, strided, offset and huge zero-stride views, numpy arrays (read-only too),
consumed DLPack capsules, NaN / Inf; buffers over another argument's memory). First each argument with each wrong
value once (seeded), then FP8EXT_FUZZ_EXAMPLES random calls per op from hypothesis (derandomized).

The contract (docs/numerics.md, Errors): a call returns or raises TypeError or ValueError (NotImplementedError
for what fp8ext does not support; RuntimeError only for CUDA / cuBLAS failures, naming them); and a call whose written
argument overlaps another one does not return. Anything else is a violation, a crash too. The calls run in a child
process (this file as a script) whose address space is limited to what it holds after start-up plus 768 MiB, so an
op that copies a huge zero-stride view, or allocates an output of its shape, fails at once instead of taking the
machine. The child prints each call before making it; the parent lists the violations, one line each with an
example, and the crashes with the call that crashed (then runs the ops not yet done in a new child).

This checks which exception a single call raises. The bounded property suite in tests/properties/ (same CI budget:
no GPU, 2 cores, fixed seeds) checks the rest: files built malformed on purpose (safetensors headers, config.json,
shard indexes, training checkpoints: test_malformed_files.py), FP8Linear state dicts (test_state_dicts.py), numeric
results against torch and float64 (test_numerics.py), memory over repeated calls (test_repeated_calls.py), threads
(test_threads.py) and interrupted saves (test_interrupted_saves.py).
"""

import functools, math, os, random, re, signal, subprocess, sys, time, warnings, zlib  # noqa: E401

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import fp8ext
from fp8ext import _C
from fp8ext.core.boundary import dl
from fp8ext.mx import MX_ELEMENT_FORMATS

EXAMPLES = int(os.environ.get("FP8EXT_FUZZ_EXAMPLES", "40"))
BUDGET_S = 55  # the whole test, child start-ups included (CI: under 60 s on 2 cores)
F32, BF16, F16, E4, E5, U8 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, \
    torch.uint8
FP8 = (E4, E5)
ODD_DTYPES = (torch.int32, torch.int64, torch.bool, torch.float64, torch.complex64, E4, E5, U8, BF16, F16, F32)
PY_JUNK = (None, "e4m3", [1.0, 2.0], 10**400, -10**400, 2**63, -1, -(2**31) - 1, 0, 1.5, math.nan, math.inf, 1e39,
           True, 1j, object(), np.float64(2.0), torch.float64, torch.float8_e5m2, fp8ext.E8M0, fp8ext.Format.HYBRID)
SPECIALS = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 1e30, -65504.0, 448.0, 1e-40])
HUGE_NUMEL = 1 << 30


class Draw:
    """Choices: from hypothesis's data (the random calls) or from a seeded random.Random (the sweep)."""

    def __init__(self, data=None, seed=0):
        self.data, self.rng = data, random.Random(seed)

    def pick(self, *xs):
        return self.data.draw(_sampled(xs)) if self.data else self.rng.choice(xs)

    def int(self, lo, hi):
        return self.data.draw(st.integers(lo, hi)) if self.data else self.rng.randint(lo, hi)


@functools.lru_cache(maxsize=None)
def _sampled(xs):
    return st.sampled_from(xs)


def rand(d, shape, dtype):
    """Random values of `dtype` (float, float8 or uint8 codes below 16), a few of them NaN, Inf, huge or tiny."""
    g = torch.Generator().manual_seed(d.int(0, 2**16))
    if dtype == U8:
        return torch.randint(0, 16, shape, generator=g, dtype=U8)
    x = torch.randn(shape, generator=g) * 2.0 ** d.int(-20, 20)
    if x.numel() and d.pick(True, False):
        x.view(-1)[torch.randint(0, x.numel(), (4,), generator=g)] = SPECIALS[torch.randint(0, 8, (4,), generator=g)]
    return x.to(dtype)


CHOICES = {"fmtx": (fp8ext.E4M3, fp8ext.E5M2, fp8ext.E2M1, fp8ext.E2M3, fp8ext.E3M2, fp8ext.E8M0, fp8ext.E4M3FNUZ,
                    fp8ext.E5M2FNUZ), "mxelem": MX_ELEMENT_FORMATS, "bool": (True, False), "code4": (0,),
           "int": (0, 1, 2, 4, 16, 32, 128), "dtype": (F32, BF16, F16), "odtype": (F32, BF16, F16, E4, E5),
           "block": (32, 16, 64), "bpair": ((1, 128), (128, 128)), "rule": ("floor", "rceil"),
           "margin": (0.0, 1.0, 1e-5), "stream": (0,), "seed": (0, 7, 2**62)}
VALID = {  # valid values of each kind, for a call on x [R, C] in FP8 format f (0: E4M3, 1: E5M2)
    "fmt": lambda d, R, C, f: (fp8ext.E4M3, fp8ext.E5M2)[f],
    "code": lambda d, R, C, f: f,
    "x": lambda d, R, C, f: rand(d, (R, C), d.pick(F32, BF16, F16)),
    "q": lambda d, R, C, f: rand(d, (R, C), FP8[f]),
    "qt": lambda d, R, C, f: rand(d, (C, R), FP8[f]),
    "qsq": lambda d, R, C, f: rand(d, (C, C), E4),
    "u8": lambda d, R, C, f: rand(d, (R, C), U8),
    "xo": lambda d, R, C, f: torch.zeros(R, C),
    "one": lambda d, R, C, f: torch.ones(d.pick((), (1,))),
    "two": lambda d, R, C, f: torch.ones(2),
    "hist": lambda d, R, C, f: torch.ones(4, 2),
    "vec": lambda d, R, C, f: torch.zeros(C),
    "vecR": lambda d, R, C, f: torch.ones(R),
    "smx": lambda d, R, C, f: torch.full((R, C // 32), 127, dtype=U8),
    "bs": lambda d, R, C, f: torch.ones(R, C // 16).to(E4),
    "ws": lambda d, R, C, f: torch.zeros(_C.cast_transpose_dbias_workspace(R, C)),
    "scale": lambda d, R, C, f: (lambda s: torch.full((1,), 2.0) if s == 0 else s)(d.pick(0, 1.0, 0.5, 448.0)),
    "pair": lambda d, R, C, f: (rand(d, (R, C), FP8[f]), rand(d, (C, R), FP8[f])),  # cast_transpose's out=
    "trip": lambda d, R, C, f: (rand(d, (R, C), FP8[f]), rand(d, (C, R), FP8[f]), torch.zeros(C)),
}
TENSORS = {k for k, make in VALID.items() if isinstance(make(Draw(), 1, 1, 0), torch.Tensor)} | {"scale"}
TUPLES = {"pair", "trip"}


def valid(d, kind, R, C, f):
    return VALID[kind](d, R, C, f) if kind in VALID else d.pick(*CHOICES[kind])


# op -> "name:kind ... | keyword:kind ...": "name=kind" for an argument the op writes, "?" for an optional one (left
# out, or None where positional). Public ops are fp8ext.<op>, raw ones fp8ext._C.<op> (tensors as DLPack capsules).
PUBLIC = {
    "quantize": "x:x fmt:fmtx scale:scale | saturate:bool stochastic:bool seed:seed? amax_out=one? scale_inv_out=one? "
                "out=q?",
    "dequantize": "q:q scale_inv:scale dtype:dtype | fmt:fmtx?", "amax": "x:x",
    "cast_transpose": "x:x fmt:fmt scale:scale amax_out=one? | saturate:bool scale_inv_out=one? out=pair?",
    "cast_transpose_dbias": "x:x fmt:fmt scale:scale amax_out=one? | saturate:bool scale_inv_out=one? out=trip?",
    "quantize_rowwise": "x:x fmt:fmt", "quantize_blockwise": "x:x fmt:fmt block:bpair",
    "scale_from_amax": "amax:one fmt:fmt margin:margin",
    "gemm": "a:q b:qsq | a_scale_inv:one b_scale_inv:one out_dtype:odtype? bias:vec? use_fast_accum:bool out=xo? "
            "accumulate:bool out_scale:one? amax_out=one? autotune:bool?",
    "quantize_mx": "x:x elem:mxelem block:block scale_rule:rule", "quantize_nvfp4": "x:x",
    "dequantize_mx": "elements:q scales:smx elem:mxelem block:block dtype:dtype",
    "dequantize_nvfp4": "elements:u8 block_scales:bs tensor_scale:one dtype:dtype",
    "pack_fp4": "codes:u8", "unpack_fp4": "packed:u8", "pack_fp6": "codes:u8", "unpack_fp6": "packed:u8",
}
RAW = {
    "quantize": "x:x out=u8 fmt:code scale:scale | amax_out=one? saturate:bool stochastic:bool seed:seed "
                "stream:stream scale_inv_out=one?",
    "dequantize": "q:q out=xo fmt:code scale_inv:scale | stream:stream",
    "amax": "x:x out=one | stream:stream",
    "cast_transpose": "x:x out=q out_t=qt fmt:code scale:scale | amax_out=one? saturate:bool stream:stream "
                      "scale_inv_out=one?",
    "cast_transpose_dbias": "x:x out=q out_t=qt dbias=vec workspace=ws fmt:code scale:scale | amax_out=one? "
                            "saturate:bool stream:stream scale_inv_out=one?",
    "cast_transpose_dbias_workspace": "rows:int cols:int",
    "cast_transpose_fused": "x:x out=q out_t=qt fmt:code scale:one prologue:int | rstd:vecR? gamma:vec? "
                            "amax_out=one? stream:stream scale_inv_out=one? dy:x?",
    "quantize_blocks": "x:x out=u8 scale_inv=vecR fmt:code block_rows:int block_cols:int stride_r:int stride_c:int "
                       "| stream:stream",
    "scale_from_amax": "amax:one scale=one scale_inv=one fmt:code | margin:margin stream:stream",
    "scale_update": "history=hist scale=two scale_inv=two fmt_max:two algo:int margin:margin update:bool "
                    "backoff:margin | stream:stream",
    "quantize_mx": "x:x out=u8 scales=smx fmt:code | rceil:bool stream:stream",
    "quantize_nvfp4": "x:x out=u8 block_scales=bs tensor_scale=one amax=one | stream:stream",
    "gemm": "a:q b:qsq a_fmt:code b_fmt:code4 a_scale_inv:one b_scale_inv:one out=xo | out_fmt:int bias:vec? "
            "out_scale:one? amax_out=one? accumulate:bool fast_accum:bool workspace=ws? stream:stream autotune:bool "
            "tune_scratch=u8?",
    "decode_attention": "q:x k:q v:q k_scale:one v_scale:one out=xo workspace=ws length:int softmax_scale:margin "
                        "splits:int | stream:stream length_dev:one?",
    "fused_rows": "x:x gamma:vec out=xo scale:one scale_inv:one eps:margin op:int out_mode:int | stream:stream",
    "kv_store": "x:x scale:one cache=q pos:int | stream:stream pos_dev:one?",
    "linear_fwd": "x:x w:x saved=u8 scratch=u8 y=xo fmt:code | x_scale:one x_amax=one w_scale:one w_amax=one "
                  "bias:vec? workspace=ws stream:stream margin:margin? keep:bool prologue:int",
    "linear_bwd": "dy:x saved:u8 scratch=u8 m:int k:int n:int fwd_fmt:code bwd_fmt:code | g_scale:one g_amax=one "
                  "dx=xo dw=xo db=vec? accumulate:bool workspace=ws stream:stream margin:margin? x_t=u8? w_t=u8? "
                  "d_a:x?",
    "rms_norm_fwd": "x:x gamma:vec y=xo rstd=vecR eps:margin | stream:stream",
    "rms_norm_bwd": "x:x dy:x gamma:vec rstd:vecR dx=xo partial=ws dgamma=vec | stream:stream",
    "rope_qkv": "qkv:x cos:x sin:x q=xo k=xo v=xo n_heads:int n_kv:int start_pos:int | stream:stream backward:bool",
    "swiglu_backward": "h:x dy:x dh=xo | stream:stream",
    "weight_only": "x:x w:u8 block_scales:bs channel_scale:vecR tensor_scale:one workspace=ws counters=u8 out=xo "
                   "fmt:code splits:int | stream:stream",
    "weight_only_blocks_per_sm": "fmt:code m:int device:int",
}
# plain torch ops on any layout: a 2**30-element view legitimately needs a result over the child's memory limit
NO_HUGE = {"pack_fp4", "unpack_fp4", "pack_fp6", "unpack_fp6"}
OPS = {**{n: (getattr(fp8ext, n), spec, False) for n, spec in PUBLIC.items()},
       **{"_C." + n: (getattr(_C, n), spec, True) for n, spec in RAW.items()}}


def parse(spec):
    """[(name, kind, written, keyword, optional)] of a spec string."""
    pos, _, kw = spec.partition("|")
    return [(m[1], m[3], m[2] == "=", keyword, m[4] == "?") for keyword, part in ((False, pos), (True, kw))
            for m in re.finditer(r"(\w+)([:=])(\w+)(\??)", part)]


def as_u8(v):
    return v.view(U8) if v.dtype in FP8 else v


def offset(v):
    flat = torch.empty(v.numel() + 1, dtype=as_u8(v).dtype)
    flat[1:].copy_(as_u8(v).reshape(-1))
    return flat[1:].view(v.shape).view(v.dtype)


def used_capsule(v):
    c = torch._C._to_dlpack(as_u8(v))
    torch.from_dlpack(c)  # consumes it: the capsule is now "used_dltensor"
    return c


MUTATIONS = {  # variants of a tensor v
    "dtype": lambda d, v: v.to(d.pick(*ODD_DTYPES)),
    "meta": lambda d, v: v.to("meta"),
    "transposed": lambda d, v: as_u8(v).transpose(-1, -2).contiguous().transpose(-1, -2).view(v.dtype),
    "strided": lambda d, v: torch.stack([as_u8(v)] * 2, -1)[..., 0].view(v.dtype),
    "offset": lambda d, v: offset(v),
    "huge": lambda d, v: torch.zeros(1, dtype=as_u8(v).dtype).view(v.dtype).expand(
        (1 << 14, HUGE_NUMEL >> 14) if v.dim() > 1 else (HUGE_NUMEL,)),
    "empty": lambda d, v: torch.empty((0,) + tuple(v.shape[1:]), dtype=v.dtype),
    "1-D": lambda d, v: v.reshape(-1),
    "3-D": lambda d, v: v.unsqueeze(0),
    "0-d": lambda d, v: as_u8(v).reshape(-1)[:1].reshape(()).view(v.dtype) if v.numel() else torch.zeros(()),
    "numpy": lambda d, v: v.numpy() if v.dtype in (F32, F16, U8) else v.float().numpy(),
    "numpy-ro": lambda d, v: np.broadcast_to(v.float().numpy(), tuple(v.shape)),
    "fill": lambda d, v: (as_u8(v).clone().fill_(d.pick(0x7F, 0xFF, 0x80)).view(v.dtype) if v.dtype in (U8, *FP8)
                          else v.clone().fill_(d.pick(math.nan, math.inf, -math.inf, 1e30))),
    "used-capsule": lambda d, v: used_capsule(v),
    "raw": lambda d, v: v,  # _C only: the tensor itself, not a capsule
}


def menu(tensor, pair=False, sources=()):
    """Ways to replace a value: each Python junk value; for a tensor, each variant, and v over each of `sources`'
    memory; for a tuple of tensors, one of those in one element."""
    return [f"py{i}" for i in range(len(PY_JUNK))] + ([*MUTATIONS, *(f"alias({m})" for m in sources)] if tensor
                                                     else []) + (["element"] if pair else [])


def mutate(d, v, how, others, huge_ok):
    """(a wrong value in place of v, what was done); others: {name: tensor} of the call's other arguments."""
    if how.startswith("py"):
        return PY_JUNK[int(how[2:])], how
    if how == "element":
        i = d.int(0, len(v) - 1)
        w, how = mutate(d, v[i], d.pick(*menu(True, False, sorted(others))), others, huge_ok)
        return v[:i] + (w,) + v[i + 1:], f"[{i}]{how}"
    v = v if isinstance(v, torch.Tensor) else torch.full((1,), float(v))  # a scale given as a number
    if how.startswith("alias("):  # v's dtype and shape over another argument's memory
        return torch.empty(0, dtype=v.dtype).set_(others[how[6:-1]].untyped_storage(), 0, v.shape), how
    how = "strided" if how == "huge" and not huge_ok else how  # one huge view per (op, argument): time bound
    return MUTATIONS[how](d, v), how


def describe(v):
    if isinstance(v, torch.Tensor):
        off = f" +{v.storage_offset()}" if v.storage_offset() else ""
        return f"T({str(v.dtype)[6:]} {list(v.shape)} s{list(v.stride())}{off}{' meta' if v.is_meta else ''})"
    if isinstance(v, np.ndarray):
        return f"np({v.dtype} {list(v.shape)}{'' if v.flags.writeable else ' read-only'})"
    if isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor):
        return "(" + ", ".join(map(describe, v)) + ")"
    if isinstance(v, int) and abs(v) > 2**80:
        return ("-" if v < 0 else "") + f"10**{len(str(abs(v))) - 1}"
    return "capsule" if type(v).__name__ == "PyCapsule" else "object()" if type(v) is object else repr(v)[:40]


def allowed(e):
    return isinstance(e, (TypeError, ValueError, NotImplementedError)) or (
        type(e) is RuntimeError and re.search(r"CUDA|cuBLAS", str(e)) is not None)


def overlap(bad, how, vals, written, passed):
    """'a overlaps b' where the call was given a written argument over another one's memory (both non-empty)."""
    for n in bad:
        m = re.fullmatch(r"(?:\[(\d)\])?alias\((\w+)\)", how[n])
        if m and m[2] in passed and m[2] not in bad and (n in written or m[2] in written):
            t = vals[n][int(m[1])] if m[1] else vals[n]
            if t.numel() and vals[m[2]].numel():
                return f"{n} overlaps {m[2]}, one of them written"
    return None


def sources(slots, n):
    """The tensor arguments whose memory argument n may be put over: those where one of the two is written."""
    w = {m: wr for m, _, wr, _, _ in slots}
    return [m for m, k, wr, _, _ in slots if m != n and k in TENSORS and (wr or w[n])]


def category(how):
    return "python value" if how.startswith("py") else "overlap" if "alias(" in how else re.sub(r"^\[\d\]", "", how)


def one_call(d, name, fn, slots, raw, state, forced=None):
    """One call of op `name`: valid arguments with the forced (argument, how), or up to two random ones, replaced.
    Prints the call first, and a violation line (once per op, outcome and kind of wrong value)."""
    sizes = ((4, 16, 32), (16, 32, 96, 128)) if forced else ((0, 4, 16, 32), (0, 16, 32, 96, 128))  # sweep: not empty
    R, C, f = d.pick(*sizes[0]), d.pick(*sizes[1]), d.pick(0, 1)
    vals = {n: valid(d, k, R, C, f) for n, k, _, _, _ in slots}
    bad, how = [forced[0]] if forced else [n for n in vals if d.int(0, len(vals)) == 0][:2], {}
    for n in bad:
        others = {m: v for m, v in vals.items() if m != n and isinstance(v, torch.Tensor) and not v.is_meta}
        v = vals[n]
        try:
            choice = forced[1] if forced else d.pick(*menu(isinstance(v, torch.Tensor), isinstance(v, tuple),
                                                           sources(slots, n)))
            vals[n], how[n] = mutate(d, v, choice, others, (name, n) not in state["huge"] and name not in NO_HUGE)
        except Exception:  # noqa: BLE001 - torch cannot make that variant: the valid value stays
            how[n] = "n/a"
        state["huge"].update([(name, n)] if how[n].endswith("huge") else [])
    args, kwargs, parts, passed = [], {}, [], set()
    for n, _, _, keyword, optional in slots:
        # an optional argument: the sweep passes it only as the memory an overlap needs; random calls, or not
        if optional and n not in bad and not (f"alias({n})" in forced[1] if forced else d.pick(True, False)):
            if keyword:
                continue
            vals[n] = None
        v, passed = vals[n], passed | ({n} if isinstance(vals[n], torch.Tensor) else set())
        parts.append(f"{n}={'!' + how[n] + ':' if n in bad else ''}{describe(v)}")
        if raw and isinstance(v, torch.Tensor) and how.get(n) != "raw":
            try:
                v = dl(v)
            except Exception:  # noqa: BLE001 - torch exports no capsule of it (meta): C gets the tensor
                pass
        (kwargs.__setitem__(n, v) if keyword else args.append(v))
    call = f"{name}({', '.join(parts)})"
    print("CALL\t" + call, flush=True)
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - judged here
        if allowed(e):
            return
        kind, msg = type(e).__name__, " ".join(str(e).split())
    else:
        kind, msg = "returned", overlap(bad, how, vals, {n for n, _, w, _, _ in slots if w}, passed)
        if msg is None:
            return
    cats = ",".join(f"{n}={category(how[n])}" for n in bad)
    if (name, kind, cats or re.sub(r"\d+", "N", msg)) not in state["seen"]:
        state["seen"].add((name, kind, cats or re.sub(r"\d+", "N", msg)))
        print(f"V\t{name}\t{kind}\t{cats}\t{msg[:150]}\t{call}", flush=True)


def fuzz_op(name, fn, spec, raw, state):
    slots = parse(spec)
    for n, kind, *_ in slots:  # the sweep: each argument with each wrong value
        for how in menu(kind in TENSORS, kind in TUPLES, sources(slots, n)):
            one_call(Draw(seed=zlib.crc32(f"{name} {n} {how}".encode())), name, fn, slots, raw, state, (n, how))

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def random_calls(data):
        one_call(Draw(data), name, fn, slots, raw, state)

    random_calls()


def child(skip):
    import resource
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    torch.randn(1 << 20).abs().sum()  # start torch's threads before the limit
    with open("/proc/self/status") as f:
        limit = (int(re.search(r"VmSize:\s+(\d+)", f.read())[1]) << 10) + (768 << 20)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    state = {"huge": set(), "seen": set()}
    for name, (fn, spec, raw) in OPS.items():
        if name not in skip:
            print("OP\t" + name, flush=True)
            t = time.monotonic()
            fuzz_op(name, fn, spec, raw, state)
            print(f"DONE\t{name}\t{time.monotonic() - t:.2f} s", flush=True)


def summary(found):
    """One line per (op, outcome, kind of wrong value) with the arguments that gave it and an example. Calls with two
    wrong arguments only where neither gives that outcome alone, and none that valid arguments give as well."""
    norm = lambda op, kind, msg: (op, kind, re.sub(r"\d+", "N", msg))  # noqa: E731
    from_valid = {norm(op, kind, msg) for op, kind, cats, msg, _ in found if not cats}
    groups, pairs_of = {}, lambda cats: [c.split("=", 1) for c in cats.split(",") if c]  # noqa: E731
    for op, kind, cats, msg, call in sorted(found, key=lambda f: len(pairs_of(f[2])) != 1):
        pairs = pairs_of(cats)
        if cats and norm(op, kind, msg) in from_valid or len(pairs) > 1 and any(
                a in groups.get((op, kind, c), ([],))[0] for a, c in pairs):
            continue
        cat = pairs[0][1] if len(pairs) == 1 else " + ".join(map("=".join, pairs)) or "valid arguments"
        args = groups.setdefault((op, kind, cat), ([], msg, call))[0]
        args += [pairs[0][0]] if len(pairs) == 1 and pairs[0][0] not in args else []
    return [f"{op}: {kind} [{'/'.join(args) + '=' if args else ''}{cat}]: {msg}\n      e.g. {call[:500]}"
            for (op, kind, cat), (args, msg, call) in sorted(groups.items())]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child's memory limit needs Linux")
def test_fuzz_every_op_keeps_the_error_contract():
    deadline, text = time.monotonic() + BUDGET_S, lambda s: s.decode(errors="replace") if isinstance(s, bytes) else s
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        os.environ.get("PYTHONPATH")])))
    skip, found, crashes = [], [], []
    while True:  # one child, and one more after each crash for the ops not yet done
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), *skip], capture_output=True, env=env,
                               timeout=max(1.0, deadline - time.monotonic()))
            out, err, rc = text(p.stdout), text(p.stderr), p.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = text(e.stdout or b""), text(e.stderr or b""), None
        op = last = None
        for tag, _, rest in (line.partition("\t") for line in out.splitlines()):
            if tag == "OP":
                op, last = rest, None
            elif tag == "DONE":
                skip.append(rest.split("\t")[0])
                op = None
            elif tag == "CALL":
                last = rest
            elif tag == "V":
                found.append(tuple(rest.split("\t", 4)))
        if rc == 0:
            break
        what = "ran past the time budget" if rc is None else f"killed by {signal.Signals(-rc).name}" if rc < 0 \
            else f"exited with {rc}"
        crashes.append(f"CRASH {op or '(start-up)'}: {what}\n      in {last}\n      stderr: "
                       + " | ".join(err.strip().splitlines()[-3:])[-600:])
        if rc is None or op is None:
            break
        skip.append(op)
    lines = summary(found) + crashes
    report = f"{len(lines)} contract violation(s) in {len(OPS)} ops:\n" + "\n".join(lines)
    print(report)
    assert not lines, report


if __name__ == "__main__":
    child(set(sys.argv[1:]))
