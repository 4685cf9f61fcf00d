"""The FLOP count of a mixture of experts is by its active parameters: the weights a token uses, counted from the
model's own parameter shapes and checked against torch's flop counter, recompute included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from lit_fsdp.flops import flops_per_token, matmul_shape, recompute_flops_per_token
from lit_fsdp.parallelize import apply_activation_checkpointing, find_blocks
from lit_fsdp.presets import build_config
from tests.moe import moe_config

SEQ_LEN = 32
CASES = {  # name: (family, overrides)
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "qwen3_moe-dense-first": ("qwen3_moe", {"mlp_only_layers": [0]}),  # block 0 a dense MLP of intermediate_size
}


def active_weights(config) -> int:
    """The weights a token uses, from the parameters of the model built on the meta device: every 2D matrix (the
    linear layers, the router's ``mlp.gate.weight``, the head; not the embedding table, a lookup), and k / E of each
    fused 3D expert parameter (``mlp.experts.*``); norms and biases are 1D."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    share = config.num_experts_per_tok / config.num_experts
    embeddings = model.get_input_embeddings().weight
    total = 0.0
    for name, parameter in model.named_parameters():
        if parameter.dim() == 3:
            assert ".experts." in name
            total += parameter.numel() * share
        elif parameter.dim() == 2 and parameter is not embeddings:
            total += parameter.numel()
    return round(total)


@pytest.mark.parametrize("case", CASES)
def test_flops_per_token_counts_the_active_parameters_of_the_model(case):
    family, overrides = CASES[case]
    config = moe_config(family, **overrides)
    heads, head_dim = config.num_attention_heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * heads * head_dim * SEQ_LEN * config.num_hidden_layers
    assert flops_per_token(config, SEQ_LEN) == 6 * active_weights(config) + attention
    shape = matmul_shape(config)
    if overrides:  # one dense block and one sparse: each counted as it is built
        assert len(shape.varied) == 2 and shape.varied[0][1] == config.intermediate_size * config.hidden_size
        assert shape.varied[1][1] == 0


def counted(config, checkpoint_every: int = 0) -> float:
    """torch's flop counter over one forward and backward per token, experts as a Python loop (``grouped_mm`` has no
    formula in the counter and would count 0) and eager attention (as tests/test_throughput.py counts)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    model.config.use_cache = False
    if checkpoint_every:
        apply_activation_checkpointing(model, find_blocks(model), checkpoint_every)
    tokens = torch.randint(0, config.vocab_size, (2, SEQ_LEN + 1))
    with FlopCounterMode(display=False) as counter:
        logits = model(input_ids=tokens[:, :-1]).logits
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    return counter.get_total_flops() / tokens[:, :-1].numel()


@pytest.mark.parametrize("case", ["qwen3_moe-dense-first"])  # a dense block and a MoE block
def test_torch_counts_the_same_flops_and_recomputes_a_moe_block_whole(case):
    """However the router spreads the tokens, each goes to k experts: the counter's total is the analytic one. The
    recompute of a MoE block runs its down projections again (the routing weights' gradient needs their outputs);
    a dense block's stops before its down projection."""
    family, overrides = CASES[case]
    config = moe_config(family, **overrides)
    plain = counted(config)
    assert flops_per_token(config, SEQ_LEN) == pytest.approx(plain, rel=1e-6)
    assert recompute_flops_per_token(config, SEQ_LEN, 1) == pytest.approx(counted(config, 1) - plain, rel=1e-6)


def test_qwen3_30b_a3b_uses_3_35e9_of_its_30_5e9_parameters_a_token():
    config = build_config("qwen3-30b-a3b")
    shape = matmul_shape(config)
    embeddings = config.vocab_size * config.hidden_size
    assert round((shape.blocks_weights + shape.head_weights + embeddings) / 1e7) == 335
    assert shape.routed_copies == 8 and shape.router_logits == 128 and shape.mlp_width == 8 * 768


def test_adapters_on_routed_experts_count_at_k_over_e():
    config = moe_config("qwen3_moe")  # k = 2 of E = 4
    base = flops_per_token(config, SEQ_LEN, trained=1000)
    assert flops_per_token(config, SEQ_LEN, trained=1000, routed_adapters=800) == base - 6 * 400
