"""SlideFSDP's speculative update (``speculative_update``; SuperOffload's speculation, then validation).

Clipping and the non-finite guard need the step's global gradient norm, which is known only once the backward is
over. The synchronous way defers every CPU update to then, losing their overlap with the backward; the delayed update
keeps the overlap but applies stale gradients. The speculative update runs each unit's update as its gradient
arrives, with clipping coefficient 1, after copying the rows it is about to change (the master and both
moments, in their own dtypes, and each piece's step count) into a backup allocated at setup. At the optimizer step
the global norm, summed as the pieces arrived, decides (``SpeculativeBackup.settle``):

- clipping does not fire (the coefficient ``max_norm / (norm + 1e-6)`` is not below 1) and the norm is finite: the
  step stands, bit for bit the synchronous one;
- clipping fires: every unit updated in the step is restored from the backup, then updated again from the gradient
  kept for it (its ring buffer, or the fp32 copy accumulation keeps) with the coefficient;
- the norm is not finite and the guard stops or skips the step: restored, and left so.

The undo is exact: it copies back what the update overwrote (no approximate inverse of AdamW). The staging rows are
not backed up: they are the master rounded to the compute dtype, so they are rewritten from the restored master (or
are the master, restored with it); a redo rounds a bfloat16 master with the bits of the first try (its seed comes from
the restored step count). The backup is one more pass over the rows before each update (master + 2 x moment bytes read and as many written per
parameter); a kernel that writes the old values out as it reads them would fold it into the update's own pass.
"""

from __future__ import annotations

import time

import torch

from offload.cpu_adam import CpuAdam
from offload.host import HostState


class SpeculativeBackup:
    """This rank's rows as they were before the step's speculative updates, and the gradients those updates took.

    ``keep`` runs on the worker thread just before each update; ``settle`` and ``undo`` run in the caller's thread
    once the worker is idle (the optimizer step, the guard's skip)."""

    def __init__(self, adam: CpuAdam, host: HostState, rows: dict[int, tuple[int, int]] | None = None):
        """``rows``: the rows ``[start, stop)`` of each unit's shard that may be speculated (``update: split``,
        ``offload.update_split``); None: every row of every unit (``update: speculative``)."""
        self.adam, self.host = adam, host
        if rows is None:
            rows = {unit: (0, master.numel()) for unit, master in enumerate(host.master) if master.numel()}
        self.steps: dict[int, list[torch.Tensor]] = {}  # each updated unit's pieces' step counts before the step
        self.updates: dict[int, list[tuple[int, int, torch.Tensor]]] = {}  # its rows updated, and their gradient
        self.undone = False  # the step's updates are rolled back now
        self.rolled_back = False  # they were, at least once, in this step
        self.seconds = 0.0  # this step's rollbacks and redos
        self.rows: dict[int, tuple[int, int]] = {}
        self.master: dict[int, torch.Tensor] = {}
        self.moments: dict[int, dict[str, torch.Tensor]] = {}
        self.retarget(rows)

    def retarget(self, rows: dict[int, tuple[int, int]]) -> None:
        """Back up ``rows`` from the next step on (``update: auto``'s choice at run time; empty: nothing speculated),
        keeping the backup of a unit whose rows stay and freeing the others'; between steps, the worker idle."""
        assert not self.updates, "a step's speculated updates are still to be settled"
        for unit in [unit for unit in self.rows if self.rows[unit] != rows.get(unit)]:
            del self.rows[unit], self.master[unit], self.moments[unit]
        for unit, (start, stop) in rows.items():
            if unit in self.rows:
                continue
            self.rows[unit] = (start, stop)
            # zero-filled, not empty: the memory is claimed now, as the moments are
            self.master[unit] = torch.zeros(stop - start, dtype=self.host.master[unit].dtype)
            optimizer = self.adam.optimizers[unit]
            state = optimizer.state[self.adam.pieces[unit][0]] if optimizer is not None else {}
            self.moments[unit] = {key: torch.zeros(stop - start, dtype=value.dtype)
                                  for key, value in state.items() if key != "step"}

    def covers(self, unit: int, start: int, stop: int) -> bool:
        """Whether rows ``[start, stop)`` of ``unit`` are speculated (backed up before their update)."""
        rows = self.rows.get(unit)
        return rows is not None and rows[0] <= start and stop <= rows[1]

    def nbytes(self) -> int:
        """Host bytes of the backup (``offload.host_memory``'s ``speculation_backup``)."""
        return sum(t.numel() * t.element_size()
                   for t in [*self.master.values(), *(m for d in self.moments.values() for m in d.values())])

    def keep(self, unit: int, start: int, stop: int, gradient: torch.Tensor) -> None:
        """Worker thread: back up rows ``[start, stop)`` of ``unit`` before their update with ``gradient``."""
        if unit not in self.updates:  # its first rows this step: the step counts advance with its last
            self.steps[unit] = [self._state(unit, index)["step"].clone() for index in range(len(self.adam.pieces[unit]))]
            self.updates[unit] = []
        offset = self.rows[unit][0]
        self.master[unit][start - offset : stop - offset].copy_(self.host.master[unit][start:stop])
        self._copy_moments(unit, start, stop, restore=False)
        self.updates[unit].append((start, stop, gradient))

    def _state(self, unit: int, index: int) -> dict[str, torch.Tensor]:
        return self.adam.optimizers[unit].state[self.adam.pieces[unit][index]]

    def _copy_moments(self, unit: int, start: int, stop: int, restore: bool) -> None:
        offset = self.rows[unit][0]
        for index, begins, first, last in self.adam.spans(unit, start, stop):
            state = self._state(unit, index)
            for key, saved in self.moments[unit].items():
                live, kept = state[key].view(-1)[first - begins : last - begins], saved[first - offset : last - offset]
                (live if restore else kept).copy_(kept if restore else live)

    def settle(self, stands: bool, scale: float) -> None:
        """Validate the step: it ``stands`` (False: the guard stops or skips it: undone), redone with clipping's
        ``scale`` if below 1."""
        if not stands or scale < 1.0:
            self.undo()
        if stands and scale < 1.0:
            for unit in list(self.updates):
                self.redo(unit, scale)
            self.undone = False

    def undo(self) -> None:
        """Restore every unit updated in this step as it was before (master, moments, step counts, staging rows)."""
        if self.undone:
            return
        for unit in list(self.updates):
            self.undo_unit(unit)
        self.undone = True

    def undo_unit(self, unit: int) -> None:
        """Restore ``unit``'s rows updated in this step as they were before (master, moments, the step counts of the
        pieces they span, staging rows); the worker may run it for one unit while others are updated."""
        began = time.perf_counter()
        pieces = set()
        for start, stop, _ in self.updates.get(unit, ()):
            offset = self.rows[unit][0]
            self.host.master[unit][start:stop].copy_(self.master[unit][start - offset : stop - offset])
            self._copy_moments(unit, start, stop, restore=True)
            pieces.update(index for index, *_ in self.adam.spans(unit, start, stop))
        for index in pieces:
            self._state(unit, index)["step"].copy_(self.steps[unit][index])
        self.host.write_staging(unit)
        self.rolled_back = True
        self.seconds += time.perf_counter() - began

    def redo(self, unit: int, scale: float, settings: list[dict] | None = None) -> None:
        """Update ``unit``'s restored rows again from the gradients they took, times ``scale``, at ``settings`` (the
        step's hyperparameters; default: the held optimizer's now)."""
        began = time.perf_counter()
        for start, stop, gradient in self.updates.get(unit, ()):
            self.adam.update_rows(unit, gradient, start, stop, self.host.staging_targets(unit), grad_scale=scale,
                                  hyperparameters=settings)
        self.seconds += time.perf_counter() - began

    def end_step(self) -> tuple[bool, float]:
        """Whether this step was rolled back and the seconds its rollbacks and redos took; the next step starts."""
        taken = (self.rolled_back, self.seconds)
        self.steps, self.updates = {}, {}
        self.undone = self.rolled_back = False
        self.seconds = 0.0
        return taken
