"""Quality's summary: time and step to a target validation loss, loss at a time budget, best loss."""

from __future__ import annotations

from callbacks import Quality

# (step, wall seconds since training started, validation loss)
CURVE = [(100, 10.0, 5.0), (200, 20.0, 3.9), (300, 30.0, 3.5), (400, 40.0, 3.8)]


def test_summary_gives_the_first_crossing_of_the_target_and_the_last_validation_within_the_budget():
    quality = Quality(target_val_loss=4.0, time_budget_s=35.0)
    quality.validations = list(CURVE)
    summary = quality.summary()
    assert (summary["time_to_target_s"], summary["step_to_target"]) == (20.0, 200)
    assert summary["val_loss_at_budget"] == 3.5  # step 300 at 30 s; step 400 came after the budget
    assert summary["best_val_loss"] == 3.5
    assert (summary["target_val_loss"], summary["time_budget_s"]) == (4.0, 35.0)


def test_summary_is_null_where_there_is_no_target_budget_crossing_or_validation():
    never = Quality(target_val_loss=1.0, time_budget_s=5.0)  # below every loss; budget before the first validation
    never.validations = list(CURVE)
    summary = never.summary()
    assert summary["time_to_target_s"] is None and summary["step_to_target"] is None
    assert summary["val_loss_at_budget"] is None and summary["best_val_loss"] == 3.5

    unset = Quality()
    unset.validations = list(CURVE)
    assert unset.summary()["time_to_target_s"] is None and unset.summary()["val_loss_at_budget"] is None

    untrained = Quality(target_val_loss=4.0).summary()
    assert untrained["best_val_loss"] is None and untrained["train_wall_s"] is None


def test_train_wall_time_runs_from_train_start_until_train_end():
    quality = Quality()
    quality.on_train_start(None, None)  # type: ignore[arg-type]  # neither hook reads the trainer or module
    running = quality.summary()["train_wall_s"]
    quality.on_train_end(None, None)  # type: ignore[arg-type]
    ended = quality.summary()["train_wall_s"]
    assert 0 <= running <= ended == quality.summary()["train_wall_s"]  # fixed once training ended
