"""``offload.cpu_binding``: planning on a fake sysfs tree, and binding threads for real in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from pathlib import Path

import pytest

from offload import cpu_binding
from offload.cpu_binding import (
    CpuBinding,
    format_cpu_list,
    numa_node_of,
    parse_cpu_list,
    physical_cores,
    plan_binding,
)

GPUS = [f"0000:{bus:02x}:00.0" for bus in (0x1B, 0x3D, 0x9C, 0xBC)]
NODE0, NODE1 = "0-15,64-79", "16-31,80-95"  # 16 physical cores each, sibling = cpu + 64


def fake_sysfs(
    root: Path,
    gpu_nodes: dict[str, str],
    nodes: dict[int, str],
    siblings_offset: int | None = 64,
) -> Path:
    """A sysfs tree: each GPU's ``numa_node`` text, each node's cpulist, and (with an offset) cpu/cpu+offset pairs."""
    def write(relative: str, text: str) -> None:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    for pci, node in gpu_nodes.items():
        write(f"bus/pci/devices/{pci}/numa_node", node)
    for node, cpulist in nodes.items():
        write(f"devices/system/node/node{node}/cpulist", cpulist)
        if siblings_offset is None:
            continue
        for cpu in parse_cpu_list(cpulist):
            low = cpu if cpu < siblings_offset else cpu - siblings_offset
            write(f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", f"{low},{low + siblings_offset}")
    return root


@pytest.fixture
def two_nodes(tmp_path: Path) -> Path:
    """Two nodes of 16 hyperthreaded cores, GPUs 0-1 on node 0 and 2-3 on node 1."""
    return fake_sysfs(tmp_path, dict(zip(GPUS, ["0", "0", "1", "1"])), {0: NODE0, 1: NODE1})


def plan_all(sysfs: Path, gpus: list[str | None], allowed: set[int], **kw: int) -> list[CpuBinding]:
    """Every local rank's binding."""
    return [plan_binding(rank, gpus, allowed, sysfs=sysfs, **kw) for rank in range(len(gpus))]


def assert_disjoint(plans: list[CpuBinding]) -> None:
    seen: set[int] = set()
    for plan in plans:
        assert not seen & plan.cpus
        seen |= plan.cpus


def test_each_rank_gets_its_own_half_of_its_gpus_node_with_siblings(two_nodes: Path) -> None:
    everything = parse_cpu_list(NODE0) | parse_cpu_list(NODE1)
    plans = plan_all(two_nodes, GPUS, everything)
    assert_disjoint(plans)
    assert [p.node for p in plans] == [0, 0, 1, 1]
    for plan in plans:
        assert plan.cpus <= parse_cpu_list(NODE0 if plan.node == 0 else NODE1)
        assert (plan.cores, plan.threads, len(plan.cpus)) == (8, 7, 16)
        assert all(cpu + 64 in plan.cpus for cpu in plan.cpus if cpu < 64)  # siblings come with their core
    assert plans[2].cpus | plans[3].cpus == parse_cpu_list(NODE1)
    assert plans[2].describe() == "NUMA node 1, CPUs 16-23,80-87 (8 cores), 7 update threads"


def test_an_uneven_split_gives_the_first_ranks_one_extra_contiguous_core(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path, dict.fromkeys(GPUS[:3], "0"), {0: "0-9"}, siblings_offset=None)
    plans = plan_all(sysfs, GPUS[:3], set(range(10)))
    assert [sorted(p.cpus) for p in plans] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [p.threads for p in plans] == [3, 2, 2]


def test_a_node_outside_the_allowed_cpus_falls_back_to_splitting_the_allowed_ones(two_nodes: Path) -> None:
    allowed = parse_cpu_list(NODE0)  # e.g. a container pinned to node 0
    plans = plan_all(two_nodes, GPUS, allowed)
    assert_disjoint(plans)
    assert all(p.node is None and p.cores == 4 for p in plans)
    assert frozenset().union(*(p.cpus for p in plans)) == allowed


def test_a_partly_allowed_node_uses_only_its_allowed_cpus(two_nodes: Path) -> None:
    allowed = parse_cpu_list("0-15,64-79,16-23,80-87")  # half of node 1
    plans = plan_all(two_nodes, GPUS, allowed)
    assert [p.node for p in plans] == [0, 0, 1, 1]
    assert plans[2].cpus | plans[3].cpus == parse_cpu_list("16-23,80-87")
    assert plans[3].cores == 4


@pytest.mark.parametrize("unknown", ["-1", None], ids=["minus-one", "missing"])
def test_an_unknown_gpu_node_falls_back_to_all_allowed_cpus(tmp_path: Path, unknown: str | None) -> None:
    gpu_nodes = dict(zip(GPUS, ["0", "0", "1"]))
    if unknown is not None:
        gpu_nodes[GPUS[3]] = unknown
    sysfs = fake_sysfs(tmp_path, gpu_nodes, {0: NODE0, 1: NODE1})
    assert numa_node_of(GPUS[3], sysfs) is None
    allowed = parse_cpu_list(NODE0) | parse_cpu_list(NODE1)
    plans = plan_all(sysfs, GPUS, allowed)
    assert all(p.node is None and p.cores == 8 for p in plans)
    assert plans[1].cpus == parse_cpu_list("8-15,72-79")  # the second quarter of all cores, not of node 0
    assert plans[0].describe().startswith("no NUMA node known, ")


def test_a_gpu_without_an_address_has_no_node(two_nodes: Path) -> None:
    assert numa_node_of(None, two_nodes) is None
    plans = plan_all(two_nodes, [GPUS[0], None], parse_cpu_list(NODE0))
    assert [p.node for p in plans] == [None, None]


def test_without_topology_each_logical_cpu_is_a_core(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path, {}, {0: "0-3"}, siblings_offset=None)
    assert physical_cores({3, 1, 2, 0}, sysfs) == [frozenset({c}) for c in range(4)]


def test_siblings_outside_the_pool_are_dropped_from_a_core(two_nodes: Path) -> None:
    assert physical_cores({1, 0, 64}, two_nodes) == [frozenset({0, 64}), frozenset({1})]


def test_fewer_cores_than_ranks_names_the_way_out(tmp_path: Path) -> None:
    sysfs = fake_sysfs(tmp_path, dict.fromkeys(GPUS[:3], "0"), {0: "0-1,64-65"})
    with pytest.raises(ValueError, match=r"2 physical cores for 3 local ranks.*cpu_binding: none"):
        plan_binding(0, GPUS[:3], parse_cpu_list("0-1,64-65"), sysfs=sysfs)


@pytest.mark.parametrize(("control", "threads"), [(0, 8), (1, 7), (8, 1), (20, 1)])
def test_control_cores_are_taken_from_the_update_threads(two_nodes: Path, control: int, threads: int) -> None:
    plan = plan_binding(0, GPUS, parse_cpu_list(NODE0) | parse_cpu_list(NODE1), control, two_nodes)
    assert plan.threads == threads


def test_negative_control_cores_are_refused(two_nodes: Path) -> None:
    with pytest.raises(ValueError, match="control_cores"):
        plan_binding(0, GPUS, parse_cpu_list(NODE0), control_cores=-1, sysfs=two_nodes)


@pytest.mark.parametrize("text", ["0-3,8,10-11\n", "5\n", "0,2,4", "16-23,80-87"])
def test_cpu_lists_round_trip(text: str) -> None:
    assert format_cpu_list(parse_cpu_list(text)) == text.strip()


def test_an_empty_cpu_list_is_empty() -> None:
    assert parse_cpu_list("") == parse_cpu_list("\n") == set()


BIND_CHECK = textwrap.dedent(
    """
    import importlib.util, os, sys, threading

    # The module file alone: the `offload` package would import Lightning, seconds for nothing here.
    spec = importlib.util.spec_from_file_location("cpu_binding", sys.argv[1])
    cpu_binding = sys.modules["cpu_binding"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(cpu_binding)
    bind_process = cpu_binding.bind_process

    stop = threading.Event()
    sleeper = threading.Thread(target=stop.wait, daemon=True)  # a failed check must not hang the exit
    sleeper.start()
    target = {min(os.sched_getaffinity(0))}
    bind_process(target)
    found = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
    assert len(found) >= 2 and all(a == target for a in found.values()), found
    later = []
    newborn = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
    newborn.start(); newborn.join()
    assert later == [target], later
    stop.set(); sleeper.join()
    """
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="os.sched_setaffinity is Linux-only")
def test_bind_process_moves_existing_and_later_threads() -> None:
    # A subprocess, so pytest's own threads and this process's affinity are left alone.
    module = Path(cpu_binding.__file__)
    command = [sys.executable, "-c", BIND_CHECK, str(module)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_slide_fsdp_on_gpus_binds_each_rank_to_its_share_and_takes_its_update_threads_from_it(two_nodes, monkeypatch):
    """``SlideFSDPStrategy.update_threads().bind``: local rank 3 of 4 GPUs binds to the second half of node 1 (what is
    bound is what was planned); ``cpu_binding: none`` and CPU runs leave affinity alone."""
    import torch

    from offload import SlideFSDPStrategy
    from offload import preflight as slide

    bound = []
    monkeypatch.setattr(slide, "pci_address", lambda index: GPUS[index])
    monkeypatch.setattr(slide, "bind_process", bound.append)
    monkeypatch.setattr(slide.os, "sched_getaffinity", lambda pid: set(range(128)))

    def on_gpus(**knobs):
        strategy = SlideFSDPStrategy(**knobs)
        strategy.parallel_devices = [torch.device("cuda", index) for index in range(4)]
        strategy.cluster_environment = SimpleNamespace(local_rank=lambda: 3)
        return strategy

    binding = on_gpus(control_cores=2).update_threads().bind(two_nodes)
    assert binding.node == 1 and binding.threads == 8 - 2
    assert bound == [set(binding.cpus)] and binding.cpus == parse_cpu_list("24-31,88-95")
    assert on_gpus(cpu_binding="none").update_threads().bind(two_nodes) is None
    on_cpu = SlideFSDPStrategy()
    on_cpu.parallel_devices = [torch.device("cpu")]
    assert on_cpu.update_threads().bind(two_nodes) is None and len(bound) == 1
    with pytest.raises(ValueError, match="cpu_binding='nodes': set it to numa or none"):
        SlideFSDPStrategy(cpu_binding="nodes")


def test_a_gpu_rank_states_its_update_threads_and_what_cut_them(two_nodes, monkeypatch):
    """The probe and the run record say how many update threads a rank got and why (affinity, quota, SMT
    siblings, binding); a cgroup quota of 24 CPUs over 4 ranks leaves 5 threads each, under the binding's 6."""
    import torch

    from offload import SlideFSDPStrategy
    from offload import preflight as slide

    monkeypatch.setattr(slide, "pci_address", lambda index: GPUS[index])
    monkeypatch.setattr(slide, "bind_process", lambda cpus: None)
    monkeypatch.setattr(slide.os, "sched_getaffinity", lambda pid: parse_cpu_list("0-31,64-95"))  # both nodes
    monkeypatch.setattr(slide, "core_limits", lambda: (64, 24.0))
    strategy = SlideFSDPStrategy(control_cores=2)
    strategy.parallel_devices = [torch.device("cuda", index) for index in range(4)]
    strategy.cluster_environment = SimpleNamespace(local_rank=lambda: 3)
    threads, reason = strategy.update_threads().plan(two_nodes)
    assert threads == 24 // 4 - 1 == 5
    assert reason.startswith("5 update threads: 64 CPUs in the affinity mask (32 physical cores), a cgroup quota of 24 "
                             "CPUs; 4 process(es) per node, one core each left to launching kernels; bound to NUMA node 1, "
                             "CPUs 24-31,88-95 (8 cores), 6 update threads")
    strategy.cpu_threads = 3
    assert strategy.update_threads().plan(two_nodes) == (3, "3 update threads: cpu_threads was set")
