"""Every shipped config parses against the real signatures; bad input fails fast with one clear line."""

from __future__ import annotations

import pytest
import yaml

from lit_fsdp.commands.cli import run
from tests.helpers import REPO, run_cli

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
QUICKSTART = REPO / "configs" / "quickstart.yaml"
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]


def print_config(capsys, *configs) -> dict:
    args = ["fit"] + [arg for config in configs for arg in ("--config", str(config))] + ["--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        run(args)
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def callback_classes(config: dict) -> list[str]:
    return [callback["class_path"] for callback in config["trainer"]["callbacks"] or []]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_parses_alone_and_after_quickstart_with_throughput_and_memory_on(capsys, config):
    alone = print_config(capsys, config)
    composed = print_config(capsys, QUICKSTART, config)
    mine = yaml.safe_load(config.read_text())
    strategy = (mine.get("trainer") or {}).get("strategy", {}).get("class_path", "FSDP2Strategy").split(".")[-1]
    for resolved in (alone, composed):  # the config's strategy, or FSDP2 by default, wins over the quickstart's
        assert resolved["trainer"]["strategy"]["class_path"].split(".")[-1] == strategy
    for key, value in (mine.get("model") or {}).items():  # the later file wins
        assert composed["model"][key] == value
    # A callbacks list replaces the earlier file's: a config with its own must list the measuring callbacks,
    # and a data or model config without one keeps the quickstart's, checkpoints included.
    own = "callbacks" in (mine.get("trainer") or {})
    for resolved in [composed, alone] if own else [composed]:
        classes = callback_classes(resolved)
        assert {"callbacks.Throughput", "callbacks.Memory"} <= set(classes) and len(classes) == len(set(classes))
    if not own:
        assert "lightning.pytorch.callbacks.ModelCheckpoint" in callback_classes(composed)


def test_quickstart_resolves_to_synthetic_data_on_two_cpu_processes(capsys):
    config = print_config(capsys, QUICKSTART)
    assert config["data"]["class_path"] == "lit_fsdp.data.synthetic.SyntheticDataModule"
    assert (config["trainer"]["accelerator"], config["trainer"]["devices"]) == ("cpu", 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.preset", "gpt5"], "unknown model preset 'gpt5'"),
        (["--trainer.strategy.init_args.sharding", "HYBRID_SHARD", "--trainer.strategy.init_args.replicate_size", "3"],
         "replicate_size=3 does not divide the world size 2"),
        (["--data", "lit_fsdp.data.wikipedia.WikipediaDataModule", "--data.train_path", "missing.json"], "missing.json"),
        (["--trainer.strategy", "ddp"], "need lit_fsdp.strategy.FSDP2Strategy"),
        (["--data.seq_len", "4096"], "--data.seq_len 4096 is longer than the model's 512 positions"),
        ([*SLIDE, "--trainer.strategy.init_args.window", "0"], "window=0"),
        ([*SLIDE, "--trainer.strategy.init_args.activation_offload", "cpu"], "set activation_checkpointing >= 1"),
        ([*SLIDE, "--trainer.strategy.init_args.param_transfer", "shard", "--trainer.devices", "1"],
         "one process per node"),
        (["--trainer.strategy", "slide_fsdp", "--model.preset", "llama-8b", "--model.config_overrides",
          "{num_hidden_layers: 256}"], "of host memory per node"),
        (["--data", "lit_fsdp.data.wikipedia.WikipediaDataModule", "--data.train_path", "tiny.jsonl",
          "--data.vocab_size", "300", "--data.seq_len", "500", "--trainer.devices", "1"], "use a shorter --data.seq_len"),
        (["--trainer.strategy.init_args.sharding", "NO_SHARD", "--trainer.strategy.init_args.compression",
          "{method: zero_one_adam}"], "zero_one_adam: local rounds need one owner per shard, but 2 replicas"),
    ],
    ids=["unknown-preset", "mesh", "missing-file", "other-strategy", "seq-len-vs-model", "offload-window",
         "offload-activations-without-checkpointing", "offload-shard-alone", "offload-host-memory", "seq-len-vs-data",
         "local-rounds-with-replicas"],
)
def test_bad_input_fails_with_one_line(tmp_path, args, message):
    (tmp_path / "tiny.jsonl").write_text('{"id": "1", "title": "Tiny", "text": "Only a few words of text."}\n')
    result = run_cli("fit", "--config", str(QUICKSTART), *args, cwd=tmp_path, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    if "--trainer.devices" not in args:  # caught before Lightning launched the second process
        assert "Initializing distributed" not in result.stderr + result.stdout
