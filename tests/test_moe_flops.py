"""The FLOP count of a mixture of experts is by its active parameters: the weights a token uses, counted from the
model's own parameter shapes and checked against torch's flop counter, recompute included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

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
#: The other families the count covers, as tests/moe.py's shapes: Qwen2-MoE's shared expert and its gate, every
#: second block sparse; OLMoE's experts of intermediate_size
OTHERS = {
    "qwen2_moe": dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=2, vocab_size=512),
    "olmoe": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=512, pad_token_id=1,
                  bos_token_id=None, eos_token_id=2),
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


#: The cases whose block 0 is a dense MLP (mlp_only_layers, decoder_sparse_step) and block 1 a MoE
DENSE_FIRST = {"qwen3_moe-dense-first", "qwen2_moe"}


def case_config(case: str):
    if case in OTHERS:
        return AutoConfig.for_model(case, **OTHERS[case])
    family, overrides = CASES[case]
    return moe_config(family, **overrides)


@pytest.mark.parametrize("case", [*CASES, *OTHERS])
def test_flops_per_token_counts_the_active_parameters_of_the_model(case):
    config = case_config(case)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = 12 * heads * head_dim * SEQ_LEN * config.num_hidden_layers
    assert flops_per_token(config, SEQ_LEN) == 6 * active_weights(config) + attention
    shape = matmul_shape(config)
    if case in DENSE_FIRST:  # one dense block and one sparse: each counted as it is built
        assert len(shape.varied) == 2 and shape.varied[0].last == config.intermediate_size * config.hidden_size
        assert shape.varied[1].last == 0


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


def test_lora_on_the_experts_counts_their_adapters_and_weight_gradients_at_k_over_e():
    """LoRA's default on a MoE: the attention's linear layers and every expert tensor. A token uses k / E of the
    expert tensors' adapters (6 FLOPs a weight) and of their weight gradient (2 more a weight, computed for W + BA);
    the attention's adapters count whole."""
    from lit_fsdp.flops import lora_flops_per_token
    from lit_fsdp.lora import adapter_parameters, as_config, attach, trained_matrices

    config, lora = moe_config("qwen3_moe"), {"rank": 2, "alpha": 4, "dropout": 0.0}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    attach(model, as_config(lora))
    on_experts = sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and ".experts." in name)
    assert 0 < on_experts < adapter_parameters(config, lora) and trained_matrices(config, lora) == experts
    share = config.num_experts_per_tok / config.num_experts
    frozen = flops_per_token(config, SEQ_LEN) - 2 * active_weights(config)  # 4 a weight, and attention
    want = frozen + 6 * (adapter_parameters(config, lora) - on_experts * (1 - share)) + 2 * experts * share
    assert lora_flops_per_token(config, SEQ_LEN, lora) == want


@pytest.mark.parametrize("case", ["qwen3_moe-dense-first", "qwen2_moe"])
def test_float8_counts_the_blocks_linear_layers_not_the_router_or_the_fused_experts(case):
    """``--model.float8`` converts the blocks' ``nn.Linear`` layers: a MoE block's attention and shared expert, a dense
    block's whole MLP; the router and the 3D experts stay in the compute dtype. A recomputed MoE block runs them all
    again, a dense block all but its down projection."""
    from lit_fsdp.flops import block_matmul_flops_per_token

    config = case_config(case)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linear = [sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear) and m.out_features > 1)
              for block in model.model.layers]
    down = config.intermediate_size * config.hidden_size  # block 0's, dense
    assert block_matmul_flops_per_token(config) == 6 * sum(linear)
    assert block_matmul_flops_per_token(config, 1) == 6 * sum(linear) + 2 * (sum(linear) - down)
