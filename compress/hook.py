"""``GradientCompression``: the strategy's comm hook for a ``CompressionConfig``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from compress.communicator import CommStats, CompressedAllReduce, CompressedReduceScatter, RestoredState
from compress.config import CompressionConfig
from compress.layout import unit_layout
from compress.onebit_adam import OneBitAdam, OneBitAdamAllReduce, OneBitAdamReduceScatter, OneBitMomentum
from compress.param_gather import QuantizedAllGather
from compress.powersgd import PowerSGD, PowerSGDAllReduce, PowerSGDReduceScatter
from compress.sketched_sgd import SketchedAllReduce, SketchedReduceScatter, SketchedSGD


class GradientCompression:
    """Installs compressed reduce-scatter (and replicate all-reduce) hooks on every FSDP module.

    With a 2-D (replicate, shard) mesh the strategy shards over the shard sub-mesh only
    (``replaces_replicate_all_reduce``), and the replicate average is this hook's compressed all-reduce.
    """

    def __init__(self, config: CompressionConfig):
        self.config = config
        self.stats = CommStats()
        self.compressor = None
        self._units = 0
        self._movers: list = []  # per hook: the call count that seeds shared randomness
        self.param_codec = config.param_codec()
        self.restored = RestoredState()  # checkpointed state, adopted by the hooks' stream at their first call

    @property
    def replaces_replicate_all_reduce(self) -> bool:
        """Whether this hook averages across replicas (it does when it compresses gradients)."""
        return self.config.method != "none"

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's compression state (residuals, warm starts, call counts): a checkpoint keeps it, so a resumed
        run compresses as the uninterrupted one would."""
        state = {f"calls/{index}": torch.tensor(mover.calls) for index, mover in enumerate(self._movers)}
        compressor_state = getattr(self.compressor, "state_dict", None)
        if compressor_state is not None:
            state.update({f"compressor/{key}": value for key, value in compressor_state().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for index, mover in enumerate(self._movers):
            mover.calls = int(state.get(f"calls/{index}", mover.calls))
        if hasattr(self.compressor, "load_state_dict"):
            self.compressor.load_state_dict(
                {k.removeprefix("compressor/"): v for k, v in state.items() if k.startswith("compressor/")}
            )
            # the tensors the compressor now holds (a load may convert them): adopted by the hooks' streams
            self.restored.load([v for v in self.compressor.state_dict().values() if isinstance(v, torch.Tensor)])

    def register(self, module: FSDPModule, mesh: DeviceMesh) -> None:
        if self.compressor is None:
            self.compressor = self.config.build(rank=dist.get_rank())
        name = f"unit{self._units}"
        self._units += 1
        shard = mesh["shard"] if mesh.ndim == 2 else mesh
        if self.param_codec is not None and shard.size() > 1:
            module.set_custom_all_gather(QuantizedAllGather(self.param_codec, self.stats, f"{name}/params"))
        if self.compressor is None:  # method none: the gradients take FSDP2's own path
            return
        check_fits = getattr(getattr(self.compressor, "inner", self.compressor), "check_fits", None)
        if check_fits is not None:  # e.g. a low rank larger than a chunk's matrix: fail before the first step
            check_fits(unit_layout(module, shard.size(), 0).shard_numel)  # elements per destination row
        if isinstance(self.compressor, PowerSGD):  # its own communicators: native all-reduces of P and Q, no payloads
            # the reduce-scatter's input is the unit's rank-major flat gradient; the replicate all-reduce's, this
            # rank's shard of it: the same layout describes both
            layout = unit_layout(module, shard.size(), shard.get_local_rank())
            if shard.size() > 1:
                module.set_custom_reduce_scatter(PowerSGDReduceScatter(self.compressor, self.stats, name, layout, self.restored))
            if mesh.ndim == 2 and mesh["replicate"].size() > 1:
                module.set_all_reduce_hook(PowerSGDAllReduce(
                    self.compressor, self.stats, f"{name}/ar", layout, mesh["replicate"].get_group(), self.restored
                ))
            return
        if isinstance(self.compressor, SketchedSGD):
            reduce_scatter_type, all_reduce_type = SketchedReduceScatter, SketchedAllReduce
        else:
            reduce_scatter_type, all_reduce_type = CompressedReduceScatter, CompressedAllReduce
        onebit_adam = isinstance(self.compressor, OneBitMomentum)
        layout = unit_layout(module, shard.size(), shard.get_local_rank()) if onebit_adam else None
        all_reduce_compressor = self.compressor
        if shard.size() > 1:
            if onebit_adam:  # its denominators are gathered in the reduce-scatter's layout
                reduce_scatter = OneBitAdamReduceScatter(self.compressor, self.stats, name, layout, self.restored)
                all_reduce_compressor = self.compressor.second_stage()  # replicas average what shard groups averaged
            else:
                reduce_scatter = reduce_scatter_type(self.compressor, self.stats, name, self.restored)
            module.set_custom_reduce_scatter(reduce_scatter)
            self._movers.append(reduce_scatter.mover)
        replicas = mesh["replicate"] if mesh.ndim == 2 else None
        self.config.check_replicas(replicas.size() if replicas is not None else 1)
        if replicas is not None and replicas.size() > 1:
            group = replicas.get_group()
        elif shard.size() == 1 and onebit_adam:
            group = shard.get_group()  # one process: its momentum is still compressed (FSDP2 calls the hook anyway)
        else:
            return
        if onebit_adam:
            all_reduce = OneBitAdamAllReduce(all_reduce_compressor, self.stats, name, group, layout, self.restored)
        else:
            all_reduce = all_reduce_type(all_reduce_compressor, self.stats, name, group, self.restored)
        module.set_all_reduce_hook(all_reduce)
        self._movers.append(all_reduce.mover)

    def optimizer(self, params, **adamw) -> torch.optim.Optimizer | None:
        """The optimizer this method needs in place of AdamW, built with AdamW's arguments (None: AdamW itself)."""
        if not isinstance(self.compressor, OneBitMomentum):
            return None
        return OneBitAdam(params, self.compressor.phase, **adamw)
