"""PowerSGD (Vogels et al., 2019) as FSDP2 communication hooks: rank-r gradients with a shared Q, error feedback, warm start.

Per parameter matrix M (the gradient viewed as ``rows x rest``, as torch's ``powerSGD_hook`` does; a stacked
parameter of three or more dimensions, a mixture-of-experts layer's fused experts, is one matrix per row: E experts
are E matrices of ``shape[1] x rest``, each with its own P and Q), every rank starts from the same Q (seeded by the
unit's name and the parameter's index, then warm started from the last step), and:

1. P = M Q, summed over ranks with the native all-reduce, then orthonormalised;
2. Q = Mᵀ P, summed over ranks;
3. M ≈ P Qᵀ / world: the average of the ranks' gradients, projected on the shared subspace.

The result is linear (each rank's contribution is added on the wire), so no all-to-all is needed:
each rank keeps its rows of the reconstruction. One-dimensional parameters, and matrices too small
to gain ``min_compression`` times, are averaged uncompressed in one all-reduce. Error feedback keeps
``M + e - P Qᵀ / world`` for the next step. The first ``start_step`` steps are plain reduce-scatters.

Under FSDP2 the reduce-scatter input is the unit's flat gradient, each parameter padded to a
multiple of the world size in rows and chunked by rank (``compress.layout``); a parameter's full
gradient is then a (world, chunk_rows, cols) view of it (zero padding rows change no product; a stacked
parameter's padding rows are left out, so they cost no P or Q).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from compress.communicator import CommStats, HookCounters, RestoredState, apply_op, keep_alive, screen
from compress.error_feedback import Residuals
from compress.layout import ParamPlace, UnitLayout
from compress.torch_compat import ReduceScatter, reduce_scatter_flat



class PowerSGD(Residuals):
    """PowerSGD's settings and its per-rank state: warm-start Q and error-feedback residual per matrix, steps per hook."""

    linear = True  # the sum of every rank's P (and Q) travels natively
    unbiased = False

    def __init__(self, rank: int = 4, start_step: int = 10, min_compression: float = 2.0):
        """
        Args:
            rank: Rank of each matrix's approximation.
            start_step: Steps of plain (uncompressed) reduction before PowerSGD starts, as torch's ``start_powerSGD_iter``.
            min_compression: Compress a matrix only if it sends at least this many times fewer values.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"powersgd: rank={rank!r} is not an integer >= 1")
        if start_step < 0 or min_compression < 1:
            raise ValueError(f"powersgd: start_step={start_step} must be >= 0 and min_compression={min_compression} >= 1")
        self.rank, self.start_step, self.min_compression = rank, start_step, min_compression
        self.q: dict[str, torch.Tensor] = {}  # the last step's Q per matrix (warm start)
        self.residuals: dict[str, torch.Tensor] = {}  # error feedback per matrix and per vector group
        self.steps: dict[str, int] = {}  # reductions done per hook

    @property
    def memory_bytes(self) -> int:
        """Residuals and warm-start Qs."""
        return super().memory_bytes + sum(q.numel() * q.element_size() for q in self.q.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Residuals, warm-start Qs and steps done per hook, for checkpoints."""
        return {
            **super().state_dict(), **{f"q/{key}": q for key, q in self.q.items()},
            **{f"steps/{name}": torch.tensor(count) for name, count in self.steps.items()},
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.q = {key.removeprefix("q/"): q for key, q in state.items() if key.startswith("q/")}
        self.steps = {key.removeprefix("steps/"): int(v) for key, v in state.items() if key.startswith("steps/")}

    def matrix_rank(self, rows: int, cols: int) -> int:
        """The rank used for a ``rows x cols`` matrix, or 0 when it is sent uncompressed (torch's ``_should_compress``)."""
        rank = min(rows, cols, self.rank)
        return rank if rows * cols >= (rows + cols) * rank * self.min_compression else 0

    def initial_q(self, key: str, count: int, cols: int, rank: int, device: torch.device) -> torch.Tensor:
        """Random Qs (``count x cols x rank``) the same on every rank: seeded by the stack's key, orthonormalised."""
        generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        # drawn on the host: every device draws the same Q; the copy does not wait for the device
        return orthonormal(torch.randn(count, cols, rank, generator=generator).to(device, non_blocking=True))

    # --- the reduction ---------------------------------------------------------------------------

    def average(self, stacks: list[torch.Tensor], keys: list[str], group: dist.ProcessGroup, stats: CommStats) -> list[torch.Tensor]:
        """The rank average of each ``stacks[i]``, a stack of matrices shaped ``(count, rows, cols)`` (count 1 for a
        weight matrix, the experts for a stacked parameter: ``as_matrices``), each compressed on its own.

        Returns float32 tensors of the same shapes; updates the warm starts and residuals under ``keys``.
        Its time outside the all-reduces (products, orthonormalisation, residuals) is counted as ``compress_s``.
        """
        with stats.clock.time("compress_s", stacks[0].device if stacks else torch.device("cpu")):
            results = self._average(stacks, keys, group, stats)
        return results

    def _average(self, stacks: list[torch.Tensor], keys: list[str], group: dist.ProcessGroup, stats: CommStats) -> list[torch.Tensor]:
        world = group.size()
        corrected = []
        for stack, key in zip(stacks, keys):
            residual = self.residuals.get(key)
            # view_as: a checkpoint from before stacks kept a weight's residual as (world, chunk_rows, cols)
            corrected.append(stack.float() if residual is None else stack.float() + residual.view_as(stack))
        low_rank = [i for i, m in enumerate(corrected) if self.matrix_rank(m.shape[1], m.shape[2])]
        dense = [i for i in range(len(corrected)) if i not in low_rank]
        results: list[torch.Tensor | None] = [None] * len(corrected)

        if dense:  # vectors and small matrices: one plain all-reduce of their concatenation
            flat = torch.cat([corrected[i].reshape(-1) for i in dense])
            _all_reduce(flat, group, stats)
            flat /= world
            offset = 0
            for i in dense:
                results[i] = flat[offset : offset + corrected[i].numel()].view_as(corrected[i])
                offset += corrected[i].numel()

        if low_rank:
            ranks = {i: self.matrix_rank(corrected[i].shape[1], corrected[i].shape[2]) for i in low_rank}
            qs = {}
            for i in low_rank:
                q = self.q.get(keys[i])
                count, _, cols = corrected[i].shape
                if q is not None and q.numel() == count * cols * ranks[i]:  # a checkpoint from before stacks: (cols, rank)
                    qs[i] = orthonormal(q.view(count, cols, ranks[i]))
                else:
                    qs[i] = self.initial_q(keys[i], count, cols, ranks[i], corrected[i].device)
            # P = M Q for every matrix, summed over ranks in one all-reduce, then orthonormalised
            ps = {i: torch.matmul(corrected[i], qs[i]) for i in low_rank}
            packed = torch.cat([ps[i].reshape(-1) for i in low_rank])
            _all_reduce(packed, group, stats)
            offset = 0
            for i in low_rank:
                ps[i] = orthonormal(packed[offset : offset + ps[i].numel()].view_as(ps[i]))
                offset += ps[i].numel()
            # Q = Mᵀ P, summed over ranks in one all-reduce
            for i in low_rank:
                qs[i] = torch.matmul(corrected[i].mT, ps[i])
            packed = torch.cat([qs[i].reshape(-1) for i in low_rank])
            _all_reduce(packed, group, stats)
            offset = 0
            for i in low_rank:
                qs[i] = packed[offset : offset + qs[i].numel()].view_as(qs[i])
                offset += qs[i].numel()
                self.q[keys[i]] = qs[i]
                results[i] = torch.matmul(ps[i], qs[i].mT) / world

        for key, value, result in zip(keys, corrected, results):
            self.residuals[key] = value - result
        return results  # type: ignore[return-value]


def orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """The columns of ``matrix`` (of each matrix of a stack) made orthonormal (reduced QR), in float32."""
    return torch.linalg.qr(matrix.float()).Q


def as_matrices(blocks: torch.Tensor, place: ParamPlace, rows: int) -> torch.Tensor:
    """``place``'s gradient as the stack of matrices PowerSGD compresses, from ``blocks`` (blocks, chunk_rows, cols):
    the rows of every block one after another, the first ``rows`` of them the parameter's, the rest padding.

    A weight is one matrix, padding rows included (zero rows change no product); a stacked parameter (a MoE layer's
    experts) is one matrix per row, its padding rows left out."""
    if not place.stacked:
        return blocks.reshape(1, -1, place.cols)
    return blocks.reshape(-1, *place.matrix)[:rows]


def as_blocks(matrices: torch.Tensor, place: ParamPlace, blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of ``as_matrices``: ``matrices`` in the shape of ``blocks``, padding rows zero."""
    if not place.stacked:
        return matrices.view(blocks.shape)
    out = matrices.new_zeros(blocks.shape)
    out.view(-1, *place.matrix)[: matrices.shape[0]] = matrices
    return out


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, stats: CommStats) -> None:
    """A summing all-reduce, counted: PowerSGD makes up to three per reduction (vectors, P, Q) instead of one."""
    with stats.clock.time("extra_collective_s", tensor.device):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    stats.extra_collectives += 1
    stats.bytes_sent += 2 * (group.size() - 1) * tensor.numel() * tensor.element_size() // group.size()  # a ring


class PowerSGDReduceScatter(ReduceScatter):
    """FSDP2 reduce-scatter by PowerSGD: every rank reconstructs the average and keeps its rows."""

    def __init__(self, state: PowerSGD, stats: CommStats, name: str, layout: UnitLayout,
                 restored: RestoredState | None = None):
        self.state, self.stats, self.name, self.layout = state, stats, name, layout
        self.restored = restored or RestoredState()
        self._hook = self.restored.register()
        self.counters = stats.new_hook()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        stats, layout = self.stats, self.layout
        world, rank = group.size(), group.rank()
        self.restored.adopt(self._hook)
        stats.calls += 1
        stats.numel += input_tensor.numel()
        raw = (world - 1) * input_tensor.numel() // world * 4
        stats.bytes_raw += raw
        step = self.state.steps.get(self.name, 0)
        self.state.steps[self.name] = step + 1
        if step < self.state.start_step:  # dense steps first, as the paper and torch's hook do
            reduce_scatter_flat(output_tensor, input_tensor, op=op, group=group)
            stats.bytes_sent += raw
            return None
        stats.values_sent += input_tensor.numel()  # every element gets a value: density 1
        rows = screen(input_tensor.float(), self.counters).view(world, layout.shard_numel)
        views = [layout.rank_major_view(rows, place) for place in layout.places]
        stacks = [as_matrices(view, place, place.rows) for view, place in zip(views, layout.places)]
        averages = self.state.average(stacks, [self._key(place) for place in layout.places], group, stats)
        if stats.sampling:
            _sample(self.counters, stacks, averages, group)
        mine = output_tensor.view(layout.shard_numel)
        for place, view, average in zip(layout.places, views, averages):
            mine[place.shard_offset : place.shard_offset + place.chunk_numel].copy_(
                apply_op(as_blocks(average, place, view)[rank].reshape(-1), op, world, prescaled=True)
            )
        return None

    def _key(self, place: ParamPlace) -> str:
        return f"{self.name}/{place.names[0]}"


class PowerSGDAllReduce:
    """All-reduce hook for the replicate dimension (NO_SHARD, HYBRID_SHARD): PowerSGD over this rank's reduced shard."""

    def __init__(self, state: PowerSGD, stats: CommStats, name: str, layout: UnitLayout, group: dist.ProcessGroup,
                 restored: RestoredState | None = None):
        self.state, self.stats, self.name, self.layout, self.group = state, stats, name, layout, group
        self.restored = restored or RestoredState()
        self._hook = self.restored.register()
        self.counters = stats.new_hook()

    def __call__(self, reduce_output: torch.Tensor) -> None:
        stats, layout, group = self.stats, self.layout, self.group
        world = group.size()
        keep_alive(reduce_output)
        self.restored.adopt(self._hook)
        stats.calls += 1
        stats.numel += reduce_output.numel()
        raw = 2 * (world - 1) * reduce_output.numel() * 4 // world
        stats.bytes_raw += raw
        step = self.state.steps.get(self.name, 0)
        self.state.steps[self.name] = step + 1
        if step < self.state.start_step:
            dist.all_reduce(reduce_output, op=dist.ReduceOp.SUM, group=group)
            reduce_output /= world
            stats.bytes_sent += raw
            return
        stats.values_sent += reduce_output.numel()
        flat = screen(reduce_output.float(), self.counters).view(1, layout.shard_numel)
        views = [flat[:, p.shard_offset : p.shard_offset + p.chunk_numel].view(1, p.chunk_rows, p.cols) for p in layout.places]
        stacks = [as_matrices(view, place, place.stop_row - place.start_row)
                  for view, place in zip(views, layout.places)]
        averages = self.state.average(stacks, [f"{self.name}/{p.names[0]}" for p in layout.places], group, stats)
        out = reduce_output.view(-1)
        for place, view, average in zip(layout.places, views, averages):
            out[place.shard_offset : place.shard_offset + place.chunk_numel].copy_(
                as_blocks(average, place, view).reshape(-1))


def _sample(counters: HookCounters, gradients: list[torch.Tensor], averages: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """On a sampled step, compare the reconstruction with the exact average (one extra dense all-reduce, not counted)."""
    exact = torch.cat([g.float().reshape(-1) for g in gradients])
    dist.all_reduce(exact, op=dist.ReduceOp.SUM, group=group)
    exact /= group.size()
    estimate = torch.cat([a.reshape(-1) for a in averages])
    counters.add_samples(torch.stack([
        (estimate - exact).square().sum(), exact.square().sum(), (estimate * exact).sum(), estimate.square().sum(),
    ]).double())


def compressed_fraction(state: PowerSGD, layout: UnitLayout, world: int) -> float:
    """Values sent over values of the dense gradient, for one reduction of ``layout`` (for docs and tests)."""
    sent = dense = 0
    for place in layout.places:
        count, (rows, cols) = (place.rows, place.matrix) if place.stacked else (1, (world * place.chunk_rows, place.cols))
        rank = state.matrix_rank(rows, cols)
        dense += world * place.chunk_rows * place.cols  # as FSDP2 reduce-scatters it, padding rows included
        sent += count * ((rows + cols) * rank if rank else rows * cols)
    return sent / dense if dense else 1.0

