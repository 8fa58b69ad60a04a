"""The FP8 scaling state around fp8ext's CUDA graphs (make_graphed_callables, in modules/graphs.py): the delayed-scaling
update captured behind a device flag that follows the manager's `dirty`, the manager state saved before the
warm-up and written back after the capture, and the host bookkeeping of each replay. No capture code here."""

from __future__ import annotations

from typing import Optional

import torch

from .scaling import FP8ScalingManager

__all__ = ["UpdateGate", "ManagerState", "FP8Replay"]


class UpdateGate:
    """The delayed-scaling update of one manager inside a graph, kept only when the host says the manager is dirty
    (see fp8ext/modules/graphs.py's docstring). `flag` is a 0-d bool on the manager's device; `generation` is the
    manager's buffer generation the graphs were captured with."""

    def __init__(self, mgr: FP8ScalingManager, group=None):
        self.mgr, self.group = mgr, group
        self.flag = torch.zeros((), dtype=torch.bool, device=mgr.device)
        self._flag_value = False  # what the host last wrote into flag
        self.generation: Optional[int] = None

    def run(self) -> None:
        """The update as eager fp8_autocast runs it (the same kernel), then the select. Captured into the graph."""
        self.mgr.gated_update(self.flag, self.group)

    def before_replay(self) -> None:
        """Host side of a replay of the graph holding the update: the flag follows `dirty`, and the bookkeeping
        follows what FP8ScalingManager.update would have done."""
        mgr = self.mgr
        dirty = bool(mgr.dirty)
        if dirty != self._flag_value:
            self.flag.fill_(dirty)
            self._flag_value = dirty
        if dirty:
            mgr.steps += 1
            mgr.dirty = False

    def check(self) -> None:
        if self.generation is not None and self.mgr.generation != self.generation:
            raise RuntimeError("make_graphed_callables: the FP8 scaling manager's buffers were reallocated after the "
                               "capture (FP8 tensors registered with the same recipe since), and the graphs still "
                               "address the old ones; register every FP8 layer first (fp8ext.prepare_fp8) and graph "
                               "again")


class ManagerState:
    """A manager's scaling state before the warm-up, written back into the same buffers after the capture. Slots
    registered in between (by the warm-up) are reset to a fresh slot's state (scale 1, empty history), which is
    what an eager first step registers them with."""

    def __init__(self, mgr: FP8ScalingManager):
        self.mgr, self.saved = mgr, mgr.snapshot()

    def restore(self) -> None:
        self.mgr.restore(self.saved)


class FP8Replay:
    """The host side of one graphed callable's FP8 state at replay time."""

    def __init__(self, gate: UpdateGate, owns_update: bool, records: bool):
        self.gate, self.owns_update, self.records = gate, owns_update, records

    def before_forward(self) -> None:
        self.gate.check()
        if self.owns_update:
            self.gate.before_replay()

    def after_forward(self) -> None:
        if self.records:  # the forward recorded amaxes, as FP8Linear.forward marks it in eager mode
            self.gate.mgr.dirty = True

    def before_backward(self) -> None:
        self.gate.check()
