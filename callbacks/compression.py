"""Compression statistics: bytes before and after, ratio, time, extra collectives, non-finite values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from compress.hook import GradientCompression


class CompressionStats(pl.Callback):
    """Logs ``compress/*`` from the strategy's ``GradientCompression`` hook every optimizer step.

    Bytes are this rank's, per step: ``bytes_raw`` is what the uncompressed float32 collectives would
    send, ``bytes_sent`` what was sent (payloads, headers, size exchanges). Totals over the run go to
    ``<default_root_dir>/compression.json``.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @staticmethod
    def _hook(trainer: pl.Trainer) -> GradientCompression | None:
        hook = getattr(trainer.strategy, "comm_hook", None)
        return hook if isinstance(hook, GradientCompression) else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        hook = self._hook(trainer)
        if hook is None or trainer.fit_loop._should_accumulate():
            return
        step = hook.stats.take()
        for key, value in step.items():
            self.totals[key] = self.totals.get(key, 0) + value
        metrics = {f"compress/{key}": value for key, value in step.items() if key != "calls"}
        metrics.update(summarise(step))
        metrics.update(memory_metrics(hook))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hook = self._hook(trainer)
        if hook is None or not trainer.is_global_zero:
            return
        report = {"method": hook.config.method, "config": vars(hook.config), **self.totals, **summarise(self.totals)}
        report.update(memory_metrics(hook))
        Path(trainer.default_root_dir).mkdir(parents=True, exist_ok=True)
        (Path(trainer.default_root_dir) / "compression.json").write_text(json.dumps(report, indent=2, default=str))


def summarise(counters: dict[str, float]) -> dict[str, float]:
    """Ratios from byte counters: against float32 and against bfloat16 gradients, and the index share."""
    sent = counters.get("bytes_sent", 0)
    if not sent:
        return {}
    raw = counters["bytes_raw"]
    return {
        "compress/ratio_vs_fp32": raw / sent,
        "compress/ratio_vs_bf16": raw / 2 / sent,
        "compress/index_share": counters.get("bytes_index", 0) / sent,
    }


def memory_metrics(hook: GradientCompression) -> dict[str, float]:
    """Error-feedback residuals: their norm and the memory they hold."""
    compressor = hook.compressor
    if not hasattr(compressor, "residual_norm"):
        return {}
    return {"compress/residual_norm": compressor.residual_norm, "compress/residual_bytes": compressor.memory_bytes}
