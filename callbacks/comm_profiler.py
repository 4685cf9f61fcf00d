"""Where a step's time goes: torch.profiler on a schedule, traces on disk, time per collective, compute and overlap.

A profiled step is split into intervals on a timeline:

- **communication**: the collectives as they ran. On CPU/gloo these are the ``gloo:*`` ranges on gloo's
  worker threads; each is named after the ``c10d::*`` call that issued it (gloo runs a reduce-scatter
  as an all-reduce, for instance), matched in issue order. On CUDA/NCCL they are the NCCL kernels
  (``ncclDevKernel_*``, ``ncclKernel_*``), named by the kind in the kernel's name (``SendRecv`` is an
  all-to-all); NCCL 2.19+ runs many collectives in one ``ncclDevKernel_Generic_*`` kernel, which takes the
  name of the GPU-side ``nccl:<op>`` range around it on the same device (preferring its own stream).
- **compute**: on CPU, every ATen op on the training threads except the ``c10d::*`` calls (a blocking
  collective waits inside its call); on CUDA, every other GPU kernel and copy.

On CUDA, kineto copies each user annotation (``record_function`` ranges: ``ProfilerStep#N``, ``FSDP::*``,
``nccl:<op>``) onto the GPU timeline, spanning the kernels launched inside it. Those copies are labels, not
work: they count as neither compute nor communication. (On CPU, gloo's ``gloo:*`` ranges are annotations
too, and they stay communication: they are the only record of the collective running.)

Per step: time per collective (reduce_scatter, all_gather, all_reduce, all_to_all, ...), the union of
all communication (``comm_ms``), compute, their overlap, the exposed communication (not hidden behind
compute), and the communication share of the step (``comm_ms / step_ms``). Steps are the profiler's
CPU-side ``ProfilerStep#N`` windows, one per N and per optimizer step.
"""

from __future__ import annotations

import os
import re
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

from callbacks.run_folder import file_name, folder, log_metrics, run_name, write_json
from compress.torch_compat import kineto_events

# The c10d op (or gloo range) that issued a collective -> the collective's name in our reports.
_COLLECTIVES = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast", "barrier": "barrier", "gather_": "gather",
    "scatter_": "scatter", "send": "send_recv", "recv_": "send_recv", "recv_any_source_": "send_recv",
}
# NCCL kernel names, e.g. ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(...) or
# ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWork): the kind after the prefix. Kinds not listed (Generic) go lower case.
_NCCL_KERNEL = re.compile(r"(?:void )?nccl(?:Dev)?Kernel_([A-Za-z]+)")
_NCCL_KERNELS = {
    "ReduceScatter": "reduce_scatter", "AllGather": "all_gather", "AllReduce": "all_reduce",
    "SendRecv": "all_to_all", "Broadcast": "broadcast", "Reduce": "reduce",
}


def _plain(op: str) -> str:
    """``op`` without underscores and variant suffixes, so ``nccl:`` ranges meet c10d ops.

    ``_reduce_scatter_base`` and ``reduce_scatter_tensor_coalesced_`` -> ``reducescatter``.
    """
    return re.sub(r"(intotensor|tensor)?(coalesced|base)?$", "", op.replace("_", ""))


_COLLECTIVES_BY_PLAIN_NAME = {_plain(op): name for op, name in _COLLECTIVES.items()}


class Event(NamedTuple):
    """One profiler range, reduced to what the breakdown needs (times in nanoseconds).

    ``thread`` is the CPU thread, or for a GPU event its stream; ``annotation``: a ``record_function`` range
    (a label over other events, which kineto also copies onto the GPU timeline); ``device``: the GPU's index.
    """

    name: str
    start: int
    end: int
    thread: int
    on_gpu: bool
    annotation: bool = False
    device: int = 0


def collective_name(event_name: str) -> str | None:
    """``reduce_scatter``, ``all_gather``, ... for a c10d call, gloo range, ``nccl:<op>`` range or NCCL kernel; else None.

    NCCL's ``Generic`` kernels say ``generic``: only the ``nccl:<op>`` range around one names it (``name_collectives``).
    """
    if event_name.startswith(("c10d::", "gloo:")):
        op = event_name.split(":")[-1]
        return _COLLECTIVES.get(op, op)
    if event_name.startswith("nccl:"):  # nccl:_reduce_scatter_base, nccl:all_to_all, nccl:send 0->1
        op = event_name.removeprefix("nccl:").split(" ")[0]
        return _COLLECTIVES_BY_PLAIN_NAME.get(_plain(op), op)
    kernel = _NCCL_KERNEL.match(event_name)
    if kernel:
        return _NCCL_KERNELS.get(kernel[1], kernel[1].lower())
    return None


def union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping intervals covering exactly the same time."""
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: list[tuple[int, int]]) -> int:
    return sum(end - start for start, end in intervals)


def intersection(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Overlap of two unions (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass
class StepBreakdown:
    """One profiled step, in milliseconds; ``index`` is the profiler's step number (N of ``ProfilerStep#N``)."""

    index: int
    step_ms: float
    comm_ms: float
    compute_ms: float
    overlap_ms: float
    by_op_ms: dict[str, float] = field(default_factory=dict)

    @property
    def exposed_comm_ms(self) -> float:
        """Communication not hidden behind compute: what the step would save if it were free."""
        return self.comm_ms - self.overlap_ms

    @property
    def comm_share(self) -> float:
        return self.comm_ms / self.step_ms if self.step_ms > 0 else 0.0


def name_collectives(events: list[Event]) -> list[tuple[str, Event]]:
    """The communication ranges of ``events``, each with its collective's name.

    NCCL kernels (on the GPU, not annotations) carry their own name; a ``Generic`` one takes it from the
    ``nccl:<op>`` range around it (``enclosing_collective``). gloo ranges are named after the ``c10d::*`` call
    that issued them: calls and ranges are matched first-issued, first-run (each gloo range takes the earliest
    unmatched call that started before it), falling back to the gloo range's own name.
    """
    issued = sorted((e for e in events if e.name.startswith("c10d::")), key=lambda e: e.start)
    nccl_ranges = [e for e in events if e.on_gpu and e.annotation and e.name.startswith("nccl:")]
    named, next_call = [], 0
    for event in sorted(events, key=lambda e: e.start):
        if event.name.startswith("gloo:"):
            if next_call < len(issued) and issued[next_call].start <= event.start:
                named.append((collective_name(issued[next_call].name), event))
                next_call += 1
            else:
                named.append((collective_name(event.name), event))
        elif event.on_gpu and not event.annotation and _NCCL_KERNEL.match(event.name):
            name = collective_name(event.name)
            if name == "generic":
                name = enclosing_collective(event, nccl_ranges) or name
            named.append((name, event))
    return named


def enclosing_collective(kernel: Event, nccl_ranges: list[Event]) -> str | None:
    """The collective of the GPU-side ``nccl:<op>`` range holding ``kernel`` on its device, or None if none does.

    kineto draws one such range per device and stream; when ranges on several streams hold the kernel (FSDP2
    gathers and reduce-scatters on separate streams at once), the one on the kernel's stream wins, then the
    innermost.
    """
    around = [r for r in nccl_ranges if r.device == kernel.device and r.start <= kernel.start and kernel.end <= r.end]
    if not around:
        return None
    return collective_name(min(around, key=lambda r: (r.thread != kernel.thread, r.end - r.start)).name)


def step_windows(events: list[Event]) -> list[tuple[int, Event]]:
    """``(N, range)`` for each CPU-side ``ProfilerStep#N``, in step order; the GPU timeline's copies are left out."""
    steps: dict[int, Event] = {}
    for event in sorted(events, key=lambda e: e.start):
        if not event.on_gpu and event.name.startswith("ProfilerStep#"):
            steps.setdefault(int(event.name.removeprefix("ProfilerStep#")), event)
    return sorted(steps.items())


def breakdown(events: list[Event]) -> list[StepBreakdown]:
    """Per ``ProfilerStep#N`` window: communication per collective, compute, overlap (see the module docstring)."""
    collectives = name_collectives(events)
    gloo_threads = {e.thread for e in events if e.name.startswith("gloo:")}
    on_gpu = any(e.on_gpu for e in events)
    comm_events = {id(e) for _, e in collectives}
    if on_gpu:
        compute = [e for e in events if e.on_gpu and not e.annotation and id(e) not in comm_events]
    else:
        compute = [
            e for e in events
            if not e.on_gpu and e.thread not in gloo_threads and e.name.startswith("aten::")
        ]
    compute_union = union((e.start, e.end) for e in compute)
    comm_union = union((e.start, e.end) for _, e in collectives)
    spans: dict[str, list[tuple[int, int]]] = {}
    for name, event in collectives:
        spans.setdefault(name, []).append((event.start, event.end))
    by_op_union = {name: union(intervals) for name, intervals in sorted(spans.items())}
    results = []
    for index, step in step_windows(events):
        window = [(step.start, step.end)]
        comm = intersection(comm_union, window)
        work = intersection(compute_union, window)
        results.append(StepBreakdown(
            index=index,
            step_ms=(step.end - step.start) / 1e6,
            comm_ms=length(comm) / 1e6,
            compute_ms=length(work) / 1e6,
            overlap_ms=length(intersection(comm, work)) / 1e6,
            by_op_ms={name: length(intersection(op_union, window)) / 1e6 for name, op_union in by_op_union.items()},
        ))
    return results


def profiler_events(prof: torch.profiler.profile) -> list[Event]:
    """The finished cycle's events from kineto (no trace file parsing); a GPU event's ``thread`` is its stream."""
    out = []
    for e in kineto_events(prof):
        on_gpu = e["device_type"] != "CPU"
        out.append(Event(e["name"], e["start_ns"], e["end_ns"], e["resource_id"] if on_gpu else e["thread_id"], on_gpu,
                         e["is_user_annotation"], e["device_index"]))
    return out


def mean_breakdown(steps: list[StepBreakdown]) -> dict[str, Any]:
    """Means over profiled steps, named as in the results record."""
    if not steps:
        return {}
    ops = sorted({op for s in steps for op in s.by_op_ms})
    mean = lambda values: statistics.fmean(values)  # noqa: E731
    return {
        "comm_time_ms_total": mean(s.comm_ms for s in steps),
        "comm_ratio": mean(s.comm_share for s in steps),
        "comm_time_ms_by_op": {op: mean(s.by_op_ms.get(op, 0.0) for s in steps) for op in ops},
        "compute_time_ms": mean(s.compute_ms for s in steps),
        "comm_overlap_ms": mean(s.overlap_ms for s in steps),
        "comm_exposed_ms": mean(s.exposed_comm_ms for s in steps),
        "profiled_step_ms": mean(s.step_ms for s in steps),
        "profiled_steps": len(steps),
    }


class CommProfiler(pl.Callback):
    """Profiles optimizer steps on a schedule and reports time per collective, compute, overlap and comm share.

    Traces go to ``<run folder>/profiler/<run name>/rank<R>.<time>.pt.trace.json``: open them with
    ``tensorboard --logdir <run folder>/profiler`` (profiler plugin) or at https://ui.perfetto.dev.
    Per profiled step it logs ``comm/*``; the run's means over profiled steps and ranks go to the
    results record (``comm_time_ms_total``, ``comm_ratio``, ``comm_time_ms_by_op``, ...) and to
    ``comm_profile.json``.
    """

    def __init__(self, wait: int = 5, warmup: int = 2, active: int = 3, repeat: int = 1, record_shapes: bool = False,
                 with_stack: bool = False, profile_memory: bool = False):
        """
        Args:
            wait: Optimizer steps skipped before each profiling cycle (warm-up of caches and allocator).
            warmup: Steps profiled but discarded at the start of each cycle (the profiler's own start-up cost).
            active: Steps recorded per cycle.
            repeat: Cycles (0: until training ends).
            record_shapes: Record operator input shapes in the trace.
            with_stack: Record Python stacks in the trace (large traces).
            profile_memory: Record tensor allocations in the trace.
        """
        for name, value, low in (("wait", wait, 0), ("warmup", warmup, 0), ("active", active, 1), ("repeat", repeat, 0)):
            if value < low:
                raise ValueError(f"CommProfiler {name}={value} must be >= {low}")
        self.wait, self.warmup, self.active, self.repeat = wait, warmup, active, repeat
        self.options = dict(record_shapes=record_shapes, with_stack=with_stack, profile_memory=profile_memory)
        self.steps: list[StepBreakdown] = []
        self._profiler: torch.profiler.profile | None = None
        self._trainer: pl.Trainer | None = None
        self._traces = None
        self.per_rank: list[list[StepBreakdown]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank writes its trace into the same folder: rank 0's run name decides it.
        name = trainer.strategy.broadcast(run_name(trainer))
        trace_dir = folder(trainer) / "profiler" / file_name(name)
        self._traces = tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{trainer.global_rank}")
        self._trainer = trainer
        self._first_step = trainer.global_step  # ProfilerStep#0 is the first step of this fit (resumed or not)
        self._steps_done = 0
        # torch's profiler library (kineto) prints "USDT: ... profiler_start" and "profiler_stop" on stderr at every
        # profiled cycle; its least verbose level that still shows them also shows its errors, so this is 6, silent
        # (read at the first profile; KINETO_LOG_LEVEL=4 set by the user shows errors, and those lines, again).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU]
        if pl_module.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat),
            on_trace_ready=self._trace_ready,
            **self.options,
        )
        self._profiler.start()
        rank_zero_info(f"CommProfiler: traces to {trace_dir} (tensorboard --logdir {trace_dir.parent})")

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        # ProfilerStep#k ends at the (k+1)-th step() call; one still open when training ended is not a step.
        steps = [step for step in breakdown(profiler_events(prof)) if step.index < self._steps_done]
        self.steps.extend(steps)
        for step in steps:
            metrics = {
                "comm/step_ms": step.step_ms, "comm/comm_ms": step.comm_ms, "comm/compute_ms": step.compute_ms,
                "comm/overlap_ms": step.overlap_ms, "comm/exposed_ms": step.exposed_comm_ms, "comm/share": step.comm_share,
            }
            metrics.update({f"comm/{op}_ms": ms for op, ms in step.by_op_ms.items()})
            # Logged when the cycle ends, at the optimizer step each profiled step completed.
            log_metrics(self._trainer, metrics, step=self._first_step + step.index + 1)
        self._traces(prof)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._profiler is not None and not trainer.fit_loop._should_accumulate():
            self._steps_done += 1
            self._profiler.step()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    def _finish(self) -> None:
        """Stops profiling and gathers every rank's steps, once: at train end or at the first ``summary()``.

        ``Results`` may ask for the summary before this callback's own ``on_train_end`` runs; both paths
        run on every rank, so the gather lines up.
        """
        if self._trainer is None:
            return
        if self._profiler is not None:
            self._profiler.stop()  # the completed steps of a cycle cut short by the end of training are analysed
            self._profiler = None
        trainer, self._trainer = self._trainer, None
        mine = [asdict(s) for s in self.steps]
        per_rank = [mine]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            per_rank = [None] * trainer.world_size
            dist.all_gather_object(per_rank, mine)
        self.per_rank = [[StepBreakdown(**s) for s in steps] for steps in per_rank]
        write_json(trainer, "comm_profile.json", {
            "schedule": {"wait": self.wait, "warmup": self.warmup, "active": self.active, "repeat": self.repeat},
            "mean_over_ranks": mean_breakdown([step for steps in self.per_rank for step in steps]),
            "per_rank": [{"rank": r, "mean": mean_breakdown(breakdowns), "steps": steps}
                         for r, (breakdowns, steps) in enumerate(zip(self.per_rank, per_rank))],
        })

    def summary(self) -> dict[str, Any]:
        """Means over profiled steps and over ranks (each rank's steps weigh the same); empty if nothing was profiled."""
        self._finish()
        return mean_breakdown([step for steps in self.per_rank for step in steps])
