"""Tiny random mixture-of-experts checkpoints written by the installed transformers, in both on-disk layouts.

``save_pretrained`` writes one tensor per expert, as every Hub checkpoint of these families holds them
(Qwen3-MoE's ``mlp.experts.E.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.E.w1.weight``); ``fused``
writes the model's own 3D tensors (``mlp.experts.gate_up_proj``) as a checkpoint saved from a state dict does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

#: The families with transformers' conversion rules that the tests cover, each as small as it builds.
SHAPES: dict[str, dict] = {
    "qwen3_moe": dict(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        norm_topk_prob=True, max_position_embeddings=256, vocab_size=512, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.01,
    ),
    "mixtral": dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256, vocab_size=512,
        output_router_logits=True, router_aux_loss_coef=0.01,
    ),
}
FAMILIES = tuple(SHAPES)
LAYOUTS = ("per_expert", "fused")


def moe_config(family: str, **overrides) -> PretrainedConfig:
    """The tiny config of ``family`` (``SHAPES``) with ``overrides``."""
    return AutoConfig.for_model(family, **{**SHAPES[family], **overrides})


def write_moe_checkpoint(folder: Path, family: str = "qwen3_moe", layout: str = "per_expert", seed: int = 0,
                         **overrides) -> Path:
    """A random ``family`` model saved to ``folder`` in ``layout`` (``LAYOUTS``); the same weights for a seed."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, **overrides))
    folder = Path(folder)
    if layout == "per_expert":
        model.save_pretrained(folder, safe_serialization=True)
    elif layout == "fused":
        folder.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(folder)
        state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        raise ValueError(f"unknown layout {layout!r}; one of {LAYOUTS}")
    return folder
