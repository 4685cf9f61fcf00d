"""PowerSGD: exact on low-rank gradients, one Q on every rank, error feedback that owes exactly what it dropped,
and two processes that agree with one process compressing their summed gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist

from compress.communicator import CommStats
from compress.powersgd import PowerSGD
from tests.distributed import run

ROWS, COLS = 24, 10


def gradients(rank: int, step: int) -> list[torch.Tensor]:
    """One (1, ROWS, COLS) rank-1 matrix and one vector per rank and step, seeded by both."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    outer = torch.outer(torch.randn(ROWS, generator=generator), torch.randn(COLS, generator=generator))
    return [outer.view(1, ROWS, COLS), torch.randn(1, 1, 7, generator=generator)]


def reduce_on_ranks(rank: int, world: int, matrix_rank: int, steps: int, same_every_step: bool = False) -> dict:
    """Each step's corrected input, result, residuals and counters on this rank (the gradients of step 0 every
    step with ``same_every_step``)."""
    state = PowerSGD(rank=matrix_rank, start_step=0, min_compression=1.0)
    stats = CommStats()
    results, inputs, residuals, counters = [], [], [], []
    for step in range(steps):
        grads = gradients(rank, 0 if same_every_step else step)
        owed = [state.residuals.get(key, torch.zeros_like(g)) for key, g in zip(("m", "v"), grads)]
        inputs.append([g + o for g, o in zip(grads, owed)])
        results.append(state.average(grads, ["m", "v"], dist.group.WORLD, stats))
        residuals.append({key: value.clone() for key, value in state.residuals.items()})
        counters.append(stats.take())
    return {"results": results, "inputs": inputs, "residuals": residuals, "q": state.q["m"], "stats": counters}


def test_low_rank_sums_are_exact_and_q_is_shared(tmp_path):
    ranks = run(reduce_on_ranks, tmp_path, 2, 1)  # rank 2 >= the rank of the sum of two rank-1 matrices
    mean = (gradients(0, 0)[0] + gradients(1, 0)[0]) / 2
    for outcome in ranks:
        torch.testing.assert_close(outcome["results"][0][0], mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(outcome["results"][0][1], (gradients(0, 0)[1] + gradients(1, 0)[1]) / 2)
    torch.testing.assert_close(ranks[0]["q"], ranks[1]["q"], rtol=0, atol=0)
    # P, Q and the vector each crossed in a native all-reduce: no all-to-all, no payload headers
    assert ranks[0]["stats"][0]["extra_collectives"] == 3
    # the products and orthonormalisation are the codec's time, the all-reduces are not
    assert 0 < ranks[0]["stats"][0]["compress_s"]


def test_error_feedback_keeps_exactly_what_was_not_applied_and_the_applied_sum_converges(tmp_path):
    # The same two rank-1 gradients every step: their mean has rank 2, so rank 1 drops part of it each step.
    steps = 40
    ranks = run(reduce_on_ranks, tmp_path, 1, steps, True)
    mean = (gradients(0, 0)[0] + gradients(1, 0)[0]) / 2
    applied_sum = torch.zeros_like(mean)
    for step in range(steps):
        for outcome in ranks:
            for key, given, applied in zip(("m", "v"), outcome["inputs"][step], outcome["results"][step]):
                torch.testing.assert_close(outcome["residuals"][step][key] + applied, given)
            # P (ROWS values), Q (COLS) and the vector (7) in three ring all-reduces of 2 ranks: 4 bytes a value
            assert outcome["stats"][step]["bytes_sent"] == 4 * (ROWS + COLS + 7)
            assert outcome["stats"][step]["extra_collectives"] == 3
        applied = ranks[0]["results"][step][0]
        torch.testing.assert_close(ranks[1]["results"][step][0], applied, rtol=0, atol=0)
        assert torch.linalg.matrix_rank(applied.view(ROWS, COLS)) == 1  # a rank-1 update, not nothing
        applied_sum += applied
        # What the steps applied falls short of the steps' mean gradients by the ranks' mean residual, which
        # stays within 3 gradients while the sum grows to 40 (a rank's own residual also holds its distance
        # from the mean, and grows: the mean is what error feedback must keep bounded).
        gap = applied_sum - (step + 1) * mean
        owed = (ranks[0]["residuals"][step]["m"] + ranks[1]["residuals"][step]["m"]) / 2
        torch.testing.assert_close(gap, -owed, rtol=1e-4, atol=1e-4)
        assert torch.linalg.vector_norm(gap) < 3 * torch.linalg.vector_norm(mean), step


def _two_then_one(rank: int, world: int) -> dict:
    """Rank 1 of the 2-process run, and a 1-process run over the summed gradients, in the same state."""
    two = PowerSGD(rank=1, start_step=0, min_compression=1.0)
    result = two.average(gradients(rank, 0), ["m", "v"], dist.group.WORLD, CommStats())
    return {"result": result[0]}


def test_two_processes_equal_one_process_on_the_summed_gradient(tmp_path):
    two = run(_two_then_one, tmp_path)
    one = PowerSGD(rank=1, start_step=0, min_compression=1.0)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        summed = [a + b for a, b in zip(gradients(0, 0), gradients(1, 0))]
        single = one.average(summed, ["m", "v"], dist.group.WORLD, CommStats())
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(two[0]["result"], single[0] / 2, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(two[1]["result"], two[0]["result"])


def test_small_matrices_and_vectors_are_sent_uncompressed():
    state = PowerSGD(rank=4, min_compression=2.0)
    assert state.matrix_rank(ROWS, COLS) == 0  # (24 + 10) x 4 x 2 > 240: no gain worth the error
    assert state.matrix_rank(512, 64) == 4
    assert state.matrix_rank(1, 7) == 0
