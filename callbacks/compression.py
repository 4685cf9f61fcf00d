"""Compression statistics: bytes before and after, ratio, time, extra collectives, non-finite values."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from callbacks.run_folder import log_metrics, write_json
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
        log_metrics(trainer, metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hook = self._hook(trainer)
        if hook is None:
            return
        report = {"method": hook.config.method, "config": vars(hook.config), **self.totals, **summarise(self.totals)}
        report.update(memory_metrics(hook))
        write_json(trainer, "compression.json", report)

    def summary(self) -> dict[str, Any]:
        """Run totals for the results record; empty when no compression hook ran (the ``none`` method)."""
        totals = self.totals
        if not totals:
            return {}
        ratios = summarise(totals)
        return {
            "bytes_raw_total": totals["bytes_raw"], "bytes_compressed_total": totals["bytes_sent"],
            "compression_ratio": ratios.get("compress/ratio_vs_fp32"),
            "compress_time_ms": 1000 * totals["compress_s"], "decompress_time_ms": 1000 * totals["decompress_s"],
            "extra_collectives": totals["extra_collectives"], "nonfinite": totals["nonfinite"],
            "index_share": ratios.get("compress/index_share"),
        }


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
