"""Training behaviour: the loss approaches the synthetic floor; strategy knobs do not change the numbers."""

from __future__ import annotations

import math

import pytest

from tests.helpers import fit


def test_synthetic_loss_falls_toward_the_entropy_floor(tmp_path):
    metrics = fit(
        tmp_path,
        "--data.vocab_size", "64", "--data.branching", "3", "--data.num_val_blocks", "16",
        "--trainer.val_check_interval", "150", "--trainer.limit_val_batches", "4",
        "--model.learning_rate", "1e-2", "--model.warmup_steps", "10",
        devices=1, batch_size=16, steps=150,
    )
    floor = metrics["data/entropy_rate"][0]
    start, end = metrics["train/loss"][0], metrics["val/loss"][-1]
    assert start == pytest.approx(math.log(64), abs=0.3)  # a random init predicts about uniformly
    # Within 10% of the way from the start to the floor; a finite validation set can land a little below it.
    assert floor - 0.05 < end < floor + 0.1 * (start - floor), (floor, start, end)


def test_checkpointing_grouping_and_prefetch_leave_the_losses_unchanged(tmp_path):
    llama = ["--model.preset", "llama-tiny", "--model.config_overrides", "{num_hidden_layers: 4}"]
    plain = fit(tmp_path / "plain", *llama, steps=4)
    knobs = fit(
        tmp_path / "knobs", *llama,
        "--trainer.strategy.init_args.activation_checkpointing", "2",
        "--trainer.strategy.init_args.blocks_per_group", "2",
        "--trainer.strategy.init_args.prefetch", "1",
        steps=4,
    )
    assert knobs["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-5)
    assert plain["train/loss"][-1] < plain["train/loss"][0]
