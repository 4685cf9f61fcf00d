"""``DDPStrategy``: Lightning's DDP for lit_fsdp models, the baseline the sharded strategies are compared with.

``CausalLM`` builds its network on the meta device and leaves placing it to the strategy. This
strategy materialises the whole network on every rank, fills it with the same per-block seeded
init (or pretrained rows) that FSDP2 writes into its shards, so DDP and FSDP2 start from the same
weights, and then lets Lightning's ``DDPStrategy`` wrap it in ``DistributedDataParallel``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies import StrategyRegistry

from lit_fsdp.parallelize import find_blocks
from lit_fsdp.reliability import AtomicCheckpoints, NonFiniteGuard, OnNonFinite
from lit_fsdp.reporting import StrategyReport
from lit_fsdp.lifecycle import DType, check_precision, resolve_dtype
from lit_fsdp.weights import materialize

_AUTOCAST = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}


class DDPStrategy(NonFiniteGuard, AtomicCheckpoints, LightningDDPStrategy, StrategyReport):
    """Data parallel (DDP): the whole model, its gradients and AdamW state on every rank; gradients all-reduced."""

    strategy_name = "lit_fsdp_ddp"
    #: The strategy's name in results records and sweeps.
    label = "ddp"

    def __init__(
        self,
        param_dtype: DType = "auto",
        bucket_cap_mb: int = 25,
        gradient_as_bucket_view: bool = True,
        block_class: str | None = None,
        on_nonfinite: OnNonFinite = "stop",
        torch_powersgd_rank: int | None = None,
        torch_powersgd_start_step: int = 10,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        """
        Args:
            param_dtype: Compute dtype: ``auto`` is bfloat16 on GPUs that support it, else float32. Weights,
                gradients and AdamW stay float32; bfloat16 and float16 run the forward under autocast (torch AMP,
                with a gradient scaler for float16), which is how DDP does mixed precision.
            bucket_cap_mb: Size of DDP's gradient all-reduce buckets.
            gradient_as_bucket_view: Gradients are views into the all-reduce buckets (saves one copy of them).
            block_class: Class name of the transformer block, whose name seeds its init as under FSDP2; default:
                the model's ``_no_split_modules``.
            on_nonfinite: A step with a non-finite loss or gradient: ``stop``, ``skip_step`` or ``warn`` (as FSDP2).
            torch_powersgd_rank: Reduce gradients with torch's own PowerSGD DDP hook at this rank (the reference
                lit_fsdp's ``powersgd`` compression is compared with); null: DDP's plain all-reduce.
            torch_powersgd_start_step: Plain all-reduce steps before torch's PowerSGD starts.
            process_group_backend: ``gloo`` or ``nccl``; default from the device.
            timeout: Collective timeout.
        """
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout,
            bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
        )
        self.param_dtype = param_dtype
        self.block_class = block_class
        self.on_nonfinite = on_nonfinite
        self.torch_powersgd_rank = torch_powersgd_rank
        self.torch_powersgd_start_step = torch_powersgd_start_step

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # The network only has values once it is materialised in setup; a checkpoint must be loaded after that.
        return True

    def resolve_dtype(self, name: DType) -> torch.dtype:
        return resolve_dtype(name, self.root_device)

    def compute_dtype(self) -> torch.dtype:
        return self.resolve_dtype(self.param_dtype)

    def preflight(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None) -> None:
        """Checks run by the CLI before Lightning starts the other processes."""
        check_precision(trainer, self)

    def setup(self, trainer: pl.Trainer) -> None:
        check_precision(trainer, self)
        autocast = _AUTOCAST.get(self.resolve_dtype(self.param_dtype))
        if autocast is not None:
            self.precision_plugin = MixedPrecision(autocast, self.root_device.type)
        super().setup(trainer)
        if self.torch_powersgd_rank is not None:
            # Lightning registers DDP comm hooks on CUDA only; gloo runs them too
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

            state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=self.torch_powersgd_rank,
                start_powerSGD_iter=self.torch_powersgd_start_step,
            )
            self.model.register_comm_hook(state, powersgd.powerSGD_hook)

    def model_to_device(self) -> None:
        module = self.lightning_module
        network = getattr(module, "model", None)
        if isinstance(network, torch.nn.Module) and any(p.is_meta for p in network.parameters()):
            materialize(network, self.root_device)
            # to_empty gives each module a new Parameter: shared ones (a head tied to the embedding) come apart.
            if hasattr(network, "tie_weights"):
                network.tie_weights()
            module.initialize_weights(find_blocks(network, self.block_class))
        super().model_to_device()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        # Not Lightning's: that would register this class under "ddp", "ddp_spawn", ...
        strategy_registry.register(cls.strategy_name, cls, description=f"{(cls.__doc__ or '').splitlines()[0]} (lit_fsdp)")


# The name configs and Trainer(strategy=...) use, registered wherever the class is imported.
if DDPStrategy.strategy_name not in StrategyRegistry:
    DDPStrategy.register_strategies(StrategyRegistry)
