"""Mistakes a new user makes before training end in one line naming the value and the fix."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import AutoModelForCausalLM

from callbacks.throughput import Throughput
from lit_fsdp import hub
from lit_fsdp.commands.cli import run
from lit_fsdp.commands.main import main
from lit_fsdp.data.tokenizer import train_bpe
from lit_fsdp.presets import build_config
from tests.corpus import articles, write_lines
from tests.helpers import FAST, REPO, SFT_SAMPLES, cli_in_process, run_cli, save_sft_base

QUICKSTART = REPO / "configs" / "quickstart.yaml"


def one_error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    "args, message",
    [
        pytest.param(["--trainer.accelerator", "gpu"], "--trainer.accelerator gpu but torch sees no CUDA device",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")),
        (["--model.config_overrides", "{n_layer: six}"], "--model.config_overrides n_layer='six'"),
        (["--model.pretrained_path", "truncated"], "truncated/config.json is not valid JSON"),
        (["--model.pretrained_path", "whole", "--model.config_overrides", "{n_layer: six}"],
         "--model.config_overrides n_layer='six'"),
        (["--optimizer", "torch.optim.SGD"], "--optimizer torch.optim.SGD is not supported"),
        (["--lr_scheduler", "{class_path: torch.optim.lr_scheduler.StepLR, init_args: {step_size: 5}}"],
         "--lr_scheduler torch.optim.lr_scheduler.StepLR is not supported"),
        (["--config", "optimizer.yaml"], "--optimizer torch.optim.Adam is not supported"),
    ],
    ids=["gpu-without-cuda", "override-of-wrong-type", "truncated-config-json", "pretrained-override-of-wrong-type",
         "optimizer", "lr-scheduler", "optimizer-in-a-config"],
)
def test_fit_refuses_in_one_line_before_training(tmp_path, args, message):
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "config.json").write_text('{"model_type": "gpt2", "n_')
    build_config("gpt2-tiny").save_pretrained(tmp_path / "whole")
    (tmp_path / "optimizer.yaml").write_text("optimizer:\n  class_path: torch.optim.Adam\n")
    result = cli_in_process("fit", *FAST, "--trainer.devices", "1", "--trainer.max_steps", "1",
                            "--trainer.default_root_dir", str(tmp_path / "run"), *args, cwd=tmp_path)
    assert result.returncode == 2 and message in one_error_line(result.stderr), result.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained


def test_a_traceback_is_shown_with_lit_fsdp_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("LIT_FSDP_TRACEBACK", "1")
    result = run_cli("fit", *FAST, "--trainer.devices", "1", "--model.config_overrides", "{n_layer: six}",
                     cwd=tmp_path, check=False)
    assert result.returncode != 0 and "Traceback" in result.stderr and "n_layer" in result.stderr


@pytest.mark.parametrize("command", ["test", "predict"])
def test_test_and_predict_say_what_to_use_instead(tmp_path, command):
    result = cli_in_process(command, "--config", str(QUICKSTART), cwd=tmp_path)
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and f"'{command}' is not offered" in line
    assert all(alternative in line for alternative in ("validate", "evaluate", "generate")), line


@pytest.fixture(scope="module")
def missing_shard(tmp_path_factory) -> dict[str, Path]:
    """A sharded checkpoint as fit writes it (meta.pt beside torch.distributed.checkpoint's files) whose shard is gone."""
    root = tmp_path_factory.mktemp("missing_shard")
    config = build_config("gpt2-tiny", {"vocab_size": 300})
    model = AutoModelForCausalLM.from_config(config)
    checkpoint = root / "last.ckpt"
    with warnings.catch_warnings():  # saving in one process is the intent here
        warnings.simplefilter("ignore")
        dcp.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}},
                 checkpoint_id=str(checkpoint), no_dist=True)
    train_bpe([article["text"] for article in articles()], 300).save_pretrained(root / "tokenizer")
    torch.save({"hf_config": config.to_dict(), "tokenizer_path": str(root / "tokenizer"), "seq_len": 32},
               checkpoint / "meta.pt")
    shards = list(checkpoint.glob("*.distcp"))
    assert shards
    for shard in shards:
        shard.unlink()
    return {"root": root, "checkpoint": checkpoint, "shard": shards[0], "valid": write_lines(root / "valid.jsonl", articles(3))}


@pytest.mark.parametrize(
    "command",
    [["export", "{checkpoint}", "{root}/hf"], ["generate", "{checkpoint}", "--prompt", "a"],
     ["evaluate", "{checkpoint}", "--data.path", "{valid}", "--data.cache_dir", "{root}/cache"]],
    ids=["export", "generate", "evaluate"],
)
def test_a_checkpoint_missing_a_shard_file_is_one_line(missing_shard, capsys, command):
    places = {key: str(value) for key, value in missing_shard.items()}
    with pytest.raises(SystemExit) as exit_info:
        main([part.format(**places) for part in command])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    line = errors[0]
    assert line.startswith("lit_fsdp: error: ") and str(missing_shard["checkpoint"]) in line
    assert f"its file {missing_shard['shard'].name} is missing" in line and "copy the whole folder" in line, line


def test_estimate_validates_the_compression_settings_as_fit_does(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--config", str(QUICKSTART), "--trainer.strategy.init_args.compression",
              "{method: topk, ratio: 2}"])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1 and "ratio=2.0 is not a fraction in (0, 1]" in errors[0], errors


@pytest.mark.parametrize(("runs_folder", "base"), [(True, "runs/sft_base"), (False, "runs/sft_base"), (False, "owner/base")],
                         ids=["its-parent-exists", "fresh-clone", "a-hub-name"])
def test_a_missing_base_folder_is_said_to_be_missing_with_how_to_make_it(tmp_path, monkeypatch, capsys, runs_folder,
                                                                         base):
    """configs/sft_lora.yaml before runs/sft_base is made (on a fresh clone runs/ is missing too): the folder is named
    missing, with the export the configs' headers give, and the Hub is not asked; a name outside runs/ whose owner is
    no folder could be a Hub repository, so the Hub is asked, and its failure mentioned after the folder."""
    def unreachable(*args, **kwargs):
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known")

    monkeypatch.setattr(hub, "snapshot_download", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)
    if runs_folder:
        (tmp_path / "runs").mkdir()
    with pytest.raises(SystemExit) as exit:
        main(["fit", "--config", str(REPO / "configs" / "sft_lora.yaml"), "--trainer.devices", "1",
              "--model.pretrained_path", base,
              "--data.init_args.train_path", str(SFT_SAMPLES / "train.jsonl"),
              "--data.init_args.val_path", str(SFT_SAMPLES / "val.jsonl")])
    line = one_error_line(capsys.readouterr().err)
    assert exit.value.code == 2
    if base.startswith("runs/"):
        assert f"--model.pretrained_path {base}: no such folder {Path.cwd() / base} " in line, line
        assert f"`python -m lit_fsdp export RUN/checkpoints/last.ckpt {base}`" in line, line
        assert "configs/sft_full.yaml's: train configs/wikipedia.yaml's run, then export it" in line, line
        assert "Hub" not in line and "hf download" not in line, line
    else:
        assert f"--model.pretrained_path {base}: no folder {tmp_path / base} " in line, line
        assert f"the Hub, where {base} would name a model, cannot be reached" in line, line


def sft_lora(tmp_path: Path, base: Path, train: Path = SFT_SAMPLES / "train.jsonl", *args: str) -> list[str]:
    """``fit`` of configs/sft_lora.yaml on ``base`` and ``train``, its run and caches in ``tmp_path``."""
    return ["fit", "--config", str(REPO / "configs" / "sft_lora.yaml"), "--model.pretrained_path", str(base),
            "--data.init_args.train_path", str(train), "--data.init_args.val_path", str(SFT_SAMPLES / "val.jsonl"),
            "--data.init_args.cache_dir", str(tmp_path / "cache"), "--trainer.default_root_dir", str(tmp_path / "run"),
            *args]


def test_a_base_folder_without_a_tokenizer_is_named_before_the_data_is_blamed(tmp_path):
    """What ``export`` writes of the quickstart, which trains on token ids: a config and weights, no tokenizer, from
    which transformers builds a tokenizer of no tokens, so that every sample would look too long for --data.seq_len."""
    base = tmp_path / "quickstart_export"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config("gpt2-tiny")).save_pretrained(base)
    result = cli_in_process(*sft_lora(tmp_path, base), cwd=tmp_path)
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and f"--model.pretrained_path {base}: the base folder has no tokenizer" in line, line
    assert "configs/wikipedia.yaml's" in line and "--data.tokenizer_path" in line and "target" not in line, line


@pytest.mark.parametrize("data", ["sft", "wikipedia"])
def test_a_malformed_data_line_is_said_once_whole_before_any_process_or_wandb_run_starts(tmp_path, data):
    """Line 21 holds a raw tab inside a string: the launcher reads the file in its preflight (cli_in_process stops
    at Trainer.fit, before Lightning starts the second process), so the line is said once, with the decoder's
    position, and no W&B run is made."""
    train = tmp_path / "train.jsonl"
    if data == "sft":
        lines = (SFT_SAMPLES / "train.jsonl").read_text().splitlines()[:40]
        lines[20] = '{"prompt": "reverse:\ta b", "completion": "b a"}'
        train.write_text("\n".join(lines) + "\n")
        args = sft_lora(tmp_path, save_sft_base(tmp_path / "base"), train)
        reason = "line 21 is not JSON (Invalid control character at: line 1 column 21 (char 20)); JSON Lines needs one " \
                 "sample object per line"
    else:
        lines = write_lines(tmp_path / "good.jsonl", articles(30)).read_text().splitlines()
        lines[20] = '{"title": "Tab", "text": "a\tb"}'
        train.write_text("\n".join(lines) + "\n")
        args = ["fit", "--config", str(QUICKSTART), "--config", str(REPO / "configs" / "wikipedia.yaml"),
                "--data.train_path", str(train), "--data.val_path", "null", "--data.vocab_size", "300",
                "--data.cache_dir", str(tmp_path / "cache"), "--trainer.default_root_dir", str(tmp_path / "run")]
        reason = "malformed JSON on line 21 (Invalid control character at: line 1 column 28 (char 27)); JSON Lines " \
                 "needs one object per line"
    result = cli_in_process(*args, cwd=tmp_path)
    line = one_error_line(result.stderr)
    assert result.returncode == 2 and line.startswith(f"lit_fsdp: error: {train}: {reason}"), line
    run = tmp_path / "run"  # the checkpoint folder, checked writable, and nothing else: no W&B files, no config
    assert [path.relative_to(run) for path in run.rglob("*")] == [Path("checkpoints")]


def test_more_cpu_processes_than_cores_is_one_warning_line_saying_why_it_is_slower(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("INFO"), pytest.raises(SystemExit):  # stopped in the preflight, after the warning
        main(["fit", "--config", str(QUICKSTART), "--trainer.devices", "3", "--trainer.logger", "false",
              "--data.seq_len", "4096"])
    warned = [record.getMessage() for record in caplog.records if "warning:" in record.getMessage()]
    assert warned == ["lit_fsdp: warning: --trainer.devices 3 starts 3 CPU processes on 2 cores: they take turns on "
                      "the cores and every step waits for the slowest, so the run is slower than with "
                      "--trainer.devices 2"], warned


def test_peak_tflops_on_the_command_line_gives_throughput_its_peak():
    cli = run(["--config", str(QUICKSTART), "--trainer.logger", "false", "--peak_tflops", "0.5"], run=False)
    assert [c.peak_tflops for c in cli.trainer.callbacks if isinstance(c, Throughput)] == [0.5]
