"""Host synchronisations: the ``SyncCounter`` helper, and the budget of every compression hook.

A CUDA step overlaps communication with compute only while the host runs ahead of the device; every
``.item()``, ``.tolist()``, data-dependent shape or device wait in a hook stalls it. On 2 gloo processes,
FULL_SHARD (the reduce-scatter hook) and NO_SHARD (the replicate all-reduce hook) install each method's
hooks as a run does, train 2 steps, then count the syncs inside every hook call of one forward and
backward, and inside the non-finite guard of that step.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

import compress.timing
from callbacks.compression import CompressionStats
from compress.communicator import PayloadMover
from compress.config import METHODS, CompressionConfig
from compress.hook import GradientCompression
from lit_fsdp.reporting import StrategyReport
from tests.distributed import run
from tests.fake_cuda import FakeGpu
from tests.helpers import batch, loss_of, optimizer_for, sharded_model
from tests.sync_counter import SyncCounter, SyncPoint, summary

#: Host synchronisations allowed per hook call (a gradient reduce-scatter, replicate all-reduce or parameter
#: all-gather: one of each per FSDP unit per step, two all-gathers for units resharded after forward). A method
#: whose payload size follows from the gradient's numel needs none: the quantisers, fixed-k top-k (also with
#: error feedback or DGC), random-k, the sketch (a fixed table, k candidates), low rank and PowerSGD (rank-r factors).
BUDGETS: dict[str, int] = {
    **{name: 0 for name in METHODS if name != "none"},
    # threshold-v keeps the coordinates above a threshold: how many is known only from the data, and the
    # receiver must size its buffers, so one read of the exchanged kept counts per call is the least it needs.
    "thresholdv": 1,
    "thresholdv+int8": 1,  # the same kept counts; the int8 values of a known count add no read
    "thresholdv+density": 1,  # the same; its thresholds follow the scale on the device, corrected from the counts read
    "topk+int8": 0,
    "zero_one_adam+sync": 0,
    "topk+ef": 0,
    "topk+dgc": 0,
    "param_all_gather=int8": 0,
}
#: The non-finite guard (``NonFiniteGuard.clip_and_guard``): one read per optimizer step, of the flags (loss,
#: gradient norm, the hooks' non-finite count) after one all-reduce, so that every rank takes the same decision.
GUARD_BUDGET = 1
#: The compression callback's per-step read (``CompressionStats.on_train_batch_end``): ``CommStats.take`` waits for the
#: device once (the hooks' timing events) and reads it once (the counters); a sampled step also reads the residuals' norm.
STEP_READ_BUDGET = {"unsampled": 2, "sampled": 3}
SHARDINGS = {"FULL_SHARD": (2,), "NO_SHARD": (2, 1)}
WARMUP_STEPS = 2


def _cuda_synchronize(t: torch.Tensor) -> None:
    with contextlib.suppress(Exception):  # counted before it runs; a CPU-only torch then refuses it
        torch.cuda.synchronize()


def _copy_from_another_device(t: torch.Tensor) -> None:
    source = torch.empty_like(t, device="meta")  # the one non-CPU device a CPU-only torch has
    with contextlib.suppress(NotImplementedError):  # counted before it runs; a meta tensor has no data to copy
        t.copy_(source)


ONE_SYNC = {
    "int(t.sum())": lambda t: int(t.sum()),
    "float(t.sum())": lambda t: float(t.sum()),
    "t[0].item()": lambda t: t[0].item(),
    "bool(t[0] > 0)": lambda t: bool(t[0] > 0),
    "t.tolist()": lambda t: t.tolist(),
    "t.cpu()": lambda t: t.cpu(),
    "t.numpy()": lambda t: t.numpy(),
    't.to("cpu")': lambda t: t.to("cpu"),
    't.to(device="cpu", dtype=float16)': lambda t: t.to(device="cpu", dtype=torch.float16),
    "cpu_buffer.copy_(t on another device)": _copy_from_another_device,
    "torch.equal(t, t)": lambda t: torch.equal(t, t),
    "t[t > 0]": lambda t: t[t > 0],
    "t[0] = 5 (copied from the host)": lambda t: t.__setitem__(0, 5.0),
    "t[positions] = 5 (copied from the host)": lambda t: t.__setitem__(t.topk(2).indices, 5.0),
    "t.masked_select(t > 0)": lambda t: t.masked_select(t > 0),
    "t.nonzero()": lambda t: t.nonzero(),
    "t.unique()": lambda t: t.unique(),
    "torch.repeat_interleave(repeats)": lambda t: torch.repeat_interleave(t.new_ones(3, dtype=torch.long)),
    "torch.tensor([1, 2])": lambda t: torch.tensor([1, 2]),
    "wait_for_device": lambda t: compress.timing.wait_for_device(t.device),
    "torch.cuda.synchronize": _cuda_synchronize,
}
NO_SYNC = {
    "t + 1": lambda t: t + 1,
    "t.topk(2)": lambda t: t.topk(2),
    "t[t.topk(2).indices]": lambda t: t[t.topk(2).indices],
    "torch.where(t > 0, t, 0)": lambda t: torch.where(t > 0, t, 0.0),
    "t.new_zeros(3)": lambda t: t.new_zeros(3),
    "t[:2] = 5 (a fill)": lambda t: t.__setitem__(slice(0, 2), 5.0),
    "t[t > 0] = 5 (a masked fill)": lambda t: t.__setitem__(t > 0, 5.0),
    "t[t > 0] = zero (a masked fill)": lambda t: t.__setitem__(t > 0, t.new_zeros(())),
    "t.sum()": lambda t: t.sum(),
    "t.to(float16)": lambda t: t.to(torch.float16),
    "t.to(t.device) (stays on the device)": lambda t: t.to(t.device),
    "t.new_zeros(8).copy_(t) (on one device)": lambda t: t.new_zeros(8).copy_(t),
    "repeat_interleave(repeats, output_size=3)":
        lambda t: torch.repeat_interleave(t.new_ones(3, dtype=torch.long), output_size=3),
}


@pytest.mark.parametrize("name", ONE_SYNC)
def test_each_host_synchronisation_counts_once(name):
    t = torch.randn(8)
    with SyncCounter() as counter:
        ONE_SYNC[name](t)
    assert len(counter) == 1, f"{name}: {counter.summary()}"


@pytest.mark.parametrize("name", NO_SYNC)
def test_work_the_device_can_queue_counts_nothing(name):
    t = torch.randn(8)
    with SyncCounter() as counter:
        NO_SYNC[name](t)
    assert len(counter) == 0, f"{name}: {counter.summary()}"


def test_the_counter_counts_nested_blocks_once_and_restores_what_it_patched():
    t = torch.randn(8)
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy", "to")}
    wait, synchronize = compress.timing.wait_for_device, torch.cuda.synchronize
    counter = SyncCounter()
    with counter:
        with counter:
            t.tolist()
        int(t.sum())
    t.tolist()  # outside: not counted
    assert [point.op for point in counter.points] == ["Tensor.tolist", "aten._local_scalar_dense"]
    assert all(point.where.startswith("tests/test_sync_budget.py:") for point in counter.points), counter.summary()
    assert {name: getattr(torch.Tensor, name) for name in methods} == methods
    assert "tolist" not in vars(torch.Tensor)  # inherited again from TensorBase, not a copy left behind
    assert (compress.timing.wait_for_device, torch.cuda.synchronize) == (wait, synchronize)


def budget_cases(sharding: str) -> dict[str, CompressionConfig]:
    """Every method, the composites, top-k with error feedback and DGC; with shards, the int8 parameter all-gather."""
    found = {name: CompressionConfig(method=name) for name in METHODS if name != "none"}
    found["powersgd"] = CompressionConfig(method="powersgd", start_step=1)  # compressing by the step counted
    found["onebit_adam"] = CompressionConfig(method="onebit_adam", freeze_step=1)  # the same
    # 0/1 Adam: an exact round, then (FULL_SHARD) a sync and, at the measured step, a local round; with replicas,
    # where local rounds are refused, 1-bit rounds. "+sync": every measured round a sync.
    local = 2 if sharding == "FULL_SHARD" else 1
    found["zero_one_adam"] = CompressionConfig(method="zero_one_adam", var_freeze_step=1, var_update_scaler=1,
                                               local_step_scaler=1, local_step_clipper=local)
    found["zero_one_adam+sync"] = CompressionConfig(method="zero_one_adam", var_freeze_step=1, var_update_scaler=1,
                                                    local_step_scaler=100, local_step_clipper=local)
    found["topk+int8"] = CompressionConfig(method="topk", quantize="int8")
    found["thresholdv+int8"] = CompressionConfig(method="thresholdv", quantize="int8")
    found["thresholdv+density"] = CompressionConfig(method="thresholdv", density=0.01, error_feedback=True)
    found["topk+ef"] = CompressionConfig(method="topk", error_feedback=True)
    found["topk+dgc"] = CompressionConfig(method="topk", error_feedback=True, momentum=0.9)
    if sharding == "FULL_SHARD":
        found["param_all_gather=int8"] = CompressionConfig(param_all_gather="int8")
    assert set(found) <= set(BUDGETS), f"no budget for {sorted(set(found) - set(BUDGETS))}"
    return found


_SETTERS = {"set_custom_reduce_scatter": "reduce-scatter", "set_all_reduce_hook": "all-reduce",
            "set_custom_all_gather": "all-gather"}


@contextlib.contextmanager
def counting_hooks(counter: SyncCounter, calls: list, measuring: threading.Event):
    """Hooks installed on FSDP modules inside this block count, while ``measuring`` is set, the syncs of each call
    into ``calls`` as ``(module, kind, points, thread id)``. The counter is entered inside the call, so on the
    thread that runs the hook."""
    originals = {name: getattr(FSDPModule, name) for name in _SETTERS}

    def counted(hook, module, kind):
        base = type(hook)

        def __call__(self, *args, **kwargs):
            if not measuring.is_set():
                return base.__call__(self, *args, **kwargs)
            start = len(counter)
            with counter:
                result = base.__call__(self, *args, **kwargs)
            calls.append((module, kind, counter.points[start:], threading.get_ident()))
            return result

        # the same object, still an instance of its class, with a counting __call__ (looked up on the type)
        hook.__class__ = type(f"Counted{base.__name__}", (base,), {"__call__": __call__})
        return hook

    def installer(name):
        def install(module, hook, *args, **kwargs):
            return originals[name](module, counted(hook, module, _SETTERS[name]), *args, **kwargs)
        return install

    try:
        for name in _SETTERS:
            setattr(FSDPModule, name, installer(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(FSDPModule, name, original)


def count_syncs(rank: int, world: int) -> dict:
    """Per sharding and case: the sync points of each hook call of one step, and of the guard of that step."""
    results: dict = {"main_thread": threading.get_ident()}
    for sharding, shape in SHARDINGS.items():
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for case, compression in budget_cases(sharding).items():
            counter, calls, measuring = SyncCounter(), [], threading.Event()
            with counting_hooks(counter, calls, measuring):
                module, strategy = sharded_model(rank, world, mesh, sharding, compression)
            optimizer = optimizer_for(module, strategy)
            data = torch.Generator().manual_seed(1000 + rank)
            for step in range(WARMUP_STEPS + 1):
                if step == WARMUP_STEPS:
                    measuring.set()
                loss = loss_of(module, *batch(data, module.model.config.vocab_size))
                loss.backward()
                measuring.clear()
                # what NonFiniteGuard.training_step keeps of the loss, on the device, for the guard to read
                strategy._loss_finite = torch.isfinite(loss.detach()).all()
                with SyncCounter() as guard:
                    strategy.clip_and_guard(optimizer, 1.0)
                optimizer.step()
                optimizer.zero_grad()
            units = {id(m): f"unit{i}" for i, m in enumerate(strategy.fsdp_modules)}
            results[(sharding, case)] = {
                "calls": [(units[id(m)], kind, points, thread) for m, kind, points, thread in calls],
                "units": len(units),
                "guard": guard.points,
            }
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    return run(count_syncs, tmp_path_factory.mktemp("syncs"), world=2)


def describe(result: dict) -> str:
    """``10 syncs per unit per step ({'unit0': 10, ...}; 3 hook calls, at most 10 in one): 6 x Tensor.tolist at ...``"""
    calls = result["calls"]
    points: list[SyncPoint] = [p for _, _, call_points, _ in calls for p in call_points]
    per_unit = Counter(unit for unit, _, call_points, _ in calls for _ in call_points)
    worst = max((len(call_points) for _, _, call_points, _ in calls), default=0)
    return (f"{len(points) / result['units']:g} syncs per unit per step ({dict(per_unit)}; {len(calls)} hook calls, "
            f"at most {worst} in one): {summary(points)}")


CASES = [(sharding, case) for sharding in SHARDINGS for case in budget_cases(sharding)]


def test_hooks_run_on_the_thread_that_calls_backward_so_the_counter_sees_them(measured):
    for rank, result in enumerate(measured):
        threads = {thread for key, value in result.items() if isinstance(key, tuple) for *_, thread in value["calls"]}
        assert threads == {result["main_thread"]}, f"rank {rank}: hooks ran on threads {threads}"
        hooked = [key for key, value in result.items() if isinstance(key, tuple) and value["calls"]]
        assert len(hooked) == len(CASES), f"rank {rank}: no hook call counted for {set(CASES) - set(hooked)}"


@pytest.mark.parametrize("sharding, case", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_compression_hooks_stay_within_their_sync_budget(measured, sharding, case):
    budget = BUDGETS[case]
    for rank, result in enumerate(measured):
        over = [c for c in result[(sharding, case)]["calls"] if len(c[2]) > budget]
        assert not over, (f"{case} ({sharding}), rank {rank}: {len(over)} hook calls over the budget of {budget} per "
                          f"call: {describe(result[(sharding, case)])}")


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_the_nonfinite_guard_syncs_once_per_optimizer_step(measured, sharding):
    over: dict[str, list[str]] = {}  # what was counted: the cases (and ranks) where it was
    for case in budget_cases(sharding):
        for rank, result in enumerate(measured):
            points = result[(sharding, case)]["guard"]
            if len(points) > GUARD_BUDGET:
                over.setdefault(f"{len(points)} syncs: {summary(points)}", []).append(f"{case} (rank {rank})")
    assert not over, f"NonFiniteGuard.clip_and_guard, {sharding}: over {GUARD_BUDGET} per optimizer step:\n" + "\n".join(
        f"{found}, in {', '.join(where)}" for found, where in over.items())


class CompressingStrategy(StrategyReport):
    """A strategy as the callbacks see it (``lit_fsdp.reporting``), with a compression hook and nothing else."""

    label = "fsdp2"

    def __init__(self, hook: GradientCompression):
        self.hook = hook

    def compute_dtype(self) -> torch.dtype:
        return torch.float32

    def compression_hook(self) -> GradientCompression:
        return self.hook


@pytest.mark.parametrize("step", STEP_READ_BUDGET)
def test_the_compression_callbacks_step_read_stays_within_its_budget(monkeypatch, step):
    gpu = FakeGpu(monkeypatch)
    hook = GradientCompression(CompressionConfig(method="topk", error_feedback=True))
    hook.compressor = hook.config.build(rank=0)
    mover = PayloadMover(hook.compressor, hook.stats, "unit0", hook.restored)
    hook.stats.sampling = step == "sampled"
    # one hook call's device work: counters on the device, a collective timed by CUDA events
    row = mover.screen(torch.randn(64))
    mover.sample([mover.compress(row, "unit0/0", mover.next_seed())], [row], ["unit0/0"])
    with mover.timed("extra_collective_s", torch.device("cuda", 0)):
        gpu.run(1)
    trainer = types.SimpleNamespace(strategy=CompressingStrategy(hook), global_step=1, loggers=[],
                                    fit_loop=types.SimpleNamespace(_should_accumulate=lambda: False))
    callback = CompressionStats(sample_every_n_steps=1)
    with SyncCounter() as counter:
        callback.on_train_batch_end(trainer, None, None, None, 0)
    assert len(counter) <= STEP_READ_BUDGET[step], counter.summary()
    assert gpu.waits == 1 and callback.totals["extra_collective_s"] == pytest.approx(0.001)
    assert bool(callback.samples) == (step == "sampled")
