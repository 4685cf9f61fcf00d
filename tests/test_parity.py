"""One process and two processes with the same seed and global batch take the same steps."""

from __future__ import annotations

import pytest

from tests.helpers import fit

STEPS = 6
GLOBAL_BATCH = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("ref"), devices=1, batch_size=GLOBAL_BATCH, steps=STEPS)


def assert_same_steps(got: dict, want: dict, keys=("train/loss", "train/grad_norm")) -> None:
    for key in keys:
        assert len(got[key]) == STEPS, key
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key


@pytest.mark.parametrize(
    "sharding, extra",
    [
        ("FULL_SHARD", []),
        ("SHARD_GRAD_OP", []),
        ("NO_SHARD", []),
        ("HYBRID_SHARD", ["--trainer.strategy.init_args.replicate_size", "1"]),
        ("FULL_SHARD", ["--trainer.strategy.init_args.cpu_offload", "true"]),  # torch's CPUOffloadPolicy
    ],
    ids=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "FULL_SHARD-cpu_offload"],
)
def test_two_processes_match_one_process(tmp_path, reference, sharding, extra):
    got = fit(tmp_path, "--trainer.strategy.init_args.sharding", sharding, *extra, batch_size=GLOBAL_BATCH // 2, steps=STEPS)
    assert_same_steps(got, reference)
    assert got["train/loss"][-1] < got["train/loss"][0]


def test_gradient_accumulation_matches_and_skips_sync_between_boundaries(tmp_path, reference):
    counts = tmp_path / "rs"
    got = fit(
        tmp_path,
        "--trainer.accumulate_grad_batches", "2",
        "--trainer.strategy.init_args.comm_hook", "tests.probes.CountReduceScatters",
        "--trainer.strategy.init_args.comm_hook.path", str(counts),
        batch_size=GLOBAL_BATCH // 4,
        steps=STEPS,
    )
    assert_same_steps(got, reference, keys=("train/grad_norm",))
    calls = (counts.parent / "rs.rank0").read_text().splitlines()
    fsdp_units = 3  # two gpt2-tiny blocks and the root
    assert len(calls) == STEPS * fsdp_units  # one reduce-scatter per unit per optimizer step, not per micro-batch
