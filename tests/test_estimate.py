"""``python -m lit_fsdp estimate``: every shipped config, the 8B offload case's figures, and bad input in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from lit_fsdp.commands.estimate import estimate_step, main, parse
from lit_fsdp.commands.tune.hardware import detect, load
from lit_fsdp.data.tokenizer import train_bpe
from lit_fsdp.presets import build_config
from offload.host_memory import GIB
from tests.helpers import REPO

H100 = REPO / "configs" / "hardware" / "h100_128g.json"
QUICKSTART = REPO / "configs" / "quickstart.yaml"
ON_GPU = {"gpt2_124m.yaml", "llama_1b.yaml", "llama_8b_offload.yaml"}  # accelerator: gpu


def pretrained_folder(folder: Path) -> Path:
    """A tiny GPT-2 and its tokenizer, as ``export`` writes a base: what the fine-tuning configs start from."""
    tokenizer = train_bpe(["reverse: sea sky", "sky sea", "the river and the stone"] * 20, 300)
    tokenizer.save_pretrained(folder)
    config = build_config("gpt2-tiny", {"vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, safe_serialization=True)
    return folder


def test_every_shipped_config_is_estimated_on_the_hardware_it_is_for(tmp_path):
    h100 = load(H100)
    base = pretrained_folder(tmp_path)  # runs/sft_base, which the sft configs name, is made by the user
    cluster = replace(h100, nodes=2, devices_per_node=8, intra_node_gbps=450.0, inter_node_gbps=50.0)
    seen = 0
    for config in sorted((REPO / "configs").glob("*.yaml")):
        if config.name in ("quickstart.yaml", "wikipedia.yaml"):
            continue  # the base of every overlay; wikipedia.yaml reads ../shared, which a CI machine may not have
        configs = ["--config", str(QUICKSTART), "--config", str(config)]
        machine = h100 if config.name in ON_GPU else detect("cpu")  # "cpu": also where the test host has a GPU
        if config.name == "multinode_hybrid.yaml":  # an overlay on gpt2_124m.yaml for 2 nodes x 8 GPUs
            configs[2:2] = ["--config", str(REPO / "configs" / "gpt2_124m.yaml")]
            machine = cluster
        if "pretrained_path" in config.read_text():
            configs += ["--model.pretrained_path", str(base)]
        figures = estimate_step(*parse(configs, machine), machine)
        assert figures["device_peak_bytes"] > 0 and figures["host_bytes"] > 0, config.name
        assert figures["tokens_per_step"] > 0 and figures["model_flops"] > 0, config.name
        if machine.accelerator == "cuda":  # the example file has every rate: a step time and an MFU
            assert figures["bound"] and 0 < figures["mfu"] <= 1 and figures["fits"], config.name  # an upper bound
        seen += 1
    assert seen >= 25


def test_the_8b_offload_case_on_one_h100_is_bound_by_the_cpu_update_and_fits_its_host(capsys):
    main(["--config", str(QUICKSTART), "--config", str(REPO / "configs" / "llama_8b_offload.yaml"),
          "--tune.hardware", str(H100), "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert round(figures["host_bytes"] / GIB, 1) == 112.5 and figures["fits"]
    assert figures["host_by_buffer"]["runtime"] == 3 * GIB
    assert figures["tokens_per_step"] == 8 * 2048 and figures["strategy"] == "slide_fsdp"
    # 28 B/param in one pass per chunk: AdamW's weight and moments read and written (24), the bfloat16 gradient read
    # as it arrived (2), the bfloat16 staging copy written from the chunk in cache (2); the device checks finiteness
    assert figures["cpu_update_bytes"] == figures["parameters"] * 28
    times = figures["times"]
    assert times["cpu_update_s"] == pytest.approx(figures["cpu_update_bytes"] / 80e9)
    assert times["compute_s"] == pytest.approx(figures["flops"] / 989.5e12)
    assert figures["bound"] == "cpu_update" and figures["mfu"] == pytest.approx(0.260, abs=0.001)
    # per step: every block twice but the last (window 2), the root once, the checkpointed inputs there and back
    assert figures["h2d_bytes"] == pytest.approx(33.88e9, rel=1e-3) and figures["d2h_bytes"] == pytest.approx(20.36e9, rel=1e-3)


def test_a_config_that_names_another_machine_than_the_hardware_is_one_clear_error():
    with pytest.raises(ValueError, match="the configs train on cuda but the hardware is cpu"):
        hardware = detect("cpu")
        estimate_step(*parse(["--config", str(QUICKSTART), "--config", str(REPO / "configs" / "llama_1b.yaml")],
                             load(H100)), hardware)


def test_without_a_hardware_file_a_cpu_config_is_estimated_on_the_cpu_even_where_a_gpu_is_present(monkeypatch):
    import lit_fsdp.commands.estimate as estimate_module

    asked = []
    monkeypatch.setattr(estimate_module, "detect", lambda accelerator=None: asked.append(accelerator) or detect("cpu"))
    trainer, _, _ = parse(["--config", str(QUICKSTART)])  # accelerator: cpu
    assert asked == ["cpu"] and trainer.hardware.accelerator == "cpu"
    with pytest.raises(ValueError, match="the configs train on cpu but the hardware is cuda"):
        parse(["--config", str(QUICKSTART)], load(H100))
