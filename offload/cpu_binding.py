"""Bind each rank's CPU threads to its GPU's NUMA node, on cores no other local rank uses.

SlideFSDP runs the AdamW update on the CPU, over host buffers that first-touch places on the node of the
thread that touched them. An update whose threads run on the far node reads and writes that memory across
the socket link, at a fraction of the local bandwidth; and intra-op threads that share physical cores with
another rank's thrash each other's caches and stall both updates. So, as ``torch.numa.binding``'s
"exclusive" mode and SlideFormer's ``numa_launch.sh`` do, each local rank gets a contiguous run of the
physical cores of its GPU's node (hyperthread siblings included), disjoint from the other ranks' runs, and
leaves ``control_cores`` of them to the thread that launches kernels: the rest are its update threads.
Where the topology is unknown or the process may not use the node's CPUs (a container), the allowed CPUs
are split among all local ranks instead, so the ranks still do not share cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys")


def parse_cpu_list(text: str) -> set[int]:
    """CPUs of a sysfs list such as ``"0-3,8,10-11\\n"``."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def format_cpu_list(cpus: set[int] | frozenset[int]) -> str:
    """The sysfs list form of ``cpus``: ``{0, 1, 2, 3, 8}`` -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def pci_address(device_index: int) -> str:
    """Sysfs PCI address (``"0000:dc:00.0"``) of CUDA device ``device_index``."""
    import torch  # here, so planning and binding need only the standard library

    p = torch.cuda.get_device_properties(device_index)
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


def numa_node_of(pci: str | None, sysfs: Path = SYSFS) -> int | None:
    """NUMA node of a PCI device; None where unknown (no address, no file, or the kernel's -1)."""
    text = None if pci is None else _read(sysfs / "bus/pci/devices" / pci / "numa_node")
    node = None if text is None else int(text.strip())
    return None if node is None or node < 0 else node


def node_cpus(node: int, sysfs: Path = SYSFS) -> set[int]:
    """Logical CPUs of NUMA node ``node`` (empty where the node is unknown)."""
    return parse_cpu_list(_read(sysfs / f"devices/system/node/node{node}/cpulist") or "")


def physical_cores(cpus: set[int], sysfs: Path = SYSFS) -> list[frozenset[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), ordered by smallest CPU."""
    cores: set[frozenset[int]] = set()
    for cpu in cpus:
        siblings = _read(sysfs / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        # Without topology a logical CPU is its own core; siblings outside `cpus` are not ours to use.
        cores.add(frozenset((parse_cpu_list(siblings) | {cpu}) & cpus if siblings else {cpu}))
    return sorted(cores, key=min)


@dataclass(frozen=True)
class CpuBinding:
    """One rank's logical CPUs, its update thread count, their NUMA node (None: unknown) and physical cores."""

    cpus: frozenset[int]
    threads: int
    node: int | None
    cores: int

    def describe(self) -> str:
        """One line for the log, e.g. "NUMA node 1, CPUs 16-23,80-87 (8 cores), 7 update threads"."""
        where = "no NUMA node known" if self.node is None else f"NUMA node {self.node}"
        return f"{where}, CPUs {format_cpu_list(self.cpus)} ({self.cores} cores), {self.threads} update threads"


def plan_binding(
    local_rank: int,
    pci_addresses: list[str | None],
    allowed: set[int],
    control_cores: int = 1,
    sysfs: Path = SYSFS,
) -> CpuBinding:
    """CPUs for ``local_rank``, whose GPU is at ``pci_addresses[local_rank]``, among the local ranks' GPUs.

    Each rank gets a contiguous run of physical cores, disjoint from the other local ranks': of its GPU's
    node where every local GPU's node is known and usable, else of all ``allowed`` CPUs.
    """
    if control_cores < 0:
        raise ValueError(f"control_cores must be >= 0, got {control_cores}")
    nodes = [numa_node_of(pci, sysfs) for pci in pci_addresses]
    usable = {n: node_cpus(n, sysfs) & allowed for n in set(nodes) if n is not None}
    node = nodes[local_rank]
    if None not in nodes and all(usable.values()):
        pool, sharing = usable[node], [r for r, n in enumerate(nodes) if n == node]
    else:
        # Partial knowledge cannot tell which ranks share which cores, so split what we may use evenly.
        pool, sharing, node = set(allowed), list(range(len(pci_addresses))), None
    cores = physical_cores(pool, sysfs)
    if len(cores) < len(sharing):
        where = "all allowed CPUs" if node is None else f"NUMA node {node}"
        raise ValueError(
            f"{where} has {len(cores)} physical cores for {len(sharing)} local ranks: "
            "set cpu_binding: none or run fewer processes per node"
        )
    # Contiguous runs; the first `len(cores) % ranks` ranks get one extra core, as torch's exclusive mode.
    index = sharing.index(local_rank)
    base, extra = divmod(len(cores), len(sharing))
    start = index * base + min(index, extra)
    segment = cores[start : start + base + (index < extra)]
    return CpuBinding(
        cpus=frozenset().union(*segment),
        threads=max(1, len(segment) - control_cores),
        node=node,
        cores=len(segment),
    )


def bind_process(cpus: set[int]) -> None:
    """Bind the calling thread, and every thread still on its original affinity, to ``cpus``.

    Threads that set their own affinity keep it; threads created later inherit the caller's.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.sched_getaffinity(int(tid)) == original:
                os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread exited between the listing and the call
            continue
