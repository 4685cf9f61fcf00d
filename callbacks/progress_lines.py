"""Training progress as plain lines, for output that is not a terminal (nohup, SLURM, a pipe): a bar there is drawn
once, at the end, and a log holds nothing while the run lasts."""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar

from callbacks.progress_bar import shown_metrics
from lit_fsdp.data.progress import duration


class ProgressLines(ProgressBar):
    """One line every ``every_n_steps`` optimizer steps, and at the last one: ``step=10/300 loss=3.214 tok/s=812
    elapsed=12s eta=5m48s``; one line after each validation: ``val step=50/300 val_loss=2.911 val_ppl=18.37``.
    Printed by global rank 0, flushed at once."""

    def __init__(self, every_n_steps: int | None = None):
        """
        Args:
            every_n_steps: Optimizer steps between two lines; default: the trainer's ``log_every_n_steps``.
        """
        super().__init__()
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"ProgressLines every_n_steps={every_n_steps} must be >= 1, or null for log_every_n_steps")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._started: float | None = None
        self._first_step = 0
        self._printed_step = -1

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started, self._first_step = time.monotonic(), trainer.global_step  # a resumed run counts from there

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        every = self.every_n_steps or trainer.log_every_n_steps or 1
        last = 0 < trainer.max_steps <= step
        if not self._enabled or step == self._printed_step or not (step % every == 0 or last):
            return  # between a step's micro-batches global_step does not move: one line per step
        self._printed_step = step
        shown = shown_metrics(trainer, self.get_metrics(trainer, pl_module))
        shown.pop("val_loss", None), shown.pop("val_ppl", None)  # said after each validation, on their own line
        elapsed = time.monotonic() - (self._started or time.monotonic())
        shown["elapsed"] = duration(elapsed)
        done = step - self._first_step
        if trainer.max_steps > 0 and done > 0:
            shown["eta"] = duration(elapsed / done * max(0, trainer.max_steps - step))
        self._say(" ".join(f"{name}={value}" for name, value in shown.items()))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled or trainer.sanity_checking:
            return
        metrics = shown_metrics(trainer, self.get_metrics(trainer, pl_module))
        values = [f"{name}={metrics[name]}" for name in ("val_loss", "val_ppl") if name in metrics]
        if values:
            where = f" step={metrics['step']}" if "step" in metrics else ""
            self._say(f"val{where} {' '.join(values)}")

    def _say(self, line: str) -> None:
        print(line, file=sys.stdout, flush=True)
