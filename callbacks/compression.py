"""Compression statistics: bytes, ratio, density, time, extra collectives, sampled error, memory, non-finite values."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl

from callbacks.run_folder import log_metrics, write_json
from lit_fsdp.reporting import CompressionReport, strategy_report

_PEAKS = ("buffer_bytes",)  # counters that are a maximum over the run, not a sum
_SAMPLED = "sample_"  # prefix of the sums of a sampled step: turned into error and cosine, not run totals


class CompressionStats(pl.Callback):
    """Logs ``compress/*`` from the strategy's ``GradientCompression`` hook every optimizer step.

    Figures are this rank's, per step: ``bytes_raw`` is what the uncompressed float32 collectives would
    send, ``bytes_sent`` what was sent (payloads and count exchanges); ``density`` the share of
    gradient elements whose value was sent (below 1 only for sparsifiers); ``extra_memory_bytes`` the
    error-feedback residuals plus the largest call's send and receive buffers. On sampled steps each rank
    also decodes its own payloads and logs ``grad_rel_error`` (||est - g|| / ||g||) and ``grad_cosine``
    against the gradient before error feedback, over all FSDP units; that decoding is not counted as
    codec time. Totals over the run go to ``<default_root_dir>/compression.json``; the results record has the
    ratio over the whole run and over the steps after the method's warm-up (1-bit Adam's freeze, PowerSGD's
    start, DGC's density warm-up: ``compression_ratio_after_warmup``).
    """

    def __init__(self, sample_every_n_steps: int = 10) -> None:
        """
        Args:
            sample_every_n_steps: Optimizer steps between two measurements of the compressed gradient's relative
                error and cosine against the uncompressed one (logged at steps n, 2n, ...); 0 turns them off.
        """
        every = sample_every_n_steps
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"CompressionStats: sample_every_n_steps={every!r} is not an integer >= 0 (0: off)")
        self.sample_every_n_steps = sample_every_n_steps
        self.totals: dict[str, float] = {}
        self.after_warmup = dict.fromkeys(("bytes_raw", "bytes_sent", "numel", "values_sent"), 0)  # from the method's warm-up on (CompressionConfig.warmup)
        self.samples: list[dict[str, float]] = []  # grad_rel_error and grad_cosine of each sampled step
        self.peak_extra_memory = 0
        self.residual_norm: float | None = None
        self.semi_sync: dict[str, Any] = {}  # semi-synchronous training's figures (reporting.SemiSyncFigures)

    @staticmethod
    def _hook(trainer: pl.Trainer) -> CompressionReport | None:
        return strategy_report(trainer).compression_hook()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # Gradients are reduced only on the micro-batch that ends an accumulation window: switch sampling there.
        hook = self._hook(trainer)
        if hook is None or trainer.fit_loop._should_accumulate():
            return
        every = self.sample_every_n_steps
        hook.stats.sampling = bool(every) and (trainer.global_step + 1) % every == 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        hook = self._hook(trainer)
        if hook is None or trainer.fit_loop._should_accumulate():
            return
        hook.stats.sampling = False
        step = hook.stats.take()
        for key, value in step.items():
            if key in _PEAKS:
                self.totals[key] = max(self.totals.get(key, 0), value)
            elif not key.startswith(_SAMPLED):
                self.totals[key] = self.totals.get(key, 0) + value
        if trainer.global_step > hook.config.warmup():  # the step just taken was past the warm-up
            for key in self.after_warmup:
                self.after_warmup[key] += step[key]
        logged = {key: value for key, value in step.items() if key != "calls" and not key.startswith(_SAMPLED)}
        metrics = {f"compress/{key}": value for key, value in logged.items()}
        metrics.update(summarise(step))
        sample = sampled_error(step)
        if sample:
            self.samples.append(sample)
        metrics.update({f"compress/{key}": value for key, value in sample.items()})
        residuals = memory_metrics(hook, with_norm=bool(sample))  # the norm reads the device: on sampled steps only
        metrics.update(residuals)
        extra = residuals.get("compress/residual_bytes", 0) + step["buffer_bytes"]
        metrics["compress/extra_memory_bytes"] = extra
        self.peak_extra_memory = max(self.peak_extra_memory, extra)
        self.residual_norm = residuals.get("compress/residual_norm", self.residual_norm)
        log_metrics(trainer, metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = strategy_report(trainer)
        hook = strategy.compression_hook()
        if hook is None:
            return
        report = {"method": hook.config.method, "config": vars(hook.config), **self.totals, **summarise(self.totals),
                  "warmup_steps": hook.config.warmup(),
                  "ratio_after_warmup": summarise(self.after_warmup).get("compress/ratio_vs_fp32")}
        report.update(memory_metrics(hook))
        semi_sync = strategy.semi_sync_figures()
        self.semi_sync = {} if semi_sync is None else asdict(semi_sync)
        report.update(self.run_figures())
        write_json(trainer, "compression.json", report)

    def run_figures(self) -> dict[str, Any]:
        """Mean sampled error and cosine (None when no step was sampled) and the peak extra memory."""
        means = {
            key: sum(sample[key] for sample in self.samples) / len(self.samples) if self.samples else None
            for key in ("grad_rel_error", "grad_cosine")
        }
        return {**means, "extra_memory_bytes": self.peak_extra_memory, **self.semi_sync}

    def summary(self) -> dict[str, Any]:
        """Run totals for the results record; empty when no compression hook ran (the ``none`` method)."""
        totals = self.totals
        if not totals:
            return {}
        ratios = summarise(totals)
        return {
            "bytes_raw_total": totals["bytes_raw"], "bytes_compressed_total": totals["bytes_sent"],
            "compression_ratio": ratios.get("compress/ratio_vs_fp32"),
            "compression_ratio_after_warmup": summarise(self.after_warmup).get("compress/ratio_vs_fp32"),
            "compress_time_ms": 1000 * totals["compress_s"], "decompress_time_ms": 1000 * totals["decompress_s"],
            "extra_collectives": totals["extra_collectives"], "nonfinite": totals["nonfinite"],
            "index_share": ratios.get("compress/index_share"), "density": ratios.get("compress/density"),
            "param_gather_ratio": ratios.get("compress/param_gather_ratio"),
            **self.run_figures(), "residual_norm": self.residual_norm,
        }


def summarise(counters: dict[str, float]) -> dict[str, float]:
    """Ratios from counters: against float32 and bfloat16 gradients, the index share, the density, and the
    parameter all-gather's ratio against its unquantised gather."""
    ratios = {}
    gathered = counters.get("gather_bytes_sent", 0)
    if gathered:
        ratios["compress/param_gather_ratio"] = counters["gather_bytes_raw"] / gathered
    sent = counters.get("bytes_sent", 0)
    if not sent:
        return ratios
    raw = counters["bytes_raw"]
    return {
        **ratios,
        "compress/ratio_vs_fp32": raw / sent,
        "compress/ratio_vs_bf16": raw / 2 / sent,
        "compress/index_share": counters.get("bytes_index", 0) / sent,
        "compress/density": counters.get("values_sent", 0) / counters["numel"],
    }


def sampled_error(counters: dict[str, float]) -> dict[str, float]:
    """Relative error and cosine of the decoded gradient from a sampled step's sums; empty if none was sampled."""
    ref_sq = counters.get("sample_ref_sq", 0.0)
    if not ref_sq:
        return {}
    est_sq = counters["sample_est_sq"]
    return {
        "grad_rel_error": math.sqrt(counters["sample_err_sq"] / ref_sq),
        # an all-zero estimate (a threshold that kept nothing) points nowhere: cosine 0
        "grad_cosine": counters["sample_dot"] / math.sqrt(ref_sq * est_sq) if est_sq else 0.0,
    }


def memory_metrics(hook: CompressionReport, with_norm: bool = True) -> dict[str, float]:
    """Error-feedback residuals: the memory they hold, and their norm (``with_norm``: one read of the device)."""
    compressor = hook.compressor
    if not hasattr(type(compressor), "residual_norm"):  # on the class: hasattr on the instance computes the norm
        return {}
    metrics = {"compress/residual_bytes": compressor.memory_bytes}
    if with_norm:
        metrics["compress/residual_norm"] = compressor.residual_norm
    return metrics
