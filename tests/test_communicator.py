"""The compressed reduce-scatter and all-reduce hooks on 2 gloo processes, called as FSDP2 calls them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compress.communicator import CommStats, CompressedAllReduce, CompressedReduceScatter, deserialize, serialize
from compress.config import METHODS, CompressionConfig
from compress.payload import Payload
from tests.distributed import run

SHARD = 1237  # odd, so chunks and packed bits do not divide evenly


def gradient(rank: int, numel: int) -> torch.Tensor:
    """Gaussian noise with a few large coordinates shared by all ranks, as heavy-tailed gradients have."""
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
    noise[::61] += 30.0
    return noise


def reduce_scatter(rank: int, world: int, config: dict, op) -> tuple[torch.Tensor, torch.Tensor, dict]:
    compressor = CompressionConfig(**config).build(rank)
    stats = CommStats()
    hook = CompressedReduceScatter(compressor, stats, "unit0")
    out = torch.empty(SHARD)
    hook(output_tensor=out, input_tensor=gradient(rank, world * SHARD), group=dist.group.WORLD, op=op)
    total = sum(gradient(r, world * SHARD) for r in range(world)).view(world, SHARD)[rank]
    reference = total / world if op == dist.ReduceOp.AVG else total
    return out, reference, stats.take()


def int8_with_bound(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, reference, _ = reduce_scatter(rank, world, {"method": "int8", "chunk_size": 256}, dist.ReduceOp.AVG)
    # Each rank's row for this destination is quantised with its own per-chunk scale absmax / 127.
    bound = torch.zeros(SHARD)
    for r in range(world):
        row = gradient(r, world * SHARD).view(world, SHARD)[rank]
        for start in range(0, SHARD, 256):
            bound[start : start + 256] += row[start : start + 256].abs().max() / 127 / 2
    return out, reference, bound / world


def test_int8_reduce_scatter_matches_fp32_within_the_quantisation_bound(tmp_path):
    for out, reference, bound in run(int8_with_bound, tmp_path):
        assert ((out - reference).abs() <= bound + 1e-6).all()
        assert not torch.equal(out, reference)  # it really was quantised


def both_ops(rank: int, world: int, config: dict) -> list:
    return [reduce_scatter(rank, world, config, op) for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM)]


# PowerSGD and Sketched-SGD bring their own communicators: tests/test_powersgd.py, tests/test_sketched_sgd.py
@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("none", "powersgd", "sketch")])
def test_every_method_reduce_scatters_to_a_finite_estimate_of_the_sum_or_mean(tmp_path, method):
    config = {"method": method, **({"ratio": 0.3} if method in ("topk", "randomk") else {})}
    minimum_cosine = {"qsgd": 0.7, "topk": 0.8, "randomk": 0.2, "sketch": 0.05, "signsgd": 0.25, "onebit": 0.25}
    for per_op in run(both_ops, tmp_path, config):
        for out, reference, stats in per_op:
            assert out.shape == reference.shape and torch.isfinite(out).all()
            cosine = torch.nn.functional.cosine_similarity(out, reference, dim=0)
            assert cosine > minimum_cosine.get(method, 0.1 if method == "lowrank" else 0.9)
            assert stats["bytes_raw"] == SHARD * 4 and 0 < stats["bytes_sent"] < stats["bytes_raw"] * 1.1
        (avg, _, _), (total, _, _) = per_op
        if method in ("fp16", "bf16", "int8", "fp8"):  # deterministic codecs: SUM is world x AVG
            torch.testing.assert_close(total, avg * 2, rtol=0.02, atol=0.02)  # run() uses 2 ranks


def all_reduce(rank: int, world: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    group = dist.new_group(list(range(world)))
    hook = CompressedAllReduce(CompressionConfig(method=method).build(rank), CommStats(), "unit0", group)
    shard = gradient(rank, SHARD)
    hook(shard)
    return shard, sum(gradient(r, SHARD) for r in range(world)) / world


@pytest.mark.parametrize("method", ["fp16", "int8"])  # a native all-reduce and an all-gather of payloads
def test_replicate_all_reduce_averages_across_ranks(tmp_path, method):
    results = run(all_reduce, tmp_path, method)
    tolerance = 0.05 if method == "fp16" else 30.5 / 127  # int8: half a step of the spikes' scale, per rank
    for out, reference in results:
        torch.testing.assert_close(out, reference, rtol=0, atol=tolerance)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=tolerance)


def test_non_finite_values_are_counted_and_not_sent(tmp_path):
    results = run(nonfinite, tmp_path)
    for out, stats in results:
        assert torch.isfinite(out).all() and stats["nonfinite"] == 2


def nonfinite(rank: int, world: int) -> tuple[torch.Tensor, dict]:
    stats = CommStats()
    hook = CompressedReduceScatter(CompressionConfig(method="int8").build(rank), stats, "unit0")
    grad = gradient(rank, world * SHARD)
    grad[3], grad[SHARD + 5] = float("nan"), float("inf")
    out = torch.empty(SHARD)
    hook(output_tensor=out, input_tensor=grad, group=dist.group.WORLD, op=dist.ReduceOp.AVG)
    return out, stats.take()


def test_serialised_payload_round_trips_and_its_header_is_small():
    payload = Payload(
        numel=10,
        tensors={"values": torch.randn(3), "positions": torch.tensor([1, 4, 7], dtype=torch.int32)},
        scalars={"seed": 5.0},
        index_names=("positions",),
    )
    buffer = serialize(payload)
    back = deserialize(buffer, 10)
    assert back.scalars == payload.scalars and back.index_names == payload.index_names
    for name, tensor in payload.tensors.items():
        assert torch.equal(back.tensors[name], tensor)
    assert buffer.numel() - (payload.nbytes - 8) < 120
