"""Loss against step and wall time (``history.jsonl``), time to a target validation loss, loss at a time budget."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl

from callbacks.run_folder import append_jsonl, logged, run_name


class Quality(pl.Callback):
    """Appends the run's loss curve to ``<default_root_dir>/history.jsonl`` and summarises how fast it learned.

    Rank 0 writes one line every ``log_every_n_steps`` optimizer steps (and at the last step) with the
    training loss, and one after every validation with ``val_loss`` and ``val_ppl``; every line has
    ``run_name``, ``step``, ``wall_s`` (seconds since training started, validation time included) and
    ``tokens`` (seen by all ranks so far). Fields not measured at a line are null. The file may hold
    several runs: tell them apart by ``run_name``. Reading the training loss waits for the device, so
    it follows the trainer's logging cadence rather than every step.
    """

    def __init__(self, target_val_loss: float | None = None, time_budget_s: float | None = None):
        """
        Args:
            target_val_loss: Validation loss whose first crossing gives ``time_to_target_s`` and ``step_to_target``.
            time_budget_s: Wall-clock budget (seconds of training) for ``val_loss_at_budget``.
        """
        self.target_val_loss = target_val_loss
        self.time_budget_s = time_budget_s
        self.validations: list[tuple[int, float, float]] = []  # (step, wall_s, val_loss)
        self.tokens = 0
        self._start: float | None = None
        self._end: float | None = None

    def _wall(self) -> float:
        assert self._start is not None
        return time.perf_counter() - self._start

    def _append(self, trainer: pl.Trainer, wall_s: float, **losses: float | None) -> None:
        line = {"run_name": run_name(trainer), "step": trainer.global_step, "wall_s": wall_s, "tokens": self.tokens,
                "train_loss": None, "val_loss": None, "val_ppl": None}
        append_jsonl(trainer, "history.jsonl", {**line, **losses})

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validations, self.tokens, self._end = [], 0, None
        self._start = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.tokens += batch["input_ids"].numel() * trainer.world_size

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        step = trainer.global_step
        if step % trainer.log_every_n_steps == 0 or step == trainer.max_steps:
            self._append(trainer, self._wall(), train_loss=logged(trainer, "train/loss"))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._start is None or self._end is not None:  # not inside fit's training
            return
        val_loss = logged(trainer, "val/loss")
        if val_loss is None:
            return
        wall_s = self._wall()
        self.validations.append((trainer.global_step, wall_s, val_loss))
        self._append(trainer, wall_s, val_loss=val_loss, val_ppl=logged(trainer, "val/ppl"))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        """Time and step of the first validation at or under the target, the last validation loss within the
        budget, the best validation loss and the training wall time; null where there is no target, budget,
        validation or crossing."""
        target, budget = self.target_val_loss, self.time_budget_s
        reached = next(((step, wall) for step, wall, loss in self.validations if target is not None and loss <= target), None)
        in_budget = [loss for _, wall, loss in self.validations if budget is not None and wall <= budget]
        # Results asks before this callback's own on_train_end may have run: the wall time is then "now".
        end = self._end if self._end is not None else time.perf_counter()
        return {
            "target_val_loss": target,
            "time_budget_s": budget,
            "time_to_target_s": None if reached is None else reached[1],
            "step_to_target": None if reached is None else reached[0],
            "val_loss_at_budget": in_budget[-1] if in_budget else None,
            "best_val_loss": min((loss for _, _, loss in self.validations), default=None),
            "train_wall_s": None if self._start is None else end - self._start,
        }
