"""What a compressor puts on the wire, how it travels as bytes, and the interface every compressor implements.

On the wire a payload is its tensors' bytes, back to back, with no header: the receiver already knows
the layout (names, dtypes, shapes). For a fixed-size compressor every rank's payload for the same chunk
has the layout of the receiver's own payload for it (``layout_of``); a variable-size compressor (one
with ``kept_count``) describes a payload by the number of coordinates it keeps (``layout(numel, kept)``),
and the communicators exchange those counts. Nothing is read back to the host to decode a payload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from compress.layout import MatrixStack

SCALAR_BYTES = 8  # a scalar sent with a payload (a seed, a count) travels as one int64 or float64


@dataclass
class Payload:
    """The tensors and scalars that cross the wire for one compressed tensor of ``numel`` elements.

    ``numel`` and the compressor's own settings are known to both sides and are not sent. Bytes are
    counted from the tensors themselves, so the accounting cannot drift from what is transmitted.
    ``index_names`` marks tensors that encode positions (for the index share of sparsifiers).
    """

    numel: int
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, float] = field(default_factory=dict)
    index_names: tuple[str, ...] = ()
    #: coordinates given a value, where a sparsifier chose them (None: every one); known on the host, never sent
    kept: int | None = None
    #: where the chunk holds stacks of matrices a low-rank codec compressed one by one (a MoE layer's experts,
    #: ``compress.lowrank``); the same for every rank's payload of the chunk, never sent
    matrices: tuple[MatrixStack, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + SCALAR_BYTES * len(self.scalars)

    @property
    def index_nbytes(self) -> int:
        return sum(self.tensors[name].numel() * self.tensors[name].element_size() for name in self.index_names)


#: a payload's tensors as (name, dtype, shape), in the order their bytes travel
Layout = tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def nbytes(*tensors: torch.Tensor) -> int:
    """Bytes held by ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors)


def layout_of(payload: Payload) -> Layout:
    return tuple((name, t.dtype, tuple(t.shape)) for name, t in payload.tensors.items())


def layout_nbytes(layout: Layout) -> int:
    """Bytes a payload of ``layout`` takes on the wire."""
    return sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, dtype, shape in layout)


def pack(payload: Payload) -> torch.Tensor:
    """The payload's tensor bytes back to back, as one uint8 tensor on the payload's device (no header)."""
    parts = [t.contiguous().view(-1).view(torch.uint8) for t in payload.tensors.values()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buffer: torch.Tensor, layout: Layout, like: Payload) -> Payload:
    """The payload ``pack`` made, given its ``layout``; numel, scalars, index names, kept and matrices come from ``like``.

    ``like`` is a payload the receiver holds for the same chunk (its own, or one described by the
    exchanged count): those fields are equal on every rank, so they never travel.
    """
    tensors, offset = {}, 0
    for name, dtype, shape in layout:
        size = torch.empty((), dtype=dtype).element_size()
        part = buffer[offset : offset + math.prod(shape) * size]
        # a slice at an unaligned byte offset cannot be viewed as a wider dtype: copy it (on the device)
        tensors[name] = (part if part.storage_offset() % size == 0 else part.clone()).view(dtype).view(shape)
        offset += part.numel()
    return Payload(like.numel, tensors, like.scalars, like.index_names, like.kept, like.matrices)


class Compressor(Protocol):
    """Turns a 1-D float tensor into a ``Payload`` and back.

    ``seed`` is the same on every rank for the same chunk and step: compressors whose payloads must line
    up across ranks (shared random coordinates, hash functions) draw from it; private randomness
    (stochastic rounding) comes from the compressor's own generator. ``key`` names the chunk, for state
    that persists across steps (warm starts).
    """

    #: payloads of several ranks can be summed element-wise on the wire, and decode to the sum of inputs
    linear: bool
    #: E[decompress(compress(x))] == x
    unbiased: bool

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload: ...

    def decompress(self, payload: Payload) -> torch.Tensor:
        """A float32 tensor of ``payload.numel`` elements on the payload's device."""
        ...


class VariableSizeCompressor(Compressor, Protocol):
    """A compressor whose payload size depends on the data (threshold-v): the count it keeps comes first.

    ``kept_count`` is computed on the device; the communicator exchanges the counts of every chunk in one
    collective and reads them to the host once, then calls ``compress(..., kept=)`` with this rank's count
    and decodes a peer's payload with ``layout(numel, kept)``.
    """

    def kept_count(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """A 0-d int64 tensor on the tensor's device: how many coordinates ``compress`` would keep."""
        ...

    def compress(self, tensor: torch.Tensor, key: str, seed: int, kept: int | None = None) -> Payload: ...

    def layout(self, numel: int, kept: int) -> tuple[Layout, Payload]:
        """The layout of a payload keeping ``kept`` of ``numel`` coordinates, and an empty payload with its other fields."""
        ...


def is_variable_size(compressor: object) -> bool:
    """Whether ``compressor``'s payload size depends on the data (see ``VariableSizeCompressor``)."""
    return bool(getattr(compressor, "variable_size", False))
