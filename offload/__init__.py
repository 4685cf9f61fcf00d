"""SlideFSDP: a layer-streaming CPU-offload strategy for lit_fsdp (``offload.SlideFSDPStrategy``, alias ``slide_fsdp``)."""

from offload.strategy import SlideFSDPStrategy

__all__ = ["SlideFSDPStrategy"]
