"""The training progress bar: short metric names, a format for each, the step out of ``max_steps``, no ``Epoch 2/-2``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from callbacks.throughput import RUNNING_KEY
from lit_fsdp.lightning_compat import RICH_AVAILABLE as _RICH_AVAILABLE

#: Logged name -> (name in the bar, format). Other metrics keep their name and show 3 decimals.
SHOWN = {
    "train/loss": ("loss", ".3f"),
    "val/loss": ("val_loss", ".3f"),
    "val/ppl": ("val_ppl", ".2f"),
    RUNNING_KEY: ("tok/s", ".0f"),
}


def shown_metrics(trainer: pl.Trainer, metrics: dict[str, Any]) -> dict[str, Any]:
    """The bar's metrics, formatted here so both bars show the same text: ``step``, then the logged ones renamed."""
    shown: dict[str, Any] = {}
    if trainer.max_steps > 0:  # the run's length; the epoch count is unknown when max_steps ends it
        shown["step"] = f"{trainer.global_step}/{trainer.max_steps}"
    for key, value in metrics.items():
        if key == "v_num":  # the logger's version (a W&B run id): the run folder's name says it
            continue
        name, spec = SHOWN.get(key, (key, ".3f"))
        shown[name] = f"{value:{spec}}" if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    return shown


class RichBar(RichProgressBar):
    """Lightning's rich bar with our metrics and ``Epoch N`` without a total when the epochs are unlimited."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return shown_metrics(trainer, super().get_metrics(trainer, pl_module))

    def _get_train_description(self, current_epoch: int) -> str:
        # With max_epochs=-1 (a max_steps run) Lightning shows "Epoch 2/-2": Lightning-AI/pytorch-lightning#21925,
        # fixed upstream by #21924 (Lightning 2.7).
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"Epoch {current_epoch}".ljust(len(self.validation_description))  # as Lightning pads it
        return super()._get_train_description(current_epoch)


class TQDMBar(TQDMProgressBar):
    """Lightning's tqdm bar (used without ``rich``) with our metrics; its description has no epoch total."""

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return shown_metrics(trainer, super().get_metrics(trainer, pl_module))


def progress_bar() -> RichBar | TQDMBar:
    """The bar Lightning would pick (rich when installed, else tqdm), with our metrics."""
    return RichBar() if _RICH_AVAILABLE else TQDMBar()
