"""The run folder (``trainer.default_root_dir``): the run's name and the files the callbacks write there."""

from __future__ import annotations

import json
import os
import re
import time
import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lit_fsdp.reporting import strategy_report

_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compression_method(trainer: pl.Trainer) -> str:
    """The strategy's gradient compression method; ``none`` without a compression config."""
    return strategy_report(trainer).compression_method()


def run_name(trainer: pl.Trainer) -> str:
    """The run's name, fixed at its first use: a callback's ``run_name``, the logger's name, or method-world-seed-time.

    A ``Results(run_name=...)`` wins; then a W&B run name given in the logger config; otherwise
    ``<method>-w<world size>-s<seed>-<YYYYmmdd-HHMMSS>``.
    """
    if trainer not in _NAMES:
        given = [getattr(cb, "run_name", None) for cb in trainer.callbacks]
        logger_name = next((lg._wandb_init.get("name") for lg in trainer.loggers if hasattr(lg, "_wandb_init")), None)
        method = compression_method(trainer)
        seed = os.environ.get("PL_GLOBAL_SEED", "none")  # set by seed_everything
        default = f"{method}-w{trainer.world_size}-s{seed}-{time.strftime('%Y%m%d-%H%M%S')}"
        _NAMES[trainer] = next((name for name in given if name), None) or logger_name or default
    return _NAMES[trainer]


def folder(trainer: pl.Trainer) -> Path:
    """``trainer.default_root_dir``, created."""
    path = Path(trainer.default_root_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def file_name(name: str) -> str:
    """``name`` (a run name: a user's or a logger's) as one file name, so that a ``/`` or ``..`` in it cannot put
    files outside the run folder."""
    return re.sub(r"[^\w.=+-]", "_", name).strip(".") or "run"


def write_json(trainer: pl.Trainer, filename: str, data: Any) -> None:
    """Rank 0 writes ``data`` as ``<run folder>/<filename>`` (other ranks do nothing)."""
    if trainer.is_global_zero:
        write_atomically(folder(trainer) / filename, json.dumps(data, indent=2, default=str))


def write_atomically(path: Path, text: str) -> None:
    """``path`` holds its previous content or ``text``, never part of it (a full disk, a killed run): written
    beside it, then renamed over it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def append_jsonl(trainer: pl.Trainer, filename: str, record: dict[str, Any]) -> None:
    """Rank 0 appends ``record`` as one line of ``<run folder>/<filename>``; earlier lines are kept."""
    if trainer.is_global_zero:
        with open(folder(trainer) / filename, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


def logged(trainer: pl.Trainer, key: str) -> float | None:
    """The latest value the module logged under ``key`` (e.g. ``val/loss``), or None."""
    value = trainer.callback_metrics.get(key)
    return None if value is None else float(value)


def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """``metrics`` to every logger at ``step`` (default: the current optimizer step)."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step if step is None else step)
