"""The tensors a block's backward needs, kept in host memory between its forward and its backward (``host`` blocks of
the activation plan, ``offload.activation_plan``): no recompute, no device memory held for them.

While a ``host`` block computes its forward, autograd's saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``)
hand each tensor it saves to ``SavedOnHost.pack``, which copies it into a host buffer of its own on the copy stream
(``Transfers.d2h``: after the compute that made it, with the caching allocator told not to reuse it before) and keeps
the buffer instead. A tensor saved twice (a block's input, which each of its projections saves) is copied once. The
weights a block saves are left as they are: they are views of the block's device slot, streamed in again before its
backward (the engine keeps a block with saved weights in the same slot). In the backward, block i's tensors are copied
back while block i+1 computes (``prefetch``, called with the weights' prefetch), and ``unpack`` waits for them.

torch's ``save_on_cpu`` does the copies on the compute stream, without prefetch: each copy would hold up the compute.

Each tensor comes back with its size and strides (inductor's compiled backward asserts them, and some eager kernels
read a saved tensor's layout): what is copied is the span of its storage it covers, from its first element to its
last, and it is viewed with its strides on both sides. A dense tensor (a transpose too) spans its own elements; one
that overlaps itself (an expand) spans fewer; a view with gaps carries its gaps.

A block's host copies are carved out of one region of its own (``offload.host.HostState``, key ``("saved", block)``):
one ``cudaHostRegister`` per block, not one per tensor, whose small regions would share pages (a page registered twice
fails, and a copy into pageable memory synchronises the device). The region is sized by the block's previous forward,
made at the start of its next one and reused every step; a block's first forward (or one larger than the last) copies
into pageable memory. The copies back are allocated on the compute stream, the stream that uses and frees them, so
that they come from its pool, the memory the plan counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from offload.host import HostState
    from offload.transfers import Transfers


#: Bytes each host copy's offset in its block's region is a multiple of (a cache line; any dtype's alignment)
ALIGNMENT = 64


@dataclass(frozen=True)
class Packed:
    """What autograd keeps for a tensor saved on the host: its block and its place among the block's saved tensors."""

    block: int
    index: int


@dataclass(frozen=True)
class HostCopy:
    """A saved tensor on the host: the span of its storage (1-D), the size and strides it has in it, its copy's event."""

    span: torch.Tensor
    size: torch.Size
    stride: tuple[int, ...]
    copied: Any


def storage_span(tensor: torch.Tensor) -> int:
    """Elements of its storage a non-empty ``tensor`` covers, from its first element to its last."""
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def region_key(block: int) -> tuple[str, int]:
    """``block``'s host region in ``HostState.activation_buffer``."""
    return ("saved", block)


class SavedOnHost:
    """The saved tensors of ``host`` blocks between forward and backward (see the module docstring)."""

    def __init__(self, transfers: Transfers, buffers: HostState, pin: bool, slots: list[torch.Tensor]):
        """
        Args:
            buffers: Where the tensors live (``HostState.activation_buffer``); pin: pin them in place.
            slots: The device window's block buffers: a saved tensor in one of them is a weight, not copied.
        """
        self.transfers, self.buffers, self.pin = transfers, buffers, pin
        self.slot_storage = {slot.untyped_storage().data_ptr() for slot in slots}
        self.saved: dict[int, list[HostCopy]] = {}
        # block -> the tensors packed in its forward, held until it ends: their index, and the tensor itself, so that
        # its address is not handed to a later tensor of the forward that would then match its key
        self.seen: dict[int, dict[tuple, tuple[int, torch.Tensor]]] = {}
        self.fetched: dict[int, list[tuple[torch.Tensor, Any]]] = {}  # block -> (device span, ready event)
        self.regions: dict[int, torch.Tensor] = {}  # block -> its host region (bytes), carved by its forward
        self.used: dict[int, int] = {}  # block -> the bytes its last forward carved (or wanted to)

    def hooks(self, block: int) -> torch.autograd.graph.saved_tensors_hooks:
        """The context in which ``block``'s forward saves its tensors to the host; its region is (re)made first, as
        large as its last forward needed (the last backward's copies from the old one are waited for)."""
        needed, region = self.used.get(block, 0), self.regions.get(block)
        if needed and (region is None or region.numel() < needed):
            self.regions[block] = self.buffers.activation_buffer(region_key(block), needed, torch.uint8, self.pin)
        self.saved[block], self.seen[block], self.used[block] = [], {}, 0
        self.fetched.pop(block, None)
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: self.pack(block, tensor), self.unpack)

    def host_span(self, block: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory for ``numel`` elements: the next piece of ``block``'s region, or, past its end, pageable memory."""
        start = self.used[block]
        nbytes = numel * dtype.itemsize
        self.used[block] = start + -(-nbytes // ALIGNMENT) * ALIGNMENT
        region = self.regions.get(block)
        if region is not None and start + nbytes <= region.numel():
            return region[start : start + nbytes].view(dtype)
        return torch.empty(numel, dtype=dtype)

    def pack(self, block: int, tensor: torch.Tensor) -> Packed | torch.Tensor:
        if (tensor.device != self.transfers.device or not tensor.numel()
                or tensor.untyped_storage().data_ptr() in self.slot_storage):
            return tensor  # a weight (streamed in again), an empty tensor, or one off the device
        key = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor._version)
        seen = self.seen[block].get(key)
        if seen is not None:
            return Packed(block, seen[0])
        index = len(self.saved[block])
        self.seen[block][key] = (index, tensor)
        numel = storage_span(tensor)
        span = tensor.detach().as_strided((numel,), (1,), tensor.storage_offset())
        host = self.host_span(block, numel, tensor.dtype)
        copied = self.transfers.d2h(host, span)
        self.buffers.activation_copy(region_key(block), copied)
        self.saved[block].append(HostCopy(host, tensor.shape, tensor.stride(), copied))
        return Packed(block, index)

    def end_forward(self, block: int) -> None:
        """``block``'s forward is over: its saved tensors are let go, after checking that none was changed in place
        after it was saved (autograd skips that check for hooked tensors, and the copy to the host may have read it
        before or after the change)."""
        seen = self.seen.pop(block, {})
        changed = [key for key, (_, tensor) in seen.items() if tensor._version != key[-1]]
        if changed:
            raise RuntimeError(f"SlideFSDP block {block}: a tensor its backward needs (shape {list(changed[0][1])}) was "
                               "changed in place after autograd saved it, so its copy on the host may be either value; "
                               "keep this block's activations on the device or recompute them (activation_plan)")

    def prefetch(self, block: int) -> None:
        """Start copying ``block``'s saved tensors back to the device (in the backward, while a later block computes)."""
        if block not in self.saved or block in self.fetched:
            return
        fetched = []
        for copy in self.saved[block]:
            # allocated on the compute stream, which uses and frees it; the copy stream waits for the compute queued
            # so far, which may still use the memory the allocator hands out
            target = torch.empty(copy.span.numel(), dtype=copy.span.dtype, device=self.transfers.device)
            with self.transfers.on_h2d_stream(after=copy.copied, after_compute=True):  # after the copy to the host
                self.transfers.h2d(target, copy.span)
                ready = self.transfers.record()
            self.transfers.read_by_h2d(target)
            self.buffers.activation_copy(region_key(block), ready)
            fetched.append((target.as_strided(copy.size, copy.stride), ready))
        self.fetched[block] = fetched

    def unpack(self, packed: Packed | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.prefetch(packed.block)
        target, ready = self.fetched[packed.block][packed.index]
        self.transfers.wait(ready)
        return target

    def done(self, block: int) -> None:
        """``block``'s backward is over: its device copies may go (the host region stays for the next step)."""
        self.fetched.pop(block, None)

    def clear(self) -> None:
        """Drop what a step left (an interrupted backward); the host regions are kept for reuse."""
        self.saved.clear()
        self.seen.clear()
        self.fetched.clear()


class HostSavedBlock(nn.Module):
    """Wraps a ``host`` block: its forward saves what its backward needs to the host. Parameter names are the block's
    (the attribute is the one ``lit_fsdp.weights.clean_name`` removes, as for a checkpointed block)."""

    def __init__(self, block: nn.Module, store: SavedOnHost, index: int):
        super().__init__()
        self._checkpoint_wrapped_module = block
        self._store = [store]  # in a list: not registered as a submodule
        self.index = index

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        block = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled():
            return block(*args, **kwargs)
        store = self._store[0]
        try:
            with store.hooks(self.index):
                return block(*args, **kwargs)
        finally:
            store.end_forward(self.index)
