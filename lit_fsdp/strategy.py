"""lit_fsdp's strategies: the life cycle they share (``CausalLMStrategy``) and FSDP2 (``FSDP2Strategy``).

Both follow Lightning's ``ModelParallelStrategy``: ``setup_environment`` builds the process group and
the device mesh, ``setup`` places the network (shards, materialises and initialises it) and then
builds the optimizer on what it placed; checkpoints are sharded (torch.distributed.checkpoint) or one
full file. ``offload.SlideFSDPStrategy`` is the other strategy built on ``CausalLMStrategy``.
"""

from __future__ import annotations

import json
import math
from abc import abstractmethod
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from compress.communicator import CommStats
from compress.config import CompressionConfig
from compress.hook import GradientCompression
from compress.torch_compat import bf16_native
from lit_fsdp.diloco import (OuterConfig, OuterSync, load_replica_state, outer_fragments, replica_state,
                             replicate_group)
from lit_fsdp.loss import target_count
from lit_fsdp.lightning_compat import default_process_group_backend as _get_default_process_group_backend_for_device
from lit_fsdp.lightning_compat import optimizers_to_device as _optimizers_to_device
from lit_fsdp.lightning_compat import logged_step as _logged_step
from lit_fsdp.lightning_compat import set_num_threads_if_needed as _set_num_threads_if_needed
from lit_fsdp.parallelize import ShardingPlan, parallelize
from lit_fsdp.reliability import AtomicCheckpoints, NonFiniteGuard, OnNonFinite
from lit_fsdp.reporting import CompressionReport, StrategyReport
from lit_fsdp.weights import materialize

Sharding = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
_HOOK_STATE = "comm_hook."  # checkpoint keys of each rank's compression state: comm_hook.rank<r>/<key>
_OUTER_STATE = "outer."  # each rank's semi-synchronous state and replica: outer.rank<r>/<key>
ADAM_STATE_BYTES = 16  # FSDP2's model states per trained parameter: fp32 weight, gradient and two AdamW moments
FROZEN_STATE_BYTES = 4  # per frozen parameter (LoRA's base): its sharded fp32 weight, no gradient, no AdamW state
_GIB = 2**30


def model_state_bytes(parameters: int, trained: int) -> int:
    """FSDP2's model states of ``parameters``, ``trained`` of them trained and the rest frozen, before sharding."""
    return ADAM_STATE_BYTES * trained + FROZEN_STATE_BYTES * (parameters - trained)


def resolve_dtype(name: DType, device: torch.device, fallback: torch.dtype | None = None) -> torch.dtype:
    """The dtype a strategy's ``param_dtype``/``reduce_dtype`` names; ``auto`` is ``fallback``, else bfloat16 on GPUs
    that compute it in hardware (Ampere and newer; V100 and T4 only emulate it, slower than float32), else float32."""
    if name == "auto":
        if fallback is not None:
            return fallback
        return torch.bfloat16 if bf16_native(device) else torch.float32
    return getattr(torch, name)


def process_group_backend(requested: str | None, device: torch.device, host_collectives: str | None) -> str:
    """The ``init_process_group`` backend of a strategy on ``device``.

    ``host_collectives`` says why the strategy runs collectives on CPU tensors (None: it does not). On a GPU
    those need a CPU backend beside NCCL: the default is then ``cpu:gloo,cuda:nccl`` (with Lightning's plain
    ``nccl`` they fail: "No backend type associated with device type cpu") and a requested backend without a
    CPU part is refused. Otherwise: ``requested``, or Lightning's default for the device.
    """
    on_host = host_collectives is not None and device.type == "cuda"
    if not requested:
        return "cpu:gloo,cuda:nccl" if on_host else _get_default_process_group_backend_for_device(device)
    if on_host and not _serves_cpu(requested):
        raise ValueError(
            f"process_group_backend {requested!r} has no CPU part, but {host_collectives} runs collectives on CPU tensors "
            "(gradient norms, checkpoints); set --trainer.strategy.init_args.process_group_backend cpu:gloo,cuda:nccl "
            "or leave it unset"
        )
    return requested


def _serves_cpu(backend: str) -> bool:
    """Whether a backend string (``nccl``, ``gloo``, ``cpu:gloo,cuda:nccl``) has a CPU part; a custom backend is trusted."""
    if ":" in backend:
        return any(part.split(":")[0].strip().lower() == "cpu" for part in backend.split(","))
    devices = dist.Backend.backend_capability.get(backend.strip().lower())
    return devices is None or "cpu" in devices


def check_device_memory(parameters: int, rows: int, mesh: tuple[int, ...], cpu_offload: bool,
                        compression: CompressionConfig | None, device_bytes: int, trained: int | None = None) -> None:
    """Raise ValueError when FSDP2's model states and the compression state alone exceed one GPU's ``device_bytes``.

    ``mesh`` is the strategy's ``(shard,)`` or ``(replicate, shard)``; ``rows`` the hidden size (PowerSGD's Q);
    ``trained`` the parameters that train (LoRA's adapters, within ``parameters``; default all): only they have
    gradients, AdamW state and compression state. A floor, not an estimate: activations, gathered units and the
    allocator come on top (``python -m lit_fsdp tune`` estimates those), so what this refuses cannot fit at any
    micro-batch.
    """
    trained = parameters if trained is None else trained
    replicas, shard = mesh if len(mesh) == 2 else (1, mesh[0])
    states = 0 if cpu_offload else model_state_bytes(parameters, trained) // shard
    kept = compression.state_bytes(trained, shard, replicas, rows) if compression is not None else 0
    if states + kept <= device_bytes:
        return
    have = f"one GPU has {device_bytes / _GIB:.1f} GiB"
    billions = f"{parameters / 1e9:.1f}B parameters"
    lora = trained < parameters
    if lora:
        billions += f", {trained / 1e6:.1f}M of them trained (LoRA)"
    each = (f"{FROZEN_STATE_BYTES} bytes per frozen parameter, {ADAM_STATE_BYTES} per trained one," if lora
            else f"{ADAM_STATE_BYTES} bytes each")
    if states > device_bytes or not kept:
        raise ValueError(
            f"FSDP2's model states need {states / _GIB:.1f} GiB per GPU for {billions} ({each} "
            f"over {shard} shard(s)) but {have}; shard over more GPUs (sharding FULL_SHARD, more devices), set "
            "--trainer.strategy.init_args.cpu_offload true or use offload.SlideFSDPStrategy"
        )
    assert compression is not None
    per = compression.state_bytes_per_param(rows)
    what, fix = compression.state_advice("--trainer.strategy.init_args.compression")
    if states and kept <= device_bytes:
        fix += ", or move the model states to the host with --trainer.strategy.init_args.cpu_offload true"
    raise ValueError(
        f"{what} need {kept / _GIB:.1f} GiB per GPU ({per:g} bytes per trained parameter of the whole model, for "
        f"{billions}; sharding does not divide them) beside {states / _GIB:.1f} GiB of model states, but {have}: {fix}"
    )


def _semi_synchronous(sync_every: int, outer: OuterConfig | dict | None, comm_hook: Any,
                      save_distributed_checkpoint: bool) -> tuple[int, OuterConfig | None]:
    """``sync_every`` and its ``OuterConfig`` (DiLoCo's defaults when unset), or a one-line refusal."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 0:
        raise ValueError(f"sync_every={sync_every!r}: give the optimizer steps between synchronisations of the replica "
                         "groups, an integer >= 1, or 0 to synchronise every step")
    if not sync_every:
        if outer is not None:
            raise ValueError("outer sets the outer step of semi-synchronous training; set sync_every too (e.g. 32)")
        return 0, None
    if comm_hook is not None:
        raise ValueError(f"sync_every={sync_every} exchanges pseudo-gradients between replicas every {sync_every} steps, "
                         "which a per-step compression hook cannot take part in; drop compression/comm_hook and give "
                         "the codec as outer.codec (e.g. {method: int8, num_bits: 4})")
    if not save_distributed_checkpoint:
        raise ValueError(f"sync_every={sync_every}: each replica's weights differ between synchronisations and every "
                         "rank checkpoints its own; keep save_distributed_checkpoint true")
    config = OuterConfig(**outer) if isinstance(outer, dict) else outer or OuterConfig()
    config.check(sync_every)
    return sync_every, config


def check_precision(trainer: pl.Trainer, strategy: Any) -> None:
    """lit_fsdp's strategies set the compute dtype with ``param_dtype``; the trainer's precision must stay 32-true."""
    if trainer.precision not in ("32-true", "32"):
        raise ValueError(
            f"--trainer.precision {trainer.precision} is not used by {type(strategy).__name__}; leave it at 32-true and "
            "set --trainer.strategy.init_args.param_dtype bfloat16 instead"
        )


@runtime_checkable
class GradientCommHook(Protocol):
    """Everything FSDP2Strategy asks of a hook that changes how FSDP2 modules communicate gradients (compression's
    ``compress.hook.GradientCompression``, or your own: subclass ``CommHook`` and write ``register``)."""

    #: True: the hook averages across the replicate mesh dimension itself (``set_all_reduce_hook``), and the strategy
    #: shards over the shard sub-mesh only.
    replaces_replicate_all_reduce: bool
    #: The hook's counters (bytes, times, non-finite values the guard reads), or None for a hook that keeps none.
    stats: CommStats | None

    def register(self, module: FSDPModule, mesh: DeviceMesh) -> None:
        """Install the hook on one FSDP module (``set_custom_reduce_scatter``, all-reduce hooks, ...)."""

    def optimizer(self, params: Any, **adamw: Any) -> torch.optim.Optimizer | None:
        """The optimizer the hook needs in place of AdamW (1-bit Adam's), built from AdamW's arguments; None: AdamW."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's hook state (residuals, warm starts) that a checkpoint keeps: {} for none."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Adopt what ``state_dict`` returned, read back from a checkpoint."""


class CommHook:
    """The defaults of every ``GradientCommHook`` member but ``register``: no replicate all-reduce of its own, no
    counters, AdamW, no state."""

    replaces_replicate_all_reduce = False
    stats = None

    def register(self, module: FSDPModule, mesh: DeviceMesh) -> None:
        raise NotImplementedError(f"{type(self).__name__} must say how it installs itself on an FSDP module")

    def optimizer(self, params: Any, **adamw: Any) -> torch.optim.Optimizer | None:
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint holds {sorted(state)[:3]}")


class CausalLMStrategy(NonFiniteGuard, AtomicCheckpoints, ModelParallelStrategy, StrategyReport):
    """The life cycle of a lit_fsdp strategy: process group and mesh, checks, placing the network, optimizers.

    A subclass says what its mesh is (``mesh_shape``), how it places ``LightningModule.model`` on the
    devices (``place``) and whether that already happened (``is_placed``). From ``lit_fsdp.reliability``
    every step is guarded against non-finite values (``on_nonfinite``) and every checkpoint is written
    aside and renamed into place after its manifest.
    """

    strategy_name = ""

    def __init__(
        self,
        block_class: str | None,
        param_dtype: DType,
        reduce_dtype: DType,
        activation_checkpointing: int,
        on_nonfinite: OnNonFinite,
        save_distributed_checkpoint: bool,
        process_group_backend: str | None,
        timeout: timedelta | None,
    ):
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size="auto",
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if activation_checkpointing < 0:
            raise ValueError(f"activation_checkpointing must be >= 0 (0 off, k every k-th block), got {activation_checkpointing}")
        self.block_class = block_class
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.activation_checkpointing = activation_checkpointing
        self.on_nonfinite = on_nonfinite

    # --- before any worker starts ------------------------------------------------------------------

    @abstractmethod
    def mesh_shape(self, world_size: int, num_nodes: int) -> tuple[int, ...]:
        """The device mesh: (shard,) or (replicate, shard); raises ValueError when it cannot be built."""

    def check_compression(self, trainer: Any) -> None:
        """Fail before launch on compression settings that cannot run here; a strategy without compression has none."""

    def preflight(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None) -> None:
        """Checks that need no process group, run by the CLI before Lightning starts the other processes."""
        self.mesh_shape(trainer.num_nodes * trainer.num_devices, trainer.num_nodes)
        self._get_process_group_backend()

    # --- mesh ------------------------------------------------------------------------------------

    @property
    def host_collectives(self) -> str | None:
        """Why this strategy runs collectives on CPU tensors (None: it does not); on GPUs they need gloo beside NCCL."""
        return None

    def _get_process_group_backend(self) -> str:
        return process_group_backend(self._process_group_backend, self.root_device, self.host_collectives)

    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            # Lightning's launcher limits threads (cores / processes) only in the process that launches
            # the others; the ranks it starts keep every core each and oversubscribe the CPU.
            _set_num_threads_if_needed(self.num_processes)
        self._setup_distributed()
        shape = self.mesh_shape(self.world_size, self.num_nodes)
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        self._device_mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # Every rank is a data-parallel rank: there is no tensor parallelism here.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # --- model -----------------------------------------------------------------------------------

    def resolve_dtype(self, name: DType, fallback: torch.dtype | None = None) -> torch.dtype:
        return resolve_dtype(name, self.root_device, fallback)

    @abstractmethod
    def is_placed(self, network: torch.nn.Module) -> bool:
        """Whether ``network`` was already placed by this strategy (validate/test after fit reuse it)."""

    @abstractmethod
    def place(self, network: torch.nn.Module, module: pl.LightningModule) -> None:
        """Put ``network`` on the devices and fill its weights with ``module.initialize_weights``."""

    def move_module(self, module: pl.LightningModule) -> None:
        """Move the metrics and any other state outside the network to the device (the network is placed)."""
        module.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        network = getattr(module, "model", None)
        if not isinstance(network, torch.nn.Module) or not hasattr(module, "initialize_weights"):
            raise TypeError(
                f"{type(self).__name__} places `LightningModule.model` and fills it with "
                "`LightningModule.initialize_weights(blocks)`; lit_fsdp.CausalLM provides both"
            )
        check_precision(trainer, self)
        if not self.is_placed(network):
            self.place(network, module)
        self.move_module(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @property
    def label(self) -> str:
        """The strategy's name in results records and sweeps (``slide_fsdp``; FSDP2 adds its sharding mode)."""
        return self.strategy_name

    def compute_dtype(self) -> torch.dtype:
        return self.resolve_dtype(self.param_dtype)

    def _holds_adapters(self, path: Path) -> bool:
        """Whether ``path`` is a LoRA checkpoint (adapters only) for this run's base; refused in one line where one of
        the two is LoRA and the other not, or where the checkpoint's base or adapters differ from this run's."""
        from lit_fsdp import checkpoints, lora

        self.verify_checkpoint(path)
        saved = (checkpoints.inspect(path).manifest or {}).get("lora")
        current = getattr(self.lightning_module, "adapter_checkpoint", None)
        if saved is None and current is not None:
            raise checkpoints.CheckpointError(
                f"checkpoint {path} holds a whole model, not LoRA adapters; to fine-tune it with --model.lora, export "
                f"it (python -m lit_fsdp export {path} FOLDER) and start from --model.pretrained_path FOLDER")
        if saved is not None and current is None:
            raise checkpoints.CheckpointError(
                f"checkpoint {path} holds only LoRA adapters, for the base {saved['base']}; resume it with "
                f"--model.lora '{json.dumps(saved['lora'])}' on that base, or export it merged: python -m lit_fsdp "
                f"export {path} FOLDER")
        if saved is not None:
            lora.check_same_base(saved, current, path)
        return saved is not None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        summary = (cls.__doc__ or cls.__name__).strip().splitlines()[0]
        strategy_registry.register(cls.strategy_name, cls, description=f"{summary} (lit_fsdp)")


class FSDP2Strategy(CausalLMStrategy):
    """Fully sharded data parallel (FSDP2, ``fully_shard``) for Hugging Face causal LMs."""

    strategy_name = "lit_fsdp"

    def __init__(
        self,
        sharding: Sharding = "FULL_SHARD",
        replicate_size: int | None = None,
        block_class: str | None = None,
        blocks_per_group: int = 1,
        param_dtype: DType = "auto",
        reduce_dtype: DType = "float32",
        activation_checkpointing: int = 0,
        compile_blocks: bool = False,
        prefetch: int = 0,
        cpu_offload: bool = False,
        comm_hook: GradientCommHook | None = None,
        compression: CompressionConfig | None = None,
        on_nonfinite: OnNonFinite = "stop",
        sync_every: int = 0,
        outer: OuterConfig | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        """
        Args:
            sharding: FULL_SHARD (params, grads and optimizer state sharded; params re-gathered in backward),
                SHARD_GRAD_OP (params stay gathered between forward and backward), NO_SHARD (replicated, like DDP),
                HYBRID_SHARD (replicated across ``replicate_size`` groups, sharded within each).
            replicate_size: Replica groups for HYBRID_SHARD; must divide the world size. Default: the number of nodes.
            block_class: Class name of the transformer block to wrap; default: the model's ``_no_split_modules``.
            blocks_per_group: Consecutive blocks sharded as one FSDP unit (fewer, larger collectives).
            param_dtype: Dtype of parameters in forward and backward; ``auto`` is bfloat16 on GPUs that support it,
                else float32. Master weights and optimizer state stay float32.
            reduce_dtype: Dtype of gradient reduction; ``auto`` follows ``param_dtype``.
            activation_checkpointing: Recompute activations of every k-th block in backward; 0 turns it off,
                1 checkpoints every block.
            compile_blocks: ``torch.compile`` each block.
            prefetch: Units whose parameters are gathered ahead, in forward and backward; 0 leaves FSDP2's
                implicit one-ahead schedule.
            cpu_offload: torch's ``CPUOffloadPolicy``: sharded parameters, gradients and the AdamW step stay on
                the CPU, and each unit is copied to the device when gathered (see offload.SlideFSDPStrategy for
                streaming that overlaps the CPU update with the backward).
            comm_hook: Gradient communication hook registered on every FSDP module.
            compression: Gradient compression, e.g. ``{method: int8, num_bits: 8, error_feedback: false}``; see
                ``python -m lit_fsdp compressors``. Method ``none`` registers no hook at all.
            on_nonfinite: A step whose loss or gradient norm is not finite (or whose compressed gradients held
                non-finite values): ``stop`` the run with a one-line error before the update, ``skip_step`` on every
                rank, or ``warn`` and apply it.
            sync_every: Semi-synchronous training (DiLoCo): each replica group (HYBRID_SHARD's shard groups; with
                NO_SHARD each rank) takes this many optimizer steps on its own, then the groups average and apply
                their pseudo-gradients (``outer``); 0 synchronises every step's gradients.
            outer: The outer step with ``sync_every``: learning rate, momentum, the pseudo-gradients' codec,
                streaming fragments and delay (``lit_fsdp.diloco.OuterConfig``; default DiLoCo's).
            save_distributed_checkpoint: Sharded checkpoint folder (one file per rank); False writes one full file.
            process_group_backend: ``gloo``, ``nccl`` or per device (``cpu:gloo,cuda:nccl``); default from the device,
                and ``cpu:gloo,cuda:nccl`` on GPUs with ``cpu_offload`` (gradient norms of CPU DTensors need gloo).
            timeout: Collective timeout.
        """
        super().__init__(block_class, param_dtype, reduce_dtype, activation_checkpointing, on_nonfinite,
                         save_distributed_checkpoint, process_group_backend, timeout)
        if blocks_per_group < 1 or prefetch < 0:
            raise ValueError(f"blocks_per_group must be >= 1 and prefetch >= 0; got {blocks_per_group}, {prefetch}")
        if replicate_size is not None and (replicate_size < 1 or sharding != "HYBRID_SHARD"):
            raise ValueError(f"replicate_size={replicate_size} needs sharding=HYBRID_SHARD and a value >= 1")
        self.sharding = sharding
        self.replicate_size = replicate_size
        self.blocks_per_group = blocks_per_group
        self.compile_blocks = compile_blocks
        self.prefetch = prefetch
        self.cpu_offload = cpu_offload
        if compression is not None and compression.active:
            if comm_hook is not None:
                raise ValueError("set either compression or comm_hook on the strategy, not both")
            comm_hook = GradientCompression(compression)
        self.compression = compression
        self.comm_hook = comm_hook
        self.fsdp_modules: list[FSDPModule] = []
        self._nonfinite_seen = 0
        self.sync_every, self.outer = _semi_synchronous(sync_every, outer, comm_hook, save_distributed_checkpoint)
        self.outer_sync: OuterSync | None = None
        self._outer_group: dist.ProcessGroup | None = None

    @property
    def label(self) -> str:
        """``fsdp2`` for FULL_SHARD, ``fsdp2_shard_grad_op``, ``fsdp2_no_shard`` or ``fsdp2_hybrid_shard`` otherwise;
        ``_diloco<H>`` after it when semi-synchronous."""
        label = "fsdp2" if self.sharding == "FULL_SHARD" else f"fsdp2_{self.sharding.lower()}"
        return f"{label}_diloco{self.sync_every}" if self.sync_every else label

    # --- mesh ------------------------------------------------------------------------------------

    @property
    def host_collectives(self) -> str | None:
        return "cpu_offload: true" if self.cpu_offload else None

    def mesh_shape(self, world_size: int, num_nodes: int) -> tuple[int, ...]:
        """(shard,) for FULL_SHARD / SHARD_GRAD_OP, (replicate, shard) for NO_SHARD / HYBRID_SHARD."""
        if self.sharding == "NO_SHARD":
            shape = (world_size, 1)
        elif self.sharding == "HYBRID_SHARD":
            replicas = self.replicate_size or num_nodes
            if world_size % replicas:
                raise ValueError(
                    f"HYBRID_SHARD: replicate_size={replicas} does not divide the world size {world_size}; "
                    f"set --trainer.strategy.init_args.replicate_size to a divisor of {world_size}"
                )
            shape: tuple[int, ...] = (replicas, world_size // replicas)
        else:
            shape = (world_size,)
        if self.sync_every and (len(shape) == 1 or shape[0] == 1):
            raise ValueError(
                f"sync_every={self.sync_every} synchronises replica groups, but {self.sharding} on {world_size} "
                f"process(es) has {'no replicate dimension' if len(shape) == 1 else 'one replica'}; use sharding "
                "HYBRID_SHARD with replicate_size >= 2 (or NO_SHARD on 2+ processes), or sync_every 0")
        return shape

    # --- model -----------------------------------------------------------------------------------

    def sharding_plan(self) -> ShardingPlan:
        param_dtype = self.resolve_dtype(self.param_dtype)
        mesh = self.device_mesh
        if mesh.ndim == 2 and (self.sync_every or self.comm_hook is not None
                               and self.comm_hook.replaces_replicate_all_reduce):
            mesh = mesh["shard"]  # the replicas average elsewhere: in the hook, or every sync_every steps
        return ShardingPlan(
            mesh=mesh,
            reshard_after_forward=self.sharding in ("FULL_SHARD", "HYBRID_SHARD"),
            param_dtype=param_dtype,
            reduce_dtype=self.resolve_dtype(self.reduce_dtype, fallback=param_dtype),
            block_class=self.block_class,
            blocks_per_group=self.blocks_per_group,
            checkpoint_every=self.activation_checkpointing,
            compile_blocks=self.compile_blocks,
            prefetch=self.prefetch,
            cpu_offload=self.cpu_offload,
            pin_memory=self.root_device.type == "cuda",
        )

    def preflight(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None) -> None:
        super().preflight(trainer, module, datamodule)
        self.check_compression(trainer)
        self.check_device_memory(trainer, module)
        if self.sync_every:
            assert self.outer is not None
            blocks = module.hf_config().num_hidden_layers
            self.outer.check_units(-(-blocks // self.blocks_per_group) + 1)  # the blocks' units and the root

    def check_compression(self, trainer: Any) -> None:
        """Unknown methods, out-of-range parameters, replicas a method cannot serve (fit's preflight and ``estimate``)."""
        if self.compression is not None:
            self.compression.build(rank=0)  # unknown method, out-of-range parameter: fail here
            self.compression.param_codec()
            shape = self.mesh_shape(trainer.num_nodes * trainer.num_devices, trainer.num_nodes)
            self.compression.check_replicas(shape[0] if len(shape) == 2 else 1)

    def check_device_memory(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Fail before launch when the model states and the compression state cannot fit in this GPU (CPU: no check)."""
        device = self.root_device
        if device.type != "cuda" or not torch.cuda.is_available():
            return
        from transformers import AutoModelForCausalLM

        from lit_fsdp.lora import adapter_parameters, trained_parameters

        config = module.hf_config()
        with torch.device("meta"):
            network = AutoModelForCausalLM.from_config(config)
        lora = (getattr(module, "hparams", None) or {}).get("lora")
        parameters = sum(p.numel() for p in network.parameters()) + adapter_parameters(network, lora)
        mesh = self.mesh_shape(trainer.num_nodes * trainer.num_devices, trainer.num_nodes)
        check_device_memory(parameters, config.hidden_size, mesh, self.cpu_offload, self.compression,
                            torch.cuda.get_device_properties(device).total_memory,
                            trained=trained_parameters(network, lora) or parameters)

    def is_placed(self, network: torch.nn.Module) -> bool:
        return isinstance(network, FSDPModule)

    def place(self, network: torch.nn.Module, module: pl.LightningModule) -> None:
        blocks, self.fsdp_modules = parallelize(network, self.sharding_plan())
        # With CPU offload FSDP2 wants the sharded parameters on the CPU; buffers are used on the device.
        materialize(network, torch.device("cpu") if self.cpu_offload else self.root_device, buffer_device=self.root_device)
        module.initialize_weights(blocks)
        if self.comm_hook is not None:
            for fsdp_module in self.fsdp_modules:
                self.comm_hook.register(fsdp_module, self.device_mesh)
        if self.sync_every:
            assert self.outer is not None and self._outer_group is not None
            fragments = outer_fragments(self.fsdp_modules, self.outer)
            self.outer_sync = OuterSync(self.outer, self.sync_every, fragments, self._outer_group, self.root_device)

    def move_module(self, module: pl.LightningModule) -> None:
        if not self.cpu_offload:
            return super().move_module(module)
        network = module._modules.pop("model")  # its sharded parameters stay on the CPU
        try:
            super().move_module(module)
        finally:
            module._modules["model"] = network

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        if not self.cpu_offload:
            _optimizers_to_device(self.optimizers, self.root_device)

    def compression_hook(self) -> CompressionReport | None:
        if self.outer_sync is not None:
            return self.outer_sync
        return self.comm_hook if isinstance(self.comm_hook, GradientCompression) else None

    def compression_method(self) -> str:
        if not self.sync_every:
            return super().compression_method()
        assert self.outer is not None
        return f"diloco{self.sync_every}_{self.outer.codec.method}" + ("_streaming" if self.outer.fragments > 1 else "")

    # --- semi-synchronous training -------------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.sync_every:
            assert self.outer is not None
            self._outer_group = replicate_group(self.device_mesh, on_host=self.outer.state_device == "cpu")

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.outer_sync is not None:
            self.outer_sync.after_step()
            trainer = self.lightning_module.trainer  # its global_step counts this step once we return
            if trainer.max_steps > 0 and trainer.global_step + 1 >= trainer.max_steps:
                self.outer_sync.end_on_synchronisation()  # before the last validation and checkpoint
        return output

    def on_train_end(self) -> None:
        if self.outer_sync is not None:  # a run ended by max_epochs or a callback ends on a synchronisation too
            self.outer_sync.end_on_synchronisation()
        super().on_train_end()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._scores_outer():  # the replicas' average, the same on every replica: the ranks' shares make one set
            self._replica_loss = torch.zeros(2, dtype=torch.float64, device=self.root_device)
            self._swap(self.outer_sync.swap_in_outer)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._scores_outer():  # each replica's own weights too, on its share: val/loss_replica
            batch, module = args[0], self.lightning_module
            self._swap(self.outer_sync.swap_out_outer)
            with torch.no_grad():
                targets = target_count(batch["labels"])
                self._replica_loss += torch.stack([module._loss(batch).double() * targets, targets.double()])
            self._swap(self.outer_sync.swap_in_outer)
        return super().validation_step(*args, **kwargs)

    def on_validation_end(self) -> None:
        if self._scores_outer():
            self._swap(self.outer_sync.swap_out_outer)
            total = self.reduce(self._replica_loss, reduce_op="sum")
            loss = float(total[0] / total[1])
            trainer = self.lightning_module.trainer
            for logger in trainer.loggers:  # at the step Lightning logs val/loss at
                logger.log_metrics({"val/loss_replica": loss, "val/ppl_replica": math.exp(loss)},
                                   step=_logged_step(trainer))
        super().on_validation_end()

    def _swap(self, write: Any) -> None:
        """Write other weights into the shards; a unit left unsharded (NO_SHARD's root keeps its weights gathered after
        a forward) would go on computing with the old ones, so every unit reshards and gathers them again."""
        write()
        for unit in self.fsdp_modules:
            unit.reshard()

    def _scores_outer(self) -> bool:
        """Whether validation scores theta_outer: semi-synchronous, inside fit (a sanity check included)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return self.outer_sync is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def teardown(self) -> None:
        if self.outer_sync is not None:
            self.outer_sync.close()
        super().teardown()

    def replacement_optimizer(self, params: Any, **adamw: Any) -> torch.optim.Optimizer | None:
        """The optimizer the compression method needs instead of AdamW (1-bit Adam's), from AdamW's arguments; None: AdamW."""
        return self.comm_hook.optimizer(params, **adamw) if self.comm_hook is not None else None

    def nonfinite_values(self) -> int | torch.Tensor:
        """Non-finite values the compression hooks replaced by zeros since the last step, as a device count."""
        stats = self.comm_hook.stats if self.comm_hook is not None else None
        total = stats.nonfinite_total() if stats is not None else None
        if total is None:
            return 0
        new = total - self._nonfinite_seen  # the hooks' run total, never reset: compared with the last step's
        self._nonfinite_seen = total
        return new

    # --- the comm hook's state in checkpoints -------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state (with LoRA, what trains only: the frozen base is read again from where it came),
        and this rank's compression state (residuals, warm starts) under its rank."""
        if getattr(self.lightning_module, "adapter_checkpoint", None) is None:
            state = super().lightning_module_state_dict()
        else:
            state = self._trainable_state(full=not self._save_distributed_checkpoint)
        if self.comm_hook is not None and self._save_distributed_checkpoint:
            hook_state = self.comm_hook.state_dict()
            state.update({f"{_HOOK_STATE}rank{self.global_rank}/{key}": value for key, value in hook_state.items()})
        if self.outer_sync is not None:  # the replicas differ between synchronisations: each rank keeps its own
            outer_state = {**self.outer_sync.state_dict(),
                           **replica_state(self.model, self.optimizers, self.outer_sync.replica_weights())}
            state.update({f"{_OUTER_STATE}rank{self.global_rank}/{key}": value for key, value in outer_state.items()})
        return state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not self._holds_adapters(path):
            metadata = super().load_checkpoint(checkpoint_path, weights_only)
        elif path.is_dir():
            metadata = self._load_adapters(path)
        else:  # one full file: Lightning loads the keys it holds, the adapters, when not strict
            self.lightning_module.strict_loading = False
            metadata = super().load_checkpoint(checkpoint_path, weights_only)
        if self.comm_hook is not None:
            state = self._rank_state(path, _HOOK_STATE, "compression state (error-feedback residuals, warm starts)")
            if state is not None:
                self.comm_hook.load_state_dict({key: value.to(self.root_device) for key, value in state.items()})
        if self.outer_sync is not None:
            state = self._rank_state(path, _OUTER_STATE, "outer state (theta_outer, momentum, each replica's weights)")
            if state is None:  # a fully synchronous run's (or another number of processes'): one model, every replica's
                rank_zero_info(f"{path} holds no outer state for this run: every replica and theta_outer start from its "
                               f"weights, and the replicas synchronise every {self.sync_every} steps from here")
                self.outer_sync.reset_outer()
            else:
                self.outer_sync.load_state_dict(state)
                load_replica_state(self.model, self.optimizers, state)
        return metadata

    def _trainable_state(self, full: bool) -> dict[str, Any]:
        """The module's state without its frozen parameters (LoRA's base), under any of their names: torch's
        ``ignore_frozen_params`` keeps a frozen head tied to the embeddings (torch 2.13)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from lit_fsdp.weights import clean_name

        frozen = {clean_name(name) for name, param in self.model.named_parameters(remove_duplicate=False)
                  if not param.requires_grad}
        options = StateDictOptions(full_state_dict=full, cpu_offload=True, ignore_frozen_params=True)
        return {key: value for key, value in get_model_state_dict(self.model, options=options).items()
                if key not in frozen}

    def _load_adapters(self, path: Path) -> dict[str, Any]:
        """Read a sharded LoRA checkpoint: the trainable parameters and the optimizers' state (Lightning's loader
        asks for every parameter, and the checkpoint holds no frozen one), then the metadata."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        from lit_fsdp import checkpoints
        from lit_fsdp.lightning_compat import METADATA_FILENAME

        state = {"state_dict": self._trainable_state(full=False)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(self.model, state["state_dict"], options=StateDictOptions(ignore_frozen_params=True,
                                                                                       strict=False))
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optimizer_state, checkpoint_id=str(path))
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optimizer_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return checkpoints.load(path / METADATA_FILENAME)

    def _rank_state(self, path: Path, family: str, what: str) -> dict[str, torch.Tensor] | None:
        """This rank's own tensors saved under ``<family>rank<r>/`` (a collective), on the CPU; None where the
        checkpoint is one file, holds none, or was saved by another number of processes (then ``what`` starts afresh)."""
        import torch.distributed.checkpoint as dcp

        if not path.is_dir():
            return None
        entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        prefix = f"{family}rank{self.global_rank}/"
        mine = {key.removeprefix("state_dict."): entry for key, entry in entries.items()
                if key.startswith(f"state_dict.{prefix}")}
        saved_by_others = any(key.startswith(f"state_dict.{family}") for key in entries)
        if saved_by_others and not self.reduce_boolean_decision(bool(mine), all=True):
            rank_zero_warn(f"the checkpoint's {what} was saved by another number of processes; it starts afresh")
            return None
        if not saved_by_others:
            return None
        state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in mine.items()}
        dcp.load({"state_dict": state}, checkpoint_id=str(path))
        return {key.removeprefix(prefix): value for key, value in state.items()}

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip gradient reduction on micro-batches that do not end an accumulation window."""
        for fsdp_module in self.fsdp_modules:
            fsdp_module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for fsdp_module in self.fsdp_modules:
                fsdp_module.set_requires_gradient_sync(True, recurse=False)


# The name configs and Trainer(strategy=...) use, registered wherever the class is imported.
if FSDP2Strategy.strategy_name not in StrategyRegistry:
    FSDP2Strategy.register_strategies(StrategyRegistry)
