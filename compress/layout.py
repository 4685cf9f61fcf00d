"""Where a unit's parameters live in a flat buffer: whole (one after another) or sharded by rows (FSDP2's layout).

A *unit* is a transformer block, or the root (embeddings, final norm, head): an FSDP2 module, or what
SlideFSDP moves at once. Its parameters are laid out two ways:

- **full** (device slots, the full-mode staging copy): each parameter whole, one after another, so a
  parameter is a plain view of the buffer.
- **shard** (master weights, gradients, the shard-mode staging copy): each of the ``shards`` ranks
  holds rows ``[r * chunk, (r + 1) * chunk)`` of every parameter (``chunk = ceil(rows / shards)``,
  as ``torch.chunk`` and FSDP2 split dim 0), each padded to ``chunk`` rows, one parameter after
  another. Every rank's shard has the same size, so ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` work on the concatenation of the shards (*rank-major*).

Because a rank's piece of a parameter is whole rows, it is a rectangular chunk of the full tensor:
checkpoints store it as a ``Shard(0)`` DTensor, in the same layout as FSDP2's. PowerSGD reads FSDP2's
reduce-scatter buffer through a unit's layout; ``offload.layout`` lays out a whole model for SlideFSDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ParamPlace:
    """One parameter of a unit: its shape and where its values sit in the full and shard layouts."""

    names: tuple[str, ...]  # the parameter's name in the network, then any tied aliases
    param: nn.Parameter  # the network's parameter object (the meta one is swapped for an empty one at placement)
    shape: torch.Size
    full_offset: int
    shard_offset: int
    chunk_rows: int
    start_row: int  # this rank's rows: [start_row, stop_row)
    stop_row: int

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.cols

    @property
    def local_shape(self) -> torch.Size:
        return torch.Size([self.stop_row - self.start_row, *self.shape[1:]])

    @property
    def stacked(self) -> bool:
        """Whether the parameter is a stack of matrices, one per row: three or more dimensions, as a mixture-of-experts
        layer's fused experts (``mlp.experts.gate_up_proj``: experts x out x in). Low-rank methods compress each."""
        return len(self.shape) >= 3

    @property
    def matrix(self) -> tuple[int, int]:
        """The shape of the matrices low-rank methods see: a row of a stacked parameter (``shape[1]`` x the rest),
        otherwise the whole parameter (``rows x cols``)."""
        return (self.shape[1], math.prod(self.shape[2:])) if self.stacked else (self.rows, self.cols)

    def rows_on(self, rank: int) -> range:
        """The rows rank ``rank`` holds (empty past the last row)."""
        start = min(self.rows, rank * self.chunk_rows)
        return range(start, min(self.rows, start + self.chunk_rows))


@dataclass(frozen=True)
class MatrixStack:
    """``count`` matrices of ``rows x cols`` one after another from element ``offset`` of a flat chunk: a stacked
    parameter's rows in one rank's shard, which low-rank methods compress one by one."""

    offset: int
    count: int
    rows: int
    cols: int

    @property
    def end(self) -> int:
        return self.offset + self.count * self.rows * self.cols


@dataclass
class UnitLayout:
    """A unit's parameters in order, with the sizes of its full and per-rank shard buffers."""

    name: str
    places: list[ParamPlace]
    full_numel: int
    shard_numel: int
    shards: int

    @classmethod
    def build(cls, name: str, params: list[tuple[tuple[str, ...], nn.Parameter]], shards: int, shard_rank: int) -> UnitLayout:
        """Lay out ``params`` (names, parameter) for ``shards`` ranks, from the point of view of ``shard_rank``."""
        places, full, shard = [], 0, 0
        for names, param in params:
            if param.dim() == 0:
                raise ValueError(f"SlideFSDP shards parameters by rows; {names[0]} is a scalar")
            rows = param.shape[0]
            chunk = math.ceil(rows / shards)
            start = min(rows, shard_rank * chunk)
            place = ParamPlace(names, param, param.shape, full, shard, chunk, start, min(rows, start + chunk))
            places.append(place)
            full += place.numel
            shard += place.chunk_numel
        return cls(name, places, full, shard, shards)

    # --- views -----------------------------------------------------------------------------------

    def full_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter, shaped, as a view of a full-layout buffer."""
        return [buffer[p.full_offset : p.full_offset + p.numel].view(p.shape) for p in self.places]

    def local_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of each parameter, shaped, as views of a shard-layout buffer (padding left out)."""
        return [
            shard[p.shard_offset : p.shard_offset + p.local_shape.numel()].view(p.local_shape) for p in self.places
        ]

    def local_rows_in_full(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """This rank's rows of each parameter, shaped, as views of a full-layout buffer."""
        return [
            buffer[p.full_offset + p.start_row * p.cols : p.full_offset + p.stop_row * p.cols].view(p.local_shape)
            for p in self.places
        ]

    def stacks(self, rank: int | None = None) -> tuple[MatrixStack, ...]:
        """The stacked parameters' matrices in rank ``rank``'s shard (None: the rank the layout was built for), where
        they lie in it (padding rows left out)."""
        counts = [len(p.rows_on(rank)) if rank is not None else p.stop_row - p.start_row for p in self.places]
        return tuple(MatrixStack(p.shard_offset, count, *p.matrix) for p, count in zip(self.places, counts)
                     if p.stacked and count)

    # --- between layouts -------------------------------------------------------------------------

    def rank_major_view(self, rank_major: torch.Tensor, place: ParamPlace) -> torch.Tensor:
        """``place``'s padded rows in a rank-major buffer: shape (shards, chunk_rows, cols), a view.

        FSDP2's reduce-scatter input is such a buffer: merging the first two dimensions gives the
        parameter's full gradient (as a rows x cols matrix), padded with zero rows.
        """
        columns = rank_major.view(self.shards, self.shard_numel)[:, place.shard_offset : place.shard_offset + place.chunk_numel]
        return columns.view(self.shards, place.chunk_rows, place.cols)

    def gather_to_full(self, rank_major: torch.Tensor, full: torch.Tensor) -> None:
        """Copy an all-gathered rank-major buffer into the full layout (padding dropped)."""
        for place, view in zip(self.places, self.full_views(full)):
            chunks = self.rank_major_view(rank_major, place)
            rows = view.view(place.rows, place.cols)
            for rank in range(self.shards):
                start = rank * place.chunk_rows
                stop = min(place.rows, start + place.chunk_rows)
                if stop > start:
                    rows[start:stop].copy_(chunks[rank, : stop - start])

    def scatter_to_rank_major(self, tensors: list[torch.Tensor | None], rank_major: torch.Tensor) -> None:
        """Copy full-shape tensors (one per parameter; None is zero) into a rank-major buffer, padding with zeros."""
        for place, tensor in zip(self.places, tensors):
            chunks = self.rank_major_view(rank_major, place)
            if tensor is None:
                chunks.zero_()
                continue
            rows = tensor.reshape(place.rows, place.cols)
            for rank in range(self.shards):
                start = rank * place.chunk_rows
                stop = min(place.rows, start + place.chunk_rows)
                if stop > start:
                    chunks[rank, : stop - start].copy_(rows[start:stop])
                if stop - start < place.chunk_rows:
                    chunks[rank, max(0, stop - start) :].zero_()


def unit_layout(module: torch.nn.Module, world: int, rank: int) -> UnitLayout:
    """The flat layout of an FSDP module's gradient reduce-scatter: its own trainable parameters, by rows over ``world``
    ranks. FSDP2 reduces only the gradients that exist: a frozen parameter (a LoRA base weight) has no place in it."""
    from torch.distributed.fsdp import FSDPModule

    nested = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    own = (p for p in module.parameters() if id(p) not in nested and p.requires_grad)
    params = [((str(i),), p) for i, p in enumerate(own)]
    return UnitLayout.build(type(module).__name__, params, world, rank)
