"""Stopping and resuming gives the uninterrupted run; the exported folder loads in transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_fsdp.commands.main import main
from lit_fsdp.presets import build_config
from tests.helpers import assert_export_gives_logits, checkpoint_every, digests, fit, record

STEPS = 8


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full-file"])
def test_resume_at_step_4_of_8_continues_exactly(tmp_path, sharded):
    knob = ["--trainer.strategy.init_args.save_distributed_checkpoint", str(sharded).lower()]
    whole = fit(tmp_path / "whole", *knob, steps=STEPS, callbacks=[record(tmp_path / "whole.b")])

    part = tmp_path / "part"
    ckpts = tmp_path / "ckpt"
    first = fit(
        part, *knob, steps=STEPS,
        callbacks=[record(tmp_path / "part.b"), {"class_path": "tests.probes.StopAtStep", "init_args": {"step": 4}},
                   checkpoint_every(4, ckpts)],
    )
    assert (ckpts / "last.ckpt").exists() and sharded == (ckpts / "last.ckpt").is_dir()
    second = fit(part, *knob, "--ckpt_path", "last", steps=STEPS,
                 callbacks=[record(tmp_path / "part.b"), checkpoint_every(4, ckpts)])

    assert len(first["train/loss"]) == 4 and len(second["train/loss"]) == 4
    assert first["train/loss"] + second["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-5, abs=1e-6)
    for rank in (0, 1):  # every batch once, in the same order: nothing replayed, nothing skipped
        assert digests(tmp_path / "part.b", rank) == digests(tmp_path / "whole.b", rank)


def test_exported_folder_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    ckpts = tmp_path / "ckpt"
    logits_file = tmp_path / "logits.pt"
    fit(tmp_path, steps=3, callbacks=[checkpoint_every(3, ckpts),
                                      {"class_path": "tests.probes.SaveLogits", "init_args": {"path": str(logits_file)}}])
    assert_export_gives_logits(ckpts / "last.ckpt", logits_file, tmp_path)


def test_the_export_of_a_run_trained_on_token_ids_says_it_has_no_tokenizer(tmp_path, capsys):
    """A checkpoint as the quickstart (synthetic token ids) writes one: no tokenizer to export, which the folder's
    user would otherwise learn only when fine-tuning it."""
    config = build_config("gpt2-tiny")
    model = AutoModelForCausalLM.from_config(config)
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"hf_config": config.to_dict(), "tokenizer_files": None,
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, checkpoint)
    main(["export", str(checkpoint), str(tmp_path / "hf")])
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"exported {checkpoint} to {tmp_path / 'hf'}",
                   f"no tokenizer: this run trained on token ids, so {tmp_path / 'hf'} holds none; fine-tuning it, "
                   "generate and evaluate need one: export a run that trained on text, such as "
                   "configs/wikipedia.yaml's, or give --tokenizer_path FOLDER"], out
    assert not list((tmp_path / "hf").glob("tokenizer*")) and (tmp_path / "hf" / "model.safetensors").is_file()
