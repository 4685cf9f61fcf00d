"""Training behaviour: the loss approaches the synthetic floor; strategy knobs are applied and do not change the numbers."""

from __future__ import annotations

import json
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


def placed(tmp_path, *args, **kwargs) -> tuple[dict, dict]:
    """A short llama-tiny fit with 4 blocks: its metrics and how the strategy placed the network."""
    probe = tmp_path / "placement.json"
    metrics = fit(tmp_path, "--model.preset", "llama-tiny", "--model.config_overrides", "{num_hidden_layers: 4}", *args,
                  callbacks=[{"class_path": "tests.probes.RecordPlacement", "init_args": {"path": str(probe)}}], **kwargs)
    return metrics, json.loads(probe.read_text())


BLOCKS = [f"model.layers.{i}" for i in range(4)]


def test_checkpointing_grouping_prefetch_and_compile_are_applied_and_leave_the_losses_unchanged(tmp_path):
    plain, plain_placement = placed(tmp_path / "plain", steps=4)
    assert plain_placement == {"units": [[""], *[[block] for block in BLOCKS]], "forward_prefetch": [[]] * 5,
                               "backward_prefetch": [[]] * 5, "checkpointed": [], "compiled": []}

    knobs, knobs_placement = placed(
        tmp_path / "knobs",
        "--trainer.strategy.init_args.activation_checkpointing", "2",
        "--trainer.strategy.init_args.blocks_per_group", "2",
        "--trainer.strategy.init_args.prefetch", "1",
        steps=4,
    )
    # Units: the root, then blocks 0-1 and 2-3; every other block checkpointed; the root is not prefetched,
    # the first group gathers the second ahead in forward, the second the first in backward.
    assert knobs_placement == {
        "units": [[""], BLOCKS[:2], BLOCKS[2:]], "forward_prefetch": [[], [2], []], "backward_prefetch": [[], [], [1]],
        "checkpointed": [BLOCKS[0], BLOCKS[2]], "compiled": [],
    }
    assert knobs["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-5)
    assert plain["train/loss"][-1] < plain["train/loss"][0]

    # torch.compile on this CPU takes about 40 s (the blocks share one graph): one process, two steps.
    compiled, compiled_placement = placed(tmp_path / "compiled", "--trainer.strategy.init_args.compile_blocks", "true",
                                          devices=1, batch_size=4, steps=2)
    assert compiled_placement["compiled"] == BLOCKS and len(compiled_placement["units"]) == 5
    assert compiled["train/loss"] == pytest.approx(plain["train/loss"][:2], rel=1e-4)  # 1 vs 2 processes, same batch


def test_bfloat16_compute_with_float32_reduce_trains_and_keeps_float32_weights(tmp_path):
    probe, reduced = tmp_path / "dtypes.json", tmp_path / "reduce"
    metrics = fit(
        tmp_path,
        "--trainer.strategy.init_args.param_dtype", "bfloat16",
        "--trainer.strategy.init_args.reduce_dtype", "float32",
        "--trainer.strategy.init_args.comm_hook", "tests.probes.CountReduceScatters",
        "--trainer.strategy.init_args.comm_hook.path", str(reduced),
        steps=6, callbacks=[{"class_path": "tests.probes.RecordDtypes", "init_args": {"path": str(probe)}}],
    )
    losses = metrics["train/loss"]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    assert losses[0] == pytest.approx(math.log(512), abs=0.1) and losses[-1] < losses[0] - 0.05, losses
    assert json.loads(probe.read_text()) == {
        "forward_weights": ["torch.bfloat16"], "forward_output": "torch.bfloat16",  # compute in bfloat16
        "parameters": ["torch.float32"], "gradients": ["torch.float32"], "adam_moments": ["torch.float32"],
    }
    for rank in (0, 1):  # 3 units (two blocks and the root) x 6 steps, every one reduced in float32
        calls = (tmp_path / f"reduce.rank{rank}").read_text().splitlines()
        assert [call.split()[1] for call in calls] == ["torch.float32"] * 18

