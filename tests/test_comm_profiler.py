"""The communication profiler: interval arithmetic, collective naming, and a real 2-process profiled run."""

from __future__ import annotations

import json

import pytest

from callbacks.comm_profiler import (CommProfiler, Event, breakdown, collective_name, intersection, name_collectives,
                                     union)
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


# NCCL kernels as CUPTI names them (NCCL 2.19+)
ALL_GATHER = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
REDUCE_SCATTER = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SEND_RECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"
GENERIC = "ncclDevKernel_Generic_1(ncclDevKernelArgsStorage<4096ul>)"


@pytest.mark.parametrize("name, expected", [
    ("nccl:_all_gather_base", "all_gather"),
    ("nccl:all_gather_into_tensor_coalesced", "all_gather"),
    ("nccl:_reduce_scatter_base", "reduce_scatter"),
    ("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter"),
    ("nccl:all_reduce", "all_reduce"),
    ("nccl:all_to_all", "all_to_all"),
    ("nccl:alltoall_base", "all_to_all"),
    (SEND_RECV, "all_to_all"),
])
def test_nccl_ranges_and_kernels_are_named_after_their_collective(name, expected):
    assert collective_name(name) == expected


@pytest.mark.parametrize("kernel, nccl_range, expected", [
    (ALL_GATHER, "nccl:_all_gather_base", "all_gather"),
    (ALL_GATHER, "nccl:all_gather_into_tensor_coalesced", "all_gather"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWork)", "nccl:_all_gather_base", "all_gather"),
    (REDUCE_SCATTER, "nccl:_reduce_scatter_base", "reduce_scatter"),
    (REDUCE_SCATTER, "nccl:reduce_scatter_tensor_coalesced", "reduce_scatter"),
    (SEND_RECV, "nccl:all_to_all", "all_to_all"),
    (SEND_RECV, "nccl:alltoall_base", "all_to_all"),
    (GENERIC, "nccl:all_reduce", "all_reduce"),
    (GENERIC, "nccl:_reduce_scatter_base", "reduce_scatter"),
])
def test_nccl_kernel_is_the_communication_and_its_gpu_range_only_a_label(kernel, nccl_range, expected):
    # kineto copies the nccl:<op> range onto the GPU timeline around the kernel; only the kernel is communication.
    events = [Event(nccl_range, 10 * MS, 20 * MS, 7, True, annotation=True), Event(kernel, 10 * MS, 20 * MS, 7, True)]
    assert [(name, event.name) for name, event in name_collectives(events)] == [(expected, kernel)]


def test_generic_kernel_is_named_by_the_nccl_range_on_its_device_and_stream():
    events = [
        Event(GENERIC, 10 * MS, 20 * MS, 9, True, device=0),
        Event("nccl:all_reduce", 5 * MS, 25 * MS, 9, True, annotation=True, device=0),  # its stream
        Event("nccl:_all_gather_base", 9 * MS, 21 * MS, 7, True, annotation=True, device=0),  # tighter, other stream
        Event("nccl:all_to_all", 10 * MS, 20 * MS, 9, True, annotation=True, device=1),  # tightest, other GPU
        Event(GENERIC, 40 * MS, 50 * MS, 9, True, device=0),  # no range around it
    ]
    assert [name for name, _ in name_collectives(events)] == ["all_reduce", "generic"]


def fsdp2_cuda_step(index: int, t0: int) -> list[Event]:
    """One FSDP2 step as kineto reports it on CUDA + NCCL: CPU ops, annotations and their GPU copies, kernels."""
    t = lambda start, end: (t0 + start * MS, t0 + end * MS)  # noqa: E731
    cpu, compute_stream, gather_stream, reduce_stream = 1, 3, 7, 9
    collectives = [  # GPU-side nccl:<op> range, its kernel, stream, ms
        ("nccl:_all_gather_base", ALL_GATHER, gather_stream, (2, 12)),
        ("nccl:all_gather_into_tensor_coalesced", ALL_GATHER, gather_stream, (30, 45)),
        ("nccl:_reduce_scatter_base", REDUCE_SCATTER, reduce_stream, (60, 80)),
        ("nccl:all_reduce", GENERIC, reduce_stream, (82, 88)),
        ("nccl:all_to_all", SEND_RECV, reduce_stream, (90, 95)),
    ]
    events = [
        Event(f"ProfilerStep#{index}", *t(0, 100), cpu, False, annotation=True),
        Event(f"ProfilerStep#{index}", *t(2, 95), compute_stream, True, annotation=True),
        Event("FSDP::pre_forward", *t(1, 4), cpu, False, annotation=True),
        Event("FSDP::all_gather", *t(2, 12), gather_stream, True, annotation=True),
        Event("FSDP::post_backward_reduce", *t(60, 80), reduce_stream, True, annotation=True),
        Event("aten::mm", *t(5, 8), cpu, False),
        Event("cudaLaunchKernel", *t(6, 7), cpu, False),
        Event("aten::add", *t(45, 48), cpu, False),
        Event("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", *t(10, 40), compute_stream, True),
        Event("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", *t(50, 70),
              compute_stream, True),
    ]
    for nccl_range, kernel, stream, (start, end) in collectives:
        events += [Event(nccl_range, *t(start - 1, start), cpu, False, annotation=True),  # the CPU-side call
                   Event(nccl_range, *t(start, end), stream, True, annotation=True),
                   Event(kernel, *t(start, end), stream, True)]
    return events


def test_cuda_trace_counts_kernels_not_annotations_and_each_step_once():
    steps = breakdown(fsdp2_cuda_step(4, 0) + fsdp2_cuda_step(5, 100 * MS))
    assert [s.index for s in steps] == [4, 5]  # the GPU copies of ProfilerStep#N are not steps
    for step in steps:
        assert step.by_op_ms == {"all_gather": 25.0, "all_reduce": 6.0, "all_to_all": 5.0, "reduce_scatter": 20.0}
        assert (step.step_ms, step.comm_ms, step.compute_ms) == (100.0, 56.0, 30.0 + 20.0)  # gemm + elementwise
        # gathers 10..12 and 30..40 under the gemm, the reduce-scatter 60..70 under the elementwise kernel
        assert step.overlap_ms == 2.0 + 10.0 + 10.0
        assert step.exposed_comm_ms == 34.0 and step.comm_share == 0.56


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
