"""CompressionStats extras: density, sampled gradient error and cosine, extra memory; hooks on 2 gloo processes."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
import torch.distributed as dist

import compress.timing
from callbacks.compression import CompressionStats, sampled_error, summarise
from compress.communicator import CommStats, CompressedAllReduce, CompressedReduceScatter
from compress.config import CompressionConfig
from tests.distributed import run
from tests.helpers import REPO, SHARD, fit, gradient


def gaussian(rank: int, numel: int) -> torch.Tensor:
    """Light-tailed rows: int8's error then stays under 1% (the spikes of ``gradient`` take most of a chunk's scale)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(200 + rank))


def reduce_scatter(rank: int, world: int, compressor, stats: CommStats, rows=gradient, calls: int = 1) -> None:
    hook = CompressedReduceScatter(compressor, stats, "unit0")
    for _ in range(calls):
        hook(output_tensor=torch.empty(SHARD), input_tensor=rows(rank, world * SHARD), group=dist.group.WORLD,
             op=dist.ReduceOp.AVG)


DENSE = [{"method": "int8", "chunk_size": 256}, {"method": "fp16"}]  # int8: all-to-all / all-gather; fp16: native
SPARSE = [
    {"method": "topk", "ratio": 0.01, "error_feedback": True},
    {"method": "topk", "ratio": 0.01, "quantize": "int8"},
    {"method": "randomk", "ratio": 0.01},  # native reduce-scatter
    {"method": "thresholdv", "threshold": 0.5},  # keeps most of a unit Gaussian: bitmap positions
]


def dense_steps(rank: int, world: int) -> list[dict]:
    """One sampled reduce-scatter per dense config, then one sampled replicate all-reduce each."""
    results = []
    group = dist.new_group(list(range(world)))
    for all_reduce in (False, True):
        for config in DENSE:
            stats = CommStats()
            stats.sampling = True
            compressor = CompressionConfig(**config).build(rank)
            if all_reduce:
                CompressedAllReduce(compressor, stats, "unit0", group)(gaussian(rank, SHARD))
            else:
                reduce_scatter(rank, world, compressor, stats, rows=gaussian)
            results.append(stats.take())
    return results


def sparse_steps(rank: int, world: int) -> list[dict]:
    """Counters of each sparse config; top-k with error feedback is sampled on its second call."""
    results = []
    for config in SPARSE:
        stats = CommStats()
        compressor = CompressionConfig(**config).build(rank)
        if config.get("error_feedback"):  # a first step leaves a residual behind
            reduce_scatter(rank, world, compressor, stats)
            stats.take()
        stats.sampling = True
        reduce_scatter(rank, world, compressor, stats)
        results.append(stats.take())
    return results


class _Clock:
    """A fake ``time`` for the hooks' clock (compress.timing): it moves only when the compressor below says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Slow:
    """A compressor taking 10 fake seconds to compress and 1 to decompress."""

    def __init__(self, inner, clock: _Clock) -> None:
        self.inner, self.clock, self.linear = inner, clock, inner.linear

    def compress(self, tensor, key, seed):
        self.clock.now += 10
        return self.inner.compress(tensor, key, seed)

    def decompress(self, payload):
        self.clock.now += 1
        return self.inner.decompress(payload)


def timed_steps(rank: int, world: int) -> list[dict]:
    """int8 (all-to-all) and fp16 (native reduce-scatter), unsampled then sampled, 2 calls each on the fake clock."""
    clock = _Clock()  # patched in this worker process only, after the other hook calls
    compress.timing.time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    results = []
    for method in ("int8", "fp16"):
        for sampling in (False, True):
            stats = CommStats()
            stats.sampling = sampling
            start = clock.now
            reduce_scatter(rank, world, _Slow(CompressionConfig(method=method).build(rank), clock), stats, calls=2)
            results.append({**stats.take(), "clock": clock.now - start})
    return results


def every_step(rank: int, world: int) -> dict[str, list[dict]]:
    return {"dense": dense_steps(rank, world), "sparse": sparse_steps(rank, world), "timed": timed_steps(rank, world)}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict[str, list[dict]]]:
    """Each rank's counters from all the hook calls above: one pair of processes for the module's tests."""
    return run(every_step, tmp_path_factory.mktemp("hooks"))


def test_int8_and_fp16_sampled_error_is_small_on_every_path(per_rank):
    for rank, results in enumerate(per_rank):
        for counters in results["dense"]:
            sample = sampled_error(counters)
            assert 0 < sample["grad_rel_error"] < 0.01 and sample["grad_cosine"] > 0.999
            assert summarise(counters)["compress/density"] == 1.0
        # the sums are this rank's rows decoded directly: no other rank's payload is in them
        int8 = CompressionConfig(**DENSE[0]).build(rank)
        rows = gaussian(rank, 2 * SHARD).view(2, SHARD)
        error = sum((int8.decompress(int8.compress(row, "k", 0)) - row).square().sum() for row in rows)
        assert results["dense"][0]["sample_err_sq"] == pytest.approx(float(error), rel=1e-5)


def test_sparsifiers_count_kept_values_exactly_and_topk_cosine_is_well_below_one(per_rank):
    kept = round(0.01 * SHARD) / SHARD  # k per row over the row's elements
    for rank, results in enumerate(per_rank):
        topk, topk_int8, randomk, threshold = results["sparse"]
        for counters in (topk, topk_int8, randomk):
            assert summarise(counters)["compress/density"] == pytest.approx(kept) and abs(kept - 0.01) < 0.001
        expected = int((gradient(rank, 2 * SHARD).abs() >= 0.5).sum()) / (2 * SHARD)
        assert summarise(threshold)["compress/density"] == pytest.approx(expected)
        assert sampled_error(topk)["grad_cosine"] < 0.9 and sampled_error(topk_int8)["grad_cosine"] < 0.9
        # compared with the gradient as it came in, not with the gradient plus the residual error feedback adds
        assert topk["sample_ref_sq"] == pytest.approx(float(gradient(rank, 2 * SHARD).square().sum()), rel=1e-6)


def test_sampling_is_not_counted_as_codec_time_and_buffers_are_a_peak_not_a_sum(per_rank):
    for results in per_rank:
        int8_off, int8_on, fp16_off, fp16_on = results["timed"]
        for off, on, decodes in ((int8_off, int8_on, 2), (fp16_off, fp16_on, 1)):  # decodes per call, unsampled
            assert off["compress_s"] == on["compress_s"] == 2 * 2 * 10  # 2 calls x 2 rows
            assert off["decompress_s"] == on["decompress_s"] == 2 * decodes
            assert on["clock"] == off["clock"] + 2 * 2  # sampling did decode both rows of both calls
            assert off["sample_ref_sq"] == 0 < on["sample_ref_sq"]
            assert off["buffer_bytes"] == on["buffer_bytes"] > 0
        # two equal calls: one call's fp16 buffers (both rows stacked to send, one row received), not twice that
        assert fp16_off["buffer_bytes"] == 3 * SHARD * 2


def test_a_negative_sample_interval_is_refused():
    with pytest.raises(ValueError, match="sample_every_n_steps=-1"):
        CompressionStats(sample_every_n_steps=-1)


def test_topk_run_logs_density_sampled_error_and_extra_memory(tmp_path):
    # after topk.yaml, whose own callback list would otherwise win
    callbacks = tmp_path / "sampled.yaml"
    callbacks.write_text(json.dumps({"trainer": {"callbacks": [
        {"class_path": "callbacks.CompressionStats", "init_args": {"sample_every_n_steps": 2}},
        {"class_path": "callbacks.Results"},
    ]}}))
    metrics = fit(
        tmp_path, "--config", str(REPO / "configs" / "topk.yaml"), "--config", str(callbacks),
        "--trainer.accumulate_grad_batches", "2", steps=4,
    )
    assert all(0.005 < d < 0.03 for d in metrics["compress/density"]) and len(metrics["compress/density"]) == 4
    # steps 2 and 4 sampled: the reduce-scatter on the last micro-batch of each accumulation window
    assert len(metrics["compress/grad_rel_error"]) == len(metrics["compress/grad_cosine"]) == 2
    assert all(e > 0 for e in metrics["compress/grad_rel_error"])
    assert all(-1 <= c < 0.99 for c in metrics["compress/grad_cosine"])
    for extra, residual in zip(metrics["compress/extra_memory_bytes"], metrics["compress/residual_bytes"]):
        assert extra > residual > 0
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    report = json.loads((tmp_path / "compression.json").read_text())
    assert record["density"] == pytest.approx(report["compress/density"]) and 0.005 < record["density"] < 0.03
    assert record["grad_cosine"] == pytest.approx(sum(metrics["compress/grad_cosine"]) / 2)
    assert record["grad_rel_error"] == report["grad_rel_error"]
    assert record["extra_memory_bytes"] == report["extra_memory_bytes"] == max(metrics["compress/extra_memory_bytes"])
    assert math.isfinite(record["residual_norm"]) and record["residual_norm"] == report["compress/residual_norm"] > 0
