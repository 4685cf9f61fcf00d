"""``SlideFSDPStrategy``: train models larger than device memory by streaming blocks from the host (after SlideFormer).

The fp32 master weights and the AdamW moments stay in host memory, sharded across the ranks of a node;
the device holds the root (embeddings, final norm, head) and a sliding window of ``window`` blocks in
the compute dtype. Each block's gradients go to the host as soon as its backward is done, and its CPU
AdamW update runs while the device computes the backward of the blocks before it. The life cycle is
``CausalLMStrategy``'s, as for FSDP2: the same model, data, callbacks, LR schedule and checkpoint layout.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lit_fsdp import checkpoints
from offload.layout import build_layouts
from lit_fsdp.lightning_compat import METADATA_FILENAME as _METADATA_FILENAME
from lit_fsdp.lightning_compat import is_sharded_checkpoint as _is_sharded_checkpoint
from lit_fsdp.parallelize import find_blocks
from lit_fsdp.reliability import OnNonFinite
from lit_fsdp.strategy import CausalLMStrategy, DType
from offload.cpu_adam import CpuAdam
from offload.cpu_binding import SYSFS, CpuBinding, bind_process, pci_address, physical_cores, plan_binding
from offload.engine import FORWARD, SlideEngine
from offload.gradients import GradientPipeline, gradient_parts
from offload.host import HostState, SharedStaging, can_pin, check_shared_memory, node_tag
from offload.host_memory import (HostSetup, UnitSize, describe, host_buffers, offloaded_activation_bytes, ring_size,
                                  with_runtime)
from offload.residency import DeviceWindow, replace_meta_parameters
from offload.state_dict import HostStateDict
from offload.transfers import Transfers

_GIB = 2**30
OptimizerStateDType = Literal["float32", "bfloat16"]


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


class SlideFSDPStrategy(CausalLMStrategy):
    """Layer-streaming CPU offload (SlideFSDP): master weights and AdamW on the host, a window of blocks on the device."""

    strategy_name = "slide_fsdp"

    def __init__(
        self,
        window: int = 2,
        param_transfer: Literal["full", "shard"] = "full",
        grad_sync: Literal["gpu_reduce", "cpu_reduce"] = "gpu_reduce",
        activation_offload: Literal["none", "cpu"] = "none",
        param_dtype: DType = "auto",
        reduce_dtype: DType = "auto",
        activation_checkpointing: int = 0,
        cpu_threads: int | None = None,
        cpu_binding: Literal["numa", "none"] = "numa",
        control_cores: int = 1,
        optimizer_state_dtype: OptimizerStateDType = "float32",
        delayed_update: bool = False,
        pin_memory: bool = True,
        host_memory_gb: float | None = None,
        block_class: str | None = None,
        on_nonfinite: OnNonFinite = "stop",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        """
        Args:
            window: Blocks whose weights may be on the device at once (the block being computed and the ones
                prefetched); device memory for weights is ``window`` x the largest block, whatever the depth.
            param_transfer: ``full``: every rank copies whole blocks host-to-device (the node keeps one staging
                copy in shared memory); ``shard``: every rank copies its 1/N and the devices all-gather the rest.
            grad_sync: ``gpu_reduce``: reduce-scatter on the devices, each rank copies its 1/N of the gradients to
                the host; ``cpu_reduce``: whole gradients to the host, all-reduced there with gloo (CPU runs only: on
                GPUs it cannot pay for its traffic and is refused before launch).
            activation_offload: ``cpu`` keeps the inputs of checkpointed blocks in pinned host memory between
                forward and backward (needs activation_checkpointing >= 1).
            param_dtype: Dtype of the weights on the device and of the compute; ``auto`` is bfloat16 on GPUs that
                support it, else float32. Master weights stay float32 on the host (moments: ``optimizer_state_dtype``).
            reduce_dtype: Dtype the gradients are reduced and copied to the host in; ``auto`` (default) follows
                ``param_dtype``: bfloat16 on GPUs halves the device-to-host bytes, and the CPU update reads it as it is.
            activation_checkpointing: Recompute the activations of every k-th block in backward; 0 turns it off.
            cpu_threads: Threads of this rank's CPU work (the AdamW updates); default: the cores this process may run
                on (affinity, cgroup CPU quota) / processes per node, less one left to the thread that launches kernels
                (with ``cpu_binding: numa``: the rank's cores less ``control_cores``).
            cpu_binding: ``numa`` (GPU runs): every thread of a rank runs on its GPU's NUMA node, on physical cores no
                other local rank uses (the node's cores split among its GPUs; ``offload.cpu_binding``), so the update
                reads local memory; ``none`` leaves affinity alone.
            control_cores: Cores of each rank's share left to the threads that launch kernels and run autograd.
            optimizer_state_dtype: AdamW moments on the host; ``bfloat16`` halves them (8 -> 4 B/param; the update
                still computes in float32, and the moments are rounded to nearest after it).
            delayed_update: Apply each step's CPU updates during the next step's backward (ZeRO-Offload's one-step
                delayed parameter update, DPU): with clipping or ``on_nonfinite: skip_step`` the updates then overlap
                the backward instead of following it, and every step computes with weights one update old. A
                checkpoint, a validation and the end of training apply the waiting update first. Keeps each unit's
                gradient on the host (4 B/param); not with gradient accumulation.
            pin_memory: Pin the host buffers that cross PCIe (GPU only); if pinning fails it is turned off with a warning.
            host_memory_gb: Host memory (GiB per node) the preflight may count on; default: MemAvailable now. Set it
                on a VM whose memory is granted as it is used, where MemAvailable starts far below what the VM gets.
            block_class: Class name of the transformer block; default: the model's ``_no_split_modules``.
            on_nonfinite: A step whose loss or gradients are not finite: ``stop`` the run before anything non-finite is
                applied, ``skip_step`` on every rank (the CPU updates then wait for the end of the backward, as with
                clipping), or ``warn`` and apply it.
            process_group_backend: Default ``cpu:gloo,cuda:nccl`` on GPUs (host collectives use gloo; a backend without
                a CPU part is refused), ``gloo`` on CPU.
            timeout: Collective timeout.
        """
        super().__init__(block_class, param_dtype, reduce_dtype, activation_checkpointing, on_nonfinite, True,
                         process_group_backend, timeout)
        if window < 1:
            raise ValueError(f"SlideFSDP window={window}: at least 1 block must fit on the device; set window >= 1")
        if activation_offload == "cpu" and not activation_checkpointing:
            raise ValueError(
                "activation_offload: cpu offloads the inputs of checkpointed blocks; set activation_checkpointing >= 1"
            )
        if cpu_threads is not None and cpu_threads < 1:
            raise ValueError(f"cpu_threads={cpu_threads} must be >= 1, or null for usable cores / processes per node, less one")
        if host_memory_gb is not None and not host_memory_gb > 0:
            raise ValueError(f"SlideFSDP host_memory_gb={host_memory_gb} must be > 0, or null for MemAvailable")
        if optimizer_state_dtype not in get_args(OptimizerStateDType):
            raise ValueError(f"SlideFSDP optimizer_state_dtype={optimizer_state_dtype!r}: set it to float32 or bfloat16")
        self.window = window
        self.param_transfer = param_transfer
        self.grad_sync = grad_sync
        self.activation_offload = activation_offload
        self.cpu_threads = cpu_threads
        if cpu_binding not in ("numa", "none"):
            raise ValueError(f"SlideFSDP cpu_binding={cpu_binding!r}: set it to numa or none")
        if control_cores < 0:
            raise ValueError(f"SlideFSDP control_cores={control_cores} must be >= 0")
        self.cpu_binding = cpu_binding
        self.control_cores = control_cores
        self.optimizer_state_dtype = optimizer_state_dtype
        self.delayed_update = delayed_update
        self.pin_memory = pin_memory
        self.host_memory_gb = host_memory_gb
        self.engine: SlideEngine | None = None
        self.host: HostState | None = None
        self.adam: CpuAdam | None = None
        self.host_state_dict: HostStateDict | None = None
        self.update_threads_reason = ""  # set with the threads in setup_environment; in the run record

    # --- before any worker starts ------------------------------------------------------------------

    def mesh_shape(self, world_size: int, num_nodes: int) -> tuple[int, int]:
        """(nodes, processes per node): master state is sharded within a node and the same on every node."""
        if world_size % num_nodes:
            raise ValueError(f"SlideFSDP: {world_size} processes do not split evenly over {num_nodes} nodes")
        return (num_nodes, world_size // num_nodes)

    def defers_updates(self, trainer: pl.Trainer) -> bool:
        """Clipping and skipping non-finite steps need every gradient before the first update of a step; a delayed
        update waits for the next step."""
        return bool(trainer.gradient_clip_val) or self.on_nonfinite == "skip_step" or self.delayed_update

    def overlaps_updates(self, trainer: pl.Trainer) -> bool:
        """The CPU updates run during a backward (this step's, or the next one's when delayed), not after it."""
        return self.delayed_update or not self.defers_updates(trainer)

    def keeps_gradients(self, trainer: pl.Trainer) -> bool:
        """Accumulation and deferred updates need each unit's gradient kept on the host until the optimizer step."""
        return trainer.accumulate_grad_batches > 1 or self.defers_updates(trainer)

    def preflight(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None) -> None:
        super().preflight(trainer, module, datamodule)
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
        self.check_host_memory(trainer, module, datamodule)

    def checks_units_finite(self, trainer: pl.Trainer) -> bool:
        """Each unit's gradients are checked for non-finite values before its update (the device does it with
        ``gpu_reduce``): deferred updates are guarded by the global norm instead, ``on_nonfinite: warn`` by nothing."""
        return self.on_nonfinite != "warn" and not self.defers_updates(trainer)

    def host_setup(self, trainer: pl.Trainer, activation_bytes: int = 0, compute: torch.dtype | None = None) -> HostSetup:
        """What decides this run's host buffers (``offload.host_memory``); ``compute`` overrides the resolved dtype."""
        compute = compute or self.resolve_dtype(self.param_dtype)
        return HostSetup.of_knobs(compute, self.resolve_dtype(self.reduce_dtype, fallback=compute),
                                  getattr(torch, self.optimizer_state_dtype), trainer.num_devices, self.param_transfer,
                                  self.grad_sync, self.window, self.keeps_gradients(trainer), activation_bytes)

    def unit_sizes(self, module: pl.LightningModule, datamodule: Any, shards: int) -> list[UnitSize]:
        """Every unit's size (blocks, then the root) with ``shards`` ranks per node, from the model on the meta device."""
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            network = AutoModelForCausalLM.from_config(module.hf_config(datamodule))
        block_layouts, root_layout = build_layouts(network, find_blocks(network, self.block_class), shards, 0)
        root_parts = gradient_parts(root_layout, per_parameter=self.grad_sync == "gpu_reduce")
        return [*(UnitSize(layout.full_numel, layout.shard_numel) for layout in block_layouts),
                UnitSize(root_layout.full_numel, root_layout.shard_numel, tuple(p.layout.shard_numel for p in root_parts))]

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

    # --- processes -------------------------------------------------------------------------------

    @property
    def host_collectives(self) -> str | None:
        """Gradients on the host, their norms and checkpoints: gloo beside NCCL (``lit_fsdp.strategy.process_group_backend``)."""
        return "SlideFSDP"

    def setup_environment(self) -> None:
        super().setup_environment()
        threads, self.update_threads_reason = self.plan_update_threads()
        rank_zero_info(f"SlideFSDP CPU update: {self.update_threads_reason}")
        if threads is not None:
            torch.set_num_threads(threads)
        shape = self.mesh_shape(self.world_size, self.num_nodes)
        if self.root_device.type == "cpu":
            self.cpu_mesh = self.device_mesh
        else:  # host tensors (checkpoint DTensors, norms, barriers) get gloo groups of their own
            self.cpu_mesh = init_device_mesh(
                "cpu", shape, mesh_dim_names=("replicate", "shard"), backend_override={"replicate": "gloo", "shard": "gloo"}
            )
        # The worker thread's collectives (cpu_reduce) need a group no other thread uses, or orders could mix.
        self.host_group = dist.new_group(backend="gloo") if self.grad_sync == "cpu_reduce" else None

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

    # --- model -----------------------------------------------------------------------------------

    def is_placed(self, network: nn.Module) -> bool:
        return self.engine is not None and self.engine.network is network

    def place(self, network: nn.Module, module: pl.LightningModule) -> None:
        trainer = module.trainer
        device = self.root_device
        compute = self.resolve_dtype(self.param_dtype)
        reduce = self.resolve_dtype(self.reduce_dtype, fallback=compute)
        blocks = find_blocks(network, self.block_class)
        shard_mesh = self.cpu_mesh["shard"]
        shards, shard_rank = shard_mesh.size(), shard_mesh.get_local_rank()
        block_layouts, root_layout = build_layouts(network, blocks, shards, shard_rank)
        layouts = [*block_layouts, root_layout]
        replace_meta_parameters(network, layouts, device, compute)
        pin = can_pin(device, self.pin_memory)
        full = self.param_transfer == "full"
        shared = None
        if full and shards > 1:
            numel = sum(layout.full_numel for layout in layouts)
            shared = SharedStaging(numel, compute, pin, shard_rank, node_tag(self.node_rank), shard_mesh.get_group())
        self.host = HostState(
            layouts, compute, reduce, full_staging=full, keep_gradients=self.keeps_gradients(trainer),
            incoming_full=self.grad_sync == "cpu_reduce", ring_size=ring_size(self.window), pin=pin, shared=shared,
        )
        self.host_state_dict = HostStateDict(network, layouts, self.host.master, self.cpu_mesh)
        with self.host_state_dict.parameters_as_dtensors():
            module.initialize_weights(blocks)
        self.refresh_staging()
        transfers = Transfers(device)
        device_shards = self.device_mesh["shard"].get_group() if shards > 1 else None
        window = DeviceWindow(
            layouts, len(layouts) - 1, self.host, transfers, self.window, compute, device,
            shard_group=None if full else device_shards,
        )
        window.unbind_all()
        gradients = GradientPipeline(
            layouts, self.host, None, transfers, gpu_reduce=self.grad_sync == "gpu_reduce", reduce_dtype=reduce,
            world_size=self.world_size, shard_rank=shard_rank, shard_group=device_shards,
            replicate_group=self.device_mesh["replicate"].get_group() if self.num_nodes > 1 else None,
            host_group=self.host_group,
            check_finite=self.checks_units_finite(trainer),
        )
        self.engine = SlideEngine(
            network, blocks, layouts, window, gradients, transfers, self.activation_checkpointing,
            self.activation_offload == "cpu", pin,
        )
        self.engine.defer_updates = self.defers_updates(trainer)
        self.engine.delay_updates = self.delayed_update
        self._describe(layouts, compute, shards, pin)

    def _describe(self, layouts: list, compute: torch.dtype, shards: int, pin: bool) -> None:
        parameters = self.parameter_count()
        largest = max(layout.full_numel for layout in layouts[:-1]) * compute.itemsize
        rank_zero_info(
            f"SlideFSDP: {parameters / 1e6:.1f}M parameters in {len(layouts) - 1} blocks + root; master sharded over "
            f"{shards} rank(s) per node; device window {self.window} x {largest / 2**20:.1f} MiB in {compute}; "
            f"param_transfer {self.param_transfer}, grad_sync {self.grad_sync}, pinned host buffers: {pin}"
        )

    def parameter_count(self) -> int:
        assert self.host is not None
        return sum(place.numel for layout in self.host.layouts for place in layout.places)

    def host_buffer_bytes(self) -> dict[str, int]:
        """This rank's host bytes per buffer as allocated (``offload.host_memory`` names; a shared staging copy is
        counted by local rank 0; offloaded activations once the first step has made them)."""
        assert self.host is not None and self.engine is not None
        parts = self.host.buffer_bytes(count_shared=self.cpu_mesh["shard"].get_local_rank() == 0)
        parts["adam_moments"] = self.adam.nbytes() if self.adam is not None else 0
        return parts

    def host_state_bytes(self) -> int:
        """This rank's host buffers in all (``host_buffer_bytes``)."""
        return sum(self.host_buffer_bytes().values())

    def refresh_staging(self) -> None:
        """Rewrite every staging copy from the master rows (after init or a checkpoint load)."""
        assert self.host is not None
        for unit in range(len(self.host.layouts)):
            self.host.write_staging(unit)
        self._staging_barrier()
        if self.engine is not None:
            self.engine.window.root_stale = True

    def _staging_barrier(self) -> None:
        # With a shared staging copy, every rank must have written its rows before any rank loads a block.
        if self.host is not None and self.host.shared is not None:
            dist.barrier(group=self.cpu_mesh["shard"].get_group())

    # --- optimizer -------------------------------------------------------------------------------

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"SlideFSDP runs one CPU AdamW; configure_optimizers returned {len(self.optimizers)} optimizers")
        assert self.host is not None and self.engine is not None
        if self.adam is not None:
            self.adam.close()
        self.adam = CpuAdam(self.host.layouts, self.host.master, self.optimizers[0], self.root_device,
                            getattr(torch, self.optimizer_state_dtype))
        self.engine.gradients.adam = self.adam

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None
        self.engine.phase = FORWARD
        return super().training_step(*args, **kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        assert self.engine is not None
        self.engine.begin_backward()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        assert self.engine is not None
        self.engine.end_backward()

    def clip_gradients(self, max_norm: float | None) -> torch.Tensor | None:
        """With deferred updates: the global norm of the kept host gradients (all units, all ranks), clipped.

        Otherwise the updates already ran during the backward (each unit's gradients checked for
        non-finite values first): wait for them; there is no global norm.
        """
        assert self.engine is not None and self.adam is not None
        if not self.engine.defer_updates:
            self.adam.wait()
            return None
        group = self.cpu_mesh["shard"].get_group() if self.cpu_mesh["shard"].size() > 1 else None
        return self.engine.gradients.clip_kept(max_norm, group)

    def drop_gradients(self, optimizer: Any) -> None:
        assert self.engine is not None
        self.engine.gradients.discard()

    def nonfinite_values(self) -> int:
        assert self.engine is not None
        return self.engine.gradients.take_nonfinite()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)  # forward, backward, clipping
        assert self.engine is not None and self.adam is not None
        self.engine.finish_step(self.adam)
        self._staging_barrier()
        return result

    def apply_delayed_updates(self) -> None:
        """Apply the update ``delayed_update`` keeps for the next step now, on every rank (before weights are read)."""
        if self.engine is None or self.adam is None or not self.engine.gradients.delayed:
            return
        self.engine.gradients.run_delayed()
        self.engine.window.root_stale = True
        self._staging_barrier()

    def on_validation_start(self) -> None:
        self.apply_delayed_updates()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self.apply_delayed_updates()
        super().on_train_end()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Micro-batches that do not end an accumulation window add their gradients on the host, with no update."""
        assert self.engine is not None
        self.engine.accumulating = True
        try:
            yield
        finally:
            self.engine.accumulating = False

    # --- checkpoints -----------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.host_state_dict is not None
        self.apply_delayed_updates()
        return self.host_state_dict.model_state()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        assert self.host_state_dict is not None and self.adam is not None
        self.apply_delayed_updates()
        return self.host_state_dict.optimizer_state(self.adam)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        path = Path(self.broadcast(checkpoint_path))
        self.verify_checkpoint(path)
        if not _is_sharded_checkpoint(path):
            raise ValueError(f"{path} is not a sharded checkpoint folder (with {_METADATA_FILENAME}); SlideFSDP resumes from those")
        assert self.host_state_dict is not None
        state: dict[str, Any] = {"state_dict": self.host_state_dict.model_state()}
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.adam is not None
        if fitting:
            state["optimizer_0"] = self.host_state_dict.optimizer_state(self.adam)
        dcp.load(state, checkpoint_id=path)
        if self.engine is not None and self.adam is not None:  # gradients of the weights that were replaced
            self.engine.gradients.delayed.clear()
            self.engine.gradients.discard()
        if fitting:
            HostStateDict.restore_groups(self.adam, state["optimizer_0"])
        self.refresh_staging()
        return checkpoints.load(path / _METADATA_FILENAME)

    def teardown(self) -> None:
        if self.adam is not None:
            self.adam.close()
            self.adam = None
        if self.host is not None:  # unpinned, not freed: a later validate or test on this trainer copies pageable
            self.host.close()
        super().teardown()


# The name configs and Trainer(strategy=...) use, registered wherever the class is imported.
if SlideFSDPStrategy.strategy_name not in StrategyRegistry:
    SlideFSDPStrategy.register_strategies(StrategyRegistry)
