"""One JSON line per run in ``<default_root_dir>/results.jsonl``, and the run's environment beside it."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from callbacks.compression import CompressionStats, summarise
from callbacks.memory import Memory
from callbacks.throughput import Throughput

_PACKAGES = ("torch", "lightning", "transformers", "torchmetrics", "jsonargparse", "wandb")


def environment(trainer: pl.Trainer) -> dict[str, Any]:
    """Versions and devices: enough to tell two runs' machines apart."""
    versions = {}
    for package in _PACKAGES:
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "python": platform.python_version(), "platform": platform.platform(), "packages": versions,
        "cuda_devices": devices, "cuda": torch.version.cuda, "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes, "strategy": type(trainer.strategy).__name__,
    }


def _metric(trainer: pl.Trainer, key: str) -> float | None:
    value = trainer.callback_metrics.get(key)
    return None if value is None else float(value)


class Results(pl.Callback):
    """Appends the run's record to ``results.jsonl`` (rank 0) and writes ``environment.json``.

    Figures come from the other measuring callbacks of the same trainer (``Throughput``, ``Memory``,
    ``CompressionStats``) when they are present, and from the logged losses.
    """

    def __init__(self, run_name: str | None = None):
        """
        Args:
            run_name: Name of the run in the record; default: method, world size and a timestamp.
        """
        self.run_name = run_name

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            folder = Path(trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "environment.json").write_text(json.dumps(environment(trainer), indent=2))

    def record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        strategy = trainer.strategy
        compression = getattr(strategy, "compression", None)
        method = compression.method if compression is not None else "none"
        datamodule = trainer.datamodule
        found = {type(cb): cb for cb in trainer.callbacks}
        record: dict[str, Any] = {
            "run_name": self.run_name or f"{method}-w{trainer.world_size}-{time.strftime('%Y%m%d-%H%M%S')}",
            "world_size": trainer.world_size,
            "model": pl_module.hparams.get("pretrained_path") or pl_module.hparams.get("preset"),
            "dataset": getattr(datamodule, "dataset_name", None),
            "max_length": getattr(datamodule, "seq_len", None),
            "batch_size": getattr(datamodule, "batch_size", None),
            "compress_method": method,
            "compress_config": None if compression is None else vars(compression),
            "seed": int(os.environ["PL_GLOBAL_SEED"]) if "PL_GLOBAL_SEED" in os.environ else None,  # seed_everything
            "steps": trainer.global_step,
            "train_loss": _metric(trainer, "train/loss"),
            "val_loss": _metric(trainer, "val/loss"),
            "val_ppl": _metric(trainer, "val/ppl"),
            # The communication profiler fills these; without it they are unknown, not zero.
            "comm_time_ms_total": None, "comm_ratio": None, "comm_time_ms_by_op": None,
        }
        if Throughput in found:
            record.update(found[Throughput].summary())
        if Memory in found:
            record.update({key.removeprefix("memory/"): value for key, value in found[Memory].peaks.items()})
        stats = found.get(CompressionStats)
        totals = stats.totals if stats is not None else {}
        ratios = summarise(totals)
        record.update(
            bytes_raw_total=totals.get("bytes_raw"), bytes_compressed_total=totals.get("bytes_sent"),
            compression_ratio=ratios.get("compress/ratio_vs_fp32", 1.0 if method == "none" else None),
            compress_time_ms=None if not totals else 1000 * totals["compress_s"],
            decompress_time_ms=None if not totals else 1000 * totals["decompress_s"],
            extra_collectives=totals.get("extra_collectives"), nonfinite=totals.get("nonfinite"),
            index_share=ratios.get("compress/index_share"),
        )
        return {key: (None if isinstance(value, float) and not math.isfinite(value) else value) for key, value in record.items()}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Computed on every rank (it reads only local state); written by rank 0.
        record = self.record(trainer, pl_module)
        if trainer.is_global_zero:
            with open(Path(trainer.default_root_dir) / "results.jsonl", "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
