"""Two-round Sketched-SGD on 2 gloo processes, called as FSDP2 calls its reduce-scatter and all-reduce hooks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compress.communicator import CommStats
from compress.config import CompressionConfig
from compress.sketched_sgd import SketchedAllReduce, SketchedReduceScatter, SketchedSGD
from tests.distributed import run

SHARD = 2000
PLANTED = torch.arange(7, 2 * SHARD, 401)  # heavy coordinates, the same on every rank


def gradient(rank: int, step: int) -> torch.Tensor:
    noise = 0.1 * torch.randn(2 * SHARD, generator=torch.Generator().manual_seed(10 * step + rank))
    noise[PLANTED] += 5.0 * (1 + step)
    return noise


def two_steps(rank: int, world: int) -> list[tuple]:
    state = SketchedSGD(ratio=0.2, rows=5, heavy_ratio=0.02)
    hook, stats, results = SketchedReduceScatter(state, CommStats(), "unit0"), None, []
    for step in range(2):
        owed = {d: state.residuals.get(f"unit0/{d}", torch.zeros(SHARD)).clone() for d in range(world)}
        out = torch.empty(SHARD)
        hook(output_tensor=out, input_tensor=gradient(rank, step), group=dist.group.WORLD, op=dist.ReduceOp.AVG)
        stats = hook.mover.stats.take()
        corrected = {d: gradient(rank, step).view(world, SHARD)[d] / world + owed[d] for d in range(world)}
        results.append((out, {d: state.residuals[f"unit0/{d}"] for d in range(world)}, corrected, stats))
    return results


def test_the_result_is_the_exact_mean_at_the_candidates_and_error_feedback_keeps_the_rest(tmp_path):
    per_rank = run(two_steps, tmp_path)
    for rank, results in enumerate(per_rank):
        for step, (out, residuals, corrected, stats) in enumerate(results):
            # every rank's corrected row for this rank, summed: the mean of the gradients plus what each still owed
            exact = sum(per_rank[source][step][2][rank] for source in range(2))
            sent = out != 0
            assert int(sent.sum()) == 40  # heavy_ratio 0.02 of 2000
            torch.testing.assert_close(out[sent], exact[sent])  # exact values, not sketch estimates
            planted_here = PLANTED[(PLANTED >= rank * SHARD) & (PLANTED < (rank + 1) * SHARD)] - rank * SHARD
            assert sent[planted_here].all()  # the heavy hitters were found
            for destination, residual in residuals.items():  # what was applied, and what is still owed
                applied = per_rank[destination][step][0] != 0
                torch.testing.assert_close(residual[~applied], corrected[destination][~applied])
                assert (residual[applied] == 0).all()
            assert stats["bytes_sent"] < stats["bytes_raw"] / 3 and stats["extra_collectives"] == 2


def replicated(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    group = dist.new_group(list(range(world)))
    hook = SketchedAllReduce(SketchedSGD(ratio=0.2, heavy_ratio=0.02), CommStats(), "unit0", group)
    shard = gradient(rank, 0)
    hook(shard)
    return shard, sum(gradient(r, 0) for r in range(world)) / world


def test_the_replicate_all_reduce_gives_every_rank_the_same_exact_heavy_hitters(tmp_path):
    (first, mean), (second, _) = run(replicated, tmp_path)
    torch.testing.assert_close(first, second)
    sent = first != 0
    assert int(sent.sum()) == 80 and sent[PLANTED].all()
    torch.testing.assert_close(first[sent], mean[sent])


def test_sketch_has_its_own_error_feedback():
    assert isinstance(CompressionConfig(method="sketch").build(0), SketchedSGD)
    with pytest.raises(ValueError, match="'sketch' is built with its own error feedback"):
        CompressionConfig(method="sketch", error_feedback=True).build(0)
