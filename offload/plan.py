"""SlideFSDP's plan: what a run's knobs, its trainer and its model decide before any worker starts.

``SlidePlan`` declares its inputs (the strategy's knobs that shape the host side, the run's processes, accumulation
and clipping, the dtypes) and returns what they decide: the update schedule (``offload.schedule.UpdateSchedule``)
and the refusal of knobs that cannot work together; given the model's units (``model_units``), the host buffers and
the gradient ring, and the refusal of a run that does not fit the host. The strategy's preflight and ``place``,
``estimate`` and ``tune`` build the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
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
    speculated_units,
    with_runtime,
)
from offload.layout import build_layouts, leading_root_places, trained_layouts
from offload.activation_plan import ActivationPlan, ActivationPlanSpec, BlockCosts, block_activation_bytes, choose
from offload.schedule import EXACT_UPDATES, UPDATES, UpdateSchedule
from offload.update_split import choose_split


def check_knob_values(*, cpu_threads: int | None, host_memory_gb: float | None, optimizer_state_dtype: str,
                      host_reserve_gb: float | None = None,
                      master_dtype: str, cpu_binding: str, control_cores: int, delayed_update_warmup: int,
                      update: str, speculated_blocks: int | None, accumulate_on: str) -> None:
    """Refuse, when the strategy is built, a knob's value that no run could take (one line naming it and the fix)."""
    if cpu_threads is not None and cpu_threads < 1:
        raise ValueError(f"cpu_threads={cpu_threads} must be >= 1, or null for usable cores / processes per node, less one")
    if host_memory_gb is not None and not host_memory_gb > 0:
        raise ValueError(f"SlideFSDP host_memory_gb={host_memory_gb} must be > 0, or null for MemAvailable")
    if host_reserve_gb is not None and not host_reserve_gb >= 0:
        raise ValueError(f"SlideFSDP host_reserve_gb={host_reserve_gb} must be >= 0 GiB, or null for 1/16 of the host")
    for knob, value in (("optimizer_state_dtype", optimizer_state_dtype), ("master_dtype", master_dtype)):
        if value not in ("float32", "bfloat16"):
            raise ValueError(f"SlideFSDP {knob}={value!r}: set it to float32 or bfloat16")
    if cpu_binding not in ("numa", "none"):
        raise ValueError(f"SlideFSDP cpu_binding={cpu_binding!r}: set it to numa or none")
    if control_cores < 0:
        raise ValueError(f"SlideFSDP control_cores={control_cores} must be >= 0")
    if delayed_update_warmup < 0:
        raise ValueError(f"SlideFSDP delayed_update_warmup={delayed_update_warmup} must be >= 0 optimizer steps")
    if update not in ("auto", *UPDATES):
        raise ValueError(f"SlideFSDP update={update!r}: set it to auto (the fastest exact schedule that fits), "
                         f"{', '.join(EXACT_UPDATES)} or delayed (docs/offload.md#the-update)")
    if speculated_blocks is not None and (speculated_blocks < 0 or update not in ("auto", "split")):
        raise ValueError(f"SlideFSDP speculated_blocks={speculated_blocks}: the blocks update: split (or auto) "
                         "speculates, >= 0; or null to have the host's room choose")
    if delayed_update_warmup and update != "delayed":
        raise ValueError(f"SlideFSDP delayed_update_warmup={delayed_update_warmup} warms up update: delayed; set "
                         "update: delayed, or delayed_update_warmup: 0")
    if accumulate_on not in ("device", "host"):
        raise ValueError(f"SlideFSDP accumulate_on={accumulate_on!r}: set it to device or host")


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
    blocks = find_blocks(network, block_class)
    block_layouts, root_layout = build_layouts(network, blocks, shards, 0)
    layouts = [*block_layouts, root_layout]
    trained = trained_layouts(layouts, shards, 0)
    return sizes_of(layouts, trained, gpu_reduce, leading_root_places(network, blocks, trained[-1]))


def sizes_of(layouts: list, trained: list, gpu_reduce: bool, leading_places: int = 0) -> list[UnitSize]:
    """Every unit's size (blocks, then the root) from its layout and its trained parameters' layout, the root's
    gradient parts as ``offload.gradients.gradient_parts`` makes them; ``leading_places``: the root's trained
    parameters used before the blocks (``offload.layout.leading_root_places``), whose parts arrive last (one part for
    the whole root: it arrives last)."""
    root_parts = gradient_parts(trained[-1], per_parameter=gpu_reduce)
    sizes = []
    for unit, (layout, trained_layout) in enumerate(zip(layouts, trained)):
        root = unit == len(layouts) - 1
        parts = tuple(p.layout.shard_numel for p in root_parts) if root else ()
        leading = (leading_places if gpu_reduce else len(root_parts)) if root else 0
        sizes.append(UnitSize(layout.full_numel, layout.shard_numel, parts, layout.full_numel - trained_layout.full_numel,
                              layout.shard_numel - trained_layout.shard_numel, leading))
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
    update: str  # ``auto`` or one of ``offload.schedule.UPDATES``
    gradient_slots: int | None
    on_nonfinite: str
    # the run
    run: SlideRun
    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype = torch.float32  # knobs, last for the callers that predate them
    activation_plan: ActivationPlanSpec = None
    accumulate_on: str = "device"
    speculated_blocks: int | None = None  # ``split``'s blocks; None: chosen (``split``)
    split_blocks: int | None = None  # the split taken (``split``): None until chosen, or where nothing is speculated

    @cached_property
    def schedule(self) -> UpdateSchedule:
        """``auto`` is ``split``: by the step-time model, speculating the first-arriving units never slows the ordered
        update, and the split takes only as many blocks as fit (none fit: ``forward``)."""
        update = "split" if self.update == "auto" else self.update
        return UpdateSchedule.of(update, self.run.clipping, self.run.accumulation, self.on_nonfinite, self.accumulate_on)

    def split(self, units: Sequence[UnitSize], available: int | None, activation_bytes: int = 0,
              step_s: Callable[[int | None], float] | None = None) -> "SlidePlan":
        """This plan with its split taken (``offload.update_split``): ``speculated_blocks`` where set, else the most
        blocks whose backup fits ``available`` host bytes per node beside everything else (unknown: none), or, with
        the step-time model ``step_s`` (of the blocks speculated; None: ``forward``), the fastest of those and
        ``forward``. Not a split: this plan."""
        if not self.schedule.split:
            return self
        blocks = len(units) - 1
        if self.speculated_blocks is not None:
            if self.speculated_blocks > blocks:
                raise ValueError(f"SlideFSDP speculated_blocks={self.speculated_blocks}: the model has {blocks} blocks")
            return replace(self, split_blocks=self.speculated_blocks)

        def fits(count: int) -> bool:
            parts = with_runtime(replace(self, split_blocks=count).host_buffers(units, activation_bytes),
                                 self.run.processes_per_node)
            return available is not None and sum(parts.values()) <= available

        return replace(self, split_blocks=choose_split(blocks, fits, step_s))

    def describe_update(self, units: Sequence[UnitSize] = ()) -> str:
        """The update as the run takes it, in words (the log, ``estimate``, ``OffloadReport``); ``units`` tell whether
        a split speculates the root's head side (not where the root trains nothing: LoRA)."""
        schedule = self.schedule
        if not schedule.defer and not schedule.speculate:
            return "overlapped (on arrival: nothing waits for the norm)"
        if schedule.split and self.split_blocks is not None:
            head = not units or len(units) - 1 in speculated_units(units, self.split_blocks)
            speculated = [*(["the root's head side"] if head else []),
                          *([f"the last {self.split_blocks} blocks"] if self.split_blocks else [])]
            return f"split: {' and '.join(speculated) or 'nothing'} speculated, the rest in forward order"
        return {"delayed": "delayed by one step", "forward": "forward order after the norm", "after": "synchronous",
                "overlapped": "speculative"}[schedule.name]

    @property
    def host_accumulation(self) -> int:
        """Micro-batches whose gradients the host receives per optimizer step: 1 where the device sums them."""
        return 1 if self.schedule.accumulate_on_device else self.run.accumulation

    def accumulator_bytes(self, units: Sequence[UnitSize]) -> int:
        """One rank's device bytes for the micro-batches' float32 sum of its trained rows (0 without accumulation on
        the device): its shard of each unit with ``gpu_reduce``, the whole gradients with ``cpu_reduce``."""
        if not self.schedule.accumulate_on_device:
            return 0
        shards = self.run.processes_per_node if self.grad_sync == "cpu_reduce" else 1
        return sum(unit.trained().shard_numel for unit in units) * shards * 4

    def check_knobs(self) -> None:
        """Refuse knobs that cannot work together on this run's devices (no model needed)."""
        run = self.run
        if self.window < 1:
            raise ValueError(f"SlideFSDP window={self.window}: at least 1 block must fit on the device; set window >= 1")
        if self.gradient_slots is not None and self.gradient_slots < 1:
            raise ValueError(f"SlideFSDP gradient_slots={self.gradient_slots} must be >= 1, or null to have it chosen")
        spec = self.activation_plan
        if spec is not None and spec != "auto" and not isinstance(spec, dict):
            raise ValueError(f"SlideFSDP activation_plan={spec!r}: give block counts per mode such as "
                             "{host: 4, recompute: 20, keep: 8}, or auto")
        recomputes = self.activation_checkpointing if spec is None else spec == "auto" or spec.get("recompute", 0)
        if self.activation_offload == "cpu" and not recomputes:
            raise ValueError("activation_offload: cpu offloads the inputs of recomputed blocks; set "
                             "activation_checkpointing >= 1 (or recompute blocks in activation_plan)")
        if self.param_transfer == "shard" and run.processes_per_node < 2:
            raise ValueError(
                "SlideFSDP param_transfer: shard all-gathers each block across the devices of a node, but there is "
                "one process per node; use param_transfer: full or more --trainer.devices"
            )
        if self.update == "delayed" and run.accumulation > 1 and self.accumulate_on == "host":
            raise ValueError(
                f"SlideFSDP update: delayed with accumulate_on: host would rewrite a unit's staging rows after the "
                f"first of a step's {run.accumulation} micro-batches, so the others would compute with newer weights; "
                "set accumulate_on: device (the sum is sent once, in the last micro-batch) or update: auto"
            )
        if self.update == "split" and run.accumulation > 1 and self.accumulate_on == "host":
            raise ValueError("SlideFSDP update: split speculates updates from the gradient as it arrives, and with "
                             "accumulate_on: host the step's gradient is whole only at its end; set accumulate_on: "
                             "device, or update: forward")
        if self.grad_sync == "cpu_reduce" and run.accelerator == "cuda" and run.nodes * run.processes_per_node > 1:
            raise ValueError(
                "SlideFSDP grad_sync: cpu_reduce copies every rank's whole gradients to the host and all-reduces them there "
                "with gloo over TCP (at 8B, 32 GB per rank per step: tens of seconds), where NCCL's reduce-scatter on the "
                "GPUs sends each rank only its 1/N; use grad_sync: gpu_reduce"
            )

    def activations(self, blocks: int, costs: Callable[[], BlockCosts] | None = None) -> ActivationPlan:
        """Each of ``blocks`` blocks' activation mode (``offload.activation_plan``): ``activation_plan``'s counts, the
        fastest that fits for ``auto`` (``costs()`` gives what it weighs), else ``activation_checkpointing``'s."""
        if self.activation_plan is None:
            return ActivationPlan.every(blocks, self.activation_checkpointing)
        if self.activation_plan == "auto":
            if costs is None:
                raise ValueError("SlideFSDP activation_plan: auto is chosen from the device's free memory when the "
                                 "model is placed; this plan has no costs to choose from")
            return choose(blocks, costs()).plan
        return ActivationPlan.of_counts(self.activation_plan, blocks)

    def activation_bytes(self, units: Sequence[UnitSize], module: Any, datamodule: Any) -> int:
        """One rank's activations on the host for the blocks of ``units`` (blocks, then the root): the saved tensors of
        ``host`` blocks and, with ``activation_offload: cpu``, recomputed blocks' inputs, for micro-batches of
        ``datamodule``'s size (None: unknown, not counted). ``auto`` keeps within what the host has left when the
        model is placed, so nothing is counted for it here."""
        if datamodule is None or self.activation_plan == "auto":
            return 0
        plan = self.activations(len(units) - 1)
        saved, block_input = saved_activation_bytes(module.hf_config(datamodule), datamodule.batch_size * datamodule.seq_len,
                                                    self.compute_dtype)
        inputs = plan.count("recompute") * block_input if self.activation_offload == "cpu" else 0
        return plan.count("host") * saved + inputs

    def setup(self, activation_bytes: int = 0) -> HostSetup:
        """What decides the host buffers (``offload.host_memory``)."""
        return HostSetup.of_knobs(self.compute_dtype, self.reduce_dtype, self.optimizer_state_dtype,
                                  self.run.processes_per_node, self.param_transfer, self.grad_sync, self.window,
                                  self.schedule.keep_gradients, activation_bytes, self.gradient_slots,
                                  self.schedule.delay, self.schedule.speculate, self.master_dtype,
                                  self.schedule.ordered, self.split_blocks if self.schedule.split else None)

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
            backup, activations = parts.get("speculation_backup", 0), parts.get("activations", 0)
            fix = (f"put fewer blocks on the host in activation_plan (their activations take {activations / GIB:.1f} "
                   "GiB; recompute them instead), or use auto" if self.activation_plan not in (None, "auto")
                   and activations else
                   f"set update: auto (its backup is {backup / GIB:.1f} GiB; auto speculates only the blocks the host "
                   "has room for), use a smaller model or more nodes" if backup else
                   "use a smaller model or more nodes, or drop what keeps gradients (clipping, accumulation, "
                   "on_nonfinite: skip_step)")
            raise ValueError(
                f"SlideFSDP needs {needed / GIB:.1f} GiB of host memory per node for {billions:.2f}B parameters "
                f"({describe(parts)} GiB) but {available / GIB:.1f} GiB are {source}; {fix}"
            )
        if self.param_transfer == "full" and self.run.processes_per_node > 1:  # the node's staging copy: /dev/shm
            check_shared_memory(parts["staging"])
        return parts


def saved_activation_bytes(config: Any, tokens: int, compute_dtype: torch.dtype) -> tuple[int, int]:
    """(a block's saved activations, its input) in bytes for ``tokens`` tokens of the Hugging Face ``config``."""
    from lit_fsdp.flops import matmul_shape

    shape = matmul_shape(config)
    gated = config.model_type != "gpt2"  # the Llama-like families' MLPs and every expert are gated
    return block_activation_bytes(config.hidden_size, shape.mlp_width, gated, tokens, compute_dtype.itemsize,
                                  shape.routed_copies, shape.router_logits)


#: Of the device memory free once the window and the root are placed, the share activations may take: the rest is
#: the allocator's slack and the transient buffers of the step (gradients before their copy, collectives)
DEVICE_SHARE = 0.85
#: The share of the device's dense peak a block's matmuls reach (the H100 records: 45-55%, docs/gpu.md)
COMPUTE_EFFICIENCY = 0.5


def block_costs(plan: SlidePlan, config: Any, data: Any, units: Sequence[UnitSize], flops_per_s: float,
                device_free: int, host_free: int, link_bytes_per_s: float) -> BlockCosts:
    """What ``auto`` weighs for ``data``'s micro-batches of ``config``'s model: a block's saved activations, input and
    weights, its forward at ``flops_per_s``, and the memory and the link rate given (``placed_costs`` measures them,
    ``estimate`` takes them from the hardware file)."""
    from lit_fsdp.flops import flops_per_token

    tokens = data.batch_size * data.seq_len
    saved, block_input = saved_activation_bytes(config, tokens, plan.compute_dtype)
    forward_flops = tokens * flops_per_token(config, data.seq_len) / 3 / (len(units) - 1)
    return BlockCosts(saved, block_input, units[0].full_numel * plan.compute_dtype.itemsize, forward_flops / flops_per_s,
                      device_free, max(0, host_free), link_bytes_per_s, plan.activation_offload == "cpu")


def placed_host_buffers(host: Any) -> tuple[str, ...]:
    """The buffers of ``offload.host_memory.host_buffers`` that ``host`` (``HostState``) holds in memory once placed:
    the master and the staging copy (written by then, every rank's: the staging barrier), the kept gradients (zeroed),
    and the gradient ring if pinned (registering it faults its pages in; else untouched until the first step)."""
    return ("master", "staging", "kept_gradients", *(("gradient_ring",) if host.incoming.region.pinned else ()))


def placed_costs(module: Any, plan: SlidePlan, window: Any, units: Sequence[UnitSize],
                 host_memory_gb: float | None, host_reserve_gb: float | None = None) -> BlockCosts:
    """``activation_plan: auto``'s costs, once the window, the root and the micro-batches' gradient sums are on the
    device: its free memory less the loss's, the host's (less its reserve) less SlideFSDP's buffers not yet in it
    (``host_memory_gb``: all of them), the link's rate timed on a block's weights, a block's forward from its FLOPs at ``COMPUTE_EFFICIENCY`` of
    the device's peak (on a CPU: nominal rates, for tests)."""
    from lit_fsdp.device_peaks import peak_tflops
    from lit_fsdp.loss import loss_bytes
    from offload.host_memory import with_runtime
    from offload.preflight import available_host_bytes, host_memory_budget

    data = module.trainer.datamodule
    config = module.hf_config(data)
    device = window.device
    loss = loss_bytes(data.batch_size * data.seq_len, config.vocab_size, config.hidden_size, plan.compute_dtype.itemsize,
                      (getattr(module, "hparams", None) or {}).get("loss_chunk_tokens", 0))
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        rate = window.transfers.measure_h2d(window.slots[0].buffer, window.host.staging[0])
        peak = (peak_tflops(torch.cuda.get_device_name(device), plan.compute_dtype) or 100.0) * 1e12
    else:
        free, rate, peak = (available_host_bytes() or 0) // 4, 10e9, 2e11
    host, _ = host_memory_budget(host_memory_gb, host_reserve_gb)
    to_come = with_runtime(plan.host_buffers(units), plan.run.processes_per_node)
    if host_memory_gb is None:  # MemAvailable, read now, already lacks what is placed and written: not counted twice
        for name in placed_host_buffers(window.host):
            to_come.pop(name)
    host_left = (host or 0) - sum(to_come.values())
    device_left = int(free * DEVICE_SHARE) - loss  # the micro-batches' sums are allocated: not free any more
    return block_costs(plan, config, data, units, peak * COMPUTE_EFFICIENCY, device_left, host_left, rate)
