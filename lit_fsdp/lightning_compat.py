"""Every private Lightning API lit_fsdp uses, in one place (``compress/torch_compat.py`` is torch's), and the one
edit of Lightning's checkpointed loop state (``reopen_cut_epoch``).

Lightning's underscored names are not part of its API and move or change between minor releases; the rest
of the project imports them from here under public names, so a new Lightning release is checked, and if need
be adapted, in this module alone. ``tests/test_torch_compat.py`` pins what each name must provide and that
nothing else imports a private Lightning name; ``pyproject.toml`` admits Lightning up to the newest minor tested.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _set_num_threads_if_needed
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

#: the newest Lightning minor release CI runs (pyproject.toml caps lightning below the next one)
LIGHTNING_NEWEST_TESTED = (2, 6)

#: the file of a sharded checkpoint folder that holds everything but the sharded tensors (ModelParallelStrategy
#: writes and reads it under this name)
METADATA_FILENAME: str = _METADATA_FILENAME
#: whether a path is a folder of checkpoint shards as ModelParallelStrategy writes them (it holds METADATA_FILENAME)
is_sharded_checkpoint = _is_sharded_checkpoint
#: the process group backend Lightning picks for a device (``nccl`` for CUDA, ``gloo`` for the CPU)
default_process_group_backend = _get_default_process_group_backend_for_device
#: sets torch's and OMP's threads per process for ``num_processes`` processes, unless OMP_NUM_THREADS is set
set_num_threads_if_needed = _set_num_threads_if_needed
#: moves the state of each optimizer to a device
optimizers_to_device = _optimizers_to_device
#: whether ``rich`` is installed (a truthy RequirementCache), which RichProgressBar needs
RICH_AVAILABLE = _RICH_AVAILABLE



def logged_step(trainer: Any) -> int:
    """The step Lightning logs a metric at now (its loop's count of batches that stepped; ``global_step`` differs
    under gradient accumulation and manual optimisation)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def stop_as_on_sigterm(trainer: Any) -> None:
    """Stop fit as Lightning does after a SIGTERM: ``SIGTERMException`` where the current step ends (its loops then
    call the callbacks' ``on_exception``), on this rank; every rank must call it at the same step."""
    trainer._signal_connector.received_sigterm = True


__all__ = ["LIGHTNING_NEWEST_TESTED", "reopen_cut_epoch", "logged_step", "stop_as_on_sigterm", "METADATA_FILENAME",
           "is_sharded_checkpoint", "default_process_group_backend", "set_num_threads_if_needed", "optimizers_to_device",
           "RICH_AVAILABLE"]


def reopen_cut_epoch(checkpoint: dict[str, Any], trainer: Any) -> None:
    """Make a checkpoint written after ``max_steps`` (or ``should_stop``) ended an epoch early resume inside that epoch.

    Lightning counts such an epoch as finished before ``ModelCheckpoint`` writes ``last`` at the end of training: a
    run extended from it (a larger ``max_steps``) started the next epoch, reshuffled, and never saw the rest of this
    one. The loops' counters go back to where a checkpoint written at that batch's end has them (epoch started, not
    processed; batch not completed; one batch fewer stepped), as our data modules' position already says.
    """
    loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}  # Lightning 2.x's layout; another is left as it is
    epochs, batches, stepped = (loop.get(key) for key in ("epoch_progress", "epoch_loop.batch_progress",
                                                          "epoch_loop.state_dict"))
    if trainer is None or not (epochs and batches and stepped and "_batches_that_stepped" in stepped):
        return
    epoch, batch = epochs["current"], batches["current"]
    ended = epoch["ready"] == epoch["started"] == epoch["processed"] and epoch["completed"] >= epoch["processed"] - 1
    last_batch_done = batch["ready"] == batch["started"] == batch["processed"] == batch["completed"]
    cut = batch["ready"] < trainer.num_training_batches and not batches["is_last_batch"]
    if not (ended and last_batch_done and cut and batch["ready"] > 0):
        return
    undone = {"processed": 1, "completed": epoch["completed"] - (epoch["processed"] - 1)}
    for counts in epochs.values():
        for key, by in undone.items():
            counts[key] -= by
    for counts in (batches["current"], batches["total"]):
        counts["completed"] -= 1
    stepped["_batches_that_stepped"] -= 1
    checkpoint["epoch"] = epoch["completed"]
