"""SlideFSDP streams a mixture of experts' blocks (their fused 3D expert tensors with the rest) and takes FSDP2's
steps, its exact update under ``update: auto`` with clipping firing at every step; the CPU twin of the 30B-A3B LoRA
recipe trains; and estimate counts a MoE's memory and traffic by all its parameters but its FLOPs by the active
ones. One spawned process runs every fit."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_fsdp.commands.estimate import estimate_step, parse
from lit_fsdp.commands.tune.hardware import detect, load
from lit_fsdp.commands.tune.memory import ModelShape
from lit_fsdp.flops import flops_per_token, matmul_shape
from lit_fsdp.presets import build_config
from offload.activation_plan import ROUTING_INDEX_BYTES, block_activation_bytes
from offload.cpu_adam import EMULATED_UPDATE_DELAY_VARIABLE
from offload.host_memory import GIB
from offload.transfers import EMULATED_DELAY_VARIABLE
from tests.helpers import REPO, fit_arguments, read_metrics

STEPS = 6  # auto decides at step 4
CLIP = 0.05  # the tiny MoE's gradient norms run 0.7 to 1.0: clipping fires at every step
MOE = ["--model.preset", "qwen3-moe-tiny", "--trainer.gradient_clip_val", str(CLIP)]
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--trainer.strategy.init_args.window", "1",
         "--trainer.strategy.init_args.activation_checkpointing", "1"]
TWIN = REPO / "configs" / "qwen3_moe_lora_cpu.yaml"
RESULTS = [{"class_path": "callbacks.OffloadStats", "init_args": {"warmup_steps": 0}},
           {"class_path": "callbacks.Results"}]


def update(name: str) -> list[str]:
    return ["--trainer.strategy.init_args.update", name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """FSDP2, SlideFSDP with the synchronous update and with ``auto`` on the tiny MoE (one process, 4 rows a step,
    the same seed and data), and the CPU twin for 2 steps and a validation: each run's metrics, one spawn for all;
    SlideFSDP's copies asynchronous and its updates slowed, as tests/test_offload_forward_order.py runs them."""
    from tests.distributed import fit_in_process, run

    tmp = tmp_path_factory.mktemp("moe_offload")
    fits = {
        "fsdp2": fit_arguments(tmp / "fsdp2", *MOE, devices=1, batch_size=4, steps=STEPS),
        "synchronous": fit_arguments(tmp / "synchronous", *MOE, *SLIDE, *update("synchronous"), devices=1,
                                     batch_size=4, steps=STEPS),
        "auto": fit_arguments(tmp / "auto", *MOE, *SLIDE, *update("auto"), devices=1, batch_size=4, steps=STEPS,
                              callbacks=RESULTS),
        # the twin's own keys, less its length: 2 steps and a validation after the second
        "twin": [*fit_arguments(tmp / "twin", "--config", str(TWIN), devices=1, batch_size=8, steps=2),
                 "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"],
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(EMULATED_DELAY_VARIABLE, "2")
        patch.setenv(EMULATED_UPDATE_DELAY_VARIABLE, "5")
        run(fit_in_process, tmp, list(fits.values()), world=1)
    metrics = {name: read_metrics(max((tmp / name).glob("lightning_logs/version_*/metrics.csv"))) for name in fits}
    return {**metrics, "auto_arguments": fits["auto"][1:],
            "auto_record": json.loads(next((tmp / "auto").rglob("results.jsonl")).read_text().splitlines()[-1])}


def test_slidefsdp_streams_a_moe_and_takes_fsdp2s_steps(runs):
    """Window 1: each block, its 8 experts' fused tensors with it, is loaded for its forward and again for its
    backward (recomputed whole); the losses and clipped gradient norms are FSDP2's. Where a dense model's agree to
    1e-5 (tests/test_offload.py), a MoE's drift apart once a token's routing, near a tie between two experts, flips
    on the last bit of a weight (the two AdamWs round differently): from step 2 here, as the router's load-balancing
    loss, a count of tokens per expert, shows; then by up to 1e-3."""
    want, got = runs["fsdp2"], runs["synchronous"]
    assert len(got["train/loss"]) == STEPS
    assert got["train/loss"][:2] == pytest.approx(want["train/loss"][:2], rel=1e-5)
    assert got["train/grad_norm"][:1] == pytest.approx(want["train/grad_norm"][:1], rel=1e-5)
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-4)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-3)


def test_auto_with_clipping_firing_at_every_step_takes_the_synchronous_steps(runs):
    """``update: auto`` with clipping at every step: forward order for 4 steps, then its step model's choice with the
    run's clip rate of 100%; either way the exact update, so its steps are the synchronous run's to the bit."""
    auto, synchronous = runs["auto"], runs["synchronous"]
    assert all(norm > CLIP for norm in synchronous["train/grad_norm"])
    assert auto["train/loss"] == synchronous["train/loss"] and auto["train/grad_norm"] == synchronous["train/grad_norm"]
    reason = runs["auto_record"]["offload_update_reason"]
    assert reason.startswith("by the step model with this run's rates over steps 2-4 (") and "clip rate 100%" in reason


def test_the_moe_run_holds_and_moves_what_estimate_counts(runs):
    """The auto run's host buffers as allocated and its bytes to and from the device per step, every expert's
    included, are what ``estimate`` counts for its arguments."""
    record, machine = runs["auto_record"], detect("cpu")
    predicted = estimate_step(*parse(runs["auto_arguments"], machine), machine)
    assert record["host_state_gb_per_node"] == record["host_estimate_gb_per_node"] > 0
    assert record["offload_h2d_gb"] == pytest.approx(predicted["h2d_bytes"] / 1e9, rel=1e-6)
    assert record["offload_d2h_gb"] == pytest.approx(predicted["d2h_bytes"] / 1e9, rel=1e-6)


def test_the_cpu_twin_of_the_30b_a3b_lora_recipe_trains(runs):
    twin = runs["twin"]
    assert len(twin["train/loss"]) == 2 and len(twin["val/loss"]) == 1
    assert all(math.isfinite(value) for value in twin["train/loss"] + twin["val/loss"])


def test_estimate_counts_every_parameter_of_a_moe_in_memory_and_traffic_and_the_active_ones_in_flops():
    """SlideFSDP on the tiny MoE, every parameter trained, one process, window 1: the parameters are the model's own
    (3D experts in full), every block crosses to the device twice a step and the CPU update reads and writes all of
    them; the FLOPs are the active parameters' (k = 2 of E = 8 experts)."""
    machine = detect("cpu")
    args = ["--config", str(REPO / "configs" / "quickstart.yaml"), *MOE, *SLIDE, "--trainer.devices", "1",
            "--data.batch_size", "4"]
    figures = estimate_step(*parse(args, machine), machine)
    config = build_config("qwen3-moe-tiny")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.model.layers.parameters())
    assert figures["parameters"] == figures["trained_parameters"] == parameters
    assert figures["h2d_bytes"] >= 2 * blocks * 4  # float32 on a CPU, each block in for its forward and its backward
    assert figures["cpu_update_bytes"] >= 16 * parameters  # master, gradient and two moments of every parameter
    tokens = figures["tokens_per_process"]
    assert figures["model_flops"] == tokens * flops_per_token(config, 128) < tokens * 6 * parameters


def test_a_moe_blocks_activations_count_its_routed_copies_and_the_expert_width():
    """qwen3-30b-a3b: the router sends each token to 8 experts of 768: the MLP's width is 8 x 768, and each copy keeps
    the hidden state its expert got and the expert's output (2 x 8 x 2048 values a token), beside 8 copies' indices
    and 128 float32 router probabilities; its shape for the tuner the same."""
    config = build_config("qwen3-30b-a3b")
    shape = ModelShape.of(build_config("qwen3-30b-a3b", {"num_hidden_layers": 1}))
    assert (shape.intermediate, shape.routed_copies, shape.router_logits) == (8 * 768, 8, 128)
    saved, block_input = block_activation_bytes(2048, 8 * 768, True, 1, 2, 8, 128)
    assert saved == (8 * 2048 + 4 * 8 * 768 + 2 * 8 * 2048) * 2 + 8 * ROUTING_INDEX_BYTES + 128 * 4
    assert block_input == 2048 * 2 and shape.block_parameters > 128 * 3 * 2048 * 768
    assert matmul_shape(config).mlp_width == 8 * 768


def test_the_30b_a3b_recipe_fits_the_recorded_h100_box_with_the_figures_docs_give():
    """configs/qwen3_30b_a3b_lora.yaml on configs/hardware/h100_128g.json, the Hub name replaced by the preset's shape
    (``--model.pretrained_path null``: nothing downloaded): the figures of docs/offload.md#mixtures-of-experts."""
    h100 = load(REPO / "configs" / "hardware" / "h100_128g.json")
    args = ["--config", str(REPO / "configs" / "qwen3_30b_a3b_lora.yaml"), "--model.pretrained_path", "null"]
    figures = estimate_step(*parse(args, h100), h100)
    assert figures["fits"] and figures["bound"] == "compute"
    assert round(figures["parameters"] / 1e9, 2) == 31.17 and round(figures["trained_parameters"] / 1e6) == 643
    assert round(figures["host_bytes"] / GIB, 2) == 76.63 and round(figures["device_peak_bytes"] / GIB, 2) == 31.81
    assert round(figures["step_time_s"], 3) == 3.989 and round(figures["mfu"], 3) == 0.348
    assert round(figures["tokens_per_step"] / figures["step_time_s"]) == 16430
