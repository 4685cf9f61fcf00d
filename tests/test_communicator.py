"""The compressed reduce-scatter and all-reduce hooks on 2 gloo processes, called as FSDP2 calls them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from compress.communicator import CommStats, CompressedAllReduce, CompressedReduceScatter, PayloadMover, RestoredState
from compress.config import METHODS, CompressionConfig
from compress.payload import Payload, layout_of, pack, unpack
from tests.distributed import run
from tests.helpers import SHARD, gradient, payload_bytes


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


def local_estimate(config: dict, world: int, destination: int) -> torch.Tensor:
    """What the hook must return on ``destination``: every rank's decoded payload for that row, summed in rank
    order (linear methods: the payloads summed on the wire, then decoded), over ``world``; computed in one process."""
    seed = PayloadMover(None, CommStats(), "unit0").next_seed() + destination
    decoded, payloads = [], []
    for rank in range(world):
        compressor = CompressionConfig(**config).build(rank)
        row = gradient(rank, world * SHARD).view(world, SHARD)[destination]
        if compressor.linear:
            row = row / world
        payload = compressor.compress(row, f"unit0/{destination}", seed)
        payloads.append(payload)
        decoded.append(compressor.decompress(payload).float())
    if compressor.linear:  # summed element-wise on the wire, in the payload's dtype
        summed = {name: sum(p.tensors[name] for p in payloads) for name in payloads[0].tensors}
        return compressor.decompress(Payload(SHARD, summed, payloads[0].scalars, payloads[0].index_names, payloads[0].kept))
    total = decoded[0]
    for part in decoded[1:]:
        total = total + part
    return total / world


# PowerSGD and Sketched-SGD bring their own communicators: tests/test_powersgd.py, tests/test_sketched_sgd.py;
# 1-bit and 0/1 Adam's hooks compress momenta, not the gradient given: tests/test_onebit_adam.py, test_zero_one_adam.py
REDUCE_SCATTERED = [m for m in METHODS if m not in ("none", "powersgd", "sketch", "onebit_adam", "zero_one_adam")]


def method_config(method: str) -> dict:
    return {"method": method, **({"ratio": 0.3} if method in ("topk", "randomk") else {})}


def every_method_both_ops(rank: int, world: int) -> dict[str, list]:
    return {method: both_ops(rank, world, method_config(method)) for method in REDUCE_SCATTERED}


@pytest.fixture(scope="module")
def reduce_scattered(tmp_path_factory) -> dict[str, list]:
    """Every method's hook, AVG then SUM, one after another in one spawn of 2 processes: per method, per rank."""
    ranks = run(every_method_both_ops, tmp_path_factory.mktemp("reduce_scatter"))
    return {method: [r[method] for r in ranks] for method in REDUCE_SCATTERED}


@pytest.mark.parametrize("method", REDUCE_SCATTERED)
def test_every_method_reduce_scatters_exactly_the_rank_ordered_sum_of_decoded_payloads(reduce_scattered, method):
    config = method_config(method)
    for rank, per_op in enumerate(reduce_scattered[method]):
        expected = local_estimate(config, 2, rank)
        for (out, reference, stats), factor in zip(per_op, (1, 2)):  # AVG, then SUM = world x AVG
            torch.testing.assert_close(out, expected * factor, rtol=1e-6, atol=1e-6)
            assert stats["bytes_raw"] == SHARD * 4
            other = gradient(rank, 2 * SHARD).view(2, SHARD)[1 - rank]  # the row this rank sent away
            assert stats["bytes_sent"] == payload_bytes(config, SHARD, kept=int((other.abs() >= 1e-3).sum()))
        # and an estimate of the true mean, better than sending nothing (sign methods barely, on these spiky rows)
        error = (per_op[0][0] - per_op[0][1]).norm() / per_op[0][1].norm()
        assert error < {"topk": 0.75, "sparseloco": 0.75, "randomk": 2.0, "thresholdv": 1e-5, "signsgd": 0.99, "onebit": 0.99,
                        "lowrank": 1.0, "qsgd": 0.5, "natural": 0.5}.get(method, 0.07), f"{method}: {error:.3f}"


def all_reduce(rank: int, world: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    group = dist.new_group(list(range(world)))
    hook = CompressedAllReduce(CompressionConfig(method=method).build(rank), CommStats(), "unit0", group)
    shard = gradient(rank, SHARD)
    hook(shard)
    return shard, sum(gradient(r, SHARD) for r in range(world)) / world


def both_all_reduces(rank: int, world: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {method: all_reduce(rank, world, method) for method in ("fp16", "int8")}


@pytest.fixture(scope="module")
def all_reduced(tmp_path_factory) -> dict[str, list]:
    ranks = run(both_all_reduces, tmp_path_factory.mktemp("all_reduce"))
    return {method: [r[method] for r in ranks] for method in ("fp16", "int8")}


@pytest.mark.parametrize("method", ["fp16", "int8"])  # a native all-reduce and an all-gather of payloads
def test_replicate_all_reduce_averages_across_ranks(all_reduced, method):
    results = all_reduced[method]
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


def test_packed_payload_round_trips_by_its_layout_with_no_header():
    payload = Payload(
        numel=10,
        tensors={"values": torch.randn(3), "flags": torch.tensor([1], dtype=torch.uint8),
                 "positions": torch.tensor([1, 4, 7], dtype=torch.int32)},  # int32 at an odd byte offset
        scalars={"seed": 5.0},
        index_names=("positions",),
        kept=3,
    )
    buffer = pack(payload)
    assert buffer.numel() == payload.nbytes - 8  # tensor bytes only: scalars and layout never travel
    back = unpack(buffer, layout_of(payload), payload)
    assert (back.scalars, back.index_names, back.kept) == (payload.scalars, payload.index_names, 3)
    for name, tensor in payload.tensors.items():
        assert torch.equal(back.tensors[name], tensor) and back.tensors[name].dtype == tensor.dtype


@pytest.mark.parametrize("method", ["fp16", "bf16", "fp8", "int8", "qsgd", "natural", "signsgd", "onebit"])
@pytest.mark.parametrize("n", [1, 7, 1024, 1237])
def test_a_quantisers_layout_is_what_it_sends(method, n):
    quantizer = CompressionConfig(method=method, **({"num_bits": 3} if method == "int8" and n == 7 else {})).build(0)
    assert quantizer.layout(n) == layout_of(quantizer.compress(gradient(0, n), "k", 0))


@pytest.mark.parametrize("config", [
    {"method": "thresholdv", "threshold": 1.0}, {"method": "thresholdv", "threshold": 0.05},
    {"method": "thresholdv", "threshold": 1.0, "quantize": "int8"},
    {"method": "thresholdv", "threshold": 0.05, "quantize": "qsgd"},
    {"method": "thresholdv", "threshold": 100.0, "quantize": "int8"},  # keeps nothing
    {"method": "thresholdv", "threshold": 1.0, "error_feedback": True},
])
def test_a_variable_size_payload_is_described_by_its_kept_count(config):
    compressor = CompressionConfig(**config).build(0)
    x = gradient(0, SHARD)
    kept = int(compressor.kept_count(x, "k"))
    payload = compressor.compress(x, "k", 3, kept=kept)
    layout, like = compressor.layout(SHARD, kept)
    assert layout == layout_of(payload) and like.kept == payload.kept == kept
    assert like.index_names == payload.index_names
    torch.testing.assert_close(compressor.decompress(unpack(pack(payload), layout, like)), compressor.decompress(payload))


class OnGpu:
    """A restored state tensor as ``RestoredState`` sees it: on a GPU, noting the streams it is recorded on."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self) -> None:
        self.streams: list[str] = []

    def record_stream(self, stream: str) -> None:
        self.streams.append(stream)


def test_restored_state_is_recorded_once_on_each_hooks_stream_then_let_go(monkeypatch):
    stream = {"current": "default"}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream["current"])
    restored, stats = RestoredState(), CommStats()
    # one unit's two hooks, as GradientCompression.register shares its RestoredState; FSDP2 runs each on its stream
    hooks = {name: PayloadMover(None, stats, f"unit0/{name}", restored) for name in ("reduce_scatter", "all_reduce")}
    residual, momentum = OnGpu(), OnGpu()
    restored.load([residual, torch.zeros(2), momentum])  # a CPU tensor needs no stream
    for step in range(2):
        for name, mover in hooks.items():
            stream["current"] = name
            mover.next_seed()  # what every hook call starts with
            if (step, name) == (0, "reduce_scatter"):
                assert restored.tensors == [residual, momentum]  # the all-reduce hook has yet to adopt them
    assert residual.streams == momentum.streams == ["reduce_scatter", "all_reduce"]
    assert restored.tensors == []  # adopted by every hook: the list no longer keeps replaced state alive
    restored.load([residual])  # a second load is adopted again
    hooks["all_reduce"].next_seed()
    assert residual.streams == ["reduce_scatter", "all_reduce", "all_reduce"] and restored.tensors == [residual]
