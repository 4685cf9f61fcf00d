"""Lightning's ModelCheckpoint, with ``last`` also saved at fit's last step."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint (same arguments), and with ``save_last`` a run that ends between two saves of a
    step cadence (``every_n_train_steps``) saves ``last`` at its final step too, so ``--ckpt_path last`` goes on
    from where fit stopped. Lightning's own saves ``last`` at the end only when the run saved nothing before."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_last and self._last_checkpoint_saved and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)
