"""A resumed run equals the uninterrupted one bit for bit, for every method that keeps state.

Per case, on 2 processes: the whole run (a checkpoint every few steps); a run resumed from each of its mid-run
checkpoints; and a run that stops at ``max_steps`` (its ``last`` checkpoint written as training ends, as the
quickstart's ``ModelCheckpoint`` writes it) and is extended with a larger ``max_steps`` and ``--ckpt_path last``.
Every one logs the whole run's losses at the same steps and ends with the same parameter shards.

One spawn runs the real CLI in-process, run after run, for every case (a CLI process per run would take about
20 s each on 2 cores). The warm-up spans every run, so that the learning rate does not depend on ``max_steps``:
extending a run lengthens its cosine, a change the user asks for.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from tests.distributed import in_process_cli, run
from tests.helpers import REPO, fit_arguments

KNOB = "--trainer.strategy.init_args.compression"


def configured(config: str, **scaled) -> list[str]:
    """The compression settings of ``configs/<config>.yaml``, with ``scaled`` replacing those sized for long runs."""
    settings = yaml.safe_load((REPO / "configs" / f"{config}.yaml").read_text())
    compression = settings["trainer"]["strategy"]["init_args"]["compression"]
    return [KNOB, json.dumps({**compression, **scaled})]


DILOCO = ["--trainer.strategy.init_args.sharding", "NO_SHARD", "--trainer.strategy.init_args.sync_every", "4"]
# name: (compression arguments, steps of the whole run, steps after which a resumed run starts)
CASES = {
    "none": ([], 6, (3,)),
    # a mixture of experts: its router, load-balancing loss and fused 3D expert tensors
    "moe": (["--model.preset", "qwen3-moe-tiny"], 6, (3,)),
    "topk+ef": (configured("topk"), 6, (3,)),
    "int8+ef": ([KNOB, "{method: int8, num_bits: 2, error_feedback: true}"], 6, (3,)),  # a quantiser's residuals
    "randomk+ef": (configured("randomk_ef"), 6, (3,)),
    "thresholdv+density": (configured("thresholdv_density"), 6, (3,)),
    "dgc": (configured("dgc", warmup_steps=6), 6, (3,)),  # resumed inside the density warm-up
    "powersgd": (configured("powersgd", start_step=1), 6, (3,)),  # warm-start Qs and residuals from step 1
    "sketch": (configured("sketch"), 6, (3,)),
    # freeze at 3: resumed before it (crossing it) and after it (local momenta, residuals, carried momentum)
    "onebit_adam": (configured("onebit_adam", freeze_step=3), 6, (2, 4)),
    # exact rounds 0, 2, 6, 1-bit ones between; from 8, syncs at 8, 10 and 14, local rounds between. After 6 steps the
    # 1-bit round 5 has delivered the momentum the exact round 6 adds; after 12, local round 11 has filled the
    # accumulators the sync at 14 sends.
    "zero_one_adam": (configured("zero_one_adam", var_freeze_step=8, local_step_scaler=1, local_step_clipper=4), 15,
                      (6, 12)),
    "param_all_gather": ([KNOB, "{param_all_gather: int8}"], 6, (3,)),
    # semi-synchronous: every 4 steps; stopped at 6, between synchronisations, where each replica's
    # weights and AdamW state are its own. Top-k with error feedback keeps residuals. Streaming: fragment 1 was sent
    # at step 6 and is applied at 7, so the checkpoint holds its average in flight.
    "diloco": (DILOCO + ["--trainer.strategy.init_args.outer", "{codec: {method: topk, ratio: 0.1, error_feedback: true}}"],
               10, (6,)),
    "diloco_streaming": (DILOCO + ["--trainer.strategy.init_args.outer",
                                   "{fragments: 2, delay: 1, mix: 0.5, codec: {method: int8, num_bits: 4}}"], 10, (6,)),
    # LoRA's adapters are what trains, and what the replicas exchange; the checkpoint holds them only
    "diloco_lora": (DILOCO + ["--model.lora", "{rank: 4, alpha: 8}"], 10, (6,)),
}


class ShardDigests(pl.Callback):
    """At the end of fit, writes a SHA-256 of each of this rank's parameter shards to ``<path>.rank<r>``."""

    def __init__(self, path: str):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        digests = [hashlib.sha256(p.to_local().detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
                   .hexdigest() for p in pl_module.model.parameters()]
        Path(f"{self.path}.rank{trainer.global_rank}").write_text(json.dumps(digests))


def arguments(folder: Path, extra: list[str], steps: int, warmup: int, callbacks: list[dict]) -> list[str]:
    """A short fit of the quickstart logged to CSV in ``folder``, its weights' digests in ``folder/digests``."""
    digests = {"class_path": f"{__name__}.ShardDigests", "init_args": {"path": str(folder / "digests")}}
    return fit_arguments(folder, *extra, "--model.warmup_steps", str(warmup), steps=steps, callbacks=[*callbacks, digests])


def checkpoint_callback(folder: Path, every: int, save_last: bool = False) -> dict:
    return {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(folder), "every_n_train_steps": every, "save_top_k": -1, "save_last": save_last}}


def run_every_case(rank: int, world: int, root: Path) -> None:
    """On each rank, every case's runs through the CLI, in the same order on both ranks."""
    cli = in_process_cli(rank, world)
    for name, (extra, steps, resume_at) in CASES.items():
        case = root / name
        saved = checkpoint_callback(case / "whole" / "ckpt", math.gcd(*resume_at))
        cli(arguments(case / "whole", extra, steps, steps, [saved]))
        for stop in resume_at:
            checkpoint = next((case / "whole" / "ckpt").glob(f"*-step={stop}.ckpt"))
            cli(arguments(case / f"resumed{stop}", [*extra, "--ckpt_path", str(checkpoint)], steps, steps, []))
        # as the quickstart's: save_last, no step checkpoint before max_steps ends training
        stop, kept = resume_at[0], checkpoint_callback(case / "ckpt", every=1000, save_last=True)
        cli(arguments(case / "stopped", extra, stop, steps, [kept]))
        cli(arguments(case / "extended", [*extra, "--ckpt_path", "last"], steps, steps, [kept]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exact_resume")
    run(run_every_case, root, root)
    return root


def logged(folder: Path) -> list[dict[str, str]]:
    """The rows of the train loss in the CSV log of the run in ``folder``."""
    with open(max(folder.glob("lightning_logs/version_*/metrics.csv"))) as f:
        return [row for row in csv.DictReader(f) if row.get("train/loss")]


def losses(folder: Path) -> dict[int, float]:
    return {int(row["step"]): float(row["train/loss"]) for row in logged(folder)}


def digests(folder: Path) -> list[list[str]]:
    return [json.loads(Path(f"{folder / 'digests'}.rank{rank}").read_text()) for rank in range(2)]


def check_same_as_whole(case: Path, part: Path, first_step: int, steps: int) -> None:
    whole, resumed = losses(case / "whole"), losses(part)
    assert sorted(whole) == list(range(steps)) and sorted(resumed) == list(range(first_step, steps))
    differing = {step: (loss, whole[step]) for step, loss in resumed.items() if loss != whole[step]}
    assert not differing, f"{part.name}: step: (loss, uninterrupted run's loss) {differing}"
    assert {row["epoch"] for row in logged(part)} == {"0"}  # still the first epoch, as in the uninterrupted run
    assert digests(part) == digests(case / "whole"), f"{part.name}: the final weights differ"


@pytest.mark.parametrize("name", CASES)
def test_a_run_resumed_from_a_mid_run_checkpoint_equals_the_uninterrupted_run_bit_for_bit(runs, name):
    _, steps, resume_at = CASES[name]
    for stop in resume_at:
        check_same_as_whole(runs / name, runs / name / f"resumed{stop}", stop, steps)


@pytest.mark.parametrize("name", CASES)
def test_a_run_extended_after_max_steps_ended_it_equals_the_uninterrupted_run_bit_for_bit(runs, name):
    _, steps, resume_at = CASES[name]
    stopped = losses(runs / name / "stopped")
    whole = losses(runs / name / "whole")
    assert stopped == {step: whole[step] for step in range(resume_at[0])}
    check_same_as_whole(runs / name, runs / name / "extended", resume_at[0], steps)
