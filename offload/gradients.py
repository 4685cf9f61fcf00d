"""From a unit's finished gradients on the device to its CPU update: reduce, copy to the host, accumulate, step.

``grad_sync: gpu_reduce`` reduce-scatters the unit's gradients across the node's devices (and
all-reduces the shard across nodes), so each rank copies only its 1/N to the host. ``cpu_reduce``
copies the whole gradient to the host and all-reduces it there with gloo, on the worker thread,
so the device does no collective; each rank then keeps its 1/N. Gradients are averaged over all
ranks, as FSDP2 averages them.

The host side runs on the CPU optimizer's worker thread while the device goes on with the backward
of the units before it: wait for the copy, then either update the unit at once, or add the gradient
to the unit's kept buffer (gradient accumulation, clipping) and update it at the optimizer step.

Non-finite gradients (``check_finite``): with ``gpu_reduce`` the device sums the reduced shard and sends
whether the sum is finite as one more element of the copy, so the host reads no gradient twice (on a GPU
the check costs a reduction at device bandwidth, and no host sync); with ``cpu_reduce`` the host sums it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist

from compress.layout import UnitLayout
from compress.torch_compat import reduce_scatter_flat
from lit_fsdp.errors import OneLineError
from offload.cpu_adam import CpuAdam
from offload.host import HostState
from offload.host_memory import FLAG_ELEMENTS, pieces
from offload.transfers import Event, Transfers


class HostUpdateError(OneLineError):
    """The host side of a unit's gradients (the copy's wait, the CPU reduce or the CPU update) failed."""


def host_update_error(unit: int, error: Exception) -> HostUpdateError:
    """``error`` as one line naming the unit (unchanged if it already is one)."""
    if isinstance(error, HostUpdateError):
        return error
    cause = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
    return HostUpdateError(f"SlideFSDP: the host side of unit {unit}'s gradients failed ({type(error).__name__}: {cause})")


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


class GradientPipeline:
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
        check_finite: bool,
    ):
        """
        Args:
            layouts: Every unit's trained parameters, blocks then the root (the last).
            adam: The CPU optimizer; None when not fitting (nothing is updated).
            shard_group: The node's ranks (reduce-scatter); replicate_group: the same shard on every node.
            host_group: A gloo group of all ranks used only from the worker thread (``cpu_reduce``).
            check_finite: Before an update, check the unit's gradients; a unit with non-finite values is not
                updated, and counted (``take_nonfinite``) for the strategy's guard.
        """
        self.layouts, self.host, self.adam, self.transfers = layouts, host, adam, transfers
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
        self.check_finite = check_finite
        self.flag_elements = FLAG_ELEMENTS if gpu_reduce and check_finite else 0  # the device's verdict, copied along
        self.finite = [True] * len(layouts)  # the device's verdicts on each kept gradient's pieces, and-ed
        self.nonfinite_units: set[int] = set()  # units with an update withheld for non-finite gradients since the last take
        self.delayed: set[int] = set()  # units whose kept gradient is applied during the next step (``delay_kept``)

    def reduce_and_offload(self, unit: int, part: int, gradients: list[torch.Tensor | None], update_now: bool) -> None:
        """Send a part of ``unit``'s full gradients (device, one per parameter of the part; None counts as zero) to the
        host update, in ring-buffer-sized pieces."""
        sent = self.parts[unit][part]
        layout = sent.layout
        device = next((g.device for g in gradients if g is not None), self.transfers.device)
        numel = layout.shard_numel * layout.shards
        unsharded = self.gpu_reduce and layout.shards == 1  # the flat buffer is the shard: room for the verdict in it
        flat = torch.empty(numel + (self.flag_elements if unsharded else 0), dtype=self.reduce_dtype, device=device)
        layout.scatter_to_rank_major(gradients, flat[:numel])
        if not self.gpu_reduce:  # the whole gradient, reduced on the host: one piece (the ring is sized for it)
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

    def _on_host(self, unit: int, start: int, stop: int, incoming: torch.Tensor, copied: Event, update_now: bool) -> None:
        """Worker thread: rows ``[start, stop)`` of ``unit``'s shard are (being) copied into ``incoming``; reduce them here
        if needed, apply them.

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
            raise host_update_error(unit, error) from error
        finally:
            release()

    def _apply_on_host(self, unit: int, start: int, stop: int, incoming: torch.Tensor, copied: Event, update_now: bool,
                       release) -> None:
        self.transfers.synchronize(copied)
        layout = self.layouts[unit]
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
        if self.host.gradients is not None:
            if unit in self.delayed:  # the last step's update, delayed until now: see ``delay_kept``
                self.delayed.discard(unit)
                self.update(unit)
            kept = self.host.gradients[unit][start:stop]
            if self.received[unit] == 0:
                self.finite[unit] = True
            if self.received[unit] < self.pieces_per_unit[unit]:  # the first micro-batch's pieces come first
                kept.copy_(shard)
            else:
                kept.add_(shard)
            self.finite[unit] &= finite is not False
            self.received[unit] += 1
            release()  # the kept buffer holds the gradient now
            if update_now and self.received[unit] % self.pieces_per_unit[unit] == 0:
                self.update(unit)
            return
        self._step(unit, start, stop, shard, finite)  # a bfloat16 gradient is read as it is, chunk by chunk (offload.cpu_adam)

    def update(self, unit: int) -> None:
        """Apply the kept gradient of ``unit`` (worker thread or idle worker)."""
        try:
            self._step(unit, 0, self.layouts[unit].shard_numel, self.host.gradients[unit],
                       self.finite[unit] if self.flag_elements else None)
        except Exception as error:
            raise host_update_error(unit, error) from error
        self.received[unit] = 0

    def _step(self, unit: int, start: int, stop: int, gradient: torch.Tensor, finite: bool | None) -> None:
        """Update rows ``[start, stop)`` of ``unit``'s shard and their staging rows in one pass, unless the gradient is not
        finite (``finite``: the device's verdict on its part; None: the host checks with one reduction, no mask the
        size of the gradient)."""
        if self.check_finite:
            if finite is None:
                finite = bool(torch.isfinite(gradient.sum(dtype=torch.float32)))
            if not finite:
                self.nonfinite_units.add(unit)
                return
        self.adam.update_rows(unit, gradient, start, stop, self.host.staging_targets(unit))

    def take_nonfinite(self) -> int:
        """Units whose update was withheld for non-finite gradients since the last call (after the worker is idle)."""
        self.adam.wait()
        withheld, self.nonfinite_units = self.nonfinite_units, set()
        return len(withheld)

    def discard(self) -> None:
        """Forget the kept gradients of this step: the optimizer step then updates nothing (a delayed update of the
        last step that is still waiting is kept)."""
        self.adam.wait()
        self.received = [count if unit in self.delayed else 0 for unit, count in enumerate(self.received)]

    # --- at the optimizer step -------------------------------------------------------------------

    def kept_units(self) -> list[int]:
        """Units whose kept gradient of this step has not been applied yet."""
        return [unit for unit, count in enumerate(self.received) if count and unit not in self.delayed]

    def delay_kept(self) -> None:
        """Apply the kept gradients during the next step instead of now (the one-step delayed update, DPU).

        A unit's delayed update runs on the worker when the first piece of its next gradient is on the host: its
        slot on the worker comes before that piece overwrites the kept buffer, and (with more than one rank per node)
        the gradient's collective, done on every rank, shows that every rank has loaded the unit for the last time
        in this step, so a shared staging copy is not rewritten under another rank's load.
        """
        self.adam.wait()
        self.delayed = set(self.kept_units())

    def run_delayed(self) -> None:
        """Apply the delayed updates still waiting (a unit that got no gradient, or before a checkpoint, a validation
        or the end of training), and wait for them."""
        self.adam.wait()
        for unit in sorted(self.delayed):
            self.adam.submit(partial(self.update, unit))
        self.delayed = set()
        self.adam.wait()

    def clip_kept(self, max_norm: float | None, norm_group: dist.ProcessGroup | None) -> torch.Tensor:
        """Scale the kept gradients so that their global norm is at most ``max_norm`` (if set); returns the norm before.

        The norm covers every rank's rows (``norm_group`` sums over the node's shards; replicas hold
        the same rows and are not counted twice), as ``torch.nn.utils.clip_grad_norm_`` computes it.
        """
        assert self.host.gradients is not None, "clipping needs kept gradient buffers"
        self.adam.wait()
        norms = [
            torch.linalg.vector_norm(view)
            for unit in self.kept_units() for view in self.layouts[unit].local_views(self.host.gradients[unit])
        ]
        squared = torch.linalg.vector_norm(torch.stack(norms)).pow(2) if norms else torch.zeros(())
        if norm_group is not None:
            dist.all_reduce(squared, group=norm_group)
        total = squared.sqrt()
        if max_norm:
            coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for unit in self.kept_units():
                self.host.gradients[unit].mul_(coefficient)
        return total
