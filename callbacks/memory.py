"""Peak memory: allocated and reserved GPU memory, and the process's peak RSS on CPU."""

from __future__ import annotations

import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from callbacks.run_folder import log_metrics

_GIB = 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Memory(pl.Callback):
    """Logs ``memory/*`` in GiB every ``every_n_steps`` optimizer steps and keeps the run's peaks in ``peaks``."""

    def __init__(self, every_n_steps: int = 50):
        """
        Args:
            every_n_steps: Optimizer steps between two logged readings.
        """
        self.every_n_steps = every_n_steps
        self.peaks: dict[str, float] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def reading(self, device: torch.device) -> dict[str, float]:
        """Peaks so far: both sources only ever grow (CUDA's since ``on_train_start``), so the last reading is the run's."""
        values = {"memory/peak_rss_gb": peak_rss_bytes() / _GIB}
        if device.type == "cuda":
            values["memory/peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / _GIB
            values["memory/peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / _GIB
        return values

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps or trainer.fit_loop._should_accumulate():
            return
        self.peaks = self.reading(pl_module.device)
        log_metrics(trainer, self.peaks)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peaks = self.reading(pl_module.device)

    def summary(self) -> dict[str, float]:
        """The run's peaks, for the results record (``peak_rss_gb`` and, on GPUs, ``peak_allocated_gb``, ``peak_reserved_gb``)."""
        return {key.removeprefix("memory/"): value for key, value in self.peaks.items()}
