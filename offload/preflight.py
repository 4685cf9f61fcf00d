"""What SlideFSDP's host has (memory, cores), and the update threads' plan (``UpdateThreads``) from it; the host
buffers' plan is ``offload.plan``, the strategy's life cycle ``offload.strategy``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_fsdp.meminfo import available_host_bytes
from offload.cpu_binding import SYSFS, CpuBinding, bind_process, pci_address, physical_cores, plan_binding

_GIB = 2**30


def core_limits() -> tuple[int, float | None]:
    """(CPUs in this process's affinity mask, its cgroup v2 CPU quota in CPUs or None where there is none)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return cores, None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return cores, None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota where one is set."""
    cores, quota = core_limits()
    return cores if quota is None else min(cores, max(1, int(quota)))


def update_threads(processes_per_node: int) -> int:
    """Threads for one rank's CPU updates: its share of the usable cores, less one for the thread that launches kernels."""
    return max(1, usable_cores() // processes_per_node - 1)


def describe_cores(sysfs: Path = SYSFS) -> str:
    """This process's CPU limits in words, for the reason its update got the threads it got (the affinity mask, the
    cgroup quota and SMT siblings each can cut them); read them before binding, which narrows the mask."""
    cpus, quota = core_limits()
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(cpus))
    physical = len(physical_cores(set(allowed), sysfs))
    return (f"{cpus} CPUs in the affinity mask ({physical} physical cores), "
            + ("no cgroup CPU quota" if quota is None else f"a cgroup quota of {quota:g} CPUs"))


#: The share of the host's memory SlideFSDP leaves free by default (``host_reserve_gb``): a checkpoint's page cache, a
#: data worker, the allocator's growth, what else the node runs. 1/16 is 8 GiB of a 128 GiB host.
HOST_RESERVE_SHARE = 1 / 16


def host_reserve_bytes(host_bytes: int | None, host_reserve_gb: float | None) -> int:
    """The bytes of ``host_bytes`` (the host's figure: ``host_memory_gb``, MemAvailable or a hardware file's) kept
    free: ``host_reserve_gb`` if set, else ``HOST_RESERVE_SHARE`` of it."""
    if host_reserve_gb is not None:
        return int(host_reserve_gb * _GIB)
    return int((host_bytes or 0) * HOST_RESERVE_SHARE)


def host_memory_budget(host_memory_gb: float | None, host_reserve_gb: float | None = None) -> tuple[int | None, str]:
    """The bytes per node SlideFSDP's buffers may take, and where that figure comes from: ``host_memory_gb`` if set,
    else MemAvailable now (None where the host does not say), less the reserve (``host_reserve_bytes``)."""
    if host_memory_gb is not None:
        host, source = int(host_memory_gb * _GIB), f"allowed by host_memory_gb ({host_memory_gb:g} GiB"
    else:
        host = available_host_bytes()
        if host is None:
            return None, "unknown (no MemAvailable; set host_memory_gb)"
        source = (f"available (MemAvailable {host / _GIB:.1f} GiB; set host_memory_gb on a VM that grows its memory "
                  "on demand")
    reserve = host_reserve_bytes(host, host_reserve_gb)
    return host - reserve, f"{source}, less a reserve of {reserve / _GIB:.1f} GiB: host_reserve_gb)"


@dataclass(frozen=True)
class UpdateThreads:
    """One rank's CPU update threads: its knobs and its place on the node (SlideFSDP's ``cpu_threads``,
    ``cpu_binding`` and ``control_cores``; the rank's device, local rank and the node's GPUs)."""

    device: torch.device
    cpu_threads: int | None
    cpu_binding: str
    control_cores: int
    processes_per_node: int
    local_rank: int
    gpus: tuple[int, ...] = ()  # the node's GPU indices, in local-rank order

    def plan(self, sysfs: Path = SYSFS) -> tuple[int | None, str]:
        """This rank's update threads (None: leave torch's setting) and why, binding its CPUs first on GPU runs.
        Lightning limits threads on CPU runs only; the AdamW updates on a GPU run need a setting too."""
        if self.device.type != "cuda":
            if self.cpu_threads is not None:
                return self.cpu_threads, f"{self.cpu_threads} update threads: cpu_threads was set"
            return None, f"{torch.get_num_threads()} update threads: Lightning's setting on CPU runs"
        default = update_threads(self.processes_per_node)  # counted before binding: the affinity and quota we were given
        cores = describe_cores(sysfs)
        binding = self.bind(sysfs)
        if self.cpu_threads is not None:
            return self.cpu_threads, f"{self.cpu_threads} update threads: cpu_threads was set"
        threads = min(default, binding.threads) if binding is not None else default
        bound = "" if binding is None else f"; bound to {binding.describe()}"
        return threads, (f"{threads} update threads: {cores}; {self.processes_per_node} process(es) per node, one core "
                         f"each left to launching kernels{bound}")

    def bind(self, sysfs: Path = SYSFS) -> CpuBinding | None:
        """With ``cpu_binding: numa`` on GPUs, bind this process's threads (and those it starts later) to its share of
        its GPU's NUMA node (``offload.cpu_binding``) before the host buffers are first touched; returns the share."""
        if self.cpu_binding != "numa" or self.device.type != "cuda" or not hasattr(os, "sched_setaffinity"):
            return None
        addresses = [pci_address(index) for index in self.gpus]
        binding = plan_binding(self.local_rank, addresses, os.sched_getaffinity(0), self.control_cores, sysfs)
        bind_process(set(binding.cpus))
        rank_zero_info(f"SlideFSDP CPU binding of local rank {self.local_rank} (the others alike): {binding.describe()}")
        return binding
