"""callbacks.ModelCheckpoint, every run's: ``last`` is saved at fit's final step when it falls between two saves of
the step cadence, so ``--ckpt_path last`` goes on from there (Lightning's saves ``last`` only when a save is due)."""

from __future__ import annotations

from lit_fsdp.checkpoints import inspect
from tests.helpers import fit


def every(steps: int) -> list[dict]:
    return [{"class_path": "callbacks.ModelCheckpoint", "init_args": {"save_last": True, "every_n_train_steps": steps}}]


def test_a_run_ending_between_two_saves_saves_last_at_its_final_step_and_resumes_from_it(tmp_path):
    fit(tmp_path / "run", devices=1, steps=7, callbacks=every(5))
    folder = tmp_path / "run" / "checkpoints"
    assert inspect(folder / "last.ckpt").manifest["step"] == 7 and inspect(folder / "epoch=0-step=5.ckpt").manifest
    resumed = fit(tmp_path / "run", "--ckpt_path", "last", devices=1, steps=9, callbacks=every(5))
    assert len(resumed["train/loss"]) == 2  # steps 8 and 9 only
    assert inspect(folder / "last.ckpt").manifest["step"] == 9
