"""The communication profiler: interval arithmetic, collective naming, and a real 2-process profiled run."""

from __future__ import annotations

import json

import pytest

from callbacks.comm_profiler import CommProfiler, Event, breakdown, collective_name, intersection, union
from tests.helpers import fit

MS = 1_000_000  # nanoseconds


def test_union_and_intersection_count_overlapping_time_once():
    assert union([(5, 8), (0, 2), (1, 3), (8, 9)]) == [(0, 3), (5, 9)]
    assert intersection([(0, 3), (5, 9)], [(2, 6), (8, 20)]) == [(2, 3), (5, 6), (8, 9)]


@pytest.mark.parametrize("name, expected", [
    ("c10d::_reduce_scatter_base_", "reduce_scatter"),
    ("c10d::_allgather_base_", "all_gather"),
    ("c10d::alltoall_base_", "all_to_all"),
    ("gloo:all_reduce", "all_reduce"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWork)", "all_gather"),
    ("aten::mm", None),
])
def test_collective_names_from_c10d_gloo_and_nccl(name, expected):
    assert collective_name(name) == expected


def test_gloo_ranges_take_the_name_of_the_call_that_issued_them():
    # gloo runs FSDP's reduce-scatter as an all-reduce on its worker thread: the c10d call names it.
    events = [
        Event("ProfilerStep#3", 0, 100 * MS, 1, False),
        Event("aten::mm", 0, 40 * MS, 1, False),  # compute on the training thread
        Event("c10d::_allgather_base_", 10 * MS, 11 * MS, 1, False),
        Event("gloo:all_gather", 12 * MS, 30 * MS, 7, False),  # entirely under aten::mm
        Event("aten::copy_", 20 * MS, 25 * MS, 7, False),  # on a gloo thread: not compute
        Event("c10d::_reduce_scatter_base_", 60 * MS, 61 * MS, 1, False),
        Event("gloo:all_reduce", 62 * MS, 80 * MS, 8, False),
        Event("aten::add", 70 * MS, 90 * MS, 1, False),
    ]
    (step,) = breakdown(events)
    assert step.by_op_ms == {"all_gather": 18.0, "reduce_scatter": 18.0}
    assert step.comm_ms == 36.0 and step.step_ms == 100.0
    assert step.compute_ms == 60.0  # aten::mm and aten::add; c10d calls and gloo threads excluded
    assert step.overlap_ms == 18.0 + 10.0  # all-gather inside mm, reduce-scatter 70..80 inside add
    assert step.exposed_comm_ms == 8.0 and step.comm_share == 0.36


def test_nccl_kernels_against_other_gpu_kernels():
    events = [
        Event("ProfilerStep#0", 0, 50 * MS, 1, False),
        Event("ampere_sgemm_128x64_nn", 0, 30 * MS, 0, True),
        Event("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 20 * MS, 40 * MS, 0, True),
        Event("ncclDevKernel_AllGather_RING_LL", 45 * MS, 60 * MS, 0, True),  # runs past the step: clipped
    ]
    (step,) = breakdown(events)
    assert step.by_op_ms == {"all_gather": 5.0, "reduce_scatter": 20.0}
    assert (step.comm_ms, step.compute_ms, step.overlap_ms) == (25.0, 30.0, 10.0)


def test_bad_schedule_is_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="active=0"):
        CommProfiler(active=0)


def test_profiled_int8_run_reports_collectives_and_writes_traces(tmp_path):
    profiler = {"class_path": "callbacks.CommProfiler", "init_args": {"wait": 2, "warmup": 1, "active": 3}}
    metrics = fit(tmp_path, "--trainer.strategy.init_args.compression", "{method: int8}",
                  callbacks=[profiler, {"class_path": "callbacks.Results"}], steps=8)
    assert len(metrics["comm/share"]) == 3  # one row per active step
    assert all(0 < share < 1 for share in metrics["comm/share"])
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert record["comm_time_ms_total"] > 0 and 0 < record["comm_ratio"] < 1
    # FULL_SHARD gathers parameters; int8 sends its payloads with all-to-all instead of a reduce-scatter.
    assert record["comm_time_ms_by_op"]["all_gather"] > 0 and record["comm_time_ms_by_op"]["all_to_all"] > 0
    assert "reduce_scatter" not in record["comm_time_ms_by_op"]
    assert record["profiled_steps"] == 2 * 3  # active steps, both ranks
    assert record["comm_overlap_ms"] <= record["comm_time_ms_total"]
    traces = sorted((tmp_path / "profiler").glob("*/rank*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {event.get("name", "") for event in events}
    assert {"gloo:all_gather", "gloo:all_to_all", "c10d::alltoall_base_"} <= names
    profile = json.loads((tmp_path / "comm_profile.json").read_text())
    assert [rank["rank"] for rank in profile["per_rank"]] == [0, 1]
