"""1-bit Adam through the CLI: the warm-up is FSDP2's own path, resume, the other shardings."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, fit

KNOB = "--trainer.strategy.init_args.compression"


def test_the_warm_up_reproduces_fsdp2s_own_reduce_scatter_bit_for_bit(tmp_path):
    plain = fit(tmp_path / "plain", steps=5)
    onebit = fit(tmp_path / "onebit", KNOB, "{method: onebit_adam, freeze_step: 4}", steps=5)
    assert onebit["train/loss"][:5] == plain["train/loss"][:5]  # 4 AdamW steps, then the loss they lead to


# The reduce-scatter path (FULL_SHARD) trains and resumes bit for bit in tests/test_exact_resume.py; every
# sharding's hooks, HYBRID_SHARD 2 x 2 and NO_SHARD on 3 processes, in tests/test_replicas.py.
def test_the_replicate_path_trains_through_the_freeze_with_accumulation_and_clipping(tmp_path):
    metrics = fit(
        tmp_path, "--config", str(REPO / "configs" / "onebit_adam.yaml"), KNOB + ".freeze_step", "2",
        "--trainer.strategy.init_args.sharding", "NO_SHARD", "--trainer.accumulate_grad_batches", "2",
        steps=5, callbacks=[{"class_path": "callbacks.CompressionStats"}],  # compress/*: fit() replaces the standard list
    )
    losses = metrics["train/loss"]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
    assert metrics["compress/ratio_vs_fp32"][0] == pytest.approx(1.0)  # the warm-up sends float32
    assert metrics["compress/ratio_vs_fp32"][-1] > 20  # signs and a scale per 1024 values
