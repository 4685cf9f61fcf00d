"""Before launch, checkpoints that their folder's disk cannot hold are refused in one line; ones that fit, or none, are not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from compress.config import CompressionConfig
from lit_fsdp import checkpoints
from lit_fsdp.checkpoints import CheckpointError, checkpoint_size, copies_at_once
from lit_fsdp.commands.cli import run
from lit_fsdp.ddp import DDPStrategy
from lit_fsdp.presets import build_config
from lit_fsdp.strategy import FSDP2Strategy
from offload import SlideFSDPStrategy
from tests.helpers import REPO

QUICKSTART = REPO / "configs" / "quickstart.yaml"
LLAMA_8B = 8_030_261_248  # parameters of the Llama 3.1 8B shape (untied head)


def disk(free: int):
    return lambda path: shutil._ntuple_diskusage(1 << 50, (1 << 50) - free, free)


@pytest.mark.parametrize(
    "strategy, bytes_per_parameter",
    [(FSDP2Strategy(), 12), (DDPStrategy(), 12), (SlideFSDPStrategy(), 12),
     (SlideFSDPStrategy(optimizer_state_dtype="bfloat16"), 8)],
    ids=["fsdp2", "ddp", "slide_fsdp", "slide_fsdp-bfloat16-moments"],
)
def test_checkpoint_is_fp32_weights_and_adamw_moments_in_the_strategys_dtype(strategy, bytes_per_parameter):
    size = checkpoint_size(strategy, build_config("llama-8b"), world=1, nodes=1)
    assert size.weights == 4 * LLAMA_8B and size.training_state == (bytes_per_parameter - 4) * LLAMA_8B
    assert size.total(weights_only=False) == int(bytes_per_parameter * LLAMA_8B * (1 + checkpoints.SPACE_MARGIN))
    assert size.total(weights_only=True) == int(4 * LLAMA_8B * (1 + checkpoints.SPACE_MARGIN))


@pytest.mark.parametrize("sharded, extra_per_parameter", [(True, 2 * 4), (False, 0)], ids=["sharded", "full-file"])
def test_error_feedback_residuals_of_every_rank_count_where_the_checkpoint_holds_them(sharded, extra_per_parameter):
    config = build_config("llama-1b")
    compression = CompressionConfig(method="topk", ratio=0.01, error_feedback=True)
    plain = checkpoint_size(FSDP2Strategy(), config, world=2, nodes=1)
    compressed = checkpoint_size(FSDP2Strategy(compression=compression, save_distributed_checkpoint=sharded), config,
                                 world=2, nodes=1)
    unique = plain.training_state // 8  # AdamW's two float32 moments per parameter
    assert compressed.training_state - plain.training_state == extra_per_parameter * unique  # 4-byte residual, 2 ranks
    assert ("topk's state on each of 2 ranks" in compressed.counted) is sharded


def trainer(max_steps: int, val_check_interval: int = 25):
    return SimpleNamespace(max_steps=max_steps, val_check_interval=val_check_interval, check_val_every_n_epoch=None,
                           limit_val_batches=2)


@pytest.mark.parametrize(
    "options, max_steps, copies",
    [
        ({}, 50, 2),  # Lightning's default: the newest at each validation, and the next one while it is written
        ({"save_last": True, "every_n_train_steps": 100}, 300, 3),  # the quickstart's: step, last, one being written
        ({"save_last": True, "save_top_k": 0, "every_n_train_steps": 25}, 50, 2),
        ({"save_top_k": -1, "every_n_train_steps": 10}, 50, 5),  # every save is kept
        ({"save_last": True, "every_n_train_steps": 100}, 3, 1),  # no step save: last, once at the end of training
        ({"save_last": "link", "every_n_train_steps": 10}, 50, 2),  # last is a link to the newest
        ({"save_top_k": 0}, 50, 0),
    ],
    ids=["default", "quickstart", "last-only", "keep-all", "last-at-end", "last-link", "none"],
)
def test_copies_at_once_are_those_kept_last_and_the_one_being_written(options, max_steps, copies):
    assert copies_at_once(ModelCheckpoint(**options), trainer(max_steps))[0] == copies


def quickstart_trainer(tmp_path: Path, *args: str):
    cli = run(["--config", str(QUICKSTART), "--trainer.default_root_dir", str(tmp_path / "run"), *args], run=False)
    return cli.trainer, cli.model.hf_config(cli.datamodule)


def test_checkpoints_that_fit_pass_and_ones_that_do_not_fail_naming_bytes_folder_and_fixes(tmp_path, monkeypatch):
    trainer, config = quickstart_trainer(tmp_path)
    size = checkpoint_size(trainer.strategy, config, world=2, nodes=1).total(weights_only=False)
    needed = 3 * size  # step checkpoint, last, and one being written
    monkeypatch.setattr(shutil, "disk_usage", disk(needed))
    checkpoints.check_space(trainer, config)
    monkeypatch.setattr(shutil, "disk_usage", disk(needed - 1))
    with pytest.raises(CheckpointError) as failure:
        checkpoints.check_space(trainer, config)
    line = str(failure.value)
    assert "\n" not in line
    assert f"({needed} bytes) in {tmp_path / 'run' / 'checkpoints'} but" in line and f"({needed - 1} bytes) are free" in line
    assert "3 at once (save_top_k 1, save_last, one being written)" in line
    assert "dirpath" in line and "save_top_k 0 or 1" in line and "--trainer.enable_checkpointing false" in line


def test_checkpoints_already_in_the_folder_count_as_free(tmp_path, monkeypatch):
    trainer, config = quickstart_trainer(tmp_path)
    size = checkpoint_size(trainer.strategy, config, world=2, nodes=1).total(weights_only=False)
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "last.ckpt").write_bytes(b"\0" * size)  # a resumed run replaces it
    monkeypatch.setattr(shutil, "disk_usage", disk(2 * size))
    checkpoints.check_space(trainer, config)


def test_no_checkpointing_skips_the_check(tmp_path, monkeypatch):
    override = tmp_path / "no_checkpoints.yaml"
    override.write_text("trainer:\n  enable_checkpointing: false\n  callbacks: []\n")
    trainer, config = quickstart_trainer(tmp_path, "--config", str(override))

    def no_call(path):
        raise AssertionError("the disk was read without a checkpoint to write")

    monkeypatch.setattr(shutil, "disk_usage", no_call)
    checkpoints.check_space(trainer, config)


def test_impossible_checkpoint_fails_before_launch_with_one_line(tmp_path):
    # The CLI in a subprocess whose disk has 1000 bytes free; refused before Lightning starts the second process.
    script = tmp_path / "small_disk.py"
    script.write_text(
        "import shutil\n"
        "shutil.disk_usage = lambda path: shutil._ntuple_diskusage(1 << 40, (1 << 40) - 1000, 1000)\n"
        "from lit_fsdp.commands.main import main\n"
        "main()\n"
    )
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, str(script), "fit", "--config", str(QUICKSTART), "--trainer.default_root_dir", str(folder),
         "--trainer.logger", "false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert len(errors) == 1 and f"in {folder / 'checkpoints'} but 0.0 GiB (1000 bytes) are free" in errors[0], result.stderr
    assert "Initializing distributed" not in result.stderr + result.stdout


def test_llama_8b_offload_turns_checkpointing_off(capsys):
    # One checkpoint of it is 96 GB and two exist while one replaces the other: more than the GPU machine's 64 GiB disk.
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(QUICKSTART), "--config", str(REPO / "configs" / "llama_8b_offload.yaml"),
             "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert config["enable_checkpointing"] is False
    # the standard callbacks, whose ModelCheckpoint checkpointing off leaves out (tests/test_configs.py)
    assert "callbacks" not in yaml.safe_load((REPO / "configs" / "llama_8b_offload.yaml").read_text())["trainer"]
