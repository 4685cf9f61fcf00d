"""--model.float8: torchao's Float8Linear on the blocks' linear layers only, training under FSDP2 and SlideFSDP as the
unconverted model does within a stated gap, and one-line refusals (no torchao, GPT-2's Conv1D, a GPU without float8).

The conversion and the runs need torchao (the optional extra float8), emulated on the CPU; the refusals do not."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from callbacks import throughput
from callbacks.throughput import Throughput
from lit_fsdp import float8
from lit_fsdp.errors import OneLineError, RunError
from lit_fsdp.model import CausalLM
from lit_fsdp.presets import build_config
from tests.helpers import fit

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason='torchao is not installed (pip install -e ".[float8]")')

STEPS = 20
GLOBAL_BATCH = 4
LLAMA = ["--model.preset", "llama-tiny"]
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]
#: Float8 emulation against the unconverted float32 run, llama-tiny on the synthetic data, 20 steps, the losses falling
#: from 6.24 to 5.25: the largest per-step gap measured was 0.0030 (rowwise, FSDP2) and 0.0022 (tensorwise, SlideFSDP),
#: where the unconverted runs of the two strategies agree to 1e-4 (tests/test_offload.py).
MAX_LOSS_GAP = 0.02


def converted_paths(module: CausalLM) -> set[str]:
    return {name for name, m in module.model.named_modules() if type(m).__name__ == "Float8Linear"}


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_conversion_swaps_exactly_the_blocks_linears_and_keeps_every_parameter_name(recipe):
    plain = CausalLM(preset="llama-tiny")
    plain.configure_model()
    module = CausalLM(preset="llama-tiny", float8=recipe)
    module.configure_model()
    blocks = {name for name, m in plain.model.named_modules() if type(m) is nn.Linear and ".layers." in name}
    assert len(blocks) == 2 * 7 and converted_paths(module) == blocks  # q, k, v, o, gate, up, down in 2 blocks
    assert type(module.model.lm_head).__name__ == "LossHead"  # the head stays the chunked-loss head, unconverted
    assert type(module.model.model.embed_tokens) is nn.Embedding
    assert [n for n, _ in module.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    assert all(p.is_meta for p in module.model.parameters())  # converted before the strategy materialises it
    layer = module.model.model.layers[0].self_attn.q_proj
    assert layer.config.emulate  # no float8 matmul on a CPU: torchao's emulation
    granularity = layer.config.cast_config_weight.scaling_granularity.value
    assert granularity == {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]


@needs_torchao
def test_a_linear_whose_dims_are_not_multiples_of_16_stays_unconverted():
    module = CausalLM(preset="llama-tiny", float8="tensorwise", config_overrides={"intermediate_size": 100})
    module.configure_model()
    kinds = {name.rpartition(".")[2] for name in converted_paths(module)}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj"}  # the MLP's 64 x 100 layers are left in param_dtype


@needs_torchao
def test_lora_adapters_attach_to_converted_linears_and_only_they_get_gradients():
    module = CausalLM(preset="llama-tiny", float8="tensorwise", lora={"rank": 4})
    module.configure_model()
    network = module.model
    network.to_empty(device="cpu")
    network.apply(network._init_weights)
    for name, param in network.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_" in name:
            nn.init.normal_(param, std=0.1)
    layer = network.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == "Float8Linear" and layer.lora_A.dtype == torch.float32
    ids = torch.randint(0, 512, (2, 32))
    network(input_ids=ids, labels=ids).loss.backward()
    assert layer.weight.grad is None and layer.lora_A.grad.abs().sum() > 0


@needs_torchao
def test_float8_follows_the_unconverted_run_under_fsdp2_and_slide_fsdp(tmp_path):
    """Two processes under FSDP2 (rowwise) and one under SlideFSDP (tensorwise), the same global batch: each falls and
    stays within MAX_LOSS_GAP of the unconverted two-process FSDP2 run, step by step."""
    reference = fit(tmp_path / "off", *LLAMA, devices=2, batch_size=GLOBAL_BATCH // 2, steps=STEPS)["train/loss"]
    runs = {
        "fsdp2-rowwise": fit(tmp_path / "fsdp2", *LLAMA, "--model.float8", "rowwise", devices=2,
                             batch_size=GLOBAL_BATCH // 2, steps=STEPS)["train/loss"],
        "slide-tensorwise": fit(tmp_path / "slide", *LLAMA, *SLIDE, "--model.float8", "tensorwise", devices=1,
                                batch_size=GLOBAL_BATCH, steps=STEPS)["train/loss"],
    }
    assert len(reference) == STEPS and reference[-1] < reference[0] - 0.5
    for name, losses in runs.items():
        gaps = [abs(a - b) for a, b in zip(losses, reference)]
        assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, name
        assert 2e-4 < max(gaps) < MAX_LOSS_GAP, (name, gaps)  # float8's rounding shows, ten times the strategies' gap


def test_without_torchao_asking_for_float8_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now fails, installed or not
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(OneLineError) as error:
        CausalLM(preset="llama-tiny", float8="tensorwise")
    message = str(error.value)
    assert "\n" not in message and 'pip install -e ".[float8]"' in message and "--model.float8 off" in message
    CausalLM(preset="llama-tiny")  # off needs no torchao


def test_gpt2_blocks_have_nothing_to_convert_and_are_refused_in_one_line():
    with pytest.raises(OneLineError, match=r"gpt2 model's blocks have no nn.Linear .*Conv1D.*llama-tiny") as error:
        CausalLM(preset="gpt2-tiny", float8="tensorwise")
    assert "\n" not in str(error.value)


def test_a_gpu_without_float8_matmuls_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RunError, match=r"compute capability 8.9 .* A100-SXM4-80GB is 8.0: set --model.float8 off"):
        float8.emulated(torch.device("cuda", 0), "rowwise")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not float8.emulated(torch.device("cuda", 0), "rowwise")
    assert float8.emulated(torch.device("cpu"), "rowwise")


def test_mfu_of_a_float8_run_is_counted_against_the_bf16_peak_and_says_so(monkeypatch):
    callback = Throughput(warmup_steps=0)
    monkeypatch.setattr(throughput.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(Throughput, "_sync", staticmethod(lambda device: None))
    said = []
    monkeypatch.setattr(throughput, "rank_zero_info", said.append)
    trainer = SimpleNamespace(world_size=1, strategy=SimpleNamespace(), precision="32-true")
    config = build_config("llama-tiny")
    module = SimpleNamespace(model=SimpleNamespace(config=config), device=torch.device("cuda", 0),
                             hparams={"float8": "tensorwise"})
    callback.on_train_start(trainer, module)
    assert callback.peak == 989.5  # the H100's bf16 peak, not its fp8 1979, whatever param_dtype is
    assert said == ["Throughput: --model.float8 tensorwise: MFU is counted against the bf16 peak, not the fp8 one, "
                    "as torchtitan does"]
    callback.seq_len, callback.step_seconds, callback.tokens_per_step = 128, [1.0], 512
    summary = callback.summary()
    assert summary["float8"] == "tensorwise" and summary["mfu_peak_format"] == "bf16" and summary["mfu"] > 0


def test_estimate_runs_the_blocks_matrices_at_the_fp8_rate_and_the_rest_at_the_compute_dtypes():
    """The blocks' weight matrices alone (6n a weight, 4n frozen, a recomputed block's forward again) are what float8
    runs; the step's rate is the harmonic mix of the fp8 and bf16 peaks over them, unchanged where fp8's is unknown."""
    from lit_fsdp.commands.estimate import float8_peak
    from lit_fsdp.flops import block_matmul_flops_per_token, flops_per_token, matmul_shape

    config = build_config("llama-8b")
    shape = matmul_shape(config)
    blocks = shape.layers * shape.block_weights
    assert block_matmul_flops_per_token(config) == 6 * blocks
    assert block_matmul_flops_per_token(config, frozen=True) == 4 * blocks
    assert block_matmul_flops_per_token(config, 1, whole_block=True) == 6 * blocks + 2 * 32 * shape.block_weights
    assert block_matmul_flops_per_token(config, [0, 5], whole_block=True) == 6 * blocks + 2 * 2 * shape.block_weights
    # the head and attention stay in bfloat16: at 2,048 tokens they are 11% of the 8B's training FLOPs
    assert 0.08 < 1 - 6 * blocks / flops_per_token(config, 2048) < 0.14
    assert float8_peak(989.5, 1979.0, 100.0, 50.0) == pytest.approx(100 / (50 / 989.5 + 50 / 1979.0))
    assert float8_peak(989.5, 1979.0, 100.0, 0.0) == pytest.approx(989.5)
    assert float8_peak(989.5, None, 100.0, 50.0) == 989.5 and float8_peak(None, 1979.0, 100.0, 50.0) is None


@needs_torchao
def test_estimate_of_the_8b_with_float8_on_the_h100_file_counts_the_blocks_at_the_fp8_peak_and_mfu_against_bf16():
    from lit_fsdp.commands.estimate import estimate_step, parse
    from lit_fsdp.commands.tune.hardware import load
    from tests.helpers import REPO

    hardware = load(str(REPO / "configs" / "hardware" / "h100_128g.json"))
    configs = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(REPO / "configs" / "llama_8b_offload.yaml")]
    plain = estimate_step(*parse(configs, hardware), hardware)
    converted = estimate_step(*parse([*configs, "--model.float8", "tensorwise"], hardware), hardware)
    assert converted["model_flops"] == plain["model_flops"] and converted["mfu_peak_tflops"] == plain["mfu_peak_tflops"]
    assert converted["times"]["compute_s"] < 0.6 * plain["times"]["compute_s"]  # most of the FLOPs at twice the rate
    assert converted["mfu"] > plain["mfu"]
