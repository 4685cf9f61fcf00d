"""Which units' weights are on the device: a pool of ``window`` reusable block buffers, and the root's own buffer.

A block is *resident* while it holds a slot: its parameters are bound (``param.data``) to views of
the slot and its weights are being copied in or are there. Loading a block copies its staging copy
host-to-device on the copy stream (``full``), or this rank's rows followed by an all-gather across
the node's devices (``shard``); the consumer waits on the load's event. Releasing returns the slot,
which the next load may overwrite only after the compute that used it (an event recorded at
release). Parameters of a unit that is not resident are bound to an empty tensor, so a stray use
fails loudly instead of computing with stale values.

The root (embeddings, final norm, head) is used at both ends of the step and stays in a buffer of
its own; it is reloaded after each optimizer step changed it.

Every load first calls ``before_load`` with its unit: an ordered update (``offload.schedule``) waits there for that
unit's update after the norm, so the forward loads a unit as soon as its own update is done. A prefetch never waits
for an update: a unit whose update is still running (``update_pending``) takes its slot at once, as it would have,
and is loaded later (``load_deferred``, after the current block's work is queued; ``ensure`` when it is needed), so
that a block's compute waits for its own unit's update, not for those of the blocks it prefetches. Loads stay in the
order they were asked for (a later unit waits behind a deferred one): with ``shard`` each is a collective that
every rank issues in the same order, and each block takes the slot it would have taken without deferral, which a
backward that reuses its forward's saved views needs (``check_same_slot``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from compress.layout import UnitLayout
from compress.torch_compat import all_gather_flat
from offload.host import HostState
from offload.transfers import Event, Transfers


@dataclass
class Slot:
    buffer: torch.Tensor
    unit: int | None = None
    ready: Event = None  # the load finished
    free_after: Event = None  # the last compute that used the buffer


class DeviceWindow:
    """Block buffers (``window`` of them) and the root buffer on the device; see the module docstring."""

    def __init__(
        self,
        layouts: list[UnitLayout],
        root: int,
        host: HostState,
        transfers: Transfers,
        window: int,
        compute_dtype: torch.dtype,
        device: torch.device,
        shard_group: dist.ProcessGroup | None,
    ):
        """
        Args:
            layouts: Every unit; ``layouts[root]`` is the root, the others are blocks.
            shard_group: The node's devices for ``param_transfer: shard`` (all-gather); None for ``full``.
        """
        self.layouts, self.root, self.host, self.transfers = layouts, root, host, transfers
        self.shard_group = shard_group
        self.device = device
        largest = max(layout.full_numel for i, layout in enumerate(layouts) if i != root)
        self.slots = [Slot(torch.empty(largest, dtype=compute_dtype, device=device)) for _ in range(window)]
        self.root_slot = Slot(torch.empty(layouts[root].full_numel, dtype=compute_dtype, device=device))
        self.root_stale = True
        self.gather_buffer = None
        if shard_group is not None:
            gathered = max(layout.shard_numel * layout.shards for layout in layouts)
            self.gather_buffer = torch.empty(gathered, dtype=compute_dtype, device=device)
        self.empty = {}  # dim -> an empty tensor of that many dims: what non-resident parameters are bound to
        for layout in layouts:
            for place in layout.places:
                dims = len(place.shape)
                if dims not in self.empty:
                    self.empty[dims] = torch.empty((0,) * dims, dtype=compute_dtype, device=device)
        self.resident: dict[int, Slot] = {}
        self.most_resident = 0  # the largest number of blocks resident at once, for the window bound
        self.forward_slots: dict[int, int] = {}  # block -> the slot its saved activations point into
        self.before_load: Callable[[int], None] = lambda unit: None  # waits for the unit's pending update
        self.update_pending: Callable[[int], bool] = lambda unit: False  # whether ``before_load`` would wait now
        self.deferred: list[int] = []  # units holding a slot whose load waits for their update, in prefetch order

    # --- binding ---------------------------------------------------------------------------------

    def bind(self, unit: int, buffer: torch.Tensor) -> None:
        for place, view in zip(self.layouts[unit].places, self.layouts[unit].full_views(buffer)):
            place.param.data = view

    def unbind(self, unit: int) -> None:
        for place in self.layouts[unit].places:
            place.param.data = self.empty[len(place.shape)]

    def unbind_all(self) -> None:
        for unit in range(len(self.layouts)):
            self.unbind(unit)
        self.resident.clear()
        self.forward_slots.clear()
        self.deferred.clear()
        for slot in self.slots:
            slot.unit = None
        self.root_stale = True

    # --- loading ---------------------------------------------------------------------------------

    def _load(self, unit: int, slot: Slot) -> None:
        self.before_load(unit)
        layout, staging = self.layouts[unit], self.host.staging[unit]
        with self.transfers.on_h2d_stream(after=slot.free_after):
            target = slot.buffer[: layout.full_numel]
            if self.shard_group is None:
                self.transfers.h2d(target, staging)
            else:
                gathered = self.gather_buffer[: layout.shard_numel * layout.shards]
                rank = dist.get_rank(self.shard_group)
                mine = gathered[rank * layout.shard_numel : (rank + 1) * layout.shard_numel]
                self.transfers.h2d(mine, staging)
                self.transfers.order_after_copies()
                all_gather_flat(gathered, mine, group=self.shard_group)
                layout.gather_to_full(gathered, target)
            slot.ready = self.transfers.record()
        slot.unit = unit
        self.bind(unit, slot.buffer)

    def prefetch(self, unit: int) -> bool:
        """Start loading block ``unit`` if it is not resident and a slot is free; False if no slot was free. The host
        does not wait: while the unit's update (or one deferred before it) is pending, it takes its slot and its load
        is deferred (module docstring)."""
        if unit in self.resident:
            return True
        slot = next((s for s in self.slots if s.unit is None), None)
        if slot is None:
            return False
        slot.unit = unit
        self.resident[unit] = slot
        self.most_resident = max(self.most_resident, len(self.resident))
        if self.deferred or self.update_pending(unit):
            self.deferred.append(unit)
        else:
            self._load(unit, slot)
        return True

    def load_deferred(self, through: int | None = None) -> None:
        """Load the deferred units, in order, whose updates are done now; and, waiting for their updates, every one
        up to ``through`` (a unit needed now)."""
        while self.deferred:
            unit = self.deferred[0]
            if through not in self.deferred and self.update_pending(unit):
                return
            self.deferred.pop(0)
            self._load(unit, self.resident[unit])

    def ensure(self, unit: int) -> None:
        """Block ``unit``'s weights are usable by the work queued next on the current stream."""
        if not self.prefetch(unit):
            raise RuntimeError(f"SlideFSDP: no free device slot for block {unit}: {sorted(self.resident)} are resident")
        if unit in self.deferred:
            self.load_deferred(through=unit)
        self.transfers.wait(self.resident[unit].ready)

    def remember_slot(self, unit: int) -> None:
        """Block ``unit``'s forward saved views of its slot for backward (it is not checkpointed): note which slot."""
        self.forward_slots[unit] = self._slot_number(unit)

    def check_same_slot(self, unit: int) -> None:
        """Raise unless block ``unit`` is back in the slot its forward saved views of (``remember_slot``).

        A block that is not checkpointed keeps, for its backward, tensors that view its slot's memory; they hold
        its weights again only if the block is reloaded into the same slot. Every schedule does so today;
        this makes a schedule that does not fail loudly instead of computing gradients from another block's weights.
        """
        expected = self.forward_slots.pop(unit, None)
        if expected is None:
            return
        found = self._slot_number(unit)
        if found != expected:
            raise RuntimeError(f"SlideFSDP: block {unit} was reloaded into device slot {found} for its backward, but "
                               f"its forward saved views of slot {expected}; its gradients would use other weights")

    def _slot_number(self, unit: int) -> int:
        return next(number for number, slot in enumerate(self.slots) if slot is self.resident[unit])

    def release(self, unit: int) -> None:
        """Block ``unit`` no longer needs its weights: its slot may be reused after the work queued so far."""
        if unit in self.deferred:  # loaded all the same: with ``shard`` every rank's loads are the same collectives
            self.load_deferred(through=unit)
        slot = self.resident.pop(unit, None)
        if slot is None:
            return
        slot.free_after = self.transfers.record()
        slot.unit = None
        self.unbind(unit)

    def root_used(self) -> None:
        """The backward's last use of the root's weights is queued: a reload must wait for it."""
        self.root_slot.free_after = self.transfers.record()

    def ensure_root(self) -> None:
        """The root's weights are usable (reloaded if an optimizer step changed them)."""
        if self.root_stale:
            self._load(self.root, self.root_slot)
            self.root_stale = False
        self.transfers.wait(self.root_slot.ready)


def replace_meta_parameters(network: nn.Module, layouts: list[UnitLayout], device: torch.device, dtype: torch.dtype) -> None:
    """Swap the network's meta parameters for empty ones on ``device`` (ties kept), in the network and in ``layouts``.

    The new parameters keep their number of dimensions (the optimizer's weight-decay groups go by it) and
    hold no values until a unit is bound. A parameter may be in several layouts (a unit's and its trained one's).
    """
    places = list({id(place): place for layout in layouts for place in layout.places}.values())
    new: dict[int, nn.Parameter] = {}
    for place in places:
        if id(place.param) not in new:
            empty = torch.empty((0,) * len(place.shape), dtype=dtype, device=device)
            new[id(place.param)] = nn.Parameter(empty, requires_grad=place.param.requires_grad)
    for module in network.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = new[id(param)]
    for place in places:
        place.param = new[id(place.param)]
