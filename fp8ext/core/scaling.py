"""FP8ScalingManager: the scaling state of many FP8 tensors, in device memory, updated in one kernel.

Layout (one manager per recipe and device; "slots" are the tensors it tracks, n of them; the buffers
have room for more, unused slots hold amax 0 and scale 1):
    amax_history  float32 [n, history_len]  a row per tensor, contiguous: entry 0 is this step's amax
                                             (written by the casts, as their fused amax_out), entries
                                             1.. earlier steps (Transformer Engine stores the transpose)
    scale         float32 [n]               the multiplier each cast uses: q = fp8(x * scale)
    scale_inv     float32 [n]               1 / scale, what the GEMMs take
    fmt_max       float32 [n]               448 or 57344, from each slot's format
`update()` runs fp8ext's scale_update kernel over all slots: new scales from the histories, then each
history moves along one entry. No host synchronisation in a step: only checkpointing (slots_state) reads
the device.

Which slots an update touches: FP8Linear's forward records its slots for the step of the thread it runs in
(`record`), and the next step boundary of that thread updates those slots only (`update(slots=...)`; all of
them in one kernel when they are all the manager's slots, the usual case). So two models whose recipes
compare equal, which share a manager, never advance each other's histories, whether they take turns in one
thread (actor and critic, teacher and student) or train in two threads: each slot is updated once per step
that recorded it, as if its model trained alone. Records that name no slot (`dirty = True`: torch.compile'd
and CUDA-graphed steps, which set it for the whole manager) update every slot, as before.

The teaching API of FP8 training notes is kept: update_amax(name, amax), get_scale(name), margin (as TE's
exponent: a multiplicative margin 2.0 is margin=1), and a loss-scaling style backoff (a step whose
amax is NaN/Inf shrinks that tensor's scale by backoff_factor).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Deque, Dict, List, Optional, Union

import torch

from .. import _C
from .boundary import stream_of
from .formats import E4M3, FP8Format, format_of_code, resolve_format
from .recipe import DelayedScaling

__all__ = ["FP8ScalingManager", "pack_slots_state", "unpack_slots_state"]

_to_dl = torch._C._to_dlpack
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass


def take_records(mgr: "FP8ScalingManager") -> Optional[set]:
    """The slots of `mgr` that this thread recorded since its last step boundary (forgotten here), or None."""
    return mgr._by_thread.pop(threading.get_ident(), None)


def _runs(slots: List[int], key=lambda s: None):
    """(first, end, key) of each run of consecutive slots (sorted) with the same key."""
    runs = []
    for s in slots:
        k = key(s)
        if runs and runs[-1][1] == s and runs[-1][2] == k:
            runs[-1][1] = s + 1
        else:
            runs.append([s, s + 1, k])
    return [tuple(r) for r in runs]


def _state_mode():
    """Scaling state is made and written outside inference mode: an inference tensor could never be saved for
    backward or updated in place by a later training step."""
    return torch.inference_mode(False)


class FP8ScalingManager:
    """Amax histories, scales and scale_invs of named FP8 tensors, kept on one device.

    Slots have a lifetime: `release(names)` frees them (FP8Linear does so when it is garbage-collected) and
    `register` hands a freed slot, reset to scale 1 and an empty history, to the next tensor, so the buffers
    hold at most as many slots as were ever alive at once. All state is made outside inference mode, so a
    manager first used under torch.inference_mode() serves training later.
    """

    def __init__(self, recipe: Optional[DelayedScaling] = None, *, device: Union[str, torch.device, None] = None,
                 history_len: Optional[int] = None, margin: Optional[float] = None,
                 amax_compute_algo: Optional[str] = None, interval: Optional[int] = None,
                 backoff_factor: Optional[float] = None):
        r = recipe or DelayedScaling()
        if not isinstance(r, DelayedScaling):
            raise TypeError(f"FP8ScalingManager: recipe must be a DelayedScaling, got {type(r).__name__}")
        self.recipe = DelayedScaling(
            margin=r.margin if margin is None else margin, interval=r.interval if interval is None else interval,
            fp8_format=r.fp8_format, amax_history_len=r.amax_history_len if history_len is None else history_len,
            amax_compute_algo=r.amax_compute_algo if amax_compute_algo is None else amax_compute_algo,
            reduce_amax=r.reduce_amax, backoff_factor=r.backoff_factor if backoff_factor is None else backoff_factor)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._names: List[Optional[str]] = []  # by slot; None for a free slot
        self._formats: List[Optional[FP8Format]] = []
        self._index: Dict[str, int] = {}
        self._free: List[int] = []  # released slots, reused (after a reset) by register
        self._released: Deque[List[str]] = deque()  # names released by finalizers, applied under the lock
        with _state_mode():
            self.amax_history = torch.zeros((0, self.recipe.amax_history_len), dtype=torch.float32, device=self.device)
            self.scale = torch.ones(0, dtype=torch.float32, device=self.device)
            self.scale_inv = torch.ones(0, dtype=torch.float32, device=self.device)
            self._fmt_max = torch.ones(0, dtype=torch.float32, device=self.device)
        self.generation = 0  # bumped when the buffers are reallocated (views taken before are stale)
        self.steps = 0  # updates run so far
        self._whole = False  # `dirty = True`: recorded, slots not named: the next update takes every slot
        self._by_thread: Dict[int, set] = {}  # thread id -> the slots its current step recorded (record)
        self._lag: List[int] = []  # by slot: updates that skipped it (a slot's own count: steps - lag)
        self._lagged = False  # some lag is not 0
        # prepare_fp8 sets it: compiled steps leave `dirty` to the exit of the step's fp8_autocast (core/context.py)
        self.compiled_steps = False
        self.compiled_names: set = set()  # the slots prepare_fp8 prepared, recorded at that exit (by name)
        self._lock = threading.RLock()
        self._views: Dict[int, tuple] = {}

    # ---- what was recorded ------------------------------------------------------------------------
    @property
    def dirty(self) -> bool:
        """Whether something recorded an amax since the last update (the next step boundary updates)."""
        return self._whole or any(self._by_thread.values())

    @dirty.setter
    def dirty(self, value: bool) -> None:  # True: the next update takes every slot; False: nothing is pending
        if value:
            self._whole = True
        else:
            self._whole = False
            self._by_thread.clear()

    def record(self, slots) -> None:
        """Marks `slots` (indices) as recorded in this thread's current step: this thread's next step boundary
        updates them (fp8_autocast's entry). FP8Linear calls it on every forward: kept to a dictionary lookup and
        a set update. A forward that activation checkpointing reruns in the backward records nothing (its step
        recorded it already)."""
        if _graph_task_id() != -1:
            return
        tid = threading.get_ident()
        mine = self._by_thread.get(tid)
        if mine is None:
            mine = self._by_thread[tid] = set()
        mine.update(slots)

    def record_names(self, names: set) -> None:
        """record() of the slots named `names` (names no longer registered are forgotten)."""
        with self._lock:
            self._apply_releases()
            index = self._index
            gone = [n for n in names if n not in index]
            names.difference_update(gone)
            self.record([index[n] for n in names])

    def slot_steps(self, slot: int) -> int:
        """How many updates slot `slot` has had (the manager's `steps`, less those that skipped it)."""
        return self.steps - self._lag[slot]

    # ---- slots ----------------------------------------------------------------------------------
    @property
    def history_len(self) -> int:
        return self.recipe.amax_history_len

    @property
    def margin(self) -> float:
        return self.recipe.margin

    @property
    def names(self) -> List[str]:
        """The names of the live slots, in slot order."""
        with self._lock:
            self._apply_releases()
            return [n for n in self._names if n is not None]

    @property
    def num_slots(self) -> int:
        """How many tensors the manager tracks now (released slots not counted)."""
        return len(self.names)

    @property
    def capacity(self) -> int:
        """How many slots the buffers have room for."""
        return self.amax_history.shape[0]

    def register(self, name: str, fmt=E4M3) -> int:
        """The slot of tensor `name`, made on first use (scale 1, an empty history)."""
        f = resolve_format(fmt, "FP8ScalingManager.register")
        with self._lock:
            self._apply_releases()
            slot = self._index.get(name)
            if slot is not None:
                if self._formats[slot] is not f:
                    raise ValueError(f"FP8ScalingManager.register(): {name!r} is {self._formats[slot].name}, "
                                     f"not {f.name}")
                return slot
            with _state_mode():
                if self._free:
                    slot = self._free.pop()
                    self.amax_history[slot].zero_()
                    self.scale[slot] = 1.0
                    self.scale_inv[slot] = 1.0
                    self._names[slot], self._formats[slot] = name, f
                    self._lag[slot] = self.steps  # a new tensor's own update count starts at 0
                    for mine in self._by_thread.values():
                        mine.discard(slot)
                else:
                    if len(self._names) == self.capacity:
                        self._grow(max(64, 2 * len(self._names)))  # capacity doubles: growth is rare
                    slot = len(self._names)
                    self._names.append(name)
                    self._formats.append(f)
                    self._lag.append(self.steps)
                self._fmt_max[slot] = f.max
            self._lagged = self._lagged or self.steps != 0
            self._index[name] = slot
            return slot

    def release(self, names: List[str]) -> None:
        """Frees the slots of `names` (unknown names are ignored); their values stay until a new tensor takes
        the slot. Safe to call from a finalizer: the release is queued and applied under the lock."""
        self._released.append(list(names))

    def _apply_releases(self) -> None:
        while self._released:
            for name in self._released.popleft():
                slot = self._index.pop(name, None)
                if slot is not None:
                    self._names[slot] = self._formats[slot] = None
                    self._free.append(slot)

    def _grow(self, n: int) -> None:
        """Reallocates the buffers for n slots, keeping the values; unused slots hold scale 1, amax 0."""
        old = self.capacity
        with _state_mode():
            hist = torch.zeros((n, self.history_len), dtype=torch.float32, device=self.device)
            scale = torch.ones(n, dtype=torch.float32, device=self.device)
            scale_inv = torch.ones(n, dtype=torch.float32, device=self.device)
            fmt_max = torch.ones(n, dtype=torch.float32, device=self.device)
            hist[:old] = self.amax_history
            scale[:old], scale_inv[:old], fmt_max[:old] = self.scale, self.scale_inv, self._fmt_max
        self.amax_history, self.scale, self.scale_inv, self._fmt_max = hist, scale, scale_inv, fmt_max
        self.generation += 1
        self._views = {}

    def slot(self, name: str) -> int:
        with self._lock:
            self._apply_releases()
            try:
                return self._index[name]
            except KeyError:
                raise KeyError(f"FP8ScalingManager: no tensor named {name!r}; known: {self.names}") from None

    def views(self, slot: int):
        """(scale, scale_inv, amax) of a slot as 0-d device tensors aliasing the manager's buffers; the casts
        read scale and write their fused amax into amax (this step's history entry). They stay valid until the
        buffers grow (`generation` changes)."""
        v = self._views.get(slot)
        if v is None:
            with _state_mode():
                v = self._views[slot] = (self.scale[slot], self.scale_inv[slot], self.amax_history[slot, 0])
        return v

    # ---- the teaching API (update_amax / get_scale) ------------------------------------------------
    def update_amax(self, name: str, amax: Union[float, torch.Tensor], fmt=E4M3) -> None:
        """Records an amax for `name` this step: its history entry becomes max(entry, amax). A new name is
        registered with format `fmt`."""
        with self._lock:
            self._apply_releases()
            slot = self._index.get(name)
        entry = self.views(self.register(name, fmt) if slot is None else slot)[2]
        with _state_mode():
            value = amax.to(device=self.device, dtype=torch.float32) if isinstance(amax, torch.Tensor) else \
                torch.tensor(float(amax), device=self.device)
            torch.maximum(entry, value.reshape(()), out=entry)
        self.record((self.slot(name),))

    def get_scale(self, name: str) -> torch.Tensor:
        """The scale of `name` (a 0-d device tensor: reading it with .item() synchronises)."""
        return self.views(self.slot(name))[0]

    def get_scale_inv(self, name: str) -> torch.Tensor:
        return self.views(self.slot(name))[1]

    def format_of(self, name: str) -> FP8Format:
        return self._formats[self.slot(name)]

    # ---- the update -----------------------------------------------------------------------------
    def update(self, group=None, slots=None) -> None:
        """One step: (optionally) max-reduce this step's amaxes across `group`, then recompute the scales (every
        `interval` of each slot's updates) and move the histories down a row. `slots`: only these (the slots
        one thread's step recorded; see the module docstring); None: all. One kernel when every slot is taken
        and no slot was skipped before (interval 1 needs no more); no host synchronisation."""
        with self._lock:
            self._apply_releases()
            if not self._index:
                self.dirty = False
                return
            if slots is not None:
                slots = sorted(s for s in set(slots) if s < len(self._names) and self._names[s] is not None)
                if len(slots) == len(self._index):
                    slots = None
            if group is not None and self.recipe.reduce_amax:
                import torch.distributed as dist
                if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
                    # entry 0 of every row, whichever slots update: one collective of the same size on every rank
                    # (which slots are live can differ between ranks for a while: a released layer's slot is freed
                    # when its rank collects it). A max reduced early is reduced again, unchanged, later.
                    recent = self.amax_history[:, 0].contiguous()
                    dist.all_reduce(recent, op=dist.ReduceOp.MAX, group=group)
                    self.amax_history[:, 0].copy_(recent)
            if slots is not None and not slots:  # what was recorded has been released since
                return
            self.steps += 1
            if slots is None:
                self.dirty = False
                if not self._lagged or self.recipe.interval == 1:
                    self._scale_update(self.amax_history, self.scale, self.scale_inv, self._fmt_max, self.steps,
                                       self._own_capsules())
                    return
                taken = [s for s, n in enumerate(self._names) if n is not None]
            else:
                taken = slots
                skipped = set(range(len(self._names))) - set(slots)
                for s in skipped:
                    self._lag[s] += 1
                self._lagged = True
                for mine in self._by_thread.values():  # updated: pending for no thread (update(slots=...) called
                    mine.difference_update(slots)        # directly, or another thread recorded them too)
            self._update_rows(taken)

    def _update_rows(self, slots: List[int]) -> None:
        """The scale update of some rows, in place: a kernel per run of consecutive slots with the same `interval`
        phase (a model's layers register together, so its slots are one run or a few). Slices, no index tensors:
        nothing is copied from the host, so a CUDA graph can capture it."""
        interval = self.recipe.interval
        bufs = (self.amax_history, self.scale, self.scale_inv, self._fmt_max)
        with _state_mode():
            for a, b, due in _runs(slots, lambda s: (self.steps - self._lag[s]) % interval == 0):
                self._scale_update(*(t[a:b] for t in bufs), interval if due else interval + 1)

    def gated_update(self, flag: torch.Tensor, group=None) -> None:
        """update(group), kept only where the 0-d bool `flag` (on the manager's device) is set: what a CUDA graph
        captures, so that each replay updates or not as the host sets the flag (fp8ext/core/graph_state.py)."""
        bufs = (self.amax_history, self.scale, self.scale_inv)
        with torch.no_grad():
            previous = [b.clone() for b in bufs]
            self.update(group)
            for b, p in zip(bufs, previous):
                b.copy_(torch.where(flag, b, p))

    def snapshot(self):
        """The state restore() writes back: (live names, copies of the histories, scales and scale_invs, steps,
        dirty). Graph capture saves it before its warm-up."""
        names = set(self.names)
        with torch.no_grad():
            tensors = [t.clone() for t in (self.amax_history, self.scale, self.scale_inv)]
        return names, tensors, self.steps, self.dirty

    def restore(self, snapshot) -> None:
        """Writes a snapshot() back into the same buffers; slots registered since it was taken get a fresh slot's
        state (scale 1, an empty history), as an eager first step registers them."""
        names, tensors, steps, dirty = snapshot
        with torch.no_grad():
            for buf, saved in zip((self.amax_history, self.scale, self.scale_inv), tensors):
                buf[: saved.shape[0]].copy_(saved)
            for name in self.names:
                if name not in names:
                    slot = self.slot(name)
                    self.amax_history[slot].zero_()
                    self.scale[slot] = 1.0
                    self.scale_inv[slot] = 1.0
        self.steps, self.dirty = steps, dirty

    def discard_recorded(self, slots=None) -> None:
        """Forgets the amaxes recorded since the last update in `slots` (default: all; this step's history entries
        go back to 0, as the update left them): fp8_autocast calls it when a step raises, so a failed step leaves
        no trace. No host synchronisation."""
        with self._lock, _state_mode():
            if slots is None:
                self.amax_history[:, 0].zero_()
                self.dirty = False
                return
            for a, b, _ in _runs(sorted(s for s in set(slots) if s < self.capacity)):
                self.amax_history[a:b, 0].zero_()

    def _own_capsules(self):
        """DLPack capsules of the manager's four buffers, made again only when a buffer was replaced (the update
        runs every step; C borrows capsules and never consumes them)."""
        bufs = (self.amax_history, self.scale, self.scale_inv, self._fmt_max)
        cached = getattr(self, "_capsules", None)
        if cached is None or any(a is not b for a, b in zip(cached[0], bufs)):
            cached = self._capsules = (bufs, tuple(_to_dl(t) for t in bufs))
        return cached[1]

    def _scale_update(self, history, scale, scale_inv, fmt_max, step: int, capsules=None) -> None:
        r = self.recipe
        if capsules is None:
            capsules = (_to_dl(history), _to_dl(scale), _to_dl(scale_inv), _to_dl(fmt_max))
        _C.scale_update(*capsules,
                        0 if r.amax_compute_algo == "max" else 1, float(r.margin), step % r.interval == 0,
                        float(r.backoff_factor), stream=stream_of(history.device))

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The live slots' state as the next step will use it (see slots_state), with names and formats."""
        names = self.names
        st = self.slots_state(names)
        st.update(formats=[self.format_of(n).code for n in names], history_len=self.history_len)
        return st

    def load_state_dict(self, state: dict) -> None:
        names, formats = state["names"], state["formats"]
        for name, code in zip(names, formats):
            self.register(name, format_of_code(code))
        self.load_slots(names, state["amax_history"], state["scale"], state["scale_inv"], state.get("steps"))

    def load_slots(self, names: List[str], history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                   steps: Optional[int] = None) -> None:
        """Writes saved values into the named slots; history is [len(names), saved_len] (a history of another
        length is cut or zero-padded). `steps` (the saved update count, which decides where an `interval`
        falls) is adopted by a manager that has not updated yet."""
        with self._lock, _state_mode():
            idx = torch.tensor([self.slot(n) for n in names], dtype=torch.long, device=self.device)
            cols = min(self.history_len, history.shape[1])
            h = torch.zeros((len(names), self.history_len), dtype=torch.float32)
            h[:, :cols] = history[:, :cols].float()
            self.amax_history.index_copy_(0, idx, h.to(self.device))
            self.scale.index_copy_(0, idx, scale.float().to(self.device))
            self.scale_inv.index_copy_(0, idx, scale_inv.float().to(self.device))
            if steps is not None:  # a slot's own update count (where its `interval` falls) is the saved one
                if self.steps == 0 and not self._lagged:
                    self.steps = int(steps)
                for n in names:
                    lag = self._lag[self.slot(n)] = self.steps - int(steps)
                    self._lagged = self._lagged or lag != 0

    def slots_state(self, names: List[str]) -> dict:
        """{'names', 'amax_history', 'scale', 'scale_inv', 'steps'} of the named slots, on the CPU, as the next
        step will use them: when amaxes were recorded since the last update (the update runs when the next
        step's fp8_autocast is entered), that update is applied to the copy, so a run resumed from it scales
        exactly as the run that never stopped. (With an fp8_group, the copy's update uses this process's
        amaxes.) Reads the device: this synchronises."""
        with self._lock, _state_mode():
            idx = torch.tensor([self.slot(n) for n in names], dtype=torch.long, device=self.device)
            hist, scale, scale_inv, fmt_max = (t.index_select(0, idx).cpu() for t in
                                               (self.amax_history, self.scale, self.scale_inv, self._fmt_max))
            slots = [self.slot(n) for n in names]
            steps = self.slot_steps(slots[0]) if slots else self.steps
            if self._whole or any(not mine.isdisjoint(slots) for mine in self._by_thread.values()):
                steps += 1
                self._scale_update(hist, scale, scale_inv, fmt_max, steps)
        return {"names": list(names), "amax_history": hist, "scale": scale, "scale_inv": scale_inv, "steps": steps}

    def __repr__(self) -> str:
        return (f"FP8ScalingManager({self.num_slots} tensors on {self.device}, history {self.history_len}, "
                f"algo {self.recipe.amax_compute_algo}, margin {self.margin}, steps {self.steps})")


# ---- a layer's slots as one tensor ---------------------------------------------------------------------------------
# What a layer's get_extra_state returns: every saver (torch.save, safetensors, transformers' save_pretrained and its
# sharding, distributed checkpoints) takes a tensor, and an integer tensor is never cast by a loader that converts
# floating-point weights to another dtype. int32 [slots, 3 + history_len], a row per slot in the layer's order:
#     column 0      the manager's update count (`steps`, the same in every row)
#     columns 1, 2  scale and scale_inv, float32 bit patterns
#     columns 3..   the amax history, float32 bit patterns (entry 0 first)
# A layer without FP8 state yet gives an empty tensor (0 rows).


def pack_slots_state(state: dict) -> torch.Tensor:
    """The tensor form (see above) of slots_state()'s dict; an empty dict gives an empty tensor."""
    if not state:
        return torch.zeros((0, 3), dtype=torch.int32)
    hist = state["amax_history"].float().cpu()
    n = hist.shape[0]
    out = torch.empty((n, 3 + hist.shape[1]), dtype=torch.int32)
    out[:, 0] = int(state.get("steps") or 0)
    out[:, 1] = state["scale"].float().cpu().reshape(n).view(torch.int32)
    out[:, 2] = state["scale_inv"].float().cpu().reshape(n).view(torch.int32)
    out[:, 3:] = hist.view(torch.int32)
    return out


def unpack_slots_state(packed, who: str, slots: int) -> dict:
    """slots_state()'s dict back from pack_slots_state's tensor ({} for an empty one); a dict (the form fp8ext's
    checkpoints had before) passes through. Anything else, or a tensor of another shape or dtype, raises naming
    `who`."""
    if isinstance(packed, dict):
        return check_slots_state(packed, who, slots) if packed else {}
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.int32 or packed.dim() != 2 \
            or packed.shape[0] not in (0, slots) or packed.shape[1] < 3:
        what = f"{packed.dtype} tensor of shape {list(packed.shape)}" if isinstance(packed, torch.Tensor) \
            else type(packed).__name__
        raise ValueError(f"{who}: the FP8 scaling state must be an int32 tensor [{slots}, 3 + amax history length] "
                         f"(as get_extra_state gives), got a {what}")
    if packed.shape[0] == 0:
        return {}
    t = packed.detach().cpu().contiguous()
    return check_slots_state({"steps": int(t[0, 0]), "scale": t[:, 1].clone().view(torch.float32),
                              "scale_inv": t[:, 2].clone().view(torch.float32),
                              "amax_history": t[:, 3:].clone().view(torch.float32)}, who, slots)


_TINY = 2.0 ** -126  # below: float32 subnormals, where 1 / scale keeps fewer digits


def check_slots_state(state: dict, who: str, slots: int) -> dict:
    """`state` (slots_state's dict: scale, scale_inv [slots], amax_history [slots, n], steps) if a layer can scale
    with it; else a ValueError naming `who` and what is wrong. A scale that is not a positive finite float32 of
    normal size, or whose scale_inv is not its inverse, would cast every later step wrongly (a 0 or NaN scale fails
    in a kernel, a scale_inv that is not 1 / scale dequantizes wrongly), so it is refused when loaded, not at the
    next forward. Any positive finite scale up to float32's largest is one a history can give (amax tiny)."""
    try:
        scale, scale_inv, hist = (torch.as_tensor(state[k]).detach().cpu() for k in ("scale", "scale_inv", "amax_history"))
    except KeyError as e:
        raise ValueError(f"{who}: the FP8 scaling state has no {e.args[0]!r}") from None
    if not (scale.is_floating_point() and scale_inv.is_floating_point() and hist.is_floating_point()) or \
            scale.shape != (slots,) or scale_inv.shape != (slots,) or hist.dim() != 2 or hist.shape[0] != slots \
            or hist.shape[1] < 1:
        raise ValueError(f"{who}: the FP8 scaling state needs float scale and scale_inv of shape [{slots}] and an amax "
                         f"history [{slots}, n], got {list(scale.shape)}, {list(scale_inv.shape)} and "
                         f"{list(hist.shape)}")
    s, si = scale.double(), scale_inv.double()
    bad = ~(torch.isfinite(s) & torch.isfinite(si) & (s > 0) & (si > 0))
    inverse = torch.where(si >= _TINY, (s * si - 1).abs() <= 1e-6, (si - 1 / s).abs() <= 2.0 ** -148)
    bad |= ~inverse
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"{who}: FP8 scaling state slot {i} has scale {scale[i].item()!r} and scale_inv "
                         f"{scale_inv[i].item()!r}: a scale must be a positive finite float32 and scale_inv its inverse "
                         f"(1 / scale)")
    steps = state.get("steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 2 ** 31):
        raise ValueError(f"{who}: the FP8 scaling state's update count (steps) must be an integer from 0 to 2**31 - 1, "
                         f"got {steps!r}")
    return state
