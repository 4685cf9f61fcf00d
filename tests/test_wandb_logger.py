"""W&B is the default logger: offline unless the user set W&B up, its run and the resolved config in the run folder."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import wandb
import yaml
from wandb.proto.wandb_internal_pb2 import Record

from lit_fsdp.wandb_logger import WandbLogger, offline_by_default, publish_summary
from tests.helpers import FAST, REPO, run_cli


@pytest.fixture
def no_wandb_setup(tmp_path, monkeypatch) -> Path:
    """A user who never set W&B up: no W&B variables, a HOME without netrc or settings; returns that HOME."""
    for name in list(os.environ):
        if name.startswith("WANDB_") or name == "NETRC":
            monkeypatch.delenv(name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings from wherever pytest started
    return home


def read_offline_run(path: Path) -> dict:
    """The records of a W&B ``.wandb`` file: run (the last), history keys, config and summary (key -> value).

    The file is LevelDB's log format (32 KiB blocks of CRC, length, type-tagged chunks) after a 7-byte
    ``:W&B`` header, each record a ``wandb_internal_pb2.Record``; wandb 0.31 ships no Python reader for it.
    """
    data, pos, chunks = path.read_bytes(), 7, []
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    run = {"run": None, "history": set(), "config": {}, "summary": {}}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = Record.FromString(b"".join(chunks))
            chunks = []
            which = record.WhichOneof("record_type")
            if which == "run":
                run["run"] = record.run
            elif which == "history":
                run["history"] |= {item.key or "/".join(item.nested_key) for item in record.history.item}
            elif which in ("config", "summary"):
                for item in getattr(record, which).update:
                    run[which][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return run


def test_offline_when_wandb_was_never_set_up(no_wandb_setup):
    assert offline_by_default()
    assert WandbLogger()._offline


@pytest.mark.parametrize(
    "env, netrc, settings, offline",
    [
        ({"WANDB_MODE": "online"}, None, None, False),
        ({"WANDB_API_KEY": "k" * 40}, None, None, False),
        ({}, "machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n", None, False),
        ({"WANDB_BASE_URL": "https://wandb.example.org"}, "machine wandb.example.org login user password key\n",
         None, False),
        ({}, "machine wandb.example.org login user password key\n",
         "[default]\nbase_url = https://wandb.example.org\n", False),
        ({}, None, "[default]\nmode = offline\n", False),  # `wandb offline`: W&B's own rules decide
        ({}, "machine github.com login user password key\n", None, True),
    ],
    ids=["WANDB_MODE", "WANDB_API_KEY", "wandb-login", "login-to-WANDB_BASE_URL", "login-to-settings-base_url",
         "settings-mode", "netrc-for-another-host"],
)
def test_offline_unless_wandb_is_set_up(no_wandb_setup, monkeypatch, env, netrc, settings, offline):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if netrc is not None:
        (no_wandb_setup / ".netrc").write_text(netrc)
    if settings is not None:
        (no_wandb_setup / ".config" / "wandb").mkdir(parents=True)
        (no_wandb_setup / ".config" / "wandb" / "settings").write_text(settings)
    assert offline_by_default() is offline


def test_an_explicit_mode_is_left_to_wandb(no_wandb_setup):
    logger = WandbLogger(mode="online")
    assert not logger._offline and logger._wandb_init["mode"] == "online"


def test_log_model_while_offline_fails_with_the_fix(no_wandb_setup):
    with pytest.raises(ValueError, match="log_model True uploads checkpoints but W&B is offline: run `wandb login`"):
        WandbLogger(log_model=True)


def test_publish_summary_puts_the_record_in_the_wandb_run(no_wandb_setup, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # restored after the test: Lightning sets it to "dryrun"
    logger = WandbLogger(run_name="unit", dir=str(tmp_path))
    record = {"run_name": "unit", "train_loss": 2.5, "compress_config": {"method": "int8"}, "val_loss": None}
    try:
        publish_summary(SimpleNamespace(is_global_zero=True, loggers=[logger]), record)
    finally:
        logger.experiment.finish()
        wandb.teardown()  # stops wandb-core, which closes the run file (finish() may return before it is flushed)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    summary = read_offline_run(run_file)["summary"]
    assert summary["run_name"] == "unit" and summary["train_loss"] == 2.5
    assert summary["compress_config"] == {"method": "int8"}


def test_default_logger_writes_an_offline_run_and_the_config_to_the_run_folder(no_wandb_setup, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: whatever the decision, no network
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    folder = tmp_path / "run"
    run_cli(
        "fit", *FAST, "--config", str(REPO / "configs" / "int8.yaml"), "--trainer.max_steps", "3",
        "--data.batch_size", "2", "--trainer.default_root_dir", str(folder), cwd=tmp_path,
    )
    (run_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")  # one W&B run: rank 1 started none
    assert not (tmp_path / "wandb").exists()  # nothing in the working directory
    run = read_offline_run(run_file)
    assert {"train/loss", "compress/ratio_vs_fp32", "compress/bytes_sent"} <= run["history"]
    assert run["config"]["trainer"]["strategy"]["init_args"]["compression"]["method"] == "int8"
    assert run["config"]["model"]["preset"] == "gpt2-tiny"
    (record,) = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    assert run["run"].display_name == record["run_name"] and run["run"].project == "lit_fsdp"
    assert list(run["run"].tags) == ["int8"]
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["trainer"]["strategy"]["init_args"]["compression"]["method"] == "int8"


def test_a_failed_fit_says_in_one_line_where_its_offline_wandb_run_is(no_wandb_setup, tmp_path, monkeypatch, caplog):
    """Lightning calls ``finalize("failed")`` when a fit raises; the offline run it leaves is named with how to upload
    or drop it. A run that succeeded says nothing of it."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger(run_name="failed", dir=str(tmp_path))
    try:
        logger.log_metrics({"train/loss": 2.5}, step=0)
        with caplog.at_level("INFO"):
            logger.finalize("success")
            assert "offline W&B run" not in caplog.text
            logger.finalize("failed")
    finally:
        logger.experiment.finish()
        wandb.teardown()
    (folder,) = tmp_path.glob("wandb/offline-run-*")
    (line,) = [line for line in caplog.text.splitlines() if "offline W&B run" in line]
    assert f"the failed run's offline W&B run is in {folder}: `wandb sync {folder}` uploads it" in line
