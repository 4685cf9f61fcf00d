"""What ``FSDP2Strategy``'s sharded checkpoints hold beside Lightning's model and optimizer state.

- Each rank's own state, under ``<family>rank<r>/<key>``: state that differs between ranks and that a sharded model
  state cannot hold, the compression hook's (error-feedback residuals, warm starts) and semi-synchronous training's
  (theta_outer, the outer momentum, each replica's weights). Read back by the same number of processes only.
- With LoRA, the trainable parameters alone: the frozen base is read again from where it came.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn


def rank_entries(family: str, rank: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under this rank's keys in the checkpoint: ``<family>rank<rank>/<key>``."""
    return {f"{family}rank{rank}/{key}": value for key, value in state.items()}


def read_rank_state(path: Path, family: str, rank: int, all_agree: Callable[[bool], bool],
                    what: str) -> dict[str, torch.Tensor] | None:
    """This rank's own tensors saved under ``<family>rank<rank>/`` (a collective: ``all_agree`` is true where every rank
    says so), on the CPU; None where the checkpoint is one file, holds none, or was saved by another number of
    processes (then ``what`` starts afresh)."""
    import torch.distributed.checkpoint as dcp

    if not path.is_dir():
        return None
    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = f"{family}rank{rank}/"
    mine = {key.removeprefix("state_dict."): entry for key, entry in entries.items()
            if key.startswith(f"state_dict.{prefix}")}
    saved_by_others = any(key.startswith(f"state_dict.{family}") for key in entries)
    if saved_by_others and not all_agree(bool(mine)):
        rank_zero_warn(f"the checkpoint's {what} was saved by another number of processes; it starts afresh")
        return None
    if not saved_by_others:
        return None
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype) for key, entry in mine.items()}
    dcp.load({"state_dict": state}, checkpoint_id=str(path))
    return {key.removeprefix(prefix): value for key, value in state.items()}


def trainable_state(model: torch.nn.Module, full: bool) -> dict[str, Any]:
    """The model's state without its frozen parameters (LoRA's base), under any of their names: torch's
    ``ignore_frozen_params`` keeps a frozen head tied to the embeddings (torch 2.13)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lit_fsdp.weights import clean_name

    frozen = {clean_name(name) for name, param in model.named_parameters(remove_duplicate=False)
              if not param.requires_grad}
    options = StateDictOptions(full_state_dict=full, cpu_offload=True, ignore_frozen_params=True)
    return {key: value for key, value in get_model_state_dict(model, options=options).items() if key not in frozen}


def load_adapters(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], path: Path) -> dict[str, Any]:
    """Read a sharded LoRA checkpoint: the trainable parameters and the optimizers' state (Lightning's loader
    asks for every parameter, and the checkpoint holds no frozen one), then the metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    from lit_fsdp import checkpoints
    from lit_fsdp.lightning_compat import METADATA_FILENAME

    state = {"state_dict": trainable_state(model, full=False)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(model, optimizer)}
        dcp.load(optimizer_state, checkpoint_id=str(path))
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state[key],
                                 options=StateDictOptions(cpu_offload=True))
    return checkpoints.load(path / METADATA_FILENAME)
