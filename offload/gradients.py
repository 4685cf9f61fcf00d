"""From a unit's finished gradients on the device to its CPU update: reduce, copy to the host, accumulate, step.

``grad_sync: gpu_reduce`` reduce-scatters the unit's gradients across the node's devices (and
all-reduces the shard across nodes), so each rank copies only its 1/N to the host. ``cpu_reduce``
copies the whole gradient to the host and all-reduces it there with gloo, on the worker thread,
so the device does no collective; each rank then keeps its 1/N. Gradients are averaged over all
ranks, as FSDP2 averages them.

The host side runs on the CPU optimizer's worker thread while the device goes on with the backward
of the units before it: wait for the copy, then either update the unit at once, or add the gradient
to the unit's kept buffer (gradient accumulation, clipping) and update it at the optimizer step.

Gradient accumulation on the device (``UpdateSchedule.accumulate_on_device``): a micro-batch that does not end the
step reduces its gradients as the last one does and adds them, in float32, into a sum per gradient part kept on the
device; the last micro-batch adds its own and sends the sum, rounded once to the reduce dtype, on the path above.
The host sees one gradient a step, so every schedule (the speculative and the delayed update too) runs as without
accumulation, and no fp32 copy is kept on the host. The sums are views of one flat buffer allocated with the pipeline,
at placement: before the free memory the activation plan weighs is measured, and not carved out of the caching
allocator in the middle of the first backward, among the freed activations.

A delayed update (``UpdateSchedule.delay``, ZeRO-Offload's DPU) keeps each piece in its buffer (the reduce dtype,
no fp32 copy) and, for clipping and the non-finite guard, adds its squared norm to the step's; at the optimizer step the step's
updates are queued on the worker with the clipping coefficient, and run during the next step's forward and backward.
They update the master and moments only: the device may still load the unit from the staging copy in that step, so
the unit's staging rows are rewritten from the master when its next gradient reaches the host (its last load of the
step is over then, on every rank: the gradient's collective shows it).

A speculative update (``UpdateSchedule.speculate``, ``offload.speculation``) runs each update on arrival, its rows
backed up first, and keeps the gradient it took (its piece's buffer, or the fp32 copy accumulation keeps) and adds
its squared norm to the step's; at the optimizer step ``validate`` lets the step stand, or undoes it and redoes it
clipped, or undoes it for the guard; then the held buffers go back to the ring.

An ordered update (``UpdateSchedule.ordered``: ``update: forward`` or ``split``) holds each piece in its buffer (or,
accumulating on the host, adds it to the fp32 copy) and sums its squared norm on arrival; once the norm is known,
``start_ordered`` queues one task per unit in forward order (the root, then block 0 up) that updates it with the
clipping coefficient, writing its staging rows, and returns without waiting: the next forward's load of a unit
waits in ``await_update`` for that unit's task alone (and, with a staging copy shared by the node's ranks, for every
local rank's, through ``offload.host.SharedMarks``). A split's speculated rows (``offload.update_split``) were updated
on arrival after a backup; their task undoes and redoes them clipped if clipping fired, else only gives their
buffers back.

Non-finite gradients (``UpdateSchedule.check_units_finite``): with ``gpu_reduce`` the device sums the reduced shard
and sends whether the sum is finite as one more element of the copy, so the host reads no gradient twice (on a GPU
the check costs a reduction at device bandwidth, and no host sync); with ``cpu_reduce`` the host sums it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist

from compress.layout import UnitLayout
from compress.torch_compat import reduce_scatter_flat
from offload.cpu_adam import CpuAdam
from offload.deferred_updates import DeferredUpdates, host_update_error, squared_norm
from offload.host import HostState, SharedMarks
from offload.host_memory import FLAG_ELEMENTS, pieces
from offload.schedule import UpdateSchedule
from offload.speculation import SpeculativeBackup
from offload.transfers import Event, Transfers


@dataclass(frozen=True)
class GradientPart:
    """Parameters of a unit whose gradients go to the host together: ``layout`` lays them out from the part's start,
    which is ``shard_offset`` in the unit's shard; ``places`` are their indices among the unit's places."""

    layout: UnitLayout
    places: range
    shard_offset: int


def gradient_parts(layout: UnitLayout, per_parameter: bool) -> list[GradientPart]:
    """``layout``'s gradient parts: the whole unit, or (``per_parameter``, the root under ``gpu_reduce``) one part per
    parameter, so that the head's gradient goes to its update at the start of the backward instead of waiting for
    the embeddings' at its end. A unit with nothing to train (LoRA's root) has none."""
    if not layout.places:
        return []
    groups = [range(i, i + 1) for i in range(len(layout.places))] if per_parameter else [range(len(layout.places))]
    parts = []
    for places in groups:
        first = layout.places[places[0]]
        members = [replace(layout.places[i], full_offset=layout.places[i].full_offset - first.full_offset,
                           shard_offset=layout.places[i].shard_offset - first.shard_offset) for i in places]
        part = UnitLayout(layout.name, members, sum(m.numel for m in members), sum(m.chunk_numel for m in members),
                          layout.shards)
        parts.append(GradientPart(part, places, first.shard_offset))
    return parts


class GradientPipeline(DeferredUpdates):
    """Reduce, offload and apply each unit's gradients (see the module docstring)."""

    def __init__(
        self,
        layouts: list[UnitLayout],
        host: HostState,
        adam: CpuAdam | None,
        transfers: Transfers,
        gpu_reduce: bool,
        reduce_dtype: torch.dtype,
        world_size: int,
        shard_rank: int,
        shard_group: dist.ProcessGroup | None,
        replicate_group: dist.ProcessGroup | None,
        host_group: dist.ProcessGroup | None,
        schedule: UpdateSchedule,
        speculated: dict[int, tuple[int, int]] | None = None,
        marks: SharedMarks | None = None,
    ):
        """
        Args:
            layouts: Every unit's trained parameters, blocks then the root (the last).
            adam: The CPU optimizer; None when not fitting (nothing is updated; ``attach`` gives it).
            shard_group: The node's ranks (reduce-scatter); replicate_group: the same shard on every node.
            host_group: A gloo group of all ranks used only from the worker thread (``cpu_reduce``).
            schedule: When the updates run (``offload.schedule``). With ``check_units_finite`` each unit's gradients
                are checked before its update; a unit with non-finite values is not updated, and counted
                (``take_nonfinite``) for the strategy's guard. With ``delay`` each piece waits in its buffer for the
                next step's update (module docstring), its squared norm added to ``squared_norm`` on arrival with
                ``norms_on_arrival``.
            speculated: ``split``: each speculated unit's rows (``offload.host_memory.speculated_units``).
            marks: With a staging copy the node's ranks share, where each marks the units it has updated (ordered).
        """
        self.layouts, self.host, self.transfers = layouts, host, transfers
        self.gpu_reduce = gpu_reduce
        self.reduce_dtype = reduce_dtype
        self.world_size, self.shard_rank = world_size, shard_rank
        self.shard_group, self.replicate_group, self.host_group = shard_group, replicate_group, host_group
        root = len(layouts) - 1
        self.parts = [gradient_parts(layout, per_parameter=gpu_reduce and unit == root) for unit, layout in enumerate(layouts)]
        self.capacity = host.piece_capacity
        # ring buffers each unit's gradients take per micro-batch
        self.pieces_per_unit = [sum(pieces(part.layout.shard_numel, self.capacity) for part in parts) for parts in self.parts]
        self.received = [0] * len(layouts)  # pieces added to each kept buffer since the last update
        self.schedule = schedule
        self.flag_elements = FLAG_ELEMENTS if gpu_reduce and schedule.check_units_finite else 0  # the device's verdict, copied along
        self.finite = [True] * len(layouts)  # the device's verdicts on each kept gradient's pieces, and-ed
        self.nonfinite_units: set[int] = set()  # units with an update withheld for non-finite gradients since the last take
        self.arriving: list[list[tuple[int, int, torch.Tensor, torch.Tensor]]] = [[] for _ in layouts]  # this step's
        self.squared_norm = 0.0  # of this step's gradient on this rank (``norms``)
        self.scale = 1.0  # clipping's coefficient for this step's delayed updates
        self.stale: set[int] = set()  # units whose master was updated and whose staging rows were not rewritten yet
        self.device_sums = self._device_sums()  # (unit, part): its float32 sum's place on the device
        self.accumulated: dict[tuple[int, int], torch.Tensor] = {}  # (unit, part): this step's sum, once begun
        self.speculated = speculated if schedule.split else None
        self.marks = marks
        self.epoch = 0  # ordered updates queued so far (``start_ordered``): the marks every local rank reaches
        self.ready: dict[int, Future] = {}  # unit: its ordered update, until a load has waited for it
        self.forward_waits: list[tuple[float, float]] = []  # (start, end) of the loads' waits for ordered updates
        self.rollbacks: list[tuple[bool, float]] = []  # a split's rollbacks, as its ordered updates finish
        self.rollbacks_lock = threading.Lock()  # the worker adds to ``rollbacks`` while the step takes them
        self.kept_order: list[tuple[int, int, int]] = []  # the kept pieces (unit, rows) in the order they arrived
        self.attach(adam)

    def _device_sums(self) -> dict[tuple[int, int], torch.Tensor]:
        """With accumulation on the device, each gradient part's float32 sum (its shard with ``gpu_reduce``, else the
        whole gradient): views of one flat buffer (``SlidePlan.accumulator_bytes``); without, none."""
        if not self.schedule.accumulate_on_device:
            return {}
        sizes = {(unit, index): part.layout.shard_numel * (1 if self.gpu_reduce else part.layout.shards)
                 for unit, parts in enumerate(self.parts) for index, part in enumerate(parts)}
        flat = torch.empty(sum(sizes.values()), dtype=torch.float32, device=self.transfers.device)
        return dict(zip(sizes, flat.split(list(sizes.values()))))

    def attach(self, adam: CpuAdam | None) -> None:
        """Update with ``adam`` from now on; a speculative schedule's backup is allocated with it (at setup)."""
        self.adam = adam
        speculates = self.schedule.speculate or self.speculated is not None
        self.speculation = SpeculativeBackup(adam, self.host, self.speculated) if adam is not None and speculates else None

    def speculate(self, rows: dict[int, tuple[int, int]]) -> None:
        """Speculate ``rows`` (``offload.host_memory.speculated_units``; empty: nothing, ``forward``) from the next
        backward on, with a backup of theirs alone: ``update: auto``'s choice at run time (``offload.auto_update``).
        Between steps, with no update of the step before outstanding."""
        self.speculated = rows
        if self.speculation is not None:
            self.speculation.retarget(rows)

    def reduce_and_offload(self, unit: int, part: int, gradients: list[torch.Tensor | None], update_now: bool,
                           last: bool = True) -> None:
        """Send a part of ``unit``'s full gradients (device, one per parameter of the part; None counts as zero) to the
        host update, in ring-buffer-sized pieces; with accumulation on the device, only in the ``last`` micro-batch of
        the step (the others add theirs to the device's sum)."""
        sent = self.parts[unit][part]
        layout = sent.layout
        device = next((g.device for g in gradients if g is not None), self.transfers.device)
        numel = layout.shard_numel * layout.shards
        unsharded = self.gpu_reduce and layout.shards == 1  # the flat buffer is the shard: room for the verdict in it
        flat = torch.empty(numel + (self.flag_elements if unsharded else 0), dtype=self.reduce_dtype, device=device)
        layout.scatter_to_rank_major(gradients, flat[:numel])
        if not self.gpu_reduce:  # the whole gradient, reduced on the host: one piece (the ring is sized for it)
            if not self._sum_on_device((unit, part), flat[:numel], last):
                return
            incoming = self.host.incoming.acquire(numel, self.adam.failure, self.transfers.clock.waiting)
            copied = self.transfers.d2h(incoming, flat)
            self.adam.submit(partial(self._on_host, unit, 0, layout.shard_numel, incoming, copied, update_now))
            return
        outgoing = flat
        if not unsharded:
            outgoing = torch.empty(layout.shard_numel + self.flag_elements, dtype=self.reduce_dtype, device=device)
            reduce_scatter_flat(outgoing[: layout.shard_numel], flat, group=self.shard_group)
        n = layout.shard_numel
        shard, verdict = outgoing[:n], outgoing[n:]
        if self.replicate_group is not None:
            dist.all_reduce(shard, group=self.replicate_group)
        if self.world_size > 1:
            shard.div_(self.world_size)
        if not self._sum_on_device((unit, part), shard, last):
            return
        if self.flag_elements:  # one reduction on the device, queued: no host sync
            verdict.copy_(torch.isfinite(shard.sum(dtype=torch.float32)).reshape(1))
        for start in range(0, n, self.capacity):
            stop = min(n, start + self.capacity)
            incoming = self.host.incoming.acquire(stop - start + self.flag_elements, self.adam.failure,
                                                   self.transfers.clock.waiting)
            if stop - start == n:
                copied = self.transfers.d2h(incoming, outgoing)
            else:  # the part's verdict after each of its pieces
                self.transfers.d2h(incoming[: stop - start], shard[start:stop])
                copied = self.transfers.d2h(incoming[stop - start :], verdict)  # after the piece, on the same stream
            self.adam.submit(partial(self._on_host, unit, sent.shard_offset + start, sent.shard_offset + stop, incoming,
                                     copied, update_now))

    def _sum_on_device(self, key: tuple[int, int], values: torch.Tensor, last: bool) -> bool:
        """With accumulation on the device: add ``values`` to ``key``'s float32 sum, or, in the ``last`` micro-batch,
        replace them by the whole sum (rounded once to their dtype). Whether ``values`` go to the host now."""
        if not self.schedule.accumulate_on_device:
            return True
        if last:
            kept = self.accumulated.pop(key, None)
            if kept is not None:
                values.copy_(kept.add_(values))
            return True
        kept = self.accumulated.get(key)
        if kept is None:
            self.accumulated[key] = self.device_sums[key].copy_(values)
        else:
            kept.add_(values)
        return False

    def send_leftover_sums(self, update_now: bool | None = None) -> None:
        """At the optimizer step, before its norm and its guard read the step's gradients (``delayed_norm``,
        ``take_nonfinite``): send the device's sums that no last micro-batch sent (a part the step's last backward did
        not reach, or a last micro-batch with no backward), as that micro-batch would have (with zeros of its own), so
        that their squared norms and verdicts count in this step, not the next. ``update_now``: default, unless the
        schedule defers the updates."""
        if update_now is None:
            update_now = not self.schedule.defer
        for unit, part in sorted(self.accumulated):
            self.reduce_and_offload(unit, part, [None] * len(self.parts[unit][part].places), update_now, last=True)

    def _on_host(self, unit: int, start: int, stop: int, incoming: torch.Tensor, copied: Event, update_now: bool) -> None:
        """Worker thread: rows ``[start, stop)`` of ``unit``'s shard are (being) copied into ``incoming``; reduce them here
        if needed, apply them (or, delayed, hold them for the next step's update).

        Whatever fails, the buffer goes back to the ring, and the error becomes one line naming the unit:
        the backward waiting for a buffer and the optimizer step waiting for the worker raise it.
        """
        released = []

        def release() -> None:  # once: early on the kept-gradient path, else when done or failed
            if not released:
                released.append(True)
                self.host.incoming.release(incoming)

        try:
            self._apply_on_host(unit, start, stop, incoming, copied, update_now, release)
        except Exception as error:
            release()
            raise host_update_error(unit, error) from error
        if not (self.schedule.holds_pieces and self.arriving[unit] and self.arriving[unit][-1][3] is incoming):
            release()  # a delayed update's piece keeps its buffer until the update, a speculative one's until validated

    def _apply_on_host(self, unit: int, start: int, stop: int, incoming: torch.Tensor, copied: Event, update_now: bool,
                       release) -> None:
        self.transfers.synchronize(copied)
        buffer, layout = incoming, self.layouts[unit]
        finite = None  # not known yet: the host checks
        if self.flag_elements:
            finite, incoming = bool(incoming[-1] != 0), incoming[: -self.flag_elements]
        shard = incoming
        if not self.gpu_reduce:
            if self.world_size > 1:
                dist.all_reduce(incoming, group=self.host_group)
            shard = incoming[self.shard_rank * layout.shard_numel : (self.shard_rank + 1) * layout.shard_numel]
            if self.world_size > 1:
                shard.div_(self.world_size)
        if self.schedule.ordered and self.host.gradients is None:  # held until the norm; a split's first ones updated now
            if self.schedule.norms_on_arrival:
                self.squared_norm += squared_norm(shard)
            if self.speculation is not None and self.speculation.covers(unit, start, stop):
                self._step(unit, start, stop, shard, None)
            self.arriving[unit].append((start, stop, shard, buffer))
            return
        if self.schedule.delay:
            if self.schedule.norms_on_arrival:
                self.squared_norm += squared_norm(shard)
            self.arriving[unit].append((start, stop, shard, buffer))
            self.received[unit] += 1
            if self.received[unit] == self.pieces_per_unit[unit] and unit in self.stale:
                self.host.write_staging(unit)  # every rank has loaded it for the last time this step
                self.stale.discard(unit)
            return
        if self.host.gradients is not None:
            kept = self.host.gradients[unit][start:stop]
            if self.received[unit] == 0:
                self.finite[unit] = True
            if self.received[unit] < self.pieces_per_unit[unit]:  # the first micro-batch's pieces come first
                kept.copy_(shard)
                if self.schedule.ordered:  # its norm is taken piece by piece after the backward (``clip_kept``)
                    self.kept_order.append((unit, start, stop))
            else:
                kept.add_(shard)
            self.finite[unit] &= finite is not False
            self.received[unit] += 1
            release()  # the kept buffer holds the gradient now
            if update_now and self.received[unit] % self.pieces_per_unit[unit] == 0:
                self.update(unit)
            return
        self._step(unit, start, stop, shard, finite)  # a bfloat16 gradient is read as it is, chunk by chunk (offload.cpu_adam)
        if self.speculation is not None:  # held for a redo until the optimizer step validates the step
            self.squared_norm += squared_norm(shard)
            self.arriving[unit].append((start, stop, shard, buffer))

    def update(self, unit: int, settings: list[dict] | None = None) -> None:
        """Apply the kept gradient of ``unit`` (worker thread or idle worker), at ``settings`` (``CpuAdam``'s
        ``hyperparameters_now``; default: the held optimizer's now)."""
        try:
            if self.speculation is not None:  # the sum of the micro-batches' gradients: its norm only now
                self.squared_norm += squared_norm(self.host.gradients[unit])
            self._step(unit, 0, self.layouts[unit].shard_numel, self.host.gradients[unit],
                       self.finite[unit] if self.flag_elements else None, settings)
        except Exception as error:
            raise host_update_error(unit, error) from error
        self.received[unit] = 0

    def _step(self, unit: int, start: int, stop: int, gradient: torch.Tensor, finite: bool | None,
              settings: list[dict] | None = None) -> None:
        """Update rows ``[start, stop)`` of ``unit``'s shard and their staging rows in one pass, unless the gradient is not
        finite (``finite``: the device's verdict on its part; None: the host checks with one reduction, no mask the
        size of the gradient)."""
        if self.schedule.check_units_finite:
            if finite is None:
                finite = bool(torch.isfinite(gradient.sum(dtype=torch.float32)))
            if not finite:
                self.nonfinite_units.add(unit)
                return
        if self.speculation is not None:
            self.speculation.keep(unit, start, stop, gradient)
        self.adam.update_rows(unit, gradient, start, stop, self.host.staging_targets(unit), hyperparameters=settings)

    def take_nonfinite(self) -> int:
        """Units whose update was withheld for non-finite gradients since the last call (after the worker is idle),
        the device's leftover sums checked too."""
        self.send_leftover_sums()
        self.adam.wait()
        withheld, self.nonfinite_units = self.nonfinite_units, set()
        return len(withheld)

    def discard(self, undo: bool = False) -> None:
        """Forget the gradients of this step: the optimizer step then updates nothing (the last step's delayed
        updates, already applied by then, are kept); ``undo``: roll back this step's speculative updates too (the
        guard skips the step)."""
        self.adam.wait()
        if undo and self.speculation is not None:
            self.speculation.undo()
        self.ready.clear()
        self.kept_order = []
        self.accumulated.clear()
        self.received = [0] * len(self.layouts)
        self._release_held()
        self.squared_norm = 0.0

    def _release_held(self) -> None:
        for unit, held in enumerate(self.arriving):
            for *_, buffer in held:
                self.host.incoming.release(buffer)
            self.arriving[unit] = []

    def validate(self, max_norm: float | None, norm_group: dist.ProcessGroup | None, on_nonfinite: str) -> torch.Tensor:
        """A speculative step's global norm (``delayed_norm``); the step stands, or is undone and redone with the
        clipping coefficient, or undone where the norm is not finite and the guard (``on_nonfinite``) does not let
        it through (``offload.speculation``). The held gradients go back to the ring."""
        total = self.delayed_norm(max_norm, norm_group)
        self.speculation.settle(stands=bool(torch.isfinite(total)) or on_nonfinite == "warn", scale=self.scale)
        self._release_held()
        return total

    def speculation_bytes(self) -> int:
        """Host bytes of the speculative update's backup (0 without one)."""
        return self.speculation.nbytes() if self.speculation is not None else 0

    def take_rollback(self) -> tuple[bool, float]:
        """Whether this step's speculative updates were rolled back, and the seconds it took (redos included); a
        split's rollback runs with its ordered updates, behind the next forward: the rollbacks finished since the last
        call."""
        if self.speculation is None:
            return False, 0.0
        if self.schedule.ordered:
            with self.rollbacks_lock:
                done, self.rollbacks = self.rollbacks, []
            return any(rolled for rolled, _ in done), sum(seconds for _, seconds in done)
        return self.speculation.end_step()

    # --- at the optimizer step -------------------------------------------------------------------

    def kept_units(self) -> list[int]:
        """Units whose kept gradient of this step has not been applied yet."""
        return [unit for unit, count in enumerate(self.received) if count]
