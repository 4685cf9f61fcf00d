"""What a compressor puts on the wire, and the interface every compressor implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

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

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + SCALAR_BYTES * len(self.scalars)

    @property
    def index_nbytes(self) -> int:
        return sum(self.tensors[name].numel() * self.tensors[name].element_size() for name in self.index_names)


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
