"""The life cycle every lit_fsdp strategy shares: ``CausalLMStrategy``, and what it resolves about its device.

It follows Lightning's ``ModelParallelStrategy``: ``setup_environment`` builds the process group and the device mesh,
``setup`` places the network (shards, materialises and initialises it) and then builds the optimizer on what it
placed; checkpoints are sharded (torch.distributed.checkpoint) or one full file. ``lit_fsdp.strategy.FSDP2Strategy``
and ``offload.SlideFSDPStrategy`` are built on it.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import init_device_mesh

from compress.torch_compat import bf16_native
from lit_fsdp.lightning_compat import default_process_group_backend as _get_default_process_group_backend_for_device
from lit_fsdp.lightning_compat import set_num_threads_if_needed as _set_num_threads_if_needed
from lit_fsdp.reliability import AtomicCheckpoints, NonFiniteGuard, OnNonFinite
from lit_fsdp.reporting import StrategyReport

DType = Literal["auto", "float32", "bfloat16", "float16"]


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




def check_precision(trainer: pl.Trainer, strategy: Any) -> None:
    """lit_fsdp's strategies set the compute dtype with ``param_dtype``; the trainer's precision must stay 32-true."""
    if trainer.precision not in ("32-true", "32"):
        raise ValueError(
            f"--trainer.precision {trainer.precision} is not used by {type(strategy).__name__}; leave it at 32-true and "
            "set --trainer.strategy.init_args.param_dtype bfloat16 instead"
        )


class CausalLMStrategy(NonFiniteGuard, AtomicCheckpoints, ModelParallelStrategy, StrategyReport):
    """The life cycle of a lit_fsdp strategy: process group and mesh, checks, placing the network, optimizers.

    A subclass says what its mesh is (``mesh_shape``), how it places ``LightningModule.model`` on the
    devices (``place``) and whether that already happened (``is_placed``). From ``lit_fsdp.reliability``
    every step is guarded against non-finite values (``on_nonfinite``) and every checkpoint is written
    aside and renamed into place after its manifest.
    """

    strategy_name = ""
    #: ``reduce_dtype``'s value where none is given (null). The signatures default to null, not to this: the CLI keeps
    #: an argument's value when a config or flag changes the strategy's class_path, and a value FSDP2Strategy filled in
    #: would then override SlideFSDPStrategy's own default.
    default_reduce_dtype: DType = "float32"

    def __init__(
        self,
        block_class: str | None,
        param_dtype: DType,
        reduce_dtype: DType | None,
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
        self.reduce_dtype = self.default_reduce_dtype if reduce_dtype is None else reduce_dtype
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
