"""A wandb package that is installed but fails to import (a protobuf release it was not built for, usually): ``fit``
logs to CSV in the run folder and says why in one line, on 2 processes, instead of a traceback on rank 0 and a rank
that stops answering."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from tests.distributed import fit_in_process, run
from tests.helpers import FAST

# What protobuf 4+ raises when a wandb built for an older one imports its generated _pb2 modules.
PROTOBUF_MISMATCH = (
    'raise TypeError("Descriptors cannot be created directly.\\n'
    'If this call came from a _pb2.py file, your generated code is out of date and must be regenerated with protoc '
    '>= 3.19.0.")\n'
)


def fit_with_broken_wandb(rank: int, world: int, site: str, runs: list[list[str]]) -> None:
    sys.path.insert(0, site)  # before the real wandb: `import wandb` runs the broken package
    fit_in_process(rank, world, runs)


def test_a_wandb_that_fails_to_import_falls_back_to_csv_with_one_line_naming_the_error(tmp_path, capfd):
    site = tmp_path / "site"
    (site / "wandb").mkdir(parents=True)
    (site / "wandb" / "__init__.py").write_text(PROTOBUF_MISMATCH)
    folder = tmp_path / "run"
    arguments = ["fit", *FAST, "--trainer.max_steps", "3", "--data.batch_size", "2", "--trainer.enable_checkpointing",
                 "false", "--trainer.callbacks", "[]", "--trainer.default_root_dir", str(folder)]
    run(fit_with_broken_wandb, tmp_path, str(site), [arguments], fresh=True)  # wandb not imported before the site
    captured = capfd.readouterr()
    output = captured.out + captured.err
    metrics = folder / "lightning_logs" / "version_0" / "metrics.csv"
    assert [line for line in output.splitlines() if "wandb package" in line] == [
        "lit_fsdp: the wandb package is installed but fails to import (TypeError: Descriptors cannot be created "
        f"directly.): metrics go to {metrics} instead of Weights & Biases (`pip install --force-reinstall wandb` to "
        "repair it, or `pip uninstall wandb`)"
    ]
    assert "Traceback" not in output and "stopped answering" not in output
    assert len([row for row in csv.DictReader(metrics.open()) if row.get("train/loss")]) == 3
    assert not (folder / "wandb").exists()


def test_an_installed_wandb_that_imports_is_not_replaced(monkeypatch):
    from lit_fsdp.wandb_logger import CSVFallbackLogger, WandbLogger, without_broken_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    loggers = [WandbLogger(), CSVFallbackLogger()]
    assert without_broken_wandb(loggers) == loggers
