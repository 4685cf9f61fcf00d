"""SlideFSDP's host preflight: what the host has (memory, cores) and whether the run's host buffers and update
threads fit it, decided before any worker starts (``HostPreflight``, which ``offload.strategy.SlideFSDPStrategy``
inherits); the strategy's life cycle is ``offload.strategy``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info

from lit_fsdp.parallelize import find_blocks
from offload.cpu_binding import SYSFS, CpuBinding, bind_process, pci_address, physical_cores, plan_binding
from offload.gradients import gradient_parts
from offload.host import check_shared_memory
from offload.host_memory import HostSetup, UnitSize, describe, host_buffers, offloaded_activation_bytes, with_runtime
from offload.layout import build_layouts, trained_layouts

_GIB = 2**30


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None



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
    """This process's CPU limits in words, for the reason its update got the threads it got (issue 26: the affinity
    mask, the cgroup quota and SMT siblings each can cut them); read them before binding, which narrows the mask."""
    cpus, quota = core_limits()
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(cpus))
    physical = len(physical_cores(set(allowed), sysfs))
    return (f"{cpus} CPUs in the affinity mask ({physical} physical cores), "
            + ("no cgroup CPU quota" if quota is None else f"a cgroup quota of {quota:g} CPUs"))


def sizes_of(layouts: list, trained: list, gpu_reduce: bool) -> list[UnitSize]:
    """Every unit's size (blocks, then the root) from its layout and its trained parameters' layout, the root's
    gradient parts as ``offload.gradients.gradient_parts`` makes them."""
    root_parts = gradient_parts(trained[-1], per_parameter=gpu_reduce)
    sizes = []
    for unit, (layout, trained_layout) in enumerate(zip(layouts, trained)):
        parts = tuple(p.layout.shard_numel for p in root_parts) if unit == len(layouts) - 1 else ()
        sizes.append(UnitSize(layout.full_numel, layout.shard_numel, parts, layout.full_numel - trained_layout.full_numel,
                              layout.shard_numel - trained_layout.shard_numel))
    return sizes


class HostPreflight:
    """The host side of SlideFSDP's knobs: host buffers counted and checked against the host's memory, update threads
    planned against its cores (and bound to the GPU's NUMA node). Read by the preflight, ``estimate`` and the tuner."""

    # The knobs it reads (SlideFSDPStrategy's constructor arguments) and what the strategy resolves.
    window: int
    param_transfer: str
    grad_sync: str
    activation_offload: str
    activation_checkpointing: int
    cpu_threads: int | None
    cpu_binding: str
    control_cores: int
    optimizer_state_dtype: str
    delayed_update: bool
    delayed_update_warmup: int
    gradient_slots: int | None
    host_memory_gb: float | None
    block_class: str | None
    on_nonfinite: str
    param_dtype: str
    reduce_dtype: str
    root_device: torch.device
    num_processes: int
    local_rank: int
    parallel_devices: list[torch.device] | None
    resolve_dtype: Any  # the strategy's: lit_fsdp.strategy.CausalLMStrategy.resolve_dtype

    def check_knobs(self, trainer: pl.Trainer) -> None:
        """Refuse, before launch, knobs that cannot work together on this trainer's devices."""
        if self.param_transfer == "shard" and trainer.num_devices < 2:
            raise ValueError(
                "SlideFSDP param_transfer: shard all-gathers each block across the devices of a node, but there is "
                "one process per node; use param_transfer: full or more --trainer.devices"
            )
        if self.delayed_update and trainer.accumulate_grad_batches > 1:
            raise ValueError(
                f"SlideFSDP delayed_update applies a step's update during the next step's first backward, so the "
                f"{trainer.accumulate_grad_batches} micro-batches of a step would compute with different weights; "
                "set delayed_update: false or accumulate_grad_batches: 1"
            )
        if self.grad_sync == "cpu_reduce" and self.root_device.type == "cuda" and trainer.num_nodes * trainer.num_devices > 1:
            raise ValueError(
                "SlideFSDP grad_sync: cpu_reduce copies every rank's whole gradients to the host and all-reduces them there "
                "with gloo over TCP (at 8B, 32 GB per rank per step: tens of seconds), where NCCL's reduce-scatter on the "
                "GPUs sends each rank only its 1/N; use grad_sync: gpu_reduce"
            )

    def defers_updates(self, trainer: pl.Trainer) -> bool:
        """Clipping and skipping non-finite steps need every gradient before the first update of a step; a delayed
        update waits for the next step."""
        return bool(trainer.gradient_clip_val) or self.on_nonfinite == "skip_step" or self.delayed_update

    def overlaps_updates(self, trainer: pl.Trainer) -> bool:
        """The CPU updates run during a backward (this step's, or the next one's when delayed), not after it."""
        return self.delayed_update or not self.defers_updates(trainer)

    def keeps_gradients(self, trainer: pl.Trainer) -> bool:
        """Accumulation, and deferred updates that are not delayed, add each unit's gradient into an fp32 buffer kept
        on the host until the optimizer step (a delayed update keeps the gradient in its bfloat16 buffers instead)."""
        return trainer.accumulate_grad_batches > 1 or (self.defers_updates(trainer) and not self.delayed_update)

    def norms_on_arrival(self, trainer: pl.Trainer) -> bool:
        """A delayed update learns the step's gradient norm (for clipping and the non-finite guard) piece by piece
        as the gradients reach the host, so that the norm is known when the next step's updates start."""
        return self.delayed_update and (bool(trainer.gradient_clip_val) or self.on_nonfinite != "warn")

    def checks_units_finite(self, trainer: pl.Trainer) -> bool:
        """Each unit's gradients are checked for non-finite values before its update (the device does it with
        ``gpu_reduce``): deferred updates are guarded by the global norm instead, ``on_nonfinite: warn`` by nothing."""
        return self.on_nonfinite != "warn" and not self.defers_updates(trainer)

    def host_setup(self, trainer: pl.Trainer, activation_bytes: int = 0, compute: torch.dtype | None = None) -> HostSetup:
        """What decides this run's host buffers (``offload.host_memory``); ``compute`` overrides the resolved dtype."""
        compute = compute or self.resolve_dtype(self.param_dtype)
        return HostSetup.of_knobs(compute, self.resolve_dtype(self.reduce_dtype, fallback=compute),
                                  getattr(torch, self.optimizer_state_dtype), trainer.num_devices, self.param_transfer,
                                  self.grad_sync, self.window, self.keeps_gradients(trainer), activation_bytes,
                                  self.gradient_slots, self.delayed_update)

    def unit_sizes(self, module: pl.LightningModule, datamodule: Any, shards: int) -> list[UnitSize]:
        """Every unit's size (blocks, then the root) with ``shards`` ranks per node, from the model on the meta device
        (with ``--model.lora``'s adapters, its base frozen, as the run builds it)."""
        from transformers import AutoModelForCausalLM

        from lit_fsdp import lora

        with torch.device("meta"):
            network = AutoModelForCausalLM.from_config(module.hf_config(datamodule))
        adapters = lora.as_config((getattr(module, "hparams", None) or {}).get("lora"))
        if adapters is not None:
            lora.attach(network, adapters)
        block_layouts, root_layout = build_layouts(network, find_blocks(network, self.block_class), shards, 0)
        layouts = [*block_layouts, root_layout]
        return sizes_of(layouts, trained_layouts(layouts, shards, 0), self.grad_sync == "gpu_reduce")

    def host_buffer_estimate(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None,
                             compute: torch.dtype | None = None, units: list[UnitSize] | None = None) -> dict[str, int]:
        """The node's host bytes per buffer for this run (``offload.host_memory``); offloaded activations need
        ``datamodule`` (its batch size and sequence length). ``compute`` overrides the compute dtype the strategy
        resolves (``estimate`` on a machine without the run's GPU); ``units`` are ``unit_sizes``' when the caller
        has them already (each call builds the model on the meta device)."""
        compute = compute or self.resolve_dtype(self.param_dtype)
        units = units or self.unit_sizes(module, datamodule, trainer.num_devices)
        activations = 0
        if self.activation_offload == "cpu" and datamodule is not None:
            activations = offloaded_activation_bytes(
                len(units) - 1, self.activation_checkpointing, datamodule.batch_size, datamodule.seq_len,
                module.hf_config(datamodule).hidden_size, compute)
        return host_buffers(units, self.host_setup(trainer, activations, compute))

    def check_host_memory(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None,
                          available: int | None = None) -> dict[str, int]:
        """Fail before training if the node's host buffers and runtime cannot fit in ``available`` bytes (default:
        ``host_memory_gb``, else the memory available now); returns what it counted, per buffer."""
        units = self.unit_sizes(module, datamodule, trainer.num_devices)
        parts = with_runtime(self.host_buffer_estimate(trainer, module, datamodule, units=units), trainer.num_devices)
        needed = sum(parts.values())
        source = "available"
        if available is None and self.host_memory_gb is not None:
            available, source = int(self.host_memory_gb * _GIB), "allowed by host_memory_gb"
        elif available is None:
            available, source = available_host_bytes(), "available (MemAvailable; set host_memory_gb on a VM that grows its memory on demand)"
        if available is not None and needed > available:
            billions = sum(unit.full_numel for unit in units) / 1e9
            raise ValueError(
                f"SlideFSDP needs {needed / _GIB:.1f} GiB of host memory per node for {billions:.2f}B parameters "
                f"({describe(parts)} GiB) but {available / _GIB:.1f} GiB are {source}; use a smaller model or more "
                "nodes, or drop what keeps gradients (clipping, accumulation, on_nonfinite: skip_step)"
            )
        if self.param_transfer == "full" and trainer.num_devices > 1:  # the node's staging copy lives in /dev/shm
            check_shared_memory(parts["staging"])
        return parts

    def plan_update_threads(self, sysfs: Path = SYSFS) -> tuple[int | None, str]:
        """This rank's update threads (None: leave torch's setting) and why, binding its CPUs first on GPU runs.
        Lightning limits threads on CPU runs only; the AdamW updates on a GPU run need a setting too."""
        if self.root_device.type != "cuda":
            if self.cpu_threads is not None:
                return self.cpu_threads, f"{self.cpu_threads} update threads: cpu_threads was set"
            return None, f"{torch.get_num_threads()} update threads: Lightning's setting on CPU runs"
        default = update_threads(self.num_processes)  # counted before binding: the affinity and quota we were given
        cores = describe_cores(sysfs)
        binding = self.bind_cpus(sysfs)
        if self.cpu_threads is not None:
            return self.cpu_threads, f"{self.cpu_threads} update threads: cpu_threads was set"
        threads = min(default, binding.threads) if binding is not None else default
        bound = "" if binding is None else f"; bound to {binding.describe()}"
        return threads, (f"{threads} update threads: {cores}; {self.num_processes} process(es) per node, one core each "
                         f"left to launching kernels{bound}")

    def bind_cpus(self, sysfs: Path = SYSFS) -> CpuBinding | None:
        """With ``cpu_binding: numa`` on GPUs, bind this process's threads (and those it starts later) to its share of
        its GPU's NUMA node (``offload.cpu_binding``) before the host buffers are first touched; returns the share."""
        if self.cpu_binding != "numa" or self.root_device.type != "cuda" or not hasattr(os, "sched_setaffinity"):
            return None
        addresses = [pci_address(device.index) for device in self.parallel_devices]
        binding = plan_binding(self.local_rank, addresses, os.sched_getaffinity(0), self.control_cores, sysfs)
        bind_process(set(binding.cpus))
        rank_zero_info(f"SlideFSDP CPU binding of local rank {self.local_rank} (the others alike): {binding.describe()}")
        return binding
