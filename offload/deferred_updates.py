"""The updates that wait for the step's gradient norm (``offload.schedule``): its sum over the pieces as they arrived
or over the kept float32 gradients, the ordered update after it (``update: forward``, ``split``, ``synchronous``) and
the delayed one (``update: delayed``); a mixin of ``offload.gradients.GradientPipeline``, whose module docstring
tells how the pieces get here."""

from __future__ import annotations

import time
from functools import partial

import torch
import torch.distributed as dist

from lit_fsdp.errors import OneLineError
from offload.cpu_adam import CHUNK


def squared_norm(values: torch.Tensor, chunk: int = CHUNK) -> float:
    """The squared L2 norm of ``values`` in float32, chunk by chunk (a bfloat16 gradient widened in cache, not whole)."""
    total = torch.zeros((), dtype=torch.float32)
    for start in range(0, values.numel(), chunk):
        total += torch.linalg.vector_norm(values[start : start + chunk], dtype=torch.float32).square()
    return float(total)


class HostUpdateError(OneLineError):
    """The host side of a unit's gradients (the copy's wait, the CPU reduce or the CPU update) failed."""


def host_update_error(unit: int, error: Exception) -> HostUpdateError:
    """``error`` as one line naming the unit (unchanged if it already is one)."""
    if isinstance(error, HostUpdateError):
        return error
    cause = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
    return HostUpdateError(f"SlideFSDP: the host side of unit {unit}'s gradients failed ({type(error).__name__}: {cause})")


def global_norm(squared: float, norm_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global gradient norm in float32 from this rank's squared norm, summed in float64 over ``norm_group`` (the
    node's shards; replicas hold the same rows and are not counted twice)."""
    total = torch.tensor(squared, dtype=torch.float64)
    if norm_group is not None:
        dist.all_reduce(total, group=norm_group)
    return total.sqrt().to(torch.float32)


def clipping_coefficient(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """What clipping to ``max_norm`` multiplies the gradient by, as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


class DeferredUpdates:
    """``GradientPipeline``'s updates after the norm (a mixin: the pipeline holds the host, the optimizer, the held
    pieces ``arriving``, the kept gradients' order, the speculation and the marks)."""

    def delayed_norm(self, max_norm: float | None, norm_group: dist.ProcessGroup | None) -> torch.Tensor | None:
        """This step's global gradient norm from the pieces' squared norms (None if not summed: no clipping and
        ``on_nonfinite: warn``), and the clipping coefficient its delayed (or redone speculative) updates take if
        ``max_norm``. A device sum the step's last backward did not send is sent first: its squared norm is this
        step's."""
        self.send_leftover_sums()
        self.adam.wait()
        self.scale = 1.0
        if not self.schedule.norms_on_arrival:
            return None
        total = global_norm(self.squared_norm, norm_group)
        self.squared_norm = 0.0
        if max_norm and bool(torch.isfinite(total)):
            self.scale = float(clipping_coefficient(max_norm, total))
        return total

    def start_delayed(self) -> None:
        """Queue this step's updates on the worker (they run during the next step), and rewrite the staging rows of
        units updated last step that got no gradient in this one (their update is done: the caller waited)."""
        self.apply_delayed()
        self.adam.freeze_hyperparameters()  # this step's learning rate, before the scheduler moves on
        held, self.arriving = self.arriving, [[] for _ in self.layouts]
        self.received = [0] * len(self.layouts)
        for unit, pieces_of_unit in enumerate(held):
            if pieces_of_unit:
                self.stale.add(unit)
                self.adam.submit(partial(self._delayed_update, unit, pieces_of_unit, self.scale))

    def _delayed_update(self, unit: int, held: list[tuple[int, int, torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Worker thread: one unit's update from the pieces it held, master and moments only (``stale`` until its
        staging rows are rewritten); every buffer goes back to the ring."""
        try:
            no_staging = [None] * len(self.layouts[unit].places)
            for start, stop, shard, _ in held:
                self.adam.update_rows(unit, shard, start, stop, no_staging, grad_scale=scale)
        except Exception as error:
            raise host_update_error(unit, error) from error
        finally:
            for *_, buffer in held:
                self.host.incoming.release(buffer)

    def apply_delayed(self) -> None:
        """Finish the delayed updates and rewrite every stale staging row now (before a checkpoint, a validation or
        the end of training: the next read of the weights sees the update). Between the micro-batches of a step (a
        device sum is waiting) the rows stay as they are, so that the step's other micro-batches compute with the
        weights its first did; the master and moments, which a checkpoint saves, are updated."""
        self.adam.wait()
        if self.accumulated:
            return
        for unit in sorted(self.stale):
            self.host.write_staging(unit)
        self.stale.clear()

    def clip_kept(self, max_norm: float | None, norm_group: dist.ProcessGroup | None) -> torch.Tensor:
        """Scale the kept gradients so that their global norm is at most ``max_norm`` (if set); returns the norm before.

        The norm covers every rank's rows (``norm_group`` sums over the node's shards; replicas hold the same rows and
        are not counted twice), summed as ``delayed_norm`` sums the held pieces': each piece's squared norm in the
        order the pieces arrived, in float64, so that a kept sum and a held gradient of the same values give the same
        norm and coefficient to the bit (the padding rows are zeros).
        """
        assert self.host.gradients is not None, "clipping needs kept gradient buffers"
        self.adam.wait()
        order, self.kept_order = self.kept_order, []
        total = global_norm(sum(squared_norm(self.host.gradients[unit][start:stop]) for unit, start, stop in order),
                            norm_group)
        if max_norm:
            coefficient = clipping_coefficient(max_norm, total)
            for unit in self.kept_units():
                self.host.gradients[unit].mul_(coefficient)
        return total

    def ordered_norm(self, max_norm: float | None, norm_group: dist.ProcessGroup | None,
                     on_nonfinite: str) -> torch.Tensor | None:
        """An ordered step's global norm from the pieces' squared norms and its clipping coefficient
        (``delayed_norm``), or, accumulating on the host, the kept gradients' (``clip_kept``); a split's speculated
        rows are undone now where the norm is not finite and the guard does not let the step through (their redo,
        when clipping fires, is ``start_ordered``'s)."""
        if self.host.gradients is not None:
            return self.clip_kept(max_norm, norm_group)
        total = self.delayed_norm(max_norm, norm_group)
        if self.speculation is not None and total is not None and not bool(torch.isfinite(total)) and on_nonfinite != "warn":
            self.speculation.undo()
        return total

    def start_ordered(self) -> None:
        """Queue this step's updates, one task per unit in forward order (the root, then block 0 up), with the
        clipping coefficient, and return: a load of a unit waits for its task (``await_update``)."""
        held, self.arriving = self.arriving, [[] for _ in self.layouts]
        kept = set(self.kept_units()) if self.host.gradients is not None else set()
        scale, self.scale = self.scale, 1.0
        settings = self.adam.hyperparameters_now()  # the step's: the scheduler moves on before the updates run
        redo = self.speculation is not None and not self.speculation.undone and scale < 1.0
        self.epoch += 1
        root = len(self.layouts) - 1
        for unit in [root, *range(root)]:
            speculated = self.speculation is not None and unit in self.speculation.updates
            if not (held[unit] or unit in kept or speculated):
                self._mark(unit)
                continue
            self.ready[unit] = self.adam.submit(partial(self._ordered_update, unit, held[unit], unit in kept, scale,
                                                        redo and speculated, settings))
        if self.speculation is not None:
            self.adam.submit(self._record_rollback)

    def _ordered_update(self, unit: int, held: list[tuple[int, int, torch.Tensor, torch.Tensor]], kept: bool,
                        scale: float, redo: bool, settings: list[dict]) -> None:
        """Worker thread: ``unit``'s update after the norm, at the step's hyperparameters (``settings``): its speculated
        rows undone and redone clipped (``redo``), its other held pieces (or its kept fp32 gradient, clipped already)
        applied; its buffers back to the ring."""
        try:
            if redo:
                self.speculation.undo_unit(unit)
                self.speculation.redo(unit, scale, settings)
            for start, stop, shard, _ in held:
                if self.speculation is None or not self.speculation.covers(unit, start, stop):
                    self.adam.update_rows(unit, shard, start, stop, self.host.staging_targets(unit), grad_scale=scale,
                                          hyperparameters=settings)
            if kept:
                self.update(unit, settings)
        except Exception as error:
            raise host_update_error(unit, error) from error
        finally:
            for *_, buffer in held:
                self.host.incoming.release(buffer)
        self._mark(unit)

    def _record_rollback(self) -> None:
        """Worker thread, after the step's ordered updates: whether they rolled back and what it took, for
        ``take_rollback``, which the main thread may be running now (under the lock: an append to the list it is
        swapping out would be lost)."""
        taken = self.speculation.end_step()
        with self.rollbacks_lock:
            self.rollbacks.append(taken)

    def _mark(self, unit: int) -> None:
        if self.marks is not None:
            self.marks.mark(unit, self.epoch)

    def update_pending(self, unit: int) -> bool:
        """Whether a load of ``unit`` would wait in ``await_update`` now (its ordered update, or another local rank's,
        still running); never waits."""
        future = self.ready.get(unit)
        return (future is not None and not future.done()) or (
            self.marks is not None and not self.marks.reached(unit, self.epoch))

    def await_update(self, unit: int) -> None:
        """Before a load of ``unit``: wait for its ordered update (and every local rank's, with a shared staging copy);
        the wait is kept in ``forward_waits``. Nothing to wait for outside an ordered schedule."""
        future = self.ready.pop(unit, None)
        waits = future is not None and not future.done()
        marked = self.marks is None or self.marks.reached(unit, self.epoch)
        if not waits and marked:
            if future is not None:
                future.result()
            return
        began = time.perf_counter()
        if future is not None:
            future.result()
        if not marked:
            self.marks.wait(unit, self.epoch, self.adam.failure)
        self.forward_waits.append((began, time.perf_counter()))

    def take_forward_waits(self) -> list[tuple[float, float]]:
        """The loads' waits for ordered updates since the last call."""
        waits, self.forward_waits = self.forward_waits, []
        return waits
