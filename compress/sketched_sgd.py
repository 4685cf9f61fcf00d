"""Sketched-SGD (Ivkin et al., 2019) in two rounds, as FSDP2 communication hooks.

Round one: every rank sketches its error-corrected gradient row for each destination with hash functions
from a seed all ranks share; a native reduce-scatter sums the count sketches, and each destination takes
the ``k`` largest median estimates of the sum as its heavy-hitter candidates. Round two: the candidates'
positions are all-gathered, every rank sends its *exact* values at them, and a second native
reduce-scatter sums those. The result is exact at the candidates and zero elsewhere, and each rank's
error feedback keeps everything but what was applied. The one-round form (the candidates' sketch
estimates as values) diverged in training: estimates of the sum are biased by collisions, and the
sender cannot know what the receiver applied, so its error feedback was wrong.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compress.communicator import CommStats, PayloadMover, RestoredState, apply_op, keep_alive
from compress.error_feedback import Residuals
from compress.payload import nbytes
from compress.sketch import CountSketch
from compress.torch_compat import ReduceScatter, all_gather_flat, reduce_scatter_flat

_INDEX_BYTES = 4  # candidate positions travel as int32


class SketchedSGD(Residuals):
    """Sketched-SGD's settings (a count sketch) and each rank's error-feedback residual per row."""

    linear = True  # sketches and the candidates' values add up on the wire
    unbiased = False

    def __init__(self, ratio: float = 0.1, rows: int = 5, heavy_ratio: float | None = None, k: int | None = None):
        """
        Args:
            ratio: Sketch table size as a share of the gradient.
            rows: Hash rows of the sketch (the median of their estimates ranks the candidates).
            heavy_ratio: Share of coordinates whose exact values are sent in round two.
            k: Number of such coordinates (instead of heavy_ratio).
        """
        self.sketch = CountSketch(ratio, rows, heavy_ratio, k)
        self.residuals: dict[str, torch.Tensor] = {}

    def corrected(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` plus what is still owed for ``key``."""
        residual = self.residuals.get(key)
        return tensor.clone() if residual is None else tensor + residual

    def applied(self, key: str, corrected: torch.Tensor, positions: torch.Tensor) -> None:
        """Exact values went out at ``positions``: the rest is owed to the next step."""
        self.residuals[key] = corrected.index_fill(0, positions, 0.0)

    def candidates(self, table: torch.Tensor, n: int, seed: int) -> torch.Tensor:
        return self.sketch.heavy(table, n, seed)[0]


class SketchedReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter by two-round Sketched-SGD: each rank gets its shard exact at its candidates."""

    def __init__(self, state: SketchedSGD, stats: CommStats, name: str, restored: RestoredState | None = None):
        self.state = state
        self.mover = PayloadMover(state.sketch, stats, name, restored)  # seeds, screening and collectives' timing

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        mover, stats, state = self.mover, self.mover.stats, self.state
        world, rank = group.size(), group.rank()
        seed = mover.next_seed()
        rows = mover.screen(input_tensor.float()).view(world, -1) / world  # the mean travels: no overflow
        numel = rows.shape[1]
        stats.calls += 1
        stats.numel += rows.numel()
        stats.bytes_raw += (world - 1) * numel * 4
        with mover.timed("compress_s", rows.device):
            corrected = torch.stack([state.corrected(f"{mover.name}/{d}", rows[d]) for d in range(world)])
            tables = torch.stack([state.sketch.table(corrected[d], seed + d) for d in range(world)])
        summed = tables.new_empty(tables[0].shape)
        mover.collective(reduce_scatter_flat, summed.view(-1), tables.view(-1), op=dist.ReduceOp.SUM, group=group,
                         extra=False)
        with mover.timed("decompress_s", rows.device):
            mine = state.candidates(summed, numel, seed + rank)
        k = mine.numel()
        everyone = torch.empty(world * k, dtype=torch.int32, device=rows.device)
        mover.collective(all_gather_flat, everyone, mine.to(torch.int32), group=group, extra=True)
        positions = everyone.view(world, k).long()
        values = torch.gather(corrected, 1, positions)  # row d: this rank's exact values at d's candidates
        for d in range(world):
            state.applied(f"{mover.name}/{d}", corrected[d], positions[d])
        summed_values = values.new_empty(k)
        mover.collective(reduce_scatter_flat, summed_values, values.view(-1), op=dist.ReduceOp.SUM, group=group,
                         extra=True)
        result = torch.zeros(numel, dtype=torch.float32, device=rows.device).index_put_((mine,), summed_values)
        output_tensor.copy_(apply_op(result, op, world, prescaled=True))
        # this rank sends world - 1 rows' worth of sketch, receives and sends positions, sends values
        stats.bytes_sent += (world - 1) * (summed.numel() * 4 + k * _INDEX_BYTES + k * 4)
        stats.bytes_index += (world - 1) * k * _INDEX_BYTES
        stats.values_sent += world * k
        mover.hold(nbytes(tables, summed, everyone, values, summed_values))
        return None


class SketchedAllReduce:
    """All-reduce hook for the replicate dimension (NO_SHARD, HYBRID_SHARD): the same two rounds over one vector."""

    def __init__(self, state: SketchedSGD, stats: CommStats, name: str, group: dist.ProcessGroup,
                 restored: RestoredState | None = None):
        self.state = state
        self.mover = PayloadMover(state.sketch, stats, name, restored)
        self.group = group

    def __call__(self, reduce_output: torch.Tensor) -> None:
        mover, stats, state, group = self.mover, self.mover.stats, self.state, self.group
        world, key = group.size(), f"{self.mover.name}/ar"
        keep_alive(reduce_output)
        seed = mover.next_seed()
        flat = mover.screen(reduce_output.float()).view(-1) / world
        numel = flat.numel()
        stats.calls += 1
        stats.numel += numel
        stats.bytes_raw += 2 * (world - 1) * numel * 4 // world  # a ring all-reduce
        with mover.timed("compress_s", flat.device):
            corrected = state.corrected(key, flat)
            table = state.sketch.table(corrected, seed)
        mover.collective(dist.all_reduce, table, op=dist.ReduceOp.SUM, group=group, extra=False)
        positions = state.candidates(table, numel, seed)  # the same summed table: the same candidates everywhere
        values = corrected[positions]
        state.applied(key, corrected, positions)
        mover.collective(dist.all_reduce, values, op=dist.ReduceOp.SUM, group=group, extra=True)
        result = torch.zeros(numel, dtype=torch.float32, device=flat.device).index_put_((positions,), values)
        reduce_output.copy_(result.view_as(reduce_output))
        k = positions.numel()
        stats.bytes_sent += 2 * (world - 1) * (table.numel() * 4 + k * 4) // world
        stats.values_sent += k
        stats.extra_collectives += 1
        mover.hold(nbytes(table, values))
