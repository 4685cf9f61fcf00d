"""LoRA's memory accounting: only the adapters have gradients, AdamW moments, reduce-scatters and checkpoints; the
frozen base keeps its sharded float32 weights and is gathered as before. One adapter count
(``lit_fsdp.lora.adapter_parameters``) against the real model; ``estimate``, the tuner's filter, FSDP2's preflight
and the checkpoint space check built on it.

Nothing is allocated at 8B: the shapes come from presets built on the meta device.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from lit_fsdp import checkpoints
from lit_fsdp.checkpoints import checkpoint_size
from lit_fsdp.commands.cli import run
from lit_fsdp.commands.estimate import estimate_step, parse
from lit_fsdp.commands.tune.hardware import load
from lit_fsdp.commands.tune.memory import GIB, ModelShape, estimate
from lit_fsdp.commands.tune.space import Candidate, RunShape
from lit_fsdp.flops import flops_per_token
from lit_fsdp.lora import LoraConfig, adapter_parameters, attach, trained_matrices, trained_parameters
from lit_fsdp.model import CausalLM
from lit_fsdp.presets import build_config
from lit_fsdp.strategy import FSDP2Strategy, check_device_memory
from tests.helpers import REPO

QUICKSTART = REPO / "configs" / "quickstart.yaml"
EIGHT_H100 = replace(load(REPO / "configs" / "hardware" / "h100_128g.json"), devices_per_node=8, intra_node_gbps=450.0)
LORA = {"rank": 16, "alpha": 32}
# llama-8b, rank 16 on q, k, v, o (4096 + 4096, 4096 + 1024 twice, 4096 + 4096) and gate, up, down (4096 + 14336
# each), 32 blocks
LLAMA_8B_ADAPTERS = 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432)
LLAMA_8B = 8_030_261_248


def trainable(preset: str, lora: dict) -> int:
    """The parameters that train in the model a run builds (on the meta device)."""
    module = CausalLM(preset=preset, lora=lora)
    module.configure_model()
    return sum(p.numel() for p in module.model.parameters() if p.requires_grad)


@pytest.mark.parametrize("preset, lora", [
    ("gpt2-tiny", {"rank": 8}), ("gpt2-tiny", {"rank": 4, "targets": ["c_attn"]}),
    ("llama-tiny", {"rank": 8}), ("llama-tiny", {"rank": 2, "targets": ["q_proj", "v_proj"]}),
    ("llama-8b", LORA)])
def test_adapter_parameters_equal_the_trainable_parameters_of_the_model_a_run_builds(preset, lora):
    config = build_config(preset)
    counted = adapter_parameters(config, lora)
    assert counted == trainable(preset, lora) == ModelShape.of(config, lora=lora).adapters > 0
    assert adapter_parameters(config, None) == 0 and ModelShape.of(config).adapters == 0


def test_adapters_of_llama_8b_and_gpt2_tiny_counted_by_hand():
    assert adapter_parameters(build_config("llama-8b"), LORA) == LLAMA_8B_ADAPTERS == 41_943_040
    # gpt2-tiny's blocks: c_attn 64 + 192, attn.c_proj 64 + 64, c_fc 64 + 256, mlp.c_proj 256 + 64 (c_proj: both)
    assert adapter_parameters(build_config("gpt2-tiny"), {"rank": 8}) == 2 * 8 * 1024


def figures(*args: str) -> dict:
    """``estimate`` of llama-1b with FSDP2 FULL_SHARD on 8 H100s, bfloat16, sequence 2048, micro-batch 1."""
    fit = ["--config", str(QUICKSTART), "--model.preset", "llama-1b", "--trainer.accelerator", "gpu",
           "--trainer.devices", "8", "--trainer.strategy.init_args.param_dtype", "bfloat16",
           "--data.init_args.vocab_size", "128256", "--data.init_args.seq_len", "2048",
           "--data.init_args.batch_size", "1", *args]
    return estimate_step(*parse(fit, EIGHT_H100), EIGHT_H100)


def test_estimate_counts_gradients_moments_reduce_scatters_and_checkpoints_of_the_adapters_only():
    full, lora = figures(), figures("--model.lora", "{rank: 16, alpha: 32}")
    adapters = adapter_parameters(build_config("llama-1b"), LORA)
    base, everything = full["parameters"], lora["parameters"]
    assert lora["trained_parameters"] == adapters and everything == base + adapters
    states = lora["device_by_component"]["model_states"]
    # per GPU: every parameter's float32 master, and for the adapters only a float32 gradient (4 B) and AdamW's two
    # float32 moments (8 B), all sharded over the 8 ranks
    assert states == (4 * everything + 4 * adapters + 8 * adapters) // 8
    assert full["device_by_component"]["model_states"] == 16 * base // 8
    # gathered whole in bfloat16 (both passes: FULL_SHARD reshards after forward); reduced: the adapters' gradients
    assert lora["network_bytes"]["all_gather"] == 2 * everything * 2 * 7 / 8
    assert lora["network_bytes"]["reduce_scatter"] == adapters * 4 * 7 / 8
    assert full["network_bytes"]["reduce_scatter"] == base * 4 * 7 / 8
    # one checkpoint: the adapters in float32 and their two moments, +2%
    assert lora["checkpoint_bytes"] == int(12 * adapters * (1 + checkpoints.SPACE_MARGIN))
    tied_head = 128256 * 2048  # saved under its own name too
    assert full["checkpoint_bytes"] == int((4 * (base + tied_head) + 8 * base) * (1 + checkpoints.SPACE_MARGIN))
    # activations: the same, plus A's output (rank 16, 7 targets) per token of each of the 16 blocks, in bfloat16
    more = lora["device_by_component"]["activations"] - full["device_by_component"]["activations"]
    assert more == 16 * 2048 * 7 * 16 * 2


def test_tuner_estimate_keeps_gradient_buffers_and_dropout_inputs_of_the_adapters():
    config = build_config("llama-tiny")  # hidden 64, MLP 176, 2 blocks, tied head
    shape = ModelShape.of(config, lora={"rank": 4, "dropout": 0.1})
    assert shape.block_adapters == 4 * (2 * 128 + 2 * 96 + 3 * 240) and shape.root_adapters == 0
    assert shape.adapter_ranks == 7 * 4 and shape.adapter_dropped == 6 * 64 + 176  # q, k, v, gate, up: h; o: h; down: i
    plain = ModelShape.of(config)
    m, s, p = 2, 128, 4  # float32 on CPU
    run_shape = RunShape(world_size=2, nodes=1, accelerator="cpu", seq_len=s, batch_per_process=m, clipping=False)
    with_lora = estimate(Candidate(micro_batch=m), shape, run_shape)
    without = estimate(Candidate(micro_batch=m), plain, run_shape)
    assert with_lora.model_states == (4 * shape.parameters + 12 * shape.adapters) // 2
    gathered = (2 * shape.block_parameters + shape.root_parameters) * p
    assert with_lora.working_set == gathered + shape.block_adapters * (p + 4)  # no root gradient: the root is frozen
    # the tensors kept before, A's outputs, and each target's dropped input with its one-byte mask
    assert with_lora.activations - without.activations == 2 * m * s * (28 * p + 560 * (p + 1))


def preflight_on_one_80gb_gpu(monkeypatch, lora: dict | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    strategy = FSDP2Strategy()
    strategy.parallel_devices = [torch.device("cuda", 0)]
    module = SimpleNamespace(hf_config=lambda: build_config("llama-8b"), hparams={"lora": lora})
    strategy.preflight(SimpleNamespace(num_nodes=1, num_devices=1), module)


def test_preflight_admits_an_8b_lora_on_one_80gb_gpu_that_it_refuses_for_full_training(monkeypatch):
    with pytest.raises(ValueError, match=r"model states need 119\.7 GiB per GPU for 8\.0B parameters \(16 bytes each"):
        preflight_on_one_80gb_gpu(monkeypatch, None)
    preflight_on_one_80gb_gpu(monkeypatch, LORA)  # 4 x 8.07e9 + 12 x 41.9e6 bytes: 30.5 GiB


def test_preflight_refusing_a_lora_names_frozen_and_trained_bytes_and_the_offloads():
    parameters = LLAMA_8B + LLAMA_8B_ADAPTERS
    check_device_memory(parameters, 4096, (1,), False, None, 31 * GIB, trained=LLAMA_8B_ADAPTERS)
    with pytest.raises(ValueError) as refused:
        check_device_memory(parameters, 4096, (1,), False, None, 30 * GIB, trained=LLAMA_8B_ADAPTERS)
    line = str(refused.value)
    assert "model states need 30.5 GiB per GPU for 8.1B parameters, 41.9M of them trained (LoRA) (4 bytes per frozen " \
           "parameter, 16 per trained one, over 1 shard(s))" in line
    assert "cpu_offload true" in line and "offload.SlideFSDPStrategy" in line


def test_checkpoint_of_a_lora_run_is_its_adapters_and_their_moments():
    size = checkpoint_size(FSDP2Strategy(), build_config("llama-8b"), world=8, nodes=1, lora=LORA)
    assert size.weights == 4 * LLAMA_8B_ADAPTERS and size.training_state == 8 * LLAMA_8B_ADAPTERS
    assert "no frozen base" in size.counted
    assert checkpoint_size(FSDP2Strategy(), build_config("llama-8b"), world=8, nodes=1).weights == 4 * LLAMA_8B


def test_space_check_admits_lora_checkpoints_where_whole_ones_do_not_fit(tmp_path, monkeypatch):
    cli = run(["--config", str(QUICKSTART), "--trainer.default_root_dir", str(tmp_path / "run"),
               "--model.lora", "{rank: 8}"], run=False)
    trainer, config, lora = cli.trainer, cli.model.hf_config(cli.datamodule), cli.model.hparams.get("lora")
    adapters = checkpoint_size(trainer.strategy, config, world=2, nodes=1, lora=lora).total(weights_only=False)
    whole = checkpoint_size(trainer.strategy, config, world=2, nodes=1).total(weights_only=False)
    assert adapters == int(12 * adapter_parameters(config, lora) * (1 + checkpoints.SPACE_MARGIN)) < whole
    free = 3 * adapters  # step checkpoint, last, and one being written
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: SimpleNamespace(free=free))
    checkpoints.check_space(trainer, config, lora)
    with pytest.raises(checkpoints.CheckpointError, match="float32 weights, AdamW"):
        checkpoints.check_space(trainer, config)


# --- modules trained whole beside the adapters (--model.lora.train) ---------------------------------

TRAIN = {"rank": 8, "train": ["embeddings", "norms"]}


def test_modules_trained_beside_the_adapters_count_as_trained_in_all_in_the_blocks_and_in_the_root():
    config = build_config("gpt2-tiny")  # 2 blocks, hidden 64, 512 tokens and positions, head tied to wte
    adapters, norm = adapter_parameters(config, TRAIN), 2 * 64  # a LayerNorm: weight and bias
    embeddings = 2 * 512 * 64  # wte (and the head, the same parameter) and wpe
    shape, plain = ModelShape.of(config, lora=TRAIN), ModelShape.of(config)
    assert trained_parameters(config, TRAIN) == trainable("gpt2-tiny", TRAIN) == shape.adapters \
        == adapters + embeddings + 5 * norm
    assert shape.block_adapters == adapters // 2 + 2 * norm and shape.root_adapters == embeddings + norm
    assert shape.parameters == plain.parameters + adapters  # nothing counted twice


def test_estimate_counts_the_modules_trained_beside_the_adapters():
    lora = figures("--model.lora", "{rank: 16, alpha: 32, train: [embeddings, norms]}")
    config = build_config("llama-1b")  # tied head: the embeddings train once, and are saved under both names
    trained = trained_parameters(config, {**LORA, "train": ["embeddings", "norms"]})
    assert trained == adapter_parameters(config, LORA) + 128256 * 2048 + 33 * 2048
    assert lora["trained_parameters"] == trained
    assert lora["device_by_component"]["model_states"] == (4 * lora["parameters"] + 12 * trained) // 8
    assert lora["network_bytes"]["reduce_scatter"] == trained * 4 * 7 / 8
    assert lora["checkpoint_bytes"] == int((4 * (trained + 128256 * 2048) + 8 * trained) * (1 + checkpoints.SPACE_MARGIN))


def test_flops_per_token_of_adapters_and_trained_modules_match_torch_flop_counter():
    """A trained head tied to trained embeddings costs a weight gradient (2 more per weight); the lookups and norms
    cost no matmul: what torch's counter sees in a forward and backward of the adapted model."""
    config = build_config("gpt2-tiny")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # SDPA on CPU counts as 0
    attach(model, LoraConfig(**TRAIN), device="cpu")
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert trained_matrices(config, TRAIN) == 512 * 64  # the head
    counted = counter.get_total_flops() / (2 * 32)
    assert flops_per_token(config, 32, adapter_parameters(config, TRAIN), trained_matrices(config, TRAIN)) == counted

