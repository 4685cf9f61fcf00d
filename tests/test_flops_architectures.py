"""The analytic FLOP count and LoRA's default targets on every architecture the app trains, against the real models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from callbacks import throughput
from lit_fsdp.commands.estimate import estimate_step, parse
from lit_fsdp.commands.tune.hardware import detect
from lit_fsdp.flops import SUPPORTED, flops_per_token, matmul_shape, recompute_flops_per_token
from lit_fsdp.lora import LoraConfig, adapter_parameters, linear_modules, target_paths
from tests.helpers import REPO

SMALL = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300)
#: model_type: (config class, fields); Gemma 2 and Qwen 3 have attention wider than the residual stream (4 x 24, 4 x 32)
FAMILIES = {
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_inner=176, vocab_size=300)),
    "llama": ("LlamaConfig", SMALL),
    "mistral": ("MistralConfig", SMALL),
    "qwen2": ("Qwen2Config", SMALL),
    "qwen3": ("Qwen3Config", {**SMALL, "head_dim": 32}),
    "gemma2": ("Gemma2Config", {**SMALL, "head_dim": 24}),  # tied head by default
    "phi3": ("Phi3Config", {**SMALL, "pad_token_id": 0}),  # fused qkv_proj and gate_up_proj; pad id 32000 > vocab
    "olmo2": ("Olmo2Config", SMALL),
}
#: the MLP's down projection, by its name in a block
DOWN = {"gpt2": "mlp.c_proj"}


def tiny_config(family: str, **fields):
    name, defaults = FAMILIES[family]
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return getattr(transformers, name)(**{**defaults, **fields})


def matrices(model: nn.Module) -> dict[str, nn.Module]:
    """Every matmul module by name: nn.Linear, and GPT-2's Conv1D; a tied head is one module, counted once."""
    return {name: module for name, module in model.named_modules() if isinstance(module, (nn.Linear, Conv1D))}


def test_every_architecture_the_app_trains_is_supported():
    assert set(FAMILIES) == set(SUPPORTED)


@pytest.mark.parametrize("family", FAMILIES)
def test_matmul_shape_counts_every_linear_weight_of_the_model(family):
    config = tiny_config(family)
    model = AutoModelForCausalLM.from_config(config)
    shape = matmul_shape(config)
    weights = sum(module.weight.numel() for module in matrices(model).values())
    assert shape.layers * shape.block_weights + shape.head_weights == weights
    assert shape.head_weights == model.get_output_embeddings().weight.numel()
    down = [m for name, m in matrices(model).items() if name.endswith(DOWN.get(family, "mlp.down_proj"))]
    assert len(down) == shape.layers and shape.last_weights == down[0].weight.numel()


def test_gemma2_counts_its_explicit_head_dim_and_its_tied_head():
    config = tiny_config("gemma2")
    model = AutoModelForCausalLM.from_config(config)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert matmul_shape(config).attention_width == 4 * 24 != config.hidden_size


def counted_flops_per_token(config, seq_len: int) -> float:
    """FlopCounterMode's count for one forward + backward on CPU, per token (eager attention: SDPA has no formula)."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.config.use_cache = False
    tokens = torch.randint(0, config.vocab_size, (2, seq_len + 1))
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    return counter.get_total_flops() / tokens[:, :-1].numel()


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_per_token_matches_torch_flop_counter(family):
    # every window (Mistral's default 4096) is longer than the sequence: attention counts seq_len keys
    config = tiny_config(family)
    assert flops_per_token(config, 32) == pytest.approx(counted_flops_per_token(config, 32), rel=1e-3)


WINDOWED = {  # family: (fields, the window of each of the 2 layers)
    "mistral": (dict(sliding_window=8), (8, 8)),
    "phi3": (dict(sliding_window=8), (8, 8)),
    "gemma2": (dict(sliding_window=8), (8, None)),  # alternate layers, the first windowed
    "qwen2": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), (None, 8)),
    "qwen3": (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), (None, 8)),
}


@pytest.mark.parametrize("family", WINDOWED)
def test_windows_are_the_keys_the_model_lets_a_query_see(family):
    fields, windows = WINDOWED[family]
    config = tiny_config(family, **fields)
    shape = matmul_shape(config)
    assert shape.windows == windows
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = model(input_ids=torch.randint(0, 300, (1, 24)), output_attentions=True).attentions
    seen = [int((layer[0, :, -1] > 0).sum(-1).max()) for layer in attentions]  # keys the last query weights
    assert seen == shape.keys(24) == [24 if w is None else 8 for w in windows]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_window_qwen_does_not_use_is_not_counted(family):
    config = tiny_config(family, sliding_window=8)  # use_sliding_window defaults to False
    assert matmul_shape(config).keys(64) == [64, 64]


def test_a_windowed_layer_counts_min_seq_len_window_keys_also_in_the_recompute():
    config = tiny_config("gemma2", sliding_window=16)  # layer 0 windowed, layer 1 full
    shape = matmul_shape(config)
    weights = 2 * shape.block_weights + shape.head_weights
    width = shape.attention_width
    assert flops_per_token(config, 64) == 6 * weights + 12 * width * (16 + 64)
    assert flops_per_token(config, 8) == 6 * weights + 12 * width * (8 + 8)  # a window longer than the sequence
    # checkpoint_every=2 recomputes block 0, the windowed one, without its last matrix
    assert recompute_flops_per_token(config, 64, 2) == 2 * (shape.block_weights - shape.last_weights) + 4 * width * 16
    assert recompute_flops_per_token(config, 64, 1) == (4 * (shape.block_weights - shape.last_weights)
                                                         + 4 * width * (16 + 64))


def test_an_unknown_model_type_is_refused_in_one_line_listing_the_supported_ones():
    config = transformers.OPTConfig()
    with pytest.raises(ValueError) as error:
        matmul_shape(config)
    message = str(error.value)
    assert "\n" not in message and "model_type 'opt'" in message
    assert f"supported: {', '.join(SUPPORTED)}" in message and "qwen2" in message and "phi3" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapts_every_linear_layer_but_the_head_by_default(family):
    config = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    paths = target_paths(model, LoraConfig())
    assert paths == list(linear_modules(model))
    in_out = sum(sum(model.get_submodule(path).weight.shape) for path in paths)
    assert adapter_parameters(config, {"rank": 2}) == 2 * in_out


def test_estimate_counts_a_qwen2_model_and_its_lora_run(tmp_path):
    tiny_config("qwen2", vocab_size=512).save_pretrained(tmp_path)  # the config is all estimate reads
    machine = detect("cpu")
    base = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model.pretrained_path", str(tmp_path)]
    full = estimate_step(*parse(base, machine), machine)
    lora = estimate_step(*parse([*base, "--model.lora", "{rank: 4}"], machine), machine)
    config = tiny_config("qwen2", vocab_size=512)
    tokens = full["tokens_per_process"]
    assert full["model_flops"] == tokens * flops_per_token(config, 128)
    assert lora["model_flops"] == tokens * flops_per_token(config, 128, adapter_parameters(config, {"rank": 4}))
    assert 0 < lora["trained_parameters"] < full["trained_parameters"] == full["parameters"]


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_the_throughput_callback_keeps_mfu_for_a_llama_like_model(family, monkeypatch):
    config = tiny_config(family)
    callback = throughput.Throughput(warmup_steps=0, peak_tflops=0.1)
    trainer = SimpleNamespace(world_size=1, strategy=SimpleNamespace(), precision="32-true")
    module = SimpleNamespace(model=SimpleNamespace(config=config), device=torch.device("cpu"),
                             hparams={"lora": {"rank": 2}})
    said = []
    monkeypatch.setattr(throughput, "rank_zero_info", said.append)
    callback.on_train_start(trainer, module)
    assert said == [] and callback.model_config is config
    assert callback.lora == {"rank": 2} and adapter_parameters(config, callback.lora) > 0
