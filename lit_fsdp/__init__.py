"""lit_fsdp: train Hugging Face causal LMs with PyTorch FSDP2 under Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lit_fsdp.ddp import DDPStrategy
from lit_fsdp.strategy import FSDP2Strategy

FSDP2Strategy.register_strategies(StrategyRegistry)
DDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["DDPStrategy", "FSDP2Strategy"]
