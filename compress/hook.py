"""``GradientCompression``: the strategy's comm hook for a ``CompressionConfig``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from compress.communicator import CommStats, RestoredState
from compress.config import CompressionConfig
from compress.layout import unit_layout
from compress.param_gather import QuantizedAllGather


class GradientCompression:
    """Installs compressed reduce-scatter (and replicate all-reduce) hooks on every FSDP module: those the method's
    ``Communicator`` declares (``compress.communicators``).

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
        communicator = self.config.communicator
        if self.compressor is None or communicator is None:  # method none: the gradients take FSDP2's own path
            return
        whole = unit_layout(module, shard.size(), 0)
        if not whole.places:  # nothing to train in this unit (a LoRA model's root): FSDP2 reduces no gradient of it
            return
        size_check = self.config.size_check()
        if size_check is not None:  # e.g. a low rank larger than a chunk's matrix: fail before the first step
            size_check(whole.shard_numel)  # elements per destination row
        # the reduce-scatter's input is the unit's rank-major flat gradient; the replicate all-reduce's, this rank's
        # shard of it: the same layout describes both
        layout = {"layout": unit_layout(module, shard.size(), shard.get_local_rank())} if communicator.layout else {}
        all_reduce_compressor = self.compressor
        if shard.size() > 1:
            reduce_scatter = communicator.reduce_scatter(self.compressor, self.stats, name, restored=self.restored, **layout)
            module.set_custom_reduce_scatter(reduce_scatter)
            if communicator.movers:
                self._movers.append(reduce_scatter.mover)
            if communicator.second_stage is not None:  # replicas average what the shard group averaged
                all_reduce_compressor = communicator.second_stage(self.compressor)
        replicas = mesh["replicate"] if mesh.ndim == 2 else None
        self.config.check_replicas(replicas.size() if replicas is not None else 1)
        if replicas is not None and replicas.size() > 1:
            group = replicas.get_group()
        elif shard.size() == 1 and communicator.one_process:
            group = shard.get_group()
        else:
            return
        all_reduce = communicator.all_reduce(all_reduce_compressor, self.stats, name, group=group, restored=self.restored,
                                             **layout)
        module.set_all_reduce_hook(all_reduce)
        if communicator.movers:
            self._movers.append(all_reduce.mover)

    def optimizer(self, params, **adamw) -> torch.optim.Optimizer | None:
        """The optimizer this method needs in place of AdamW, built with AdamW's arguments (None: AdamW itself)."""
        communicator = self.config.communicator
        if self.compressor is None or communicator is None or communicator.optimizer is None:
            return None
        return communicator.optimizer(params, self.compressor, **adamw)
