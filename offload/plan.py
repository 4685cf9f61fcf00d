"""SlideFSDP's plan: what a run's knobs, its trainer and its model decide before any worker starts.

``SlidePlan`` declares its inputs (the strategy's knobs that shape the host side, the run's processes, accumulation
and clipping, the dtypes) and returns what they decide: the update schedule (``offload.schedule.UpdateSchedule``)
and the refusal of knobs that cannot work together; given the model's units (``model_units``), the host buffers and
the gradient ring, and the refusal of a run that does not fit the host. The strategy's preflight and ``place``,
``estimate`` and ``tune`` build the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from lit_fsdp.parallelize import find_blocks
from offload.gradients import gradient_parts
from offload.host import check_shared_memory
from offload.host_memory import (
    GIB,
    HostSetup,
    UnitSize,
    describe,
    gradient_slots,
    host_buffers,
    master_in_staging,
    offloaded_activation_bytes,
    with_runtime,
)
from offload.layout import build_layouts, trained_layouts
from offload.schedule import UpdateSchedule


@dataclass(frozen=True)
class SlideRun:
    """What the trainer fixes for SlideFSDP's plan."""

    processes_per_node: int  # they shard the master rows between them
    nodes: int
    accumulation: int  # micro-batches per optimizer step
    clipping: bool  # gradient_clip_val is set
    accelerator: str  # cuda or cpu

    @classmethod
    def of_trainer(cls, trainer: Any, accelerator: str) -> "SlideRun":
        """From a Trainer (or ``estimate``'s fields of one) whose strategy runs on ``accelerator``."""
        return cls(trainer.num_devices, trainer.num_nodes, trainer.accumulate_grad_batches,
                   bool(trainer.gradient_clip_val), accelerator)


def model_units(module: Any, datamodule: Any, shards: int, block_class: str | None, gpu_reduce: bool) -> list[UnitSize]:
    """Every unit's size (blocks, then the root) with ``shards`` ranks per node, from the model on the meta device
    (with ``--model.lora``'s adapters, its base frozen, as the run builds it)."""
    from transformers import AutoModelForCausalLM

    from lit_fsdp import lora

    with torch.device("meta"):
        network = AutoModelForCausalLM.from_config(module.hf_config(datamodule))
    adapters = lora.as_config((getattr(module, "hparams", None) or {}).get("lora"))
    if adapters is not None:
        lora.attach(network, adapters)
    block_layouts, root_layout = build_layouts(network, find_blocks(network, block_class), shards, 0)
    layouts = [*block_layouts, root_layout]
    return sizes_of(layouts, trained_layouts(layouts, shards, 0), gpu_reduce)


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


@dataclass(frozen=True)
class SlidePlan:
    """SlideFSDP's host side for one run, decided before it starts (see the module docstring): the knobs and the run
    decide the schedule and the refusals of knobs; with the model's units, the host buffers."""

    # the knobs (``offload.SlideFSDPStrategy``'s constructor arguments)
    window: int
    param_transfer: str
    grad_sync: str
    activation_offload: str
    activation_checkpointing: int
    optimizer_state_dtype: torch.dtype
    delayed_update: bool
    gradient_slots: int | None
    on_nonfinite: str
    # the run
    run: SlideRun
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    speculative_update: bool = False  # knobs, last for the callers that predate them
    master_dtype: torch.dtype = torch.float32

    @cached_property
    def schedule(self) -> UpdateSchedule:
        return UpdateSchedule.of(self.delayed_update, self.run.clipping, self.run.accumulation, self.on_nonfinite,
                                 self.speculative_update)

    def check_knobs(self) -> None:
        """Refuse knobs that cannot work together on this run's devices (no model needed)."""
        run = self.run
        if self.param_transfer == "shard" and run.processes_per_node < 2:
            raise ValueError(
                "SlideFSDP param_transfer: shard all-gathers each block across the devices of a node, but there is "
                "one process per node; use param_transfer: full or more --trainer.devices"
            )
        if self.delayed_update and run.accumulation > 1:
            raise ValueError(
                f"SlideFSDP delayed_update applies a step's update during the next step's first backward, so the "
                f"{run.accumulation} micro-batches of a step would compute with different weights; "
                "set delayed_update: false or accumulate_grad_batches: 1"
            )
        if self.grad_sync == "cpu_reduce" and run.accelerator == "cuda" and run.nodes * run.processes_per_node > 1:
            raise ValueError(
                "SlideFSDP grad_sync: cpu_reduce copies every rank's whole gradients to the host and all-reduces them there "
                "with gloo over TCP (at 8B, 32 GB per rank per step: tens of seconds), where NCCL's reduce-scatter on the "
                "GPUs sends each rank only its 1/N; use grad_sync: gpu_reduce"
            )

    def activation_bytes(self, units: Sequence[UnitSize], module: Any, datamodule: Any) -> int:
        """One rank's checkpointed block inputs kept on the host (``activation_offload: cpu``) for the blocks of
        ``units`` (blocks, then the root), micro-batches of ``datamodule``'s size (None: unknown, not counted) and
        ``module``'s hidden size."""
        if self.activation_offload != "cpu" or datamodule is None:
            return 0
        return offloaded_activation_bytes(len(units) - 1, self.activation_checkpointing, datamodule.batch_size,
                                          datamodule.seq_len, module.hf_config(datamodule).hidden_size,
                                          self.compute_dtype)

    def setup(self, activation_bytes: int = 0) -> HostSetup:
        """What decides the host buffers (``offload.host_memory``)."""
        return HostSetup.of_knobs(self.compute_dtype, self.reduce_dtype, self.optimizer_state_dtype,
                                  self.run.processes_per_node, self.param_transfer, self.grad_sync, self.window,
                                  self.schedule.keep_gradients, activation_bytes, self.gradient_slots,
                                  self.delayed_update, self.schedule.speculate, self.master_dtype)

    def master_in_staging(self, units: Sequence[UnitSize]) -> bool:
        """Whether the master rows are the staging copy's (``offload.host_memory.master_in_staging``)."""
        return master_in_staging(units, self.setup())

    def ring_slots(self, units: Sequence[UnitSize]) -> int:
        """Gradient buffers per rank for ``units`` (``offload.host_memory.gradient_slots``; refuses too few)."""
        return gradient_slots(units, self.setup())

    def host_buffers(self, units: Sequence[UnitSize], activation_bytes: int = 0) -> dict[str, int]:
        """The node's host bytes per buffer for ``units`` (blocks, then the root)."""
        return host_buffers(units, self.setup(activation_bytes))

    def check_host(self, units: Sequence[UnitSize], available: int | None, source: str,
                   activation_bytes: int = 0) -> dict[str, int]:
        """Refuse a run whose host buffers and runtime need more than ``available`` bytes per node (None: unknown,
        not checked); ``source`` says where that figure came from. Returns what it counted, per buffer."""
        parts = with_runtime(self.host_buffers(units, activation_bytes), self.run.processes_per_node)
        needed = sum(parts.values())
        if available is not None and needed > available:
            billions = sum(unit.full_numel for unit in units) / 1e9
            backup = parts.get("speculation_backup", 0)
            fix = (f"set speculative_update: false (its backup is {backup / GIB:.1f} GiB; delayed_update overlaps the "
                   "update without one), use a smaller model or more nodes" if backup else
                   "use a smaller model or more nodes, or drop what keeps gradients (clipping, accumulation, "
                   "on_nonfinite: skip_step)")
            raise ValueError(
                f"SlideFSDP needs {needed / GIB:.1f} GiB of host memory per node for {billions:.2f}B parameters "
                f"({describe(parts)} GiB) but {available / GIB:.1f} GiB are {source}; {fix}"
            )
        if self.param_transfer == "full" and self.run.processes_per_node > 1:  # the node's staging copy: /dev/shm
            check_shared_memory(parts["staging"])
        return parts
