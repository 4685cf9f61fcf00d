"""Tokens/s and step-time percentiles per optimizer step, warm-up steps discarded."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

from callbacks.run_folder import log_metrics, write_json


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Throughput(pl.Callback):
    """Times each optimizer step (device-synchronised) and reports tokens/s and step-time statistics.

    A step's time runs from the end of the previous step (or the start of training) to its own end,
    so time spent between steps, in data loading or logging, is counted.

    The figures are logged as ``perf/*`` at the end of fit and written by rank 0 to
    ``<default_root_dir>/throughput.json``.
    """

    def __init__(self, warmup_steps: int = 5):
        """
        Args:
            warmup_steps: Optimizer steps left out of the statistics (compilation, allocator and cache warm-up).
        """
        self.warmup_steps = warmup_steps
        self.step_seconds: list[float] = []
        self.tokens_per_step = 0
        self._start = 0.0
        self._new_step = True

    @staticmethod
    def _sync(device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._new_step:
            self.tokens_per_step, self._new_step = 0, False
        self.tokens_per_step += batch["input_ids"].numel() * trainer.world_size

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.fit_loop._should_accumulate():
            return
        # Boundary to boundary: the time between steps (data loading, logging) counts too.
        self._sync(pl_module.device)
        now = time.perf_counter()
        self.step_seconds.append(now - self._start)
        self._start, self._new_step = now, True

    def summary(self) -> dict[str, float]:
        """Statistics over the steps after warm-up (all steps if there are no more than the warm-up)."""
        steps = self.step_seconds[self.warmup_steps :] or self.step_seconds
        if not steps:
            return {}
        ms = [s * 1000 for s in steps]
        return {
            "steps_measured": len(steps),
            "step_time_ms_mean": statistics.fmean(ms),
            "step_time_ms_p50": percentile(ms, 50),
            "step_time_ms_p90": percentile(ms, 90),
            "step_time_ms_p95": percentile(ms, 95),
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_s": self.tokens_per_step * len(steps) / sum(steps),
        }

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = self.summary()
        if not summary:
            return
        log_metrics(trainer, {f"perf/{key}": value for key, value in summary.items()})
        write_json(trainer, "throughput.json", summary)
