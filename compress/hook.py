"""``GradientCompression``: the strategy's comm hook for a ``CompressionConfig``."""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from compress.communicator import CommStats, CompressedAllReduce, CompressedReduceScatter
from compress.config import CompressionConfig


def reduce_scatter_row(module: FSDPModule, world: int) -> int:
    """Elements per destination in this module's reduce-scatter: its own parameters' padded shards."""
    nested = {id(p) for m in module.modules() if m is not module and isinstance(m, FSDPModule) for p in m.parameters()}
    return sum(
        math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]) for p in module.parameters() if id(p) not in nested
    )


class GradientCompression:
    """Installs compressed reduce-scatter (and replicate all-reduce) hooks on every FSDP module.

    With a 2-D (replicate, shard) mesh the strategy shards over the shard sub-mesh only
    (``replaces_replicate_all_reduce``), and the replicate average is this hook's compressed all-reduce.
    """

    replaces_replicate_all_reduce = True

    def __init__(self, config: CompressionConfig):
        self.config = config
        self.stats = CommStats()
        self.compressor = None
        self._units = 0

    def register(self, module: FSDPModule, mesh: DeviceMesh) -> None:
        if self.compressor is None:
            self.compressor = self.config.build(rank=dist.get_rank())
        name = f"unit{self._units}"
        self._units += 1
        shard = mesh["shard"] if mesh.ndim == 2 else mesh
        check_fits = getattr(getattr(self.compressor, "inner", self.compressor), "check_fits", None)
        if check_fits is not None:  # e.g. a low rank larger than a chunk's matrix: fail before the first step
            check_fits(reduce_scatter_row(module, shard.size()))
        if shard.size() > 1:
            module.set_custom_reduce_scatter(CompressedReduceScatter(self.compressor, self.stats, name))
        if mesh.ndim == 2 and mesh["replicate"].size() > 1:
            module.set_all_reduce_hook(
                CompressedAllReduce(self.compressor, self.stats, name, mesh["replicate"].get_group())
            )
