"""The machine the trials run on: detected (``python -m lit_fsdp hardware``) or described in a JSON file (``--tune.hardware``).

The tuner needs the memory of one device (the memory filter), the dense peak TFLOPS by dtype (MFU),
the nodes (hybrid sharding) and, when known, the interconnect bandwidth within and across nodes (a
slow link makes compression worth a trial). Detection reads CUDA's device properties, the peak table
of ``lit_fsdp/device_peaks.py``, ``/proc/meminfo`` and SLURM's node count; it cannot measure links,
so their bandwidth is null unless a file gives it. On a CPU the "device" is the host: one device per
node with the host's memory, shared by the node's processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

import torch

from lit_fsdp.device_peaks import device_peaks, matmul_format
from lit_fsdp.meminfo import meminfo_bytes

_GIB = 2**30
_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass
class Hardware:
    """One node type of the machine; every field can be given in ``--tune.hardware`` JSON (the rest is detected)."""

    accelerator: Literal["cpu", "cuda"] = "cpu"
    device_name: str = "cpu"
    nodes: int = 1
    devices_per_node: int = 1
    device_memory_gb: float = 1.0
    """memory of one device in GiB (on a CPU: the host's, shared by the processes of the node)"""
    host_memory_gb: float = 1.0
    """host memory of one node in GiB: the room for offloaded state (SlideFSDP, FSDP2's cpu_offload)"""
    host_cores: int = 1
    peak_tflops: dict[str, float] = field(default_factory=dict)
    """dense peak TFLOPS of one device by matmul format (fp32, tf32, bf16, fp16, fp8); empty when unknown"""
    intra_node_gbps: float | None = None
    """bandwidth between two devices of a node in GB/s (null: unknown)"""
    inter_node_gbps: float | None = None
    """bandwidth between two nodes in GB/s (null: unknown)"""
    pcie_gbps: float | None = None
    """host-device copy bandwidth of one device per direction, pinned memory, in GB/s (null: unknown)"""
    host_memory_gbps: float | None = None
    """host memory bandwidth the CPU updates of one node reach, in GB/s (null: unknown)"""
    compute_efficiency: float | None = None
    """share of peak_tflops a transformer's forward and backward reach on one device, as measured (e.g. by
    scripts/gpu_check.py); null: the peak, and estimate's step time is a bound"""
    compiled_efficiency: float | None = None
    """the same share with compiled blocks (compile_blocks: true), fitted to a recorded compiled run; null:
    compute_efficiency's"""

    def efficiency(self, compiled: bool = False) -> float | None:
        """The share of the peak the device's compute reaches, with compiled blocks or eager."""
        return (self.compiled_efficiency if compiled and self.compiled_efficiency else None) or self.compute_efficiency

    def memory_per_process_gb(self, processes_per_node: int) -> float:
        """The device memory one process has: a device's, or its share of one when processes outnumber devices."""
        return self.device_memory_gb * min(1.0, self.devices_per_node / max(1, processes_per_node))

    def peak_for(self, dtype: torch.dtype) -> float | None:
        """Peak TFLOPS of one device for matmuls in ``dtype``, if known."""
        return self.peak_tflops.get(matmul_format(dtype))

    def check(self, where: str) -> None:
        """Raise ValueError naming the first field that is out of range."""
        if self.accelerator not in ("cpu", "cuda"):
            raise ValueError(f"{where}: accelerator {self.accelerator!r} is not cpu or cuda")
        for name in ("nodes", "devices_per_node", "host_cores"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {name} must be an integer >= 1, got {value!r}")
        for name in ("device_memory_gb", "host_memory_gb", "intra_node_gbps", "inter_node_gbps", "pcie_gbps",
                     "host_memory_gbps"):
            value = getattr(self, name)
            if value is None and name.endswith("gbps"):
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{where}: {name} must be a number > 0, got {value!r}")
        for name in ("compute_efficiency", "compiled_efficiency"):
            efficiency = getattr(self, name)
            if efficiency is not None and (not isinstance(efficiency, (int, float)) or isinstance(efficiency, bool)
                                           or not 0 < efficiency <= 1):
                raise ValueError(f"{where}: {name} must be a number in (0, 1], or null, got {efficiency!r}")
        if not isinstance(self.peak_tflops, dict):
            raise ValueError(f"{where}: peak_tflops must be an object like {{\"bf16\": 989.5}}, got {self.peak_tflops!r}")
        for key, value in self.peak_tflops.items():
            if key not in _FORMATS or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{where}: peak_tflops[{key!r}]={value!r}; keys are {', '.join(_FORMATS)} with TFLOPS > 0")


def detect(accelerator: Literal["cuda", "cpu"] | None = None) -> Hardware:
    """This node as the tuner sees it; nodes from SLURM (``SLURM_JOB_NUM_NODES``), else 1. ``accelerator`` ``cpu``
    describes the host alone where a GPU is present too (runs configured for the CPU); default: the GPU if any."""
    host_memory = (meminfo_bytes("MemTotal") or _GIB) / _GIB
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    cores = os.cpu_count() or 1
    if accelerator != "cpu" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        return Hardware(
            accelerator="cuda", device_name=properties.name, nodes=nodes, devices_per_node=torch.cuda.device_count(),
            device_memory_gb=properties.total_memory / _GIB, host_memory_gb=host_memory, host_cores=cores,
            peak_tflops=device_peaks(properties.name),
        )
    return Hardware(accelerator="cpu", device_name="cpu", nodes=nodes, devices_per_node=1, device_memory_gb=host_memory,
                    host_memory_gb=host_memory, host_cores=cores)


def load(path: str | Path) -> Hardware:
    """The detected hardware with the fields of the JSON file at ``path`` in their place, checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--tune.hardware {path} not found; write one with `python -m lit_fsdp hardware > {path.name}`")
    try:
        given = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"--tune.hardware {path} is not JSON ({error}); see `python -m lit_fsdp hardware` for the format") from None
    if not isinstance(given, dict):
        raise ValueError(f"--tune.hardware {path} holds a {type(given).__name__}, not an object of hardware fields")
    names = [f.name for f in fields(Hardware)]
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"--tune.hardware {path}: unknown field {unknown[0]!r}; fields: {', '.join(names)}")
    hardware = Hardware(**{**asdict(detect()), **given})
    hardware.check(f"--tune.hardware {path}")
    return hardware


def hardware() -> None:
    """Print this machine's hardware as JSON: the format ``tune --tune.hardware FILE`` reads (edit what detection cannot know)."""
    print(json.dumps(asdict(detect()), indent=2))
