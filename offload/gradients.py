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

from functools import partial

import torch
import torch.distributed as dist

from compress.layout import UnitLayout
from compress.torch_compat import reduce_scatter_flat
from lit_fsdp.errors import OneLineError
from offload.cpu_adam import CpuAdam
from offload.host import HostState
from offload.host_memory import FLAG_ELEMENTS
from offload.transfers import Event, Transfers


class HostUpdateError(OneLineError):
    """The host side of a unit's gradients (the copy's wait, the CPU reduce or the CPU update) failed."""


def host_update_error(unit: int, error: Exception) -> HostUpdateError:
    """``error`` as one line naming the unit (unchanged if it already is one)."""
    if isinstance(error, HostUpdateError):
        return error
    cause = str(error).strip().splitlines()[0] if str(error).strip() else "no message"
    return HostUpdateError(f"SlideFSDP: the host side of unit {unit}'s gradients failed ({type(error).__name__}: {cause})")


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
        self.received = [0] * len(layouts)  # micro-batches added to each kept buffer since the last update
        self.check_finite = check_finite
        self.flag_elements = FLAG_ELEMENTS if gpu_reduce and check_finite else 0  # the device's verdict, copied along
        self.finite = [True] * len(layouts)  # the device's verdicts on each kept gradient's micro-batches, and-ed
        self.nonfinite_units = 0  # updates withheld for non-finite gradients since the last take

    def reduce_and_offload(self, unit: int, gradients: list[torch.Tensor | None], update_now: bool) -> None:
        """Send ``unit``'s full gradients (device, one per parameter; None counts as zero) to the host update."""
        layout = self.layouts[unit]
        device = next((g.device for g in gradients if g is not None), self.transfers.device)
        numel = layout.shard_numel * layout.shards
        unsharded = self.gpu_reduce and layout.shards == 1  # the flat buffer is the shard: room for the verdict in it
        flat = torch.empty(numel + (self.flag_elements if unsharded else 0), dtype=self.reduce_dtype, device=device)
        layout.scatter_to_rank_major(gradients, flat[:numel])
        if self.gpu_reduce:
            outgoing = flat
            if not unsharded:
                outgoing = torch.empty(layout.shard_numel + self.flag_elements, dtype=self.reduce_dtype, device=device)
                reduce_scatter_flat(outgoing[: layout.shard_numel], flat, group=self.shard_group)
            shard = outgoing[: layout.shard_numel]
            if self.replicate_group is not None:
                dist.all_reduce(shard, group=self.replicate_group)
            if self.world_size > 1:
                shard.div_(self.world_size)
            if self.flag_elements:  # one reduction on the device, queued: no host sync
                outgoing[layout.shard_numel :].copy_(torch.isfinite(shard.sum(dtype=torch.float32)).reshape(1))
        else:
            outgoing = flat
        incoming = self.host.incoming.acquire(outgoing.numel(), self.adam.failure)
        copied = self.transfers.d2h(incoming, outgoing)
        self.adam.submit(partial(self._on_host, unit, incoming, copied, update_now))

    def _on_host(self, unit: int, incoming: torch.Tensor, copied: Event, update_now: bool) -> None:
        """Worker thread: the unit's gradient is (being) copied into ``incoming``; reduce it here if needed, apply it.

        Whatever fails, the buffer goes back to the ring, and the error becomes one line naming the unit:
        the backward waiting for a buffer and the optimizer step waiting for the worker raise it.
        """
        released = []

        def release() -> None:  # once: early on the kept-gradient path, else when done or failed
            if not released:
                released.append(True)
                self.host.incoming.release(incoming)

        try:
            self._apply_on_host(unit, incoming, copied, update_now, release)
        except Exception as error:
            raise host_update_error(unit, error) from error
        finally:
            release()

    def _apply_on_host(self, unit: int, incoming: torch.Tensor, copied: Event, update_now: bool, release) -> None:
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
            kept = self.host.gradients[unit]
            if self.received[unit]:
                kept.add_(shard)
            else:
                kept.copy_(shard)
                self.finite[unit] = True
            self.finite[unit] &= finite is not False
            self.received[unit] += 1
            release()  # the kept buffer holds the gradient now
            if update_now:
                self.update(unit)
            return
        self._step(unit, shard, finite)  # a bfloat16 gradient is read as it is, chunk by chunk (offload.cpu_adam)

    def update(self, unit: int) -> None:
        """Apply the kept gradient of ``unit`` (worker thread or idle worker)."""
        try:
            self._step(unit, self.host.gradients[unit], self.finite[unit] if self.flag_elements else None)
        except Exception as error:
            raise host_update_error(unit, error) from error
        self.received[unit] = 0

    def _step(self, unit: int, gradient: torch.Tensor, finite: bool | None) -> None:
        """Update ``unit`` and its staging rows in one pass, unless its gradient is not finite (``finite``: the device's
        verdict; None: the host checks with one reduction, no mask the size of the gradient)."""
        if self.check_finite:
            if finite is None:
                finite = bool(torch.isfinite(gradient.sum(dtype=torch.float32)))
            if not finite:
                self.nonfinite_units += 1
                return
        self.adam.update(unit, self.layouts[unit].local_views(gradient), self.host.staging_targets(unit))

    def take_nonfinite(self) -> int:
        """Units whose update was withheld for non-finite gradients since the last call (after the worker is idle)."""
        self.adam.wait()
        count, self.nonfinite_units = self.nonfinite_units, 0
        return count

    def discard(self) -> None:
        """Forget the kept gradients of this step: the optimizer step then updates nothing."""
        self.adam.wait()
        self.received = [0] * len(self.layouts)

    # --- at the optimizer step -------------------------------------------------------------------

    def kept_units(self) -> list[int]:
        """Units whose kept gradient has not been applied yet."""
        return [unit for unit, count in enumerate(self.received) if count]

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
