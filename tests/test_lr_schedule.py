"""The learning-rate schedule: warm-up and cosine over ``schedule_steps`` (default max_steps), a warm start stopped
early goes on along the whole run's schedule when continued, and a resumed run takes the learning rate it is given;
the standard checkpoint (callbacks.ModelCheckpoint) saves ``last`` at the final step between two saves of its cadence,
so the continuation starts there."""

from __future__ import annotations

import pytest
import torch

from lit_fsdp.checkpoints import inspect
from lit_fsdp.model import CausalLM, follow_learning_rate, warmup_cosine
from tests.helpers import fit

MONITOR = [{"class_path": "callbacks.ModelCheckpoint", "init_args": {"save_last": True, "every_n_train_steps": 3}},
           {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {"logging_interval": "step"}}]


def schedule(peak: float, steps: range, total: int) -> list[float]:
    return [peak * warmup_cosine(step, 2, total, 0.1) for step in steps]  # FAST's warm-up of 2 steps


def test_a_warm_start_saved_at_its_last_step_goes_on_at_another_lr_along_the_whole_schedule(tmp_path):
    warm = fit(tmp_path / "warm", "--model.learning_rate", "1e-3", "--model.schedule_steps", "8", devices=1, steps=4,
               callbacks=MONITOR)
    assert warm["lr-AdamW/pg1"] == pytest.approx(schedule(1e-3, range(4), 8))  # not decayed to its end at step 4
    checkpoint = tmp_path / "warm" / "checkpoints" / "last.ckpt"
    assert inspect(checkpoint).manifest["step"] == 4  # saved at the final step, not only at the cadence's step 3
    go_on = fit(tmp_path / "continued", "--model.learning_rate", "2e-3", "--ckpt_path", str(checkpoint), devices=1,
                steps=8, callbacks=MONITOR)
    assert go_on["lr-AdamW/pg1"] == pytest.approx(schedule(2e-3, range(4, 8), 8))


def test_following_a_learning_rate_rescales_the_groups_at_the_schedulers_step_and_is_a_no_op_when_equal():
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [parameter]}], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, 2, 10, 0.1))
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    assert follow_learning_rate(scheduler, 1e-3) is None
    assert follow_learning_rate(scheduler, 4e-3) == 1e-3
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-3 * warmup_cosine(5, 2, 10, 0.1))
    assert scheduler.get_last_lr() == [optimizer.param_groups[0]["lr"]]
    scheduler.step()  # and the schedule goes on from there at the new peak
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-3 * warmup_cosine(6, 2, 10, 0.1))


def test_a_schedule_no_longer_than_its_warm_up_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"--model.schedule_steps 2 must exceed --model.warmup_steps 2; give"):
        CausalLM(warmup_steps=2, schedule_steps=2)
