"""One JSON line per run in ``<default_root_dir>/results.jsonl``, and the run's environment beside it."""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
import torch

from callbacks.run_folder import append_jsonl, compression_method, folder, logged, run_name, write_json
from callbacks.run_summary import RESUME, summary_lines
from lit_fsdp.errors import error_line
from lit_fsdp.wandb_logger import publish_summary
from lit_fsdp.reporting import strategy_report

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


def finite_or_null(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities become null: JSON has no such numbers."""
    return {key: (None if isinstance(value, float) and not math.isfinite(value) else value) for key, value in record.items()}


class Results(pl.Callback):
    """Appends the run's record to ``results.jsonl`` (rank 0) and writes ``environment.json``.

    Besides the run's identity and its final losses, the record holds the ``summary()`` of every other
    callback of the trainer that has one (``Throughput``, ``Memory``, ``CompressionStats``,
    ``CommProfiler``, ``Quality``), and the module's (``CausalLM``'s experts). Figures without a callback to measure
    them are null, not zero.
    """

    def __init__(self, run_name: str | None = None):
        """
        Args:
            run_name: Name of the run in the record and the logger; default: method, world size, seed and a timestamp.
        """
        self.run_name = run_name
        self._name: str | None = None  # this run's, once fit starts: what its checkpoints say it is
        self.resumed_from: str | None = None  # the run whose checkpoint this one started from

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._name = run_name(trainer)
        write_json(trainer, "environment.json", environment(trainer))

    def state_dict(self) -> dict[str, Any]:
        """The run's name, in its checkpoints: a run resumed from one is that run's continuation (compare_runs joins
        them)."""
        return {"run_name": self._name}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.resumed_from = state_dict.get("run_name")

    def identity(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Who the run is and where it got to: what a failed run's record holds too."""
        report = strategy_report(trainer)
        compression = report.compression
        method = compression_method(trainer)
        datamodule = trainer.datamodule
        return {
            "run_name": run_name(trainer),
            "world_size": trainer.world_size,
            "model": pl_module.hparams.get("pretrained_path") or pl_module.hparams.get("preset"),
            "dataset": getattr(datamodule, "dataset_name", None),
            "max_length": getattr(datamodule, "seq_len", None),
            "batch_size": getattr(datamodule, "batch_size", None),
            "compress_method": method,
            "compress_config": None if compression is None else vars(compression),
            "strategy": report.label,  # ddp, fsdp2, slide_fsdp, ...
            "seed": int(os.environ["PL_GLOBAL_SEED"]) if "PL_GLOBAL_SEED" in os.environ else None,  # seed_everything
            "resumed_from": self.resumed_from,
            "steps": trainer.global_step,
            "train_loss": logged(trainer, "train/loss"),
            "val_loss": logged(trainer, "val/loss"),
            "val_ppl": logged(trainer, "val/ppl"),
        }

    def record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        method = compression_method(trainer)
        record: dict[str, Any] = {
            **self.identity(trainer, pl_module),
            "status": "ok",
            "error": None,
            "comm_time_ms_total": None, "comm_ratio": None, "comm_time_ms_by_op": None,
            "bytes_raw_total": None, "bytes_compressed_total": None,
            # FSDP2's own reduce-scatter sends float32 gradients: the uncompressed reference.
            "compression_ratio": 1.0 if method == "none" else None,
        }
        for callback in trainer.callbacks:
            if callback is not self and callable(getattr(callback, "summary", None)):
                record.update(callback.summary())
        if callable(getattr(pl_module, "summary", None)):  # CausalLM: a mixture of experts' tokens per expert
            record.update(pl_module.summary())
        return finite_or_null(record)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Append the record and print its summary (``callbacks.run_summary``)."""
        # Computed on every rank (callbacks may gather across ranks in summary()); written by rank 0.
        record = self.record(trainer, pl_module)
        append_jsonl(trainer, "results.jsonl", record)
        publish_summary(trainer, record)
        if trainer.is_global_zero:  # the run's last lines: what a log ends with
            saving = [callback.dirpath for callback in trainer.checkpoint_callbacks if getattr(callback, "dirpath", None)]
            print("\n".join(summary_lines(record, folder(trainer), Path(saving[0]) if saving else None)), flush=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A run that fails still leaves its line (``status: failed`` and the reason; ``interrupted`` after Ctrl-C or a
        preemption signal), so sweeps and comparisons show it.

        Only what this rank knows is recorded: the other callbacks' summaries may need collectives,
        and a failed run's peers may be gone.
        """
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if isinstance(exception, SIGTERMException):  # Ctrl-C or preemption (callbacks.interrupt): stopped, not broken
            outcome = {"status": "interrupted", "error": f"stopped by a signal after step {trainer.global_step}; {RESUME}"}
        else:
            outcome = {"status": "failed", "error": error_line(exception)}
        record = finite_or_null({**self.identity(trainer, pl_module), **outcome})
        append_jsonl(trainer, "results.jsonl", record)
        publish_summary(trainer, record)
