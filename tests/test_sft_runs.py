"""Fine-tuning runs end to end: the shipped SFT configs train on 2 CPU processes from a pretrained folder on
the shipped sample data, and a step's gradients do not depend on how its samples are split over processes and
micro-batches."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.distributed import fit_in_process, run
from tests.helpers import REPO, SFT_SAMPLES, fit, fit_arguments, read_metrics, save_sft_base

SAMPLES = SFT_SAMPLES
# after the config, whose own values would win over fit()'s
SHORT = ["--trainer.devices", "2", "--trainer.max_steps", "4", "--trainer.log_every_n_steps", "1", "--data.batch_size", "4", "--data.seq_len", "64", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "2",
         "--data.train_path", str(SAMPLES / "train.jsonl"), "--data.val_path", str(SAMPLES / "val.jsonl")]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A pretrained folder as ``export`` writes one: a tiny GPT-2 and a BPE trained on the sample's text."""
    return save_sft_base(tmp_path_factory.mktemp("base"))


@pytest.mark.parametrize("config", ["sft_full.yaml", "sft_lora.yaml"])
def test_the_sft_configs_train_on_two_processes_from_a_pretrained_folder(tmp_path, base, config):
    metrics = fit(tmp_path, "--config", str(REPO / "configs" / config), "--model.pretrained_path", str(base), *SHORT)
    losses, val = metrics["train/loss"], metrics["val/loss"]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses + val) and len(val) == 2
    assert losses[-1] < losses[0]


#: The one-GPU fine-tuning recipes (README's first screen); their CPU twin overrides only what a CPU and a tiny model
#: need.
RECIPES = ["sft_8b_lora_offload.yaml", "sft_8b_full_offload.yaml", "sft_14b_full_offload.yaml"]
TWIN = ["--trainer.accelerator", "cpu", "--trainer.strategy.init_args.compile_blocks", "false",
        "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false", "--data.seq_len", "64",
        "--data.batch_size", "2", "--data.train_path", str(SAMPLES / "train.jsonl"),
        "--data.val_path", str(SAMPLES / "val.jsonl")]


def test_the_one_gpu_recipes_cpu_twins_train_from_a_pretrained_folder_with_slidefsdp(tmp_path, base):
    """Each recipe as shipped (SlideFSDP, its update mode, LoRA or full, SFT data), with a tiny pretrained folder for
    the 8B or 14B and the CPU for the GPU: two steps and a validation, all three in one spawned process."""
    runs = {config: fit_arguments(tmp_path / config, "--config", str(REPO / "configs" / config),
                                  "--model.pretrained_path", str(base), *TWIN, devices=1) for config in RECIPES}
    run(fit_in_process, tmp_path, list(runs.values()), world=1)
    for config in RECIPES:
        metrics = read_metrics(max((tmp_path / config).glob("lightning_logs/version_*/metrics.csv")))
        losses, val = metrics["train/loss"], metrics["val/loss"]
        assert len(losses) == 2 and len(val) == 1 and all(math.isfinite(v) for v in losses + val), config


def first_gradients(tmp: Path, base: Path, packing: bool, devices: int, batch_size: int, accumulate: int) -> torch.Tensor:
    path = tmp / "grads.pt"
    fit(tmp, "--config", str(REPO / "configs" / "sft_full.yaml"), "--model.pretrained_path", str(base), *SHORT,
        "--data.packing", str(packing).lower(), "--trainer.accumulate_grad_batches", str(accumulate),
        "--trainer.limit_val_batches", "0", "--data.batch_size", str(batch_size), "--trainer.devices", str(devices),
        "--trainer.max_steps", "1", devices=devices,
        callbacks=[{"class_path": "tests.probes.RecordFirstGradients", "init_args": {"path": str(path)}}])
    return torch.load(path)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_steps_gradients_are_the_same_on_one_process_two_processes_and_with_accumulation(tmp_path, base, packing):
    """Global batch 4: one process with 4 rows, two with 2 each, one with 4 micro-batches of 1. The samples differ in
    their numbers of target tokens, so a mean of per-micro-batch means would give other gradients."""
    one = first_gradients(tmp_path / "one", base, packing, devices=1, batch_size=4, accumulate=1)
    two = first_gradients(tmp_path / "two", base, packing, devices=2, batch_size=2, accumulate=1)
    accumulated = first_gradients(tmp_path / "acc", base, packing, devices=1, batch_size=1, accumulate=4)
    assert one.abs().sum() > 0
    torch.testing.assert_close(two, one, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(accumulated, one, rtol=1e-4, atol=1e-7)
