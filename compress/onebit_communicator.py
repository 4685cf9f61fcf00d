"""1-bit and 0/1 Adam's communicators: FSDP2's reduce-scatter and all-reduce hooks for ``OneBitMomentum``
(``compress.onebit_momentum``, where the rounds are described).

After each exact round the reduce-scatter hook all-gathers the unit's frozen denominators once, in its own layout;
then it moves sign payloads as its parent does. 0/1 Adam's local rounds send nothing, and its sync rounds correct
what each shard's owner applied alone during the period.

Server-side error feedback is not needed: DeepSpeed compresses the averaged momentum a second time
because every worker must apply it to a full copy of the model; here the owner applies it to its own
shard, and FSDP2 all-gathers the updated parameters (exactly, or with ``param_all_gather``).
"""

from __future__ import annotations

from typing import Any

import torch

from compress.communicator import CompressedAllReduce, CompressedReduceScatter, apply_op, compressing
from compress.layout import UnitLayout
from compress.onebit_momentum import LOCAL, SYNC, OneBitMomentum
from compress.payload import Payload
from compress.torch_compat import all_gather_flat


class _Rounds:
    """What both 1-bit Adam hooks share: the unit's denominators after each exact round, 0/1 Adam's local rounds."""

    compressor: OneBitMomentum
    layout: UnitLayout
    mover: Any

    def shard_denominators(self, device: torch.device) -> torch.Tensor:
        """This rank's shard of the unit's denominators, in the reduce-scatter's layout (padding: 1)."""
        optimizer = self.compressor.phase.optimizer
        shard = torch.ones(self.layout.shard_numel, device=device)
        for place, view in zip(self.layout.places, self.layout.local_views(shard)):
            view.copy_(optimizer.denominator(place.param))
        return shard

    def local_round(self, rows: torch.Tensor, keys: list[str], mine: int) -> torch.Tensor:
        """A round that sends nothing: every row's momentum advances, this rank's own is what its shard gets."""
        preconditioned = self._advanced(rows, keys)
        return preconditioned[mine]

    def _advanced(self, rows: torch.Tensor, keys: list[str]) -> list[torch.Tensor]:
        """Every row's momentum after this round's gradient (over its denominators), counted as one call."""
        self.mover.stats.calls += 1
        self.mover.stats.numel += rows.numel()
        return [self.compressor.advance(row, key) for row, key in zip(rows, keys)]

    def sync_round(self, rows: torch.Tensor, keys: list[str], mine: int, seed: int) -> tuple[list[Payload], torch.Tensor]:
        """A sync round's payloads (each row's accumulated momentum) and what this rank's shard already received."""
        mover = self.mover
        preconditioned = self._advanced(rows, keys)
        periods = [self.compressor.period(key, value) for key, value in zip(keys, preconditioned)]
        totals = [total for total, _ in periods]
        with mover.timed("compress_s", rows.device):
            payloads = [self.compressor.inner.compress(total, key, seed + d) for d, (total, key) in enumerate(zip(totals, keys))]
        mover.stats.values_sent += rows.numel()
        mover.sample(payloads, totals, keys)
        return payloads, periods[mine][1]


class OneBitAdamReduceScatter(_Rounds, CompressedReduceScatter):
    """The reduce-scatter hook: after each exact round, all-gathers the unit's denominators (once), then as its
    parent; 0/1 Adam's local rounds send nothing and its sync rounds correct what the owner applied alone."""

    def __init__(self, compressor: OneBitMomentum, stats, name: str, layout: UnitLayout, restored=None):
        super().__init__(compressor, stats, name, restored)
        self.compressor, self.layout = compressor, layout

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        compressor, world, rank = self.compressor, group.size(), group.rank()
        keys = [f"{self.mover.name}/{d}" for d in range(world)]
        if not compressing(compressor):
            compressor.restart()
        elif keys[0] not in compressor.denominators:
            mine = self.shard_denominators(input_tensor.device).to(compressor.denominator_dtype)
            everyone = mine.new_empty(world * mine.numel())
            self.mover.collective(all_gather_flat, everyone, mine, group=group, extra=True)
            self.mover.stats.bytes_sent += (world - 1) * mine.numel() * mine.element_size()
            for key, row in zip(keys, everyone.view(world, -1)):
                compressor.denominators[key] = row.to(compressor.state_dtype)
        if compressor.phase.round not in (LOCAL, SYNC):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        mover, stats = self.mover, self.mover.stats
        seed = mover.next_seed()
        rows = mover.screen(input_tensor.float()).view(world, -1)
        stats.bytes_raw += (world - 1) * rows.shape[1] * 4
        if compressor.phase.round == LOCAL:
            output_tensor.copy_(apply_op(self.local_round(rows, keys, rank) * world, op, world, prescaled=False))
            return None
        payloads, applied = self.sync_round(rows, keys, rank, seed)
        result = mover.decompress(self._all_to_all(payloads, [None] * world, group, rank), rows.device)
        output_tensor.copy_(apply_op(result, op, world, prescaled=False) - applied)
        return None


class OneBitAdamAllReduce(_Rounds, CompressedAllReduce):
    """The all-reduce hook where it is the gradients' first stage (NO_SHARD, one process): local denominators."""

    def __init__(self, compressor: OneBitMomentum, stats, name: str, group, layout: UnitLayout, restored=None):
        super().__init__(compressor, stats, name, group, restored)
        self.compressor, self.layout = compressor, layout

    def __call__(self, reduce_output: torch.Tensor) -> None:
        compressor, key = self.compressor, f"{self.mover.name}/ar"
        if not compressing(compressor):
            if compressor.accumulates:
                compressor.restart()
        elif compressor.accumulates and key not in compressor.denominators:
            compressor.denominators[key] = self.shard_denominators(reduce_output.device).to(compressor.state_dtype)
        if compressor.phase.round not in (LOCAL, SYNC) or not compressor.accumulates:
            return super().__call__(reduce_output)
        # one process (local rounds are refused where replicas share a shard): nothing to send either way
        flat = self.mover.screen(reduce_output.float()).view(1, -1)
        seed = self.mover.next_seed()
        if compressor.phase.round == LOCAL:
            reduce_output.copy_(self.local_round(flat, [key], 0).view_as(reduce_output))
            return None
        payloads, applied = self.sync_round(flat, [key], 0, seed)
        result = self.mover.decompress(payloads, flat.device) - applied
        reduce_output.copy_(result.view_as(reduce_output))
        return None

