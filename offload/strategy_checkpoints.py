"""``offload.SlideFSDPStrategy``'s checkpoints: the model's and the optimizer's state from the host's master rows and
moments in FSDP2's sharded layout (``offload.state_dict``), after the updates still running, and the load that
replaces them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from lit_fsdp import checkpoints
from lit_fsdp.errors import OneLineError
from lit_fsdp.lightning_compat import METADATA_FILENAME as _METADATA_FILENAME
from lit_fsdp.lightning_compat import is_sharded_checkpoint as _is_sharded_checkpoint
from offload.state_dict import HostStateDict


class SlideCheckpoints:
    """``SlideFSDPStrategy``'s checkpoint methods (a mixin: the strategy holds ``host_state_dict``, ``adam``, ``engine``,
    ``mixed_steps``, ``apply_delayed_updates`` and ``refresh_staging``)."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The weights, refused on every rank where one rank's units are at different steps: a step interrupted after
        some of its updates (on arrival, or one that failed) and before the others."""
        assert self.host_state_dict is not None
        mixed = self.adam.settle() if self.adam is not None else self.mixed_steps
        if not self.reduce_boolean_decision(mixed is None, all=True):
            where = f"this rank's master weights at different steps ({mixed})" if mixed else (
                "another rank's master weights at different steps (its log says which)")
            raise OneLineError(f"SlideFSDP will not save: an interrupted step left {where}; resume from the last "
                               "checkpoint (--ckpt_path last)")
        self.apply_delayed_updates()
        return self.host_state_dict.model_state()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        assert self.host_state_dict is not None and self.adam is not None
        self.apply_delayed_updates()
        return self.host_state_dict.optimizer_state(self.adam)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        path = Path(self.broadcast(checkpoint_path))
        self._holds_adapters(path)  # verified; with LoRA, adapters for this run's base (the state below holds no other)
        if not _is_sharded_checkpoint(path):
            raise ValueError(f"{path} is not a sharded checkpoint folder (with {_METADATA_FILENAME}); SlideFSDP resumes from those")
        assert self.host_state_dict is not None
        state: dict[str, Any] = {"state_dict": self.host_state_dict.model_state()}
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING and self.adam is not None
        if fitting:
            state["optimizer_0"] = self.host_state_dict.optimizer_state(self.adam)
        if self.adam is not None:  # no update may land on the loaded weights
            self.adam.wait()
        dcp.load(state, checkpoint_id=path)
        if self.engine is not None and self.adam is not None:  # gradients of the weights that were replaced
            self.engine.gradients.stale.clear()  # refresh_staging below rewrites every row
            self.engine.gradients.discard()
        if fitting:
            HostStateDict.restore_groups(self.adam, state["optimizer_0"])
        self.refresh_staging()
        self.mixed_steps = None  # every row is the checkpoint's
        return checkpoints.load(path / _METADATA_FILENAME)

