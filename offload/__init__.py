"""SlideFSDP: a layer-streaming CPU-offload strategy for lit_fsdp (``offload.SlideFSDPStrategy``, alias ``slide_fsdp``)."""

from lightning.pytorch.strategies import StrategyRegistry

from offload.strategy import SlideFSDPStrategy

if SlideFSDPStrategy.strategy_name not in StrategyRegistry:
    SlideFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["SlideFSDPStrategy"]
