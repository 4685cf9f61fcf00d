"""Bad input fails fast with one clear line (the shipped configs parse: tests/test_configs.py)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, cli_in_process, run_cli

QUICKSTART = REPO / "configs" / "quickstart.yaml"
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]


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
        (["--trainer.strategy.init_args.sharding", "NO_SHARD", "--trainer.strategy.init_args.compression",
          "{method: zero_one_adam}"], "zero_one_adam: local rounds need one owner per shard, but 2 replicas"),
    ],
    ids=["unknown-preset", "mesh", "missing-file", "other-strategy", "seq-len-vs-model", "offload-window",
         "offload-activations-without-checkpointing", "offload-shard-alone", "offload-host-memory",
         "local-rounds-with-replicas"],
)
def test_bad_input_fails_with_one_line(tmp_path, args, message):
    # in this process (tests.helpers.cli_in_process: no process group started, no training reached)
    (tmp_path / "tiny.jsonl").write_text('{"id": "1", "title": "Tiny", "text": "Only a few words of text."}\n')
    result = cli_in_process("fit", "--config", str(QUICKSTART), *args, cwd=tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["--model.preset", "gpt5"], "unknown model preset 'gpt5'"),
    # refused in the data's set-up, inside fit: the one-process run Lightning starts, before its first step
    (["--data", "lit_fsdp.data.wikipedia.WikipediaDataModule", "--data.train_path", "tiny.jsonl", "--data.vocab_size",
      "300", "--data.seq_len", "500", "--trainer.devices", "1"], "use a shorter --data.seq_len"),
], ids=["before-lightning-starts", "seq-len-vs-data"])
def test_a_refusal_ends_the_process_with_status_2_and_one_line(tmp_path, args, message):
    (tmp_path / "tiny.jsonl").write_text('{"id": "1", "title": "Tiny", "text": "Only a few words of text."}\n')
    result = run_cli("fit", "--config", str(QUICKSTART), *args, cwd=tmp_path, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    if "--trainer.devices" not in args:  # caught before Lightning launched the second process
        assert "Initializing distributed" not in result.stderr + result.stdout
