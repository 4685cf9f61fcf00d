"""``SlideFSDPStrategy``: train models larger than device memory by streaming blocks from the host (after SlideFormer).

The fp32 master weights and the AdamW moments stay in host memory, sharded across the ranks of a node;
the device holds the root (embeddings, final norm, head) and a sliding window of ``window`` blocks in
the compute dtype. Each block's gradients go to the host as soon as its backward is done, and its CPU
AdamW update runs while the device computes the backward of the blocks before it. The life cycle is
``CausalLMStrategy``'s, as for FSDP2: the same model, data, callbacks, LR schedule and checkpoint layout.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lit_fsdp.parallelize import find_blocks
from lit_fsdp.reliability import OnNonFinite
from lit_fsdp.lifecycle import CausalLMStrategy, DType
from offload import adamw_kernel
from offload.activation_plan import ActivationPlanSpec
from offload.auto_update import AutoUpdate, StepRates
from offload.compile import compile_forwards
from offload.cpu_adam import CpuAdam
from offload.engine import FORWARD, SlideEngine
from offload.gradients import GradientPipeline
from offload.host import HostState, SharedMarks, SharedStaging, can_pin, node_tag
from offload.host_memory import UnitSize, speculated_units
from offload.layout import build_layouts, leading_root_places, trained_layouts
from offload.plan import SlidePlan, SlideRun, check_knob_values, model_units, placed_costs, sizes_of
from offload.preflight import UpdateThreads, host_memory_budget
from offload.residency import DeviceWindow, replace_meta_parameters
from offload.state_dict import HostStateDict
from offload.strategy_checkpoints import SlideCheckpoints
from offload.strategy_report import SlideReport
from offload.strategy_update import SlideUpdateChoice
from offload.transfers import Transfers

OptimizerStateDType = Literal["float32", "bfloat16"]


class SlideFSDPStrategy(SlideReport, SlideCheckpoints, SlideUpdateChoice, CausalLMStrategy):
    """Layer-streaming CPU offload (SlideFSDP): master weights and AdamW on the host, a window of blocks on the device."""

    strategy_name = "slide_fsdp"
    default_reduce_dtype = "auto"  # ``reduce_dtype: null``; see ``CausalLMStrategy.default_reduce_dtype``
    recomputes_whole_block = True  # offload.checkpointing runs a recomputed block's whole forward again

    def __init__(
        self,
        window: int = 2,
        param_transfer: Literal["full", "shard"] = "full",
        grad_sync: Literal["gpu_reduce", "cpu_reduce"] = "gpu_reduce",
        activation_offload: Literal["none", "cpu"] = "none",
        param_dtype: DType = "auto",
        reduce_dtype: DType | None = None,
        activation_checkpointing: int = 0,
        activation_plan: ActivationPlanSpec = None,
        compile_blocks: bool = False,
        cpu_threads: int | None = None,
        cpu_binding: Literal["numa", "none"] = "numa",
        control_cores: int = 1,
        optimizer_state_dtype: OptimizerStateDType = "float32",
        master_dtype: OptimizerStateDType = "float32",
        update: Literal["auto", "synchronous", "forward", "split", "speculative", "delayed"] = "auto",
        speculated_blocks: int | None = None,
        delayed_update_warmup: int = 0,
        accumulate_on: Literal["device", "host"] = "device",
        gradient_slots: int | None = None,
        pin_memory: bool = True,
        host_memory_gb: float | None = None,
        host_reserve_gb: float | None = None,
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
                support it, else float32. Master weights stay on the host (``master_dtype``; moments: ``optimizer_state_dtype``).
            reduce_dtype: Dtype the gradients are reduced and copied to the host in; ``auto`` (the default, null)
                follows ``param_dtype``: bfloat16 on GPUs halves the device-to-host bytes, and the CPU update reads it
                as it is.
            activation_checkpointing: Recompute the activations of every k-th block in backward; 0 turns it off.
            activation_plan: Instead, the blocks whose activations stay on the device, wait in pinned host memory or
                are recomputed, in block order: counts such as ``{host: 4, recompute: 20, keep: 8}``, or ``auto`` (the
                fastest mix that fits the device's free memory and the host's, at the link's rate; chosen when the
                model is placed). ``offload.activation_plan``.
            compile_blocks: ``torch.compile`` each block's forward (the engine's hooks stay eager; ``offload.compile``).
            cpu_threads: Threads of this rank's CPU work (the AdamW updates); default: the cores this process may run
                on (affinity, cgroup CPU quota) / processes per node, less one left to the thread that launches kernels
                (with ``cpu_binding: numa``: the rank's cores less ``control_cores``).
            cpu_binding: ``numa`` (GPU runs): every thread of a rank runs on its GPU's NUMA node, on physical cores no
                other local rank uses (the node's cores split among its GPUs; ``offload.cpu_binding``), so the update
                reads local memory; ``none`` leaves affinity alone.
            control_cores: Cores of each rank's share left to the threads that launch kernels and run autograd.
            optimizer_state_dtype: AdamW moments on the host; ``bfloat16`` halves them (8 -> 4 B/param; the update
                still computes in float32, and the moments are rounded to nearest after it).
            master_dtype: The master weights on the host; ``bfloat16`` halves them (4 -> 2 B/param), the update rounding
                them stochastically (``offload.rounding``: unbiased, and the same bits on resume); with a bfloat16
                ``param_dtype`` the master is then the copy the device loads (none of its own, except with
                ``delayed_update`` or LoRA, or several processes with ``param_transfer: full``).
            update: When each step's CPU updates run where clipping or ``on_nonfinite`` (stop, skip_step) needs the
                step's gradient norm first (docs/offload.md#the-update). The exact schedules: ``forward`` updates the
                units after the norm in forward order (the root, then block 0 up) while the next forward runs, each
                load waiting for its own unit's update; ``split`` does so too, but speculates the units whose gradients
                arrive first (the head side, the last ``speculated_blocks`` blocks) during the backward, with a backup
                of their rows alone to undo them if clipping or the guard fires; ``speculative`` speculates every unit
                (a backup of every row); ``synchronous`` updates every unit after the backward and waits. ``auto`` (the
                default) is ``split`` with as many blocks as the host has room for (none: ``forward``). ``delayed``
                (not exact: ZeRO-Offload's one-step delayed update) applies each step's updates during the next
                step's forward and backward, on weights one update old; a checkpoint, a validation and the end of
                training apply the waiting update first. Without clipping or the guard, every exact choice updates each
                unit as its gradients arrive.
            speculated_blocks: With ``split`` (or ``auto``), the last blocks speculated; null: as many as the host has
                room for beside everything else (the preflight, ``estimate`` and ``tune`` count their backup).
            delayed_update_warmup: With ``update: delayed``, the first optimizer steps of training whose updates are
                applied before the next step instead (ZeRO-Offload's DPU warm-up: staleness costs most while the
                weights change fastest).
            accumulate_on: With gradient accumulation, where the micro-batches' gradients are summed: ``device`` (in
                float32, 4 B per trained parameter of the rank's shard; sent once a step, so the updates overlap the
                last backward, whatever the update), or ``host`` (a kept float32 copy; not with ``delayed`` or ``split``).
            gradient_slots: Host buffers for gradients on their way to the CPU update, each the size of a block's
                shard; default (null): one per piece of a backward (the device never waits for an update to free
                one), plus ``max(2, window)`` with ``update: delayed``; ``max(2, window)`` when a kept fp32 gradient
                takes each piece on arrival (accumulation on the host; ``synchronous`` with clipping). Counted by the
                preflight and ``estimate``.
            pin_memory: Pin the host buffers that cross PCIe (GPU only); if pinning fails it is turned off with a warning.
            host_memory_gb: Host memory (GiB per node) the preflight may count on; default: MemAvailable now. Set it
                on a VM whose memory is granted as it is used, where MemAvailable starts far below what the VM gets.
            host_reserve_gb: Host memory (GiB per node) left free beside SlideFSDP's buffers, for a checkpoint's page
                cache, data workers and the allocator's growth: ``auto``'s split, ``activation_plan: auto`` and the
                preflight keep within the rest; default (null): 1/16 of ``host_memory_gb`` or MemAvailable (8 GiB of
                128); 0 keeps nothing back.
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
        check_knob_values(cpu_threads=cpu_threads, host_memory_gb=host_memory_gb, host_reserve_gb=host_reserve_gb,
                          optimizer_state_dtype=optimizer_state_dtype,
                          master_dtype=master_dtype, cpu_binding=cpu_binding, control_cores=control_cores,
                          delayed_update_warmup=delayed_update_warmup, update=update,
                          speculated_blocks=speculated_blocks, accumulate_on=accumulate_on)
        self.window, self.param_transfer, self.grad_sync = window, param_transfer, grad_sync
        self.activation_plan, self.accumulate_on = activation_plan, accumulate_on
        self.activation_offload, self.compile_blocks, self.cpu_threads = activation_offload, compile_blocks, cpu_threads
        self.cpu_binding, self.control_cores = cpu_binding, control_cores
        self.optimizer_state_dtype, self.master_dtype = optimizer_state_dtype, master_dtype
        self.update, self.speculated_blocks, self.delayed_update_warmup = update, speculated_blocks, delayed_update_warmup
        self.gradient_slots = gradient_slots
        self.pin_memory, self.host_memory_gb, self.host_reserve_gb = pin_memory, host_memory_gb, host_reserve_gb
        self.engine: SlideEngine | None = None
        self.host: HostState | None = None
        self.adam: CpuAdam | None = None
        self.host_state_dict: HostStateDict | None = None
        self.update_threads_reason = self.activation_plan_taken = ""  # set in setup_environment, place; in the record
        self.update_taken = ""  # the update schedule as place() took it (``SlidePlan.describe_update``)
        self.speculated_share = 0.0  # of this rank's trained rows, those a split speculates
        self.taken_plan: SlidePlan | None = None  # the plan place() took, its split chosen
        self.auto: AutoUpdate | None = None  # update: auto's choice at run time (``offload.auto_update``)
        self.update_reason = ""  # why the update taken (the log line and results.jsonl)
        self.pending_split: tuple[int | None, str] | None = None  # auto's choice, taken before the next backward
        self.model_sizes: list[UnitSize] = []
        self.forward_began: float | None = None  # the host's clock when the micro-batch's forward began
        self.forward_s = 0.0  # this optimizer step's forwards, as the host ran them
        self.clipped = False  # clipping or the guard fired at this optimizer step
        # where the units' master rows were left at different steps when the optimizer was closed (``CpuAdam.close``)
        self.mixed_steps: str | None = None

    # --- before any worker starts ------------------------------------------------------------------

    def mesh_shape(self, world_size: int, num_nodes: int) -> tuple[int, int]:
        """(nodes, processes per node): master state is sharded within a node and the same on every node."""
        if world_size % num_nodes:
            raise ValueError(f"SlideFSDP: {world_size} processes do not split evenly over {num_nodes} nodes")
        return (num_nodes, world_size // num_nodes)

    def plan(self, trainer: Any, compute: torch.dtype | None = None) -> SlidePlan:
        """This strategy's plan on ``trainer`` (``offload.plan``); ``compute`` overrides the dtype it resolves
        (``estimate`` on a machine without the run's GPU)."""
        compute = compute or self.resolve_dtype(self.param_dtype)
        return SlidePlan(
            window=self.window, param_transfer=self.param_transfer, grad_sync=self.grad_sync,
            activation_offload=self.activation_offload, activation_checkpointing=self.activation_checkpointing,
            optimizer_state_dtype=getattr(torch, self.optimizer_state_dtype), update=self.update,
            gradient_slots=self.gradient_slots, on_nonfinite=self.on_nonfinite,
            run=SlideRun.of_trainer(trainer, self.root_device.type), compute_dtype=compute,
            reduce_dtype=self.resolve_dtype(self.reduce_dtype, fallback=compute),
            master_dtype=getattr(torch, self.master_dtype), activation_plan=self.activation_plan,
            accumulate_on=self.accumulate_on, speculated_blocks=self.speculated_blocks,
        )

    def model_units(self, module: pl.LightningModule, datamodule: Any, shards: int) -> list[UnitSize]:
        """Every unit's size with ``shards`` ranks per node, from the model on the meta device (``offload.plan``)."""
        return model_units(module, datamodule, shards, self.block_class, self.grad_sync == "gpu_reduce")

    def preflight(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None) -> None:
        """The knobs against the run, LoRA's dtype, then the host buffers against the host's memory."""
        super().preflight(trainer, module, datamodule)
        self.plan(trainer).check_knobs()
        self.check_lora(module)
        self.preflight_host(trainer, module, datamodule)

    def preflight_host(self, trainer: Any, module: pl.LightningModule, datamodule: Any = None) -> dict[str, int]:
        """Refuse a run whose host buffers, with the split it would take and its reserve kept, do not fit the host's
        budget (``offload.preflight.host_memory_budget``); returns the bytes counted, per buffer."""
        units = self.model_units(module, datamodule, trainer.num_devices)
        budget = host_memory_budget(self.host_memory_gb, self.host_reserve_gb)
        plan = self.split_plan(trainer, module, datamodule, units, host_bytes=budget[0])
        return plan.check_host(units, *budget, activation_bytes=plan.activation_bytes(units, module, datamodule))

    def check_lora(self, module: pl.LightningModule) -> None:
        """LoRA's frozen base is kept in the compute dtype alone: bfloat16 (or float32) rounds it as FSDP2's cast does,
        so the base's fingerprint (``lit_fsdp.lora.base_record``) matches; float16 would not."""
        lora = (getattr(module, "hparams", None) or {}).get("lora")
        if lora is not None and self.resolve_dtype(self.param_dtype) == torch.float16:
            raise ValueError("SlideFSDP keeps LoRA's frozen base in the compute dtype only, and float16 would round it "
                             "otherwise than the bfloat16 its fingerprint is taken in; set "
                             "--trainer.strategy.init_args.param_dtype bfloat16 (or float32)")

    # --- processes -------------------------------------------------------------------------------

    @property
    def host_collectives(self) -> str | None:
        """Gradients on the host, their norms and checkpoints: gloo beside NCCL (``lit_fsdp.lifecycle.process_group_backend``)."""
        return "SlideFSDP"

    def update_threads(self) -> UpdateThreads:
        """This rank's update threads' plan (``offload.preflight``)."""
        gpus = tuple(device.index for device in self.parallel_devices or () if device.type == "cuda")
        return UpdateThreads(self.root_device, self.cpu_threads, self.cpu_binding, self.control_cores,
                             self.num_processes, self.local_rank, gpus)

    def setup_environment(self) -> None:
        super().setup_environment()
        threads, self.update_threads_reason = self.update_threads().plan()
        rank_zero_info(f"SlideFSDP CPU update: {self.update_threads_reason}")
        if threads is not None:
            torch.set_num_threads(threads)
        # the native update kernel, built once per host (the node's ranks share one build) and loaded before training
        adamw_kernel.prepare(rank=self.global_rank)
        shape = self.mesh_shape(self.world_size, self.num_nodes)
        if self.root_device.type == "cpu":
            self.cpu_mesh = self.device_mesh
        else:  # host tensors (checkpoint DTensors, norms, barriers) get gloo groups of their own
            self.cpu_mesh = init_device_mesh(
                "cpu", shape, mesh_dim_names=("replicate", "shard"), backend_override={"replicate": "gloo", "shard": "gloo"}
            )
        # The worker thread's collectives (cpu_reduce) need a group no other thread uses, or orders could mix.
        self.host_group = dist.new_group(backend="gloo") if self.grad_sync == "cpu_reduce" else None

    # --- model -----------------------------------------------------------------------------------

    def is_placed(self, network: nn.Module) -> bool:
        return self.engine is not None and self.engine.network is network

    def place(self, network: nn.Module, module: pl.LightningModule) -> None:
        trainer = module.trainer
        device = self.root_device
        plan = self.plan(trainer)
        compute, reduce = plan.compute_dtype, plan.reduce_dtype
        blocks = find_blocks(network, self.block_class)
        shard_mesh = self.cpu_mesh["shard"]
        shards, shard_rank = shard_mesh.size(), shard_mesh.get_local_rank()
        block_layouts, root_layout = build_layouts(network, blocks, shards, shard_rank)
        layouts = [*block_layouts, root_layout]
        trained = trained_layouts(layouts, shards, shard_rank)  # LoRA: the adapters; else every parameter
        replace_meta_parameters(network, [*layouts, *trained], device, compute)
        pin = can_pin(device, self.pin_memory)
        full = self.param_transfer == "full"
        shared = None
        if full and shards > 1:
            numel = sum(layout.full_numel for layout in layouts)
            shared = SharedStaging(numel, compute, pin, shard_rank, node_tag(self.node_rank), shard_mesh.get_group())
        sizes = sizes_of(layouts, trained, self.grad_sync == "gpu_reduce", leading_root_places(network, blocks, trained[-1]))
        plan = self.taken_plan = self.start_auto(trainer, self.placed_split(module, sizes), sizes)
        self.host = HostState(
            layouts, compute, reduce, full_staging=full, keep_gradients=plan.schedule.keep_gradients,
            incoming_full=self.grad_sync == "cpu_reduce", ring_size=plan.ring_slots(sizes), pin=pin, shared=shared,
            trained=trained, master_dtype=plan.master_dtype, master_in_staging=plan.master_in_staging(sizes),
        )
        self.host_state_dict = HostStateDict(network, trained, self.host.master, self.cpu_mesh, self.host.frozen_rows())
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
            trained, self.host, None, transfers, gpu_reduce=self.grad_sync == "gpu_reduce", reduce_dtype=reduce,
            world_size=self.world_size, shard_rank=shard_rank, shard_group=device_shards,
            replicate_group=self.device_mesh["replicate"].get_group() if self.num_nodes > 1 else None,
            host_group=self.host_group, schedule=plan.schedule,
            # auto: an empty split, its rows chosen once the first steps are measured (``take_update``)
            speculated=speculated_units(sizes, plan.split_blocks) if plan.split_blocks is not None else
            {} if self.auto is not None else None,
            marks=SharedMarks.on_node(len(layouts), shard_rank, shards, node_tag(self.node_rank), shard_mesh.get_group(),
                                      (self._timeout or default_pg_timeout).total_seconds())
            if shared is not None and plan.schedule.behind_forward else None,
        )
        self.note_speculated(gradients.speculated or {})
        self.update_taken = plan.describe_update(sizes) + self.describe_auto()
        activations = plan.activations(len(blocks), lambda: placed_costs(module, plan, window, sizes, self.host_memory_gb,
                                                                              self.host_reserve_gb))
        self.recomputed_blocks = tuple(activations.blocks("recompute"))
        self.activation_plan_taken = activations.describe()
        self.engine = SlideEngine(
            network, blocks, layouts, window, gradients, transfers, activations, self.activation_offload == "cpu", pin,
            plan.schedule,
        )
        if self.compile_blocks:
            compile_forwards(blocks, device)
        rank_zero_info(f"SlideFSDP: {self.host.describe(compute, shards, pin)}; device window {self.window} blocks; "
                       f"param_transfer {self.param_transfer}, grad_sync {self.grad_sync}; activations: "
                       f"{self.activation_plan_taken}; update: {self.update_taken}")

    def unsteady_steps(self) -> int:
        """The delayed update's synchronous warm-up (``delayed_update_warmup``)."""
        return self.delayed_update_warmup if self.update == "delayed" else 0

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
        self.adam = CpuAdam(self.host.trained, self.host.master, self.optimizers[0], self.root_device,
                            getattr(torch, self.optimizer_state_dtype), rank=self.cpu_mesh["shard"].get_local_rank())
        self.engine.gradients.attach(self.adam)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.engine is not None
        self.engine.phase = FORWARD
        self.forward_began = time.perf_counter()
        return super().training_step(*args, **kwargs)

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        assert self.engine is not None
        if self.forward_began is not None:
            self.forward_s += time.perf_counter() - self.forward_began
            self.forward_began = None
        self.take_update()
        self.engine.begin_backward()

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        assert self.engine is not None
        self.engine.end_backward()

    def clip_gradients(self, max_norm: float | None) -> torch.Tensor | None:
        """With deferred updates: the global norm of the kept host gradients (all units, all ranks), clipped; with
        ``update: delayed`` or ``forward`` (``split``): the norm summed as the pieces arrived, and the clipping
        coefficient the step's updates will take when they run during the next step (or after it, in forward order);
        with ``speculative``: that norm validates the updates that ran during the backward (``offload.speculation``).

        Otherwise the updates already ran during the backward (each unit's gradients checked for
        non-finite values first): wait for them; there is no global norm.
        """
        assert self.engine is not None and self.adam is not None
        group = self.cpu_mesh["shard"].get_group() if self.cpu_mesh["shard"].size() > 1 else None
        if self.engine.schedule.speculate:
            return self.engine.gradients.validate(max_norm, group, self.on_nonfinite)
        if not self.engine.schedule.defer:
            self.adam.wait()
            return None
        if self.engine.schedule.delay:
            return self.engine.gradients.delayed_norm(max_norm, group)
        norm = self.engine.gradients.ordered_norm(max_norm, group, self.on_nonfinite)
        self.clipped = norm is not None and not (bool(torch.isfinite(norm)) and (max_norm is None or float(norm) <= max_norm))
        return norm

    def drop_gradients(self, optimizer: Any) -> None:
        assert self.engine is not None
        self.engine.gradients.discard(undo=True)

    def nonfinite_values(self) -> int:
        assert self.engine is not None
        return self.engine.gradients.take_nonfinite()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)  # forward, backward, clipping
        assert self.engine is not None and self.adam is not None
        step = self.lightning_module.trainer.global_step  # this step's index: the steps before it are done
        done = self.engine.finish_step(self.adam, warming_up=step < self.delayed_update_warmup)
        self.choose_update(StepRates(max(0.0, self.forward_s - done.forward_wait_s), done.device_backward_s,
                                     max(0.0, done.cpu_update_s - done.rollback_s), self.clipped))
        self.forward_s, self.clipped = 0.0, False
        if not self.engine.schedule.behind_forward:  # else each load waits for its unit on every local rank
            self._staging_barrier()
        return result

    def apply_delayed_updates(self) -> None:
        """Finish the updates ``update: delayed`` runs during the next step now, on every rank, and rewrite their
        staging rows (before weights are read: a checkpoint, a validation, the end of training); with ``forward`` (or
        ``split``), wait for the ordered updates still running (a checkpoint reads the master and moments; a load
        waits for its unit anyway)."""
        if self.engine is None or self.adam is None:
            return
        if self.engine.schedule.behind_forward:
            self.adam.wait()
            return
        if not self.engine.schedule.delay:
            return
        self.engine.gradients.apply_delayed()
        if not self.engine.gradients.accumulated:  # mid-step the rows are kept (apply_delayed), the root as loaded
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
        """Micro-batches that do not end an accumulation window add their gradients to the step's sum (``accumulate_on``),
        with no update."""
        assert self.engine is not None
        self.engine.accumulating = True
        try:
            yield
        finally:
            self.engine.accumulating = False

    def on_exception(self, exception: BaseException) -> None:
        """This rank leaves the step: the node's other ranks, waiting for its marks on their shared staging copy, stop
        now rather than at the timeout."""
        marks = self.engine.gradients.marks if self.engine is not None else None
        if marks is not None:
            marks.abandon()
        super().on_exception(exception)

    def teardown(self) -> None:
        if self.engine is not None:  # a run stopped between micro-batches: a later fit starts with no sum
            self.engine.gradients.accumulated.clear()
        if self.adam is not None:  # the updates queued run first: every unit at the step they bring it to
            self.mixed_steps = self.adam.close()
            self.adam = None
        if self.host is not None:  # unpinned, not freed: a later validate or test on this trainer copies pageable
            self.host.close()
        super().teardown()


# The name configs and Trainer(strategy=...) use, registered wherever the class is imported.
if SlideFSDPStrategy.strategy_name not in StrategyRegistry:
    SlideFSDPStrategy.register_strategies(StrategyRegistry)
