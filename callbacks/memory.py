"""Peak memory: allocated and reserved GPU memory, the process's peak RSS on CPU, and the host's lowest MemAvailable."""

from __future__ import annotations

import resource
import sys
from typing import Any

import lightning.pytorch as pl
import torch

from callbacks.run_folder import log_metrics
from lit_fsdp.meminfo import available_host_bytes

_GIB = 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident set size (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Memory(pl.Callback):
    """Logs ``memory/*`` in GiB every ``every_n_steps`` optimizer steps and keeps the run's peaks in ``peaks``; the
    host's MemAvailable is read at each phase of every step (its start, before and after each backward, before the
    optimizer step, its end), and its lowest, over the step and over the run, is logged as
    ``memory/host_available_min_gb``: what the host had left at its fullest, beside what ``estimate`` counts."""

    def __init__(self, every_n_steps: int = 50):
        """
        Args:
            every_n_steps: Optimizer steps between two logged readings.
        """
        self.every_n_steps = every_n_steps
        self.peaks: dict[str, float] = {}
        self.step_lowest: int | None = None  # the lowest MemAvailable in bytes during the current step
        self.lowest: int | None = None  # and during the run

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def read_host(self) -> None:
        """One reading of MemAvailable into the step's and the run's lowest (none where the host does not say)."""
        available = available_host_bytes()
        if available is not None:
            self.step_lowest = available if self.step_lowest is None else min(self.step_lowest, available)
            self.lowest = available if self.lowest is None else min(self.lowest, available)

    def reading(self, device: torch.device) -> dict[str, float]:
        """Peaks so far: both sources only ever grow (CUDA's since ``on_train_start``), so the last reading is the
        run's; the host's lowest MemAvailable so far."""
        values = {"memory/peak_rss_gb": peak_rss_bytes() / _GIB}
        if device.type == "cuda":
            values["memory/peak_allocated_gb"] = torch.cuda.max_memory_allocated(device) / _GIB
            values["memory/peak_reserved_gb"] = torch.cuda.max_memory_reserved(device) / _GIB
        if self.lowest is not None:
            values["memory/host_available_min_gb"] = self.lowest / _GIB
        return values

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.read_host()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.read_host()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.read_host()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.read_host()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.read_host()
        if trainer.fit_loop._should_accumulate():
            return
        if self.step_lowest is not None:
            log_metrics(trainer, {"memory/host_available_step_min_gb": self.step_lowest / _GIB})
        self.step_lowest = None
        if trainer.global_step % self.every_n_steps:
            return
        self.peaks = self.reading(pl_module.device)
        log_metrics(trainer, self.peaks)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peaks = self.reading(pl_module.device)

    def summary(self) -> dict[str, float]:
        """The run's peaks, for the results record (``peak_rss_gb``, ``host_available_min_gb`` and, on GPUs,
        ``peak_allocated_gb``, ``peak_reserved_gb``)."""
        return {key.removeprefix("memory/"): value for key, value in self.peaks.items()}
