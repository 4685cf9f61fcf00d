"""Named model shapes, built from Hugging Face configs with random weights (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

# Dropout is off everywhere: runs are then reproducible step for step, and modern LM pre-training
# does without it. ``vocab_size`` is replaced by the data's vocabulary when the data has one, and
# the special token ids by the data tokenizer's (GPT-2's 50256 lies outside the small vocabularies).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-tiny": dict(
        model_type="gpt2", n_layer=2, n_head=2, n_embd=64, n_positions=512, vocab_size=512,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    ),
    "gpt2-small": dict(
        model_type="gpt2", n_layer=4, n_head=4, n_embd=256, n_positions=1024, vocab_size=8192,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    ),
    "gpt2-124m": dict(
        model_type="gpt2", n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
    "llama-tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, vocab_size=512, tie_word_embeddings=True,
    ),
    # The shape of Llama 3.2 1B: 1.24e9 parameters with its 128k vocabulary.
    "llama-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, vocab_size=128256,
        rope_theta=500000.0, tie_word_embeddings=True,
    ),
    # The shape of Llama 3.1 8B: 8.03e9 parameters, untied head, llama3 RoPE scaling to 128k positions.
    "llama-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, vocab_size=128256,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    # The shapes of Qwen2.5 14B (14.77e9 parameters) and 32B (32.76e9): biased q, k and v projections, untied head,
    # 152k vocabulary; random weights, as for every preset (a real checkpoint: --model.pretrained_path Qwen/...).
    "qwen2.5-14b": dict(
        model_type="qwen2", hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, max_position_embeddings=131072, vocab_size=152064, rope_theta=1000000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, use_sliding_window=False,
    ),
    "qwen2.5-32b": dict(
        model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
        num_key_value_heads=8, max_position_embeddings=131072, vocab_size=152064, rope_theta=1000000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, use_sliding_window=False,
    ),
    # Mixture of experts: every block's MLP is 8 (tiny) or 128 (30B-A3B) experts of which a token uses the top 8,
    # weighted by a router. The load-balancing loss is on (output_router_logits), as pretraining needs it; a real
    # Qwen3-30B-A3B (--model.pretrained_path Qwen/Qwen3-30B-A3B) keeps its own config's choice.
    "qwen3-moe-tiny": dict(
        model_type="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=512, vocab_size=512,
        tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.001,
    ),
    # The shape of Qwen3-30B-A3B: 30.53e9 parameters, 3.35e9 active per token (8 of 128 experts).
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=40960,
        vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.001,
    ),
}


def build_config(preset: str, overrides: dict[str, Any] | None = None) -> PretrainedConfig:
    """The Hugging Face config of ``preset`` with ``overrides`` applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)} or set --model.pretrained_path")
    values = {**PRESETS[preset], **(overrides or {})}
    return AutoConfig.for_model(**values)
