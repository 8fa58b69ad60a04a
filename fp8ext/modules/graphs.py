"""make_graphed_callables (Transformer Engine's name): the forward and backward passes of modules holding fp8ext FP8
layers captured as CUDA graphs, with the delayed-scaling scale update and the amax recording inside the graphs.

    model = fp8ext.make_graphed_callables(model, (x,), fp8_enabled=True, fp8_recipe=recipe)
    for x, target in batches:
        loss = loss_fn(model(x), target)   # forward graph: scale update, FP8 forward, amaxes recorded
        loss.backward()                     # backward graph: the gradients' amaxes recorded
        opt.step(); opt.zero_grad()

N such steps give the losses and the scaling state of N eager steps (`with fp8_autocast(...): y = model(x)`, backward,
optimizer step) from the same state, bit for bit: the same kernels run on the same data in the same order
(tests/modules/test_graphs.py compares them on the GPU).

How. The capture follows torch.cuda.make_graphed_callables (warm-up on a side stream; forward graphs in order, then
backward graphs in reverse order, in one memory pool; an autograd.Function that copies new inputs into the static
ones and replays). It is written out here because FP8 needs steps around it that torch's helper has no place for:
- slots: every FP8Linear gets its slots (prepare_fp8) before the warm-up, and the scaling manager's state is saved
  before the warm-up and written back (into the same buffers) after the capture, so the warm-up leaves no trace;
- the scale update: eager fp8_autocast runs it on entry, and only when the manager recorded amaxes since its last
  update (`dirty`). A graph cannot read a Python flag, so the first FP8 callable's forward graph holds the update
  followed by a select on a one-element device flag (`buf = where(flag, updated, previous)`), and the host writes
  the flag before a replay only when the manager's dirty flag differs from it (in a training loop every replay
  follows one that recorded amaxes: no write). Replays keep the manager's host bookkeeping as eager steps do
  (`steps` + 1 per update, `dirty`), so checkpoints (get_extra_state) and eager code afterwards see what eager steps
  would have left, in the same buffers. Calling the graphed callables inside one fp8_autocast (same recipe) with
  the rest of a step is equivalent too: its entry runs the update and the flag then skips the graph's;
- gradients: parameters' (and leaf inputs') gradients are returned as clones, not as the graph's static buffers,
  which the next backward replay overwrites (torch's helper corrupts gradient accumulation that way,
  pytorch/pytorch#181723; Transformer Engine clones too).

Refused, because a graph cannot follow it: a DelayedScaling interval other than 1 (whether a step recomputes the
scales is decided on the host), fp8_weight_caching (the weights are cast on every replay), TE's pipeline-schedule
arguments (_order, _num_layers_per_chunk, _reuse_graph_input_output_buffers), sample arguments that are not
tensors, tensors off CUDA. The graphs hold the manager's buffers: registering enough new FP8 tensors with the same
recipe after the capture to reallocate them (`generation` changes) makes the next replay raise.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.graph_state import FP8Replay, ManagerState, UpdateGate
from ..core.context import fp8_autocast, get_scaling_manager, resolve_recipe
from .convert import prepare_fp8

__all__ = ["make_graphed_callables"]

_FN = "make_graphed_callables()"


# ---- arguments ------------------------------------------------------------------------------------------------
def _check_options(n: int, fp8_enabled, fp8_calibrating, fp8_recipe, fp8_weight_caching, num_warmup_iters,
                   private: Dict[str, Any]) -> Tuple[Tuple[bool, ...], Any]:
    """(fp8_enabled per callable, recipe) after the checks of the arguments that are not tensors."""
    for name, value in private.items():
        if value not in (None, False):
            raise NotImplementedError(f"{_FN}: {name} (Transformer Engine's pipeline-parallel schedule) is not "
                                      f"supported by fp8ext; leave it at its default")
    if fp8_weight_caching:
        raise NotImplementedError(f"{_FN}: fp8_weight_caching=True is not supported: the graphs cast the weights on "
                                  "every replay; leave it False")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 0:
        raise ValueError(f"{_FN}: num_warmup_iters must be an int >= 0, got {num_warmup_iters!r}")
    enabled = tuple(fp8_enabled) if isinstance(fp8_enabled, (tuple, list)) else (fp8_enabled,) * n
    if len(enabled) != n:
        raise ValueError(f"{_FN}: fp8_enabled must be a bool or one bool per module ({n}), got {len(enabled)}")
    recipe = resolve_recipe(fp8_recipe, _FN)
    uses_fp8 = any(enabled) or bool(fp8_calibrating)
    if uses_fp8 and recipe.stateful and recipe.interval != 1:
        raise NotImplementedError(f"{_FN}: fp8_recipe.interval={recipe.interval} is not supported: whether a step "
                                  "recomputes the scales is decided on the host, which a graph replay cannot "
                                  "follow; use interval=1")
    return tuple(bool(e) for e in enabled), recipe


def _as_tuples(modules, sample_args, sample_kwargs):
    """(one callable given?, callables, args per callable, kwargs per callable)."""
    single = not isinstance(modules, tuple)
    if single:
        modules, sample_args = (modules,), (sample_args,)
        sample_kwargs = ({} if sample_kwargs is None else sample_kwargs,)
    else:
        n = len(modules)
        if not isinstance(sample_args, (tuple, list)) or len(sample_args) != n:
            raise ValueError(f"{_FN}: with a tuple of {n} modules, sample_args must be a tuple of {n} argument "
                             f"tuples, got {type(sample_args).__name__} of length {len(sample_args)}")
        sample_kwargs = ({},) * n if sample_kwargs is None else sample_kwargs
        if not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != n:
            raise ValueError(f"{_FN}: with a tuple of {n} modules, sample_kwargs must be a tuple of {n} dicts")
    for i, (m, args, kwargs) in enumerate(zip(modules, sample_args, sample_kwargs)):
        if not callable(m):
            raise TypeError(f"{_FN}: modules[{i}] must be an nn.Module or a callable, got {type(m).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{_FN}: sample_args{'' if single else f'[{i}]'} must be a tuple of tensors, got "
                            f"{type(args).__name__}")
        if not isinstance(kwargs, dict):
            raise TypeError(f"{_FN}: sample_kwargs{'' if single else f'[{i}]'} must be a dict, got "
                            f"{type(kwargs).__name__}")
    return single, tuple(modules), tuple(tuple(a) for a in sample_args), tuple(dict(k) for k in sample_kwargs)


def _check_modules(modules) -> bool:
    """Modules: no hooks yet, only parameters trainable, parameters on CUDA, one training mode. Returns it."""
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            continue
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            raise ValueError(f"{_FN}: modules[{i}] has hooks registered; register them after graphing")
        if any(b.requires_grad for b in m.buffers()):
            raise ValueError(f"{_FN}: modules[{i}] has a buffer that requires grad; only parameters may be trainable")
        for name, p in m.named_parameters():
            if not p.is_cuda:
                raise ValueError(f"{_FN}: modules[{i}] parameter {name!r} is on {p.device}; CUDA graphs need every "
                                 "parameter and input on a CUDA device")
    modes = {m.training for m in modules if isinstance(m, nn.Module)}
    if len(modes) > 1:
        raise ValueError(f"{_FN}: the modules must be all in training mode or all in eval mode")
    return modes != {False}


def _flatten_samples(sample_args, sample_kwargs) -> List[Tuple[Tuple[torch.Tensor, ...], List[str]]]:
    """Per callable: (the tensors of its args then kwargs, flattened, in key order; the kwargs' keys)."""
    parts = [(i, list(kwargs), tree_flatten(args)[0], tree_flatten([kwargs[k] for k in kwargs])[0])
             for i, (args, kwargs) in enumerate(zip(sample_args, sample_kwargs))]
    for check in ("type", "device"):  # every type first: a non-tensor is the more basic mistake
        for i, _, args, kwargs in parts:
            for what, leaves in (("sample_args", args), ("sample_kwargs", kwargs)):
                for leaf in leaves:
                    if check == "type" and not isinstance(leaf, torch.Tensor):
                        raise TypeError(f"{_FN}: {what} must hold only tensors (a graph would bake any other value "
                                        f"in), got {type(leaf).__name__} for callable {i}")
                    if check == "device" and not leaf.is_cuda:
                        raise ValueError(f"{_FN}: {what} of callable {i} holds a tensor on {leaf.device}; CUDA "
                                         "graphs need CUDA tensors")
    return [(tuple(args + kwargs), keys) for _, keys, args, kwargs in parts]


def _graph_device(modules, flat) -> torch.device:
    devices = {t.device for tensors, _ in flat for t in tensors}
    devices |= {p.device for m in modules if isinstance(m, nn.Module) for p in m.parameters()}
    if len(devices) > 1:
        raise ValueError(f"{_FN}: the inputs and parameters are on several devices ({sorted(map(str, devices))}); a "
                         "CUDA graph runs on one")
    if not devices and not torch.cuda.is_available():
        raise RuntimeError(f"{_FN}: CUDA graphs need a CUDA device, and none is available")
    return devices.pop() if devices else torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic garbage collector held off while a graph is captured (torch.cuda.graph collects once before
    it starts): a collection in the middle could free CUDA objects of earlier steps (graphs, events, tensors used on
    other streams) whose release is not allowed during a capture, and the capture would fail."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---- capture --------------------------------------------------------------------------------------------------
def _in_fp8_context(func: Callable, enabled: bool, calibrating: bool, recipe, group, gate: Optional[UpdateGate]):
    """func run as the graphs capture it: inside fp8_autocast with this call's FP8 settings (whatever the caller's
    context is at replay), the update first when `gate` is given. _graph=True: the entry leaves the update to us."""
    def run(*args, **kwargs):
        with fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe, fp8_group=group, _graph=True):
            if gate is not None:
                gate.run()
            return func(*args, **kwargs)
    return run


def _differentiable(tensors) -> Tuple[torch.Tensor, ...]:
    return tuple(t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad)


def _warm_up(funcs, samples, surfaces, iters: int, allow_unused: bool, training: bool) -> None:
    """Runs each callable `iters` times (forward, and backward with autograd.grad) on a side stream, so that lazy
    initialisation (cuBLASLt plans, workspaces, FP8 slots) happens before the capture."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for func, (args, kwargs), surface in zip(funcs, samples, surfaces):
            for _ in range(iters):
                outputs = _differentiable(tree_flatten(func(*args, **kwargs))[0])
                inputs = _differentiable(surface)
                if training and outputs and inputs:
                    torch.autograd.grad(outputs, inputs, grad_outputs=tuple(torch.zeros_like(o) for o in outputs),
                                        only_inputs=True, allow_unused=allow_unused)
    torch.cuda.synchronize()


def _capture_forwards(funcs, samples, pool, gate: Optional[UpdateGate]):
    """Forward graphs in call order: (graphs, static outputs, output specs, whether each recorded amaxes)."""
    graphs, outputs, specs, records = [], [], [], []
    for i, (func, (args, kwargs)) in enumerate(zip(funcs, samples)):
        graph = torch.cuda.CUDAGraph()
        if gate is not None:
            gate.mgr.dirty = False
        with torch.cuda.graph(graph, pool=pool), _no_gc():
            out = func(*args, **kwargs)
        leaves, spec = tree_flatten(out)
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            raise TypeError(f"{_FN}: callable {i} returned something other than tensors; a graphed callable can "
                            "return only tensors (in any nesting of tuples, lists and dicts)")
        graphs.append(graph)
        outputs.append(tuple(leaves))
        specs.append(spec)
        records.append(gate is not None and gate.mgr.dirty)
    return graphs, outputs, specs, records


def _capture_backwards(surfaces, outputs, pool, allow_unused: bool, retain_graph: bool, training: bool):
    """Backward graphs in reverse call order: (graphs or None, static grad outputs, static grads per input)."""
    n = len(surfaces)
    graphs, grad_outputs, grad_inputs = [None] * n, [None] * n, [None] * n
    for i in reversed(range(n)):
        static_grad_out = tuple(torch.empty_like(o) if o.requires_grad else None for o in outputs[i])
        outs, ins = _differentiable(outputs[i]), _differentiable(surfaces[i])
        grads = None
        if training and outs and ins:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool), _no_gc():
                grads = torch.autograd.grad(outs, ins, grad_outputs=tuple(g for g in static_grad_out if g is not None),
                                            only_inputs=True, allow_unused=allow_unused, retain_graph=retain_graph)
            graphs[i] = graph
        it = iter(grads or ())
        grad_inputs[i] = tuple(next(it) if grads is not None and t.requires_grad else None for t in surfaces[i])
        grad_outputs[i] = static_grad_out
    return graphs, grad_outputs, grad_inputs


# ---- replay ---------------------------------------------------------------------------------------------------
def _check_like(leaves: Sequence[Any], static: Sequence[torch.Tensor]) -> None:
    if len(leaves) != len(static):
        raise TypeError(f"graphed callable: got {len(leaves)} tensor arguments, it was captured with {len(static)}")
    for i, (t, s) in enumerate(zip(leaves, static)):
        if not isinstance(t, torch.Tensor) or t.shape != s.shape or t.dtype != s.dtype or t.device != s.device:
            got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"graphed callable: tensor argument {i} must be {s.dtype} {list(s.shape)} on {s.device} "
                             f"(as captured), got {got}")
        if t.requires_grad and not s.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"graphed callable: tensor argument {i} requires grad but its sample did not, so the "
                             "backward graph computes no gradient for it; capture with a sample that requires grad")


def _graphed_function(fwd_graph, bwd_graph, params, n_user: int, keys: List[str], spec, surface, outputs,
                      grad_outputs, grad_inputs, replay: Optional[FP8Replay]) -> Callable:
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for i in range(n_user):
                if surface[i].data_ptr() != inputs[i].data_ptr():
                    surface[i].copy_(inputs[i])
            if replay is not None:
                replay.before_forward()
            fwd_graph.replay()
            if replay is not None:
                replay.after_forward()
            # Gradients that autograd stores (.grad of parameters and leaf inputs) are returned as clones.
            ctx.owned = tuple(i >= n_user or inputs[i].is_leaf for i in range(len(inputs)))
            return tuple(o.detach() for o in outputs)

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            if bwd_graph is None:
                raise RuntimeError("graphed callable: no backward graph was captured (the modules were in eval mode, "
                                   "or no output required grad at capture)")
            for static, g in zip(grad_outputs, grads):
                if static is not None and static.data_ptr() != g.data_ptr():
                    static.copy_(g)
            if replay is not None:
                replay.before_backward()
            bwd_graph.replay()
            return tuple(None if b is None else (b.clone() if owned else b.detach())
                         for b, owned in zip(grad_inputs, ctx.owned))

    def graphed(*args, **kwargs):
        if sorted(kwargs) != sorted(keys):
            raise TypeError(f"graphed callable: keyword arguments {sorted(kwargs)} differ from the captured "
                            f"sample_kwargs {sorted(keys)}")
        leaves = tree_flatten(args)[0] + tree_flatten([kwargs[k] for k in keys])[0]
        _check_like(leaves, surface[:n_user])
        return tree_unflatten(list(Graphed.apply(*leaves, *params)), spec)

    return graphed


def _install(module: nn.Module, graphed: Callable) -> nn.Module:
    """module.forward replays the graphs while the module is in the training mode it was captured in, and is the
    original forward (eager, outside the graphs' FP8 settings) in the other mode, as in torch and TE."""
    original, training = module.forward, module.training

    def forward(*args, **kwargs):
        if module.training == training:
            return graphed(*args, **kwargs)
        return original(*args, **kwargs)

    module.forward = forward
    return module


# ---- the entry point ------------------------------------------------------------------------------------------
def make_graphed_callables(
    modules: Union[Callable, Tuple[Callable, ...]],
    sample_args: Union[Tuple[torch.Tensor, ...], Tuple[Tuple[torch.Tensor, ...], ...]],
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    sample_kwargs: Optional[Union[Dict[str, Any], Tuple[Dict[str, Any], ...]]] = None,
    fp8_enabled: Union[bool, Tuple[bool, ...]] = False,
    fp8_calibrating: bool = False,
    fp8_recipe=None,
    fp8_group=None,
    fp8_weight_caching: bool = False,
    _order: Optional[List[int]] = None,
    _num_layers_per_chunk: Optional[List[int]] = None,
    pool=None,
    retain_graph_in_backward: bool = False,
    _reuse_graph_input_output_buffers: bool = False,
):
    """Graphed versions of `modules` (an nn.Module or callable, or a tuple of them in the order a step calls them):
    each call replays a forward CUDA graph inside one autograd node whose backward replays a backward graph.
    Transformer Engine's arguments and semantics (see the module docstring for what differs and why).

    sample_args: the positional tensors of one call (a tuple of such tuples for a tuple of modules); they become the
      graphs' static inputs, and later calls copy their arguments into them, so calls must pass tensors of the same
      shapes, dtypes and requires_grad as the samples. sample_kwargs: keyword tensors likewise (dicts).
    num_warmup_iters: eager runs on a side stream before the capture (their effect on the FP8 state is undone).
    allow_unused_input: allow inputs or parameters that no output depends on (their gradient is None).
    fp8_enabled (one bool, or one per module), fp8_calibrating, fp8_recipe (default DelayedScaling()), fp8_group:
      the fp8_autocast the graphs are captured in. With DelayedScaling, the first FP8 module's forward graph holds
      the scale update that eager fp8_autocast runs on entry, under the same condition (the manager is dirty).
      The captured settings hold whatever fp8_autocast a graphed callable is later called in.
    pool: a torch.cuda.graph_pool_handle() to share memory with other graphs. retain_graph_in_backward: capture the
      backward with retain_graph=True.
    fp8_weight_caching and TE's pipeline-schedule arguments (_order, _num_layers_per_chunk,
      _reuse_graph_input_output_buffers) are accepted only at their defaults.

    Returns the modules themselves, their forward replaced (the eager forward runs when a module is switched to
    the other of training / eval mode), or functions for callables that are not modules; a tuple for a tuple.
    Outputs are the graphs' static output tensors: the next replay overwrites them, and the activations a backward
    replay uses, so each graphed callable has one forward in flight (backward before its next forward), as in
    torch's. Modules must not gain or lose parameters afterwards.
    """
    single, callables, args, kwargs = _as_tuples(modules, sample_args, sample_kwargs)
    private = {"_order": _order, "_num_layers_per_chunk": _num_layers_per_chunk,
               "_reuse_graph_input_output_buffers": _reuse_graph_input_output_buffers}
    enabled, recipe = _check_options(len(callables), fp8_enabled, fp8_calibrating, fp8_recipe, fp8_weight_caching,
                                     num_warmup_iters, private)
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError(f"{_FN}: torch.autocast's weight cache cannot be graphed; use "
                           "torch.autocast(..., cache_enabled=False)")
    training = _check_modules(callables)
    flat = _flatten_samples(args, kwargs)
    device = _graph_device(callables, flat)
    with torch.cuda.device(device):
        graphed = _build(callables, tuple(zip(args, kwargs)), flat, enabled, bool(fp8_calibrating), recipe,
                         fp8_group, num_warmup_iters, allow_unused_input, pool, retain_graph_in_backward, training,
                         device)
    return graphed[0] if single else tuple(graphed)


def _build(callables, samples, flat, enabled, calibrating, recipe, group, iters, allow_unused, pool, retain,
           training, device) -> list:
    delayed = recipe.stateful and (any(enabled) or calibrating)
    gate = saved = None
    if delayed:
        for m in callables:
            if isinstance(m, nn.Module):
                prepare_fp8(m, recipe)  # slots before the capture: registering later could reallocate the buffers
        gate = UpdateGate(get_scaling_manager(recipe, device), group)
        saved = ManagerState(gate.mgr)
    owner = next(i for i, e in enumerate(enabled) if e or calibrating) if delayed else None
    funcs = [_in_fp8_context(c, e, calibrating, recipe, group, gate if i == owner else None)
             for i, (c, e) in enumerate(zip(callables, enabled))]
    params = [tuple(c.parameters()) if isinstance(c, nn.Module) else () for c in callables]
    surfaces = [tensors + p for (tensors, _), p in zip(flat, params)]
    generator = torch.cuda.default_generators[device.index]
    rng = generator.get_state()  # the warm-up and the capture must not move the RNG (dropout)
    mempool = torch.cuda.graph_pool_handle() if pool is None else pool
    try:
        _warm_up(funcs, samples, surfaces, iters, allow_unused, training)
        generation = gate.mgr.generation if gate is not None else None
        fwd, outputs, specs, records = _capture_forwards(funcs, samples, mempool, gate)
        bwd, grad_outputs, grad_inputs = _capture_backwards(surfaces, outputs, mempool, allow_unused, retain, training)
        if gate is not None and gate.mgr.generation != generation:
            raise RuntimeError(f"{_FN}: FP8 tensors were registered during the capture; register every FP8 layer "
                               "first (fp8ext.prepare_fp8) or warm up with num_warmup_iters >= 1")
    finally:
        generator.set_state(rng)
        if saved is not None:
            saved.restore()
    if gate is not None:
        gate.generation = generation
    result = []
    for i, c in enumerate(callables):
        replay = FP8Replay(gate, i == owner, records[i]) if gate is not None else None
        fn = _graphed_function(fwd[i], bwd[i], params[i], len(flat[i][0]), flat[i][1], specs[i], surfaces[i],
                               outputs[i], grad_outputs[i], grad_inputs[i], replay)
        result.append(_install(c, fn) if isinstance(c, nn.Module) else fn)
    return result
