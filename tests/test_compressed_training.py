"""Every compression method through the FSDP2 strategy: 2-process CPU runs of the real CLI."""

from __future__ import annotations

import json
import math

import pytest

from compress.config import METHODS
from tests.helpers import REPO, fit, interrupted_and_whole_losses

METHOD_CONFIGS = sorted(p.stem for p in REPO.glob("configs/*.yaml") if "compression:" in p.read_text())
ODD_VOCAB = ["--data.vocab_size", "509"]  # rows that do not divide by the world size: FSDP pads the shards


def test_every_method_has_a_config():
    methods = {json_method(name) for name in METHOD_CONFIGS}
    assert methods == set(METHODS)


def json_method(config_name: str) -> str:
    text = (REPO / "configs" / f"{config_name}.yaml").read_text()
    return text.split("method:")[1].split(",")[0].split("}")[0].strip()


def test_method_none_is_bit_identical_to_no_hook(tmp_path):
    plain = fit(tmp_path / "plain", steps=4)
    none = fit(tmp_path / "none", "--config", str(REPO / "configs" / "baseline.yaml"), steps=4)
    assert none["train/loss"] == plain["train/loss"]


# PowerSGD's shipped config starts after 10 dense steps; these runs are 5 steps long
EARLY_START = {"powersgd": ["--trainer.strategy.init_args.compression.start_step", "1"]}


# Configs whose path another run here already takes (CI time): fp16 trains in the replicate tests below,
# topk10_int8 is topk_int8 at another ratio, onebit and natural go through the same all-to-all as
# signsgd and qsgd (every method's hook runs on 2 processes in test_communicator.py), thresholdv_density
# trains in the resume test below, and onebit_adam in tests/test_onebit_adam.py.
SAME_PATH = {"fp16", "topk10_int8", "onebit", "natural", "thresholdv_density", "onebit_adam"}


@pytest.mark.parametrize("config", [c for c in METHOD_CONFIGS if c != "baseline" and c not in SAME_PATH])
def test_each_method_trains_with_finite_falling_loss(tmp_path, config):
    metrics = fit(tmp_path, "--config", str(REPO / "configs" / f"{config}.yaml"), *ODD_VOCAB,
                  *EARLY_START.get(config, []), steps=5)
    losses = metrics["train/loss"]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    report = json.loads((tmp_path / "compression.json").read_text())
    assert report["bytes_sent"] > 0 and report["nonfinite"] == 0
    assert metrics["compress/ratio_vs_fp32"][-1] > (1.9 if config in ("fp16", "bf16") else 1.0)


# The strategy's wiring of the replicate all-reduce hook; every method's hook on these meshes (3 NO_SHARD replicas,
# HYBRID_SHARD 2 x 2) is in tests/test_replicas.py, and the native-sum path (fp16) trains in test_communicator.py.
@pytest.mark.parametrize("sharding, method", [("NO_SHARD", "int8"), ("HYBRID_SHARD", "int8"), ("NO_SHARD", "powersgd")])
def test_replicate_paths_train_and_compress(tmp_path, sharding, method):
    metrics = fit(
        tmp_path, "--config", str(REPO / "configs" / f"{method}.yaml"), *ODD_VOCAB, *EARLY_START.get(method, []),
        "--trainer.strategy.init_args.sharding", sharding,
        *(["--trainer.strategy.init_args.replicate_size", "2"] if sharding == "HYBRID_SHARD" else []),
        steps=5,
    )
    losses = metrics["train/loss"]
    assert losses[-1] < losses[0]
    assert metrics["compress/bytes_sent"][-1] > 0  # the replicate all-reduce went through the hook


@pytest.mark.parametrize(
    "compression",
    # top-k's residuals resume as int8's do; 1-bit Adam's resume is in tests/test_onebit_adam_runs.py
    ["{method: int8, num_bits: 2, error_feedback: true}",
     "{method: powersgd, rank: 2, start_step: 1}", "{method: thresholdv, density: 0.01, error_feedback: true}"],
    ids=["int8+EF", "powersgd", "thresholdv-density+EF"],
)
def test_compressed_resume_at_step_3_of_6_equals_the_uninterrupted_run(tmp_path, compression):
    """Residuals, warm starts and seed counters are in the checkpoint: the resumed run compresses as the whole one."""
    knob = ["--trainer.strategy.init_args.compression", compression]
    resumed, whole = interrupted_and_whole_losses(tmp_path, *knob)
    assert resumed == pytest.approx(whole, rel=1e-5, abs=1e-6)
