"""Without the wandb package the default logger is a CSV file in the run folder, said in one line; a WandbLogger that
was asked for fails in one line naming ``pip install wandb``."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import yaml

from lit_fsdp.commands.cli import run
from lit_fsdp.errors import error_line
from tests.helpers import FAST, REPO

QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.fixture
def no_wandb(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError


@pytest.mark.parametrize("installed, logger", [(True, "WandbLogger"), (False, "CSVFallbackLogger")],
                         ids=["wandb-installed", "wandb-missing"])
def test_default_logger_is_wandb_or_csv_without_the_package(capsys, monkeypatch, installed, logger):
    if not installed:
        monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit):
        run(["fit", "--config", str(QUICKSTART), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["logger"]["class_path"] == f"lit_fsdp.wandb_logger.{logger}"


def test_a_configured_wandb_logger_without_the_package_fails_in_one_line_naming_the_fix(no_wandb):
    with pytest.raises(ValueError) as failure:
        run(["--config", str(QUICKSTART), "--trainer.logger", "lit_fsdp.wandb_logger.WandbLogger"], run=False)
    line = error_line(failure.value)
    assert "WandbLogger needs the wandb package, which is not installed: `pip install wandb`" in line
    assert "\n" not in line


def test_without_wandb_a_run_logs_its_steps_to_csv_in_the_run_folder_and_says_so_once(tmp_path):
    # Both ranks run the script (Lightning starts the second with the same command line): neither can import wandb.
    script = tmp_path / "no_wandb.py"
    script.write_text("import sys\nsys.modules['wandb'] = None\nfrom lit_fsdp.commands.main import main\nmain()\n")
    folder = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run(
        [sys.executable, str(script), "fit", *FAST, "--trainer.max_steps", "3", "--data.batch_size", "2",
         "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "[]", "--trainer.default_root_dir", str(folder)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = folder / "lightning_logs" / "version_0" / "metrics.csv"
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "wandb package is not installed" in line]
    assert lines == [f"lit_fsdp: the wandb package is not installed: metrics go to {metrics} instead of Weights & Biases "
                     "(`pip install wandb` to log to W&B)"]
    steps = [row for row in csv.DictReader(metrics.open()) if row.get("train/loss")]
    assert len(steps) == 3
    assert not (tmp_path / "wandb").exists() and not (folder / "wandb").exists()
