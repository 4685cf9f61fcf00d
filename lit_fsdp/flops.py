"""Training FLOPs per token from a Hugging Face config: the numerator of MFU.

The count is analytic (PaLM, appendix B; torchtitan's ``get_num_flop_per_token``): a matrix of ``n``
weights costs ``2n`` FLOPs per token forward and ``4n`` backward (gradients of its input and of its
weight), and attention's two score/value products cost ``2 x 2 x seq_len x width`` forward per
token and layer, where width is heads x head_dim, so training costs

    6 x (matmul weights of the blocks + the LM head) + 12 x layers x width x seq_len

(a windowed layer counts its window for ``seq_len`` where shorter: below).

What counts: every weight matrix in the blocks and the LM head, which is a matmul even when it shares
its weight with the embedding. What does not: the embedding lookups (token and position; an index,
not a matmul), biases, norms, activations, softmax and the optimizer (elementwise, a few FLOPs per
value), and attention's causal mask (the full ``seq_len x seq_len`` product is counted, as PaLM does).
The recompute of activation checkpointing is not in this count either: MFU counts the FLOPs the
model needs, whatever the hardware repeats (that repeat is ``recompute_flops_per_token``).

Sliding-window attention (Mistral, Phi-3 with a window; Gemma 2's and windowed Qwen's ``sliding_attention`` layers):
a query there sees at most ``window`` keys, so such a layer counts ``min(seq_len, window)`` keys per query where a
full layer counts ``seq_len``. Both are the bound on the keys a query sees, not their average, as the causal mask is
counted in full. Neither depends on the kernel: SDPA with a mask computes the whole square, flash attention about
the band.

Families: GPT-2, and the Llama-like decoders (Llama, Mistral, Qwen 2 and 3, Gemma 2, Phi-3, OLMo 2), whose
blocks all hold the same matrices: Q and O at heads x head_dim, K and V at the grouped width, and a gated MLP's gate,
up and down projections. Phi-3 fuses Q, K and V into one matrix and gate and up into another: the same weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PretrainedConfig

#: Llama-like decoders: every field ``matmul_shape`` reads has the same name and meaning in their configs.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2")
SUPPORTED = ("gpt2", *LLAMA_LIKE)
# Their attention applies ``config.sliding_window`` to every layer (and ignores ``layer_types``); the others window
# only the layers ``layer_types`` marks "sliding_attention" (transformers >= 4.53 sets it from the config).
_EVERY_LAYER_WINDOWED = ("mistral", "phi3")


@dataclass(frozen=True)
class MatmulShape:
    """What the FLOP count needs from a decoder-only transformer's config."""

    layers: int
    block_weights: int  # weights of the matrices in one block
    attention_width: int  # query heads x head_dim: the inner size of QK^T and of AV
    head_weights: int  # the LM head: vocab x hidden
    last_weights: int  # the block's last matrix (the MLP's down projection), not recomputed by checkpointing
    windows: tuple[int | None, ...] = ()  # each layer's attention window; None (or none given): every earlier key

    def keys(self, seq_len: int) -> list[int]:
        """The keys each layer's queries are counted against: ``seq_len``, or the layer's window where shorter."""
        windows = self.windows or (None,) * self.layers
        return [seq_len if window is None else min(seq_len, window) for window in windows]


def attention_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's sliding window as the Hugging Face model applies it; None for a layer with full attention."""
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if not window:
        return (None,) * layers
    if config.model_type in _EVERY_LAYER_WINDOWED:
        return (window,) * layers
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def matmul_shape(config: PretrainedConfig) -> MatmulShape:
    """The matmul sizes of a GPT-2 or Llama-like config (``SUPPORTED``)."""
    if config.model_type == "gpt2":
        hidden = config.n_embd
        inner = config.n_inner or 4 * hidden
        # c_attn (Q, K, V) and c_proj, then the MLP's c_fc and c_proj.
        block = 3 * hidden * hidden + hidden * hidden + 2 * hidden * inner
        return MatmulShape(config.n_layer, block, hidden, config.vocab_size * hidden, inner * hidden)
    if config.model_type in LLAMA_LIKE:
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        # explicit where it differs from hidden / heads (Gemma 2, Qwen 3); Phi-3's config has none
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        # q_proj and o_proj at full width, k_proj and v_proj at the grouped (GQA) width; the gated
        # MLP has three matrices (gate, up, down). Phi-3's qkv_proj and gate_up_proj hold the same weights.
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        block = attention + 3 * hidden * config.intermediate_size
        width, down = heads * head_dim, config.intermediate_size * hidden
        return MatmulShape(config.num_hidden_layers, block, width, config.vocab_size * hidden, down,
                           attention_windows(config))
    raise ValueError(
        f"no analytic FLOP count for model_type {config.model_type!r}; supported: {', '.join(SUPPORTED)} "
        "(another family needs its matrices in lit_fsdp.flops.matmul_shape)"
    )


def flops_per_token(config: PretrainedConfig, seq_len: int, trained: int | None = None, trained_matrices: int = 0) -> int:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len``, without recompute.

    ``trained``: the weights that get gradients where the rest is frozen (LoRA's adapters); None, every weight. A
    frozen matrix costs ``2n`` forward and ``2n`` for its input's gradient, but no weight gradient: ``4n``, and each
    trained adapter weight ``6``. ``trained_matrices``: the weights of the base's matrices trained beside the adapters
    (``lit_fsdp.lora.trained_matrices``: the head, when tied to trained embeddings), ``2`` more each for their weight
    gradient; trained embeddings and norms cost no matmul.
    """
    shape = matmul_shape(config)
    weights = shape.layers * shape.block_weights + shape.head_weights
    attention = 12 * shape.attention_width * sum(shape.keys(seq_len))
    if trained is None:
        return 6 * weights + attention
    return 4 * weights + 6 * trained + 2 * trained_matrices + attention


def recomputed_blocks(layers: int, checkpoint_every: int | Sequence[int]) -> list[int]:
    """The blocks recomputed: every ``checkpoint_every``-th (0: none) of ``layers``, or those it lists."""
    if isinstance(checkpoint_every, int):
        return list(range(layers))[::checkpoint_every] if checkpoint_every > 0 else []
    return list(checkpoint_every)


def recompute_flops_per_token(config: PretrainedConfig, seq_len: int, checkpoint_every: int | Sequence[int],
                              whole_block: bool = False) -> int:
    """FLOPs per token that activation checkpointing adds: the forward of every ``checkpoint_every``-th block again
    (blocks 0, k, 2k, ..., as ``lit_fsdp.parallelize`` checkpoints them; 0: none), or of the blocks it lists.

    Non-reentrant checkpointing stops recomputing once the last tensor backward needs is back
    (``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default): the block's last matmul,
    whose output only joins the residual sum, is not run again. SlideFSDP's (``whole_block``) runs the whole
    block's forward again, that matmul included.
    """
    shape = matmul_shape(config)
    all_keys = shape.keys(seq_len)
    keys = [all_keys[block] for block in recomputed_blocks(shape.layers, checkpoint_every)]
    weights = shape.block_weights - (0 if whole_block else shape.last_weights)
    return len(keys) * 2 * weights + 4 * shape.attention_width * sum(keys)


def block_matmul_flops_per_token(config: PretrainedConfig, checkpoint_every: int | Sequence[int] = 0,
                                 whole_block: bool = False, frozen: bool = False) -> int:
    """FLOPs per token of the blocks' weight matrices alone (what ``--model.float8`` runs in float8): ``6n`` per weight
    (``4n`` where the base is frozen: LoRA), and each recomputed block's forward again (``recomputed_blocks``; its
    last matrix only where ``whole_block``, as in ``recompute_flops_per_token``). Attention's products and the head
    are not in it."""
    shape = matmul_shape(config)
    again = shape.block_weights - (0 if whole_block else shape.last_weights)
    recomputed = len(recomputed_blocks(shape.layers, checkpoint_every))
    return (4 if frozen else 6) * shape.layers * shape.block_weights + 2 * again * recomputed
