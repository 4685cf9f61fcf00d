"""FSDP2 (``FSDP2Strategy``), on the life cycle every lit_fsdp strategy shares (``lit_fsdp.lifecycle``).

It shards the network with ``fully_shard`` (``lit_fsdp.parallelize``), installs a gradient communication hook
(``GradientCommHook``: compression's, or your own) on every FSDP unit, and composes semi-synchronous training
(``lit_fsdp.semi_sync.SemiSync``) when ``sync_every`` is set. Its checkpoints keep each rank's own hook and outer
state beside the sharded model, and LoRA's adapters without the frozen base.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import StrategyRegistry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from compress.communicator import CommStats
from compress.config import CompressionConfig
from compress.hook import GradientCompression
from lit_fsdp.diloco import OuterConfig
from lit_fsdp.lifecycle import CausalLMStrategy, DType
from lit_fsdp.lightning_compat import optimizers_to_device as _optimizers_to_device
from lit_fsdp.parallelize import ShardingPlan, parallelize
from lit_fsdp.reliability import OnNonFinite
from lit_fsdp.reporting import CompressionReport, SemiSyncFigures
from lit_fsdp.semi_sync import SemiSync
from lit_fsdp.sharded_state import load_adapters, rank_entries, read_rank_state, trainable_state
from lit_fsdp.weights import materialize

Sharding = Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"]
_HOOK_STATE = "comm_hook."  # checkpoint keys of each rank's compression state: comm_hook.rank<r>/<key>
_OUTER_STATE = "outer."  # each rank's semi-synchronous state and replica: outer.rank<r>/<key>
ADAM_STATE_BYTES = 16  # FSDP2's model states per trained parameter: fp32 weight, gradient and two AdamW moments
FROZEN_STATE_BYTES = 4  # per frozen parameter (LoRA's base): its sharded fp32 weight, no gradient, no AdamW state
_GIB = 2**30


def model_state_bytes(parameters: int, trained: int) -> int:
    """FSDP2's model states of ``parameters``, ``trained`` of them trained and the rest frozen, before sharding."""
    return ADAM_STATE_BYTES * trained + FROZEN_STATE_BYTES * (parameters - trained)


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
        reduce_dtype: DType | None = None,
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
            reduce_dtype: Dtype of gradient reduction; ``auto`` follows ``param_dtype``; null (default): float32.
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
                streaming fragments and delay (``lit_fsdp.diloco.OuterConfig``; default DiLoCo's). Both go to
                ``lit_fsdp.semi_sync.SemiSync``, which the strategy calls from its life cycle.
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
        self.semi_sync = SemiSync.build(sync_every, outer, comm_hook is not None, save_distributed_checkpoint)

    @property
    def label(self) -> str:
        """``fsdp2`` for FULL_SHARD, ``fsdp2_shard_grad_op``, ``fsdp2_no_shard`` or ``fsdp2_hybrid_shard`` otherwise;
        ``_diloco<H>`` after it when semi-synchronous."""
        label = "fsdp2" if self.sharding == "FULL_SHARD" else f"fsdp2_{self.sharding.lower()}"
        return label if self.semi_sync is None else f"{label}_{self.semi_sync.config.name}"

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
        if self.semi_sync is not None:
            self.semi_sync.check_mesh(shape, self.sharding, world_size)
        return shape

    # --- model -----------------------------------------------------------------------------------

    def sharding_plan(self) -> ShardingPlan:
        param_dtype = self.resolve_dtype(self.param_dtype)
        mesh = self.device_mesh
        if mesh.ndim == 2 and (self.semi_sync is not None or self.comm_hook is not None
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
        if self.semi_sync is not None:
            blocks = module.hf_config().num_hidden_layers
            self.semi_sync.check_units(-(-blocks // self.blocks_per_group) + 1)  # the blocks' units and the root

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
        if self.semi_sync is not None:
            self.semi_sync.setup(self.device_mesh, self.fsdp_modules, self.root_device)

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
        if self.semi_sync is not None:
            return self.semi_sync.outer_sync
        return self.comm_hook if isinstance(self.comm_hook, GradientCompression) else None

    def compression_method(self) -> str:
        return super().compression_method() if self.semi_sync is None else self.semi_sync.compression_method()

    def semi_sync_figures(self) -> SemiSyncFigures | None:
        return None if self.semi_sync is None else self.semi_sync.figures()

    # --- semi-synchronous training's hooks in the life cycle ------------------------------------------

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.semi_sync is not None:
            self.semi_sync.after_optimizer_step(self.lightning_module.trainer)
        return output

    def on_train_end(self) -> None:
        if self.semi_sync is not None:
            self.semi_sync.on_train_end()
        super().on_train_end()

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.semi_sync is not None:
            self.semi_sync.before_validation(self.lightning_module.trainer)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.semi_sync is not None:
            self.semi_sync.score_replica(self.lightning_module.trainer, self.lightning_module, args[0])
        return super().validation_step(*args, **kwargs)

    def on_validation_end(self) -> None:
        if self.semi_sync is not None:
            self.semi_sync.after_validation(self.lightning_module.trainer, partial(self.reduce, reduce_op="sum"))
        super().on_validation_end()

    def teardown(self) -> None:
        if self.semi_sync is not None:
            self.semi_sync.teardown()
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

    # --- checkpoints: each rank's own state, LoRA's adapters (lit_fsdp.sharded_state) ---------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's sharded state (with LoRA, what trains only: the frozen base is read again from where it came),
        and under this rank, its compression state (residuals, warm starts) and semi-synchronous state."""
        if getattr(self.lightning_module, "adapter_checkpoint", None) is None:
            state = super().lightning_module_state_dict()
        else:
            state = trainable_state(self.model, full=not self._save_distributed_checkpoint)
        if self.comm_hook is not None and self._save_distributed_checkpoint:
            state.update(rank_entries(_HOOK_STATE, self.global_rank, self.comm_hook.state_dict()))
        if self.semi_sync is not None:  # the replicas differ between synchronisations: each rank keeps its own
            outer_state = self.semi_sync.state_dict(self.model, self.optimizers)
            state.update(rank_entries(_OUTER_STATE, self.global_rank, outer_state))
        return state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        if not self._holds_adapters(path):
            metadata = super().load_checkpoint(checkpoint_path, weights_only)
        elif path.is_dir():
            metadata = load_adapters(self.model, self.optimizers, path)
        else:  # one full file: Lightning loads the keys it holds, the adapters, when not strict
            self.lightning_module.strict_loading = False
            metadata = super().load_checkpoint(checkpoint_path, weights_only)
        all_agree = partial(self.reduce_boolean_decision, all=True)
        if self.comm_hook is not None:
            state = read_rank_state(path, _HOOK_STATE, self.global_rank, all_agree,
                                    "compression state (error-feedback residuals, warm starts)")
            if state is not None:
                self.comm_hook.load_state_dict({key: value.to(self.root_device) for key, value in state.items()})
        if self.semi_sync is not None:
            state = read_rank_state(path, _OUTER_STATE, self.global_rank, all_agree,
                                    "outer state (theta_outer, momentum, each replica's weights)")
            self.semi_sync.load_state_dict(state, self.model, self.optimizers, path)
        return metadata

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
