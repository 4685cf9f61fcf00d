"""Fixed-length token blocks, a resumable per-rank sampler, and the DataModule base they share.

Every data source in lit_fsdp ends as a flat stream of token ids cut into blocks of ``seq_len + 1``
tokens (inputs are the first ``seq_len``, labels the last ``seq_len``). Global batch ``j`` is the same
set of blocks whatever the world size, so 1 and N processes see the same data per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class TokenBlocks(Dataset):
    """Blocks ``[i * seq_len, (i + 1) * seq_len + 1)`` of a 1-D token array (memory-mapped or in memory)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first_block: int = 0, num_blocks: int | None = None):
        available = (len(tokens) - 1) // seq_len
        self.tokens = tokens
        self.seq_len = seq_len
        self.first_block = first_block
        self.num_blocks = available - first_block if num_blocks is None else num_blocks
        if self.num_blocks <= 0 or first_block + self.num_blocks > available:
            raise ValueError(
                f"{len(tokens)} tokens hold {available} blocks of seq_len={seq_len}, too few for blocks "
                f"[{first_block}, {first_block + max(self.num_blocks, 1)}); use a shorter --data.seq_len or more data"
            )

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start = (self.first_block + index) * self.seq_len
        block = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return {"input_ids": block[:-1], "labels": block[1:]}


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start part-way into an epoch.

    Rank ``r`` takes every ``world``-th index of a seeded per-epoch permutation, so a local batch of
    ``b`` on each of ``world`` ranks covers exactly the same ``b * world`` blocks as one process with a
    batch of ``b * world``. ``start`` skips the first local samples of the epoch given to ``resume``.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start = 0
        self._resume_epoch: int | None = None

    def resume(self, epoch: int, start: int) -> None:
        self.epoch, self.start, self._resume_epoch = epoch, start, epoch

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._resume_epoch:
            self.start = 0
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])


class PositionedLoader(DataLoader):
    """The training DataLoader, which Lightning can tell resumes mid-epoch (it has ``state_dict``; without one Lightning
    warns at every mid-epoch resume that the loader is not resumable). The position is the data module's
    (``BlockDataModule.state_dict``), restored before the loader is built, whose sampler starts there: the loader
    itself keeps nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class BlockDataModule(pl.LightningDataModule):
    """Shared loaders and exact resume for block datasets; subclasses build ``train_set`` / ``val_set``.

    The position in the training stream is counted from the batches the trainer actually consumed
    (not those a loader prefetched) and saved in every checkpoint as global samples, so a resumed run
    neither replays nor skips a sample, on any number of processes with the same global batch.
    """

    #: set by subclasses in ``setup``
    train_set: Dataset
    val_set: Dataset
    vocab_size: int

    def __init__(self, seq_len: int, batch_size: int, seed: int, num_workers: int):
        super().__init__()
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len and batch_size must be positive, got seq_len={seq_len}, batch_size={batch_size}")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self._epoch = 0
        self._consumed = 0  # local batches consumed by training in epoch ``_epoch``
        self._resume: tuple[int, int] | None = None

    @property
    def tokenizer(self) -> Any | None:
        """The Hugging Face tokenizer of this data, if it has one (exported with the model)."""
        return None

    @property
    def dataset_name(self) -> str:
        return type(self).__name__

    def read_before_launch(self, module: Any, local_rank: int) -> None:
        """Read the data files in the process that starts the others (the CLI's preflight; ``module`` the model to be
        trained), before it starts them or a W&B run, so that a bad file is said once and nothing is left behind;
        ``setup`` then finds them read. By default nothing: data without files is made in ``setup``."""

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def _accumulation(self) -> int:
        return 1 if self.trainer is None else self.trainer.accumulate_grad_batches

    def _loader(self, dataset: Dataset, shuffle: bool, resume: tuple[int, int] | None,
                positioned: bool = False) -> DataLoader:
        world, rank = self._world()
        if len(dataset) < world * self.batch_size:
            raise ValueError(
                f"{self.dataset_name}: {len(dataset)} blocks cannot fill one batch of {self.batch_size} on {world} "
                f"processes; lower --data.batch_size or --data.seq_len, or add data"
            )
        sampler = self._sampler(dataset, world, rank, shuffle)
        if resume is not None:
            epoch, consumed = resume
            sampler.resume(epoch, consumed * self.batch_size)
        return (PositionedLoader if positioned else DataLoader)(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _sampler(self, dataset: Dataset, world: int, rank: int, shuffle: bool) -> ResumableSampler:
        """The sampler of a loader; a subclass may return one that yields more than an index (its dataset reads it)."""
        return ResumableSampler(dataset, num_replicas=world, rank=rank, seed=self.seed, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True, resume=self._resume, positioned=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False, resume=None)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            if trainer.current_epoch != self._epoch:
                self._epoch, self._consumed = trainer.current_epoch, 0
            self._consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The position as global samples consumed in the epoch, and the global batch it was counted with."""
        world, _ = self._world()
        accumulate = self._accumulation()
        return {
            "epoch": self._epoch, "samples_consumed": self._consumed * self.batch_size * world,
            "batch_size": self.batch_size, "world_size": world, "accumulate_grad_batches": accumulate,
            "global_batch": self.batch_size * world * accumulate,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "samples_consumed" not in state_dict:
            raise ValueError("the checkpoint's data position was written by an older lit_fsdp (batches per rank); "
                             "start a new run, it cannot be resumed exactly")
        world, _ = self._world()
        check_same_global_batch(state_dict, self.batch_size, world, self._accumulation(), "the checkpoint")
        samples, per_batch = state_dict["samples_consumed"], self.batch_size * world
        if samples % per_batch:
            raise ValueError(f"the checkpoint stopped after {samples} samples, not a whole number of batches of "
                             f"{per_batch}; resume with the processes and --data.batch_size it was trained with")
        self._epoch, self._consumed = state_dict["epoch"], samples // per_batch
        self._resume = (self._epoch, self._consumed)


def check_same_global_batch(saved: dict[str, Any], batch_size: int, world: int, accumulate: int, source: str) -> None:
    """Refuse to resume ``saved`` (a data state or a checkpoint manifest) with another global batch or accumulation.

    The same global batch on another number of processes is fine: global batch j is the same samples
    on any world size (``ResumableSampler``).
    """
    saved_accumulate = saved.get("accumulate_grad_batches") or 1
    if saved_accumulate != accumulate:
        raise ValueError(
            f"{source} accumulated {saved_accumulate} micro-batches per optimizer step, this run {accumulate}: "
            f"resume with --trainer.accumulate_grad_batches {saved_accumulate}"
        )
    saved_global = saved.get("global_batch")
    if saved_global is not None and saved_global != batch_size * world * accumulate:
        per_process, advice = saved_global // (world * accumulate), ""
        if per_process * world * accumulate == saved_global:
            advice = f": resume with --data.batch_size {per_process} on {world} process(es)"
        else:
            advice = f": resume on a number of processes that divides {saved_global // accumulate}"
        raise ValueError(
            f"{source} was trained with a global batch of {saved_global} ({saved.get('batch_size')} per process x "
            f"{saved.get('world_size')} processes x {saved_accumulate}); this run's is {batch_size * world * accumulate} "
            f"({batch_size} x {world} x {accumulate}){advice}"
        )


def blocks_per_split(total_blocks: int, val_fraction: float) -> tuple[int, int]:
    """Train and validation block counts for a deterministic tail split (at least one of each)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    num_val = max(1, math.ceil(total_blocks * val_fraction))
    return total_blocks - num_val, num_val
