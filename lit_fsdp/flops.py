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

Mixtures of experts (``MIXTURES_OF_EXPERTS``: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) count the weights a token uses,
its ACTIVE parameters: a MoE block's MLP is ``E`` gated experts of which the router sends each token to the top
``k``, so the block counts the router (a matmul of ``E x hidden``, every token), ``k`` experts' gate, up and down
projections (``k / E`` of the fused 3D ``mlp.experts.*`` parameters), and Qwen2-MoE's shared expert and its
one-output gate, which every token passes; a layer that ``mlp_only_layers`` or ``decoder_sparse_step`` leaves dense
counts its dense MLP. A token's share is exact whatever the routing: every token goes to exactly ``k`` experts, so
the experts' matmuls sum to ``k`` experts' weights per token however unbalanced the load (torch's flop counter on
the eager expert loop agrees: tests/test_moe_flops.py). Qwen3-30B-A3B: 3.35e9 of its 30.5e9 parameters active.
This is torchtitan's convention (``get_moe_model_nparams_and_flops``: ``6 x (dense + sparse x top_k / num_experts)``
with the router and shared experts among the dense weights, ``12 x layers x heads x head_dim x seq_len`` for
attention): torchtitan counts every parameter but the token embedding (its norms too, a few thousand values), we the
matrices; both count the head and not the embedding lookup, so MFUs of the two compare. Megatron-LM's
``num_floating_point_operations`` counts the routed (``moe_router_topk x moe_ffn_hidden_size``) and shared experts
the same way but not the router, and attention's causal half (``seq_len / 2``): at 30B-A3B's shape and 4,096 tokens
its count is 17.6% below ours (the router alone is 0.3%), so its MFU reads lower for the same run.

Recompute of a MoE block: the experts' outputs are scaled by the routing weights, whose gradient needs those outputs,
so checkpointing's early stop has nothing left to skip: a MoE block's forward runs again whole, its down projections
included (``last_weights`` is 0 for it; the count of torch's flop counter agrees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from transformers import PretrainedConfig

from lit_fsdp.router import expert_count, experts_per_token

#: Llama-like decoders: every field ``matmul_shape`` reads has the same name and meaning in their configs.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "olmo2")
#: The dense families (tests/test_flops_architectures.py counts each with torch's flop counter).
SUPPORTED = ("gpt2", *LLAMA_LIKE)
#: Mixtures of experts with Llama-like attention and fused 3D experts (``mlp.experts.gate_up_proj``, ``down_proj``);
#: E and k read by ``lit_fsdp.router``'s ``expert_count`` and ``experts_per_token``, as the training loop reads them
MIXTURES_OF_EXPERTS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
# Their attention applies ``config.sliding_window`` to every layer (and ignores ``layer_types``); the others window
# only the layers ``layer_types`` marks "sliding_attention" (transformers >= 4.53 sets it from the config).
_EVERY_LAYER_WINDOWED = ("mistral", "phi3", "mixtral")


class BlockMatmuls(NamedTuple):
    """One block's weights a token uses, those of its last matrix (not recomputed by checkpointing) and those of its
    ``nn.Linear`` layers (what ``--model.float8`` converts: not a MoE's router or fused experts)."""

    weights: int
    last: int
    linear: int


@dataclass(frozen=True)
class MatmulShape:
    """What the FLOP count needs from a decoder-only transformer's config."""

    layers: int
    block_weights: int  # weights of the matrices in one block a token uses (a MoE block's: active, above)
    attention_width: int  # query heads x head_dim: the inner size of QK^T and of AV
    head_weights: int  # the LM head: vocab x hidden
    last_weights: int  # the block's last matrix (the MLP's down projection), not recomputed by checkpointing; 0: MoE
    windows: tuple[int | None, ...] = ()  # each layer's attention window; None (or none given): every earlier key
    # where blocks differ (a MoE with dense layers), each block's; empty: every block has the ones above
    varied: tuple[BlockMatmuls, ...] = ()
    # What a token's MLP holds for the backward (offload.activation_plan.block_activation_bytes), the widest block's:
    # its inner width (a dense MLP's intermediate; a MoE block's k x the expert's, plus a shared expert's), the copies
    # of its hidden state the experts take (k; 0: dense) and the router's logits (E; 0: dense)
    mlp_width: int = 0
    routed_copies: int = 0
    router_logits: int = 0
    linear_weights: int | None = None  # of block_weights, those of nn.Linear layers (float8's); None: all of them

    def each_block(self) -> list[BlockMatmuls]:
        """Each block's weights a token uses, its last matrix's and its linear layers'."""
        same = BlockMatmuls(self.block_weights, self.last_weights,
                            self.block_weights if self.linear_weights is None else self.linear_weights)
        return list(self.varied) or [same] * self.layers

    @property
    def blocks_weights(self) -> int:
        """The weights a token uses in all the blocks."""
        return sum(block.weights for block in self.each_block())

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


def _attention(config: PretrainedConfig) -> tuple[int, int]:
    """(weights, width) of a Llama-like attention: q_proj and o_proj at heads x head_dim, k_proj and v_proj at the
    grouped (GQA) width; head_dim explicit where it differs from hidden / heads (Gemma 2, Qwen 3), Phi-3 has none."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim, heads * head_dim


def sparse_layers(config: PretrainedConfig) -> list[bool]:
    """Which blocks of a mixture of experts hold experts, as the Hugging Face model builds them: Qwen2/3-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step`` leave some dense; Mixtral's and OLMoE's are all sparse."""
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", None) or 1
    return [layer not in dense and (layer + 1) % step == 0 for layer in range(config.num_hidden_layers)]


def _moe_shape(config: PretrainedConfig) -> MatmulShape:
    """A mixture of experts' blocks by the weights a token uses (the module docstring)."""
    hidden, experts, k = config.hidden_size, expert_count(config), experts_per_token(config)
    attention, width = _attention(config)
    expert = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # Mixtral, OLMoE: one name
    shared = getattr(config, "shared_expert_intermediate_size", None) or 0  # Qwen2-MoE
    # the router, k gated experts, and a shared gated expert with its one-output gate; all of it recomputed (above).
    # Its linear layers: the attention's and the shared expert's (its gate's one output is no float8 matmul's)
    shared_mlp = 3 * hidden * shared
    routed = experts * hidden + 3 * hidden * k * expert
    sparse = BlockMatmuls(attention + routed + (shared_mlp + hidden if shared else 0), 0, attention + shared_mlp)
    dense_mlp = 3 * hidden * config.intermediate_size
    dense = BlockMatmuls(attention + dense_mlp, config.intermediate_size * hidden, attention + dense_mlp)
    blocks = [sparse if is_sparse else dense for is_sparse in sparse_layers(config)]
    widths = [k * expert + shared if is_sparse else config.intermediate_size for is_sparse in sparse_layers(config)]
    largest = max(blocks)
    return MatmulShape(config.num_hidden_layers, largest.weights, width, config.vocab_size * hidden, largest.last,
                       attention_windows(config), tuple(blocks) if len(set(blocks)) > 1 else (),
                       max(widths), k, experts, largest.linear)


def matmul_shape(config: PretrainedConfig) -> MatmulShape:
    """The matmul sizes of a GPT-2, Llama-like or mixture-of-experts config (``SUPPORTED``, ``MIXTURES_OF_EXPERTS``)."""
    if config.model_type == "gpt2":
        hidden = config.n_embd
        inner = config.n_inner or 4 * hidden
        # c_attn (Q, K, V) and c_proj, then the MLP's c_fc and c_proj.
        block = 3 * hidden * hidden + hidden * hidden + 2 * hidden * inner
        return MatmulShape(config.n_layer, block, hidden, config.vocab_size * hidden, inner * hidden, mlp_width=inner)
    if config.model_type in LLAMA_LIKE:
        hidden = config.hidden_size
        # the gated MLP has three matrices (gate, up, down). Phi-3's qkv_proj and gate_up_proj hold the same weights.
        attention, width = _attention(config)
        block = attention + 3 * hidden * config.intermediate_size
        down = config.intermediate_size * hidden
        return MatmulShape(config.num_hidden_layers, block, width, config.vocab_size * hidden, down,
                           attention_windows(config), mlp_width=config.intermediate_size)
    if config.model_type in MIXTURES_OF_EXPERTS:
        return _moe_shape(config)
    raise ValueError(
        f"no analytic FLOP count for model_type {config.model_type!r}; supported: {', '.join(SUPPORTED)}, and the "
        f"mixtures of experts {', '.join(MIXTURES_OF_EXPERTS)} (another family needs its matrices in "
        "lit_fsdp.flops.matmul_shape)"
    )


def flops_per_token(config: PretrainedConfig, seq_len: int, trained: int | None = None, trained_matrices: int = 0,
                    routed_adapters: int = 0, routed_matrices: int = 0) -> int:
    """Training (forward + backward) FLOPs per token at sequence length ``seq_len``, without recompute.

    ``trained``: the weights that get gradients where the rest is frozen (LoRA's adapters); None, every weight. A
    frozen matrix costs ``2n`` forward and ``2n`` for its input's gradient, but no weight gradient: ``4n``, and each
    trained adapter weight ``6``. ``trained_matrices``: the weights of the base's matrices trained beside the adapters
    (``lit_fsdp.lora.trained_matrices``: the head, when tied to trained embeddings; a mixture's adapted expert
    tensors, whose weight gradient is computed), ``2`` more each for their weight gradient; trained embeddings and
    norms cost no matmul. Of these, ``routed_adapters`` (of ``trained``: the adapters on routed experts' tensors,
    LoRA's ``target_parameters``) and ``routed_matrices`` (of ``trained_matrices``: those expert tensors) count at the
    share ``k / E`` a token uses, as the experts' own weights do.
    """
    shape = matmul_shape(config)
    weights = shape.blocks_weights + shape.head_weights
    attention = 12 * shape.attention_width * sum(shape.keys(seq_len))
    if trained is None:
        return 6 * weights + attention

    def idle(routed: int) -> int:  # the part of ``routed`` weights a token does not use
        return routed - routed * shape.routed_copies // shape.router_logits if routed else 0

    return (4 * weights + 6 * (trained - idle(routed_adapters)) + 2 * (trained_matrices - idle(routed_matrices))
            + attention)


def lora_flops_per_token(config: PretrainedConfig, seq_len: int, lora: Any = None) -> int:
    """``flops_per_token`` of a run with LoRA ``lora`` (a ``lit_fsdp.lora.LoraConfig`` or its dict; None: every weight
    trained): its adapters and the base's matrices that get a weight gradient (``lit_fsdp.lora``), those on a
    mixture's routed experts at the share a token uses (``routed_lora_weights``). An adapted expert tensor's
    ``W + BA``, formed once a micro-batch and its gradient's way back to A and B, is not counted: not per token, and
    0.2% of the FLOPs of configs/qwen3_30b_a3b_lora.yaml's step of 65,536 tokens, its recompute included."""
    from lit_fsdp.lora import adapter_parameters, as_config, trained_matrices

    lora = as_config(lora)
    if lora is None:
        return flops_per_token(config, seq_len)
    return flops_per_token(config, seq_len, adapter_parameters(config, lora), trained_matrices(config, lora),
                           *routed_lora_weights(config, lora))


def routed_lora_weights(config: PretrainedConfig, lora: Any) -> tuple[int, int]:
    """(the adapters LoRA ``lora`` puts on a mixture's routed expert tensors, those tensors' weights): LoRA's
    ``target_parameters`` under ``mlp.experts``, of which a token uses ``k / E``; (0, 0) for a dense model."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_fsdp import lora_parameters
    from lit_fsdp.lora import as_config, target_parameter_paths

    lora = as_config(lora)
    if lora is None or config.model_type not in MIXTURES_OF_EXPERTS:
        return 0, 0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    paths = [path for path in target_parameter_paths(model, lora) if ".experts." in path]
    adapters = 0
    for path in paths:
        a, b = lora_parameters.adapter_shapes(model.get_parameter(path), model.get_submodule(path.rpartition(".")[0]),
                                              lora.rank)
        adapters += a[0] * a[1] + b[0] * b[1]
    return adapters, sum(model.get_parameter(path).numel() for path in paths)


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
    all_keys, blocks = shape.keys(seq_len), shape.each_block()
    recomputed = recomputed_blocks(shape.layers, checkpoint_every)
    weights = sum(blocks[block].weights - (0 if whole_block else blocks[block].last) for block in recomputed)
    return 2 * weights + 4 * shape.attention_width * sum(all_keys[block] for block in recomputed)


def block_matmul_flops_per_token(config: PretrainedConfig, checkpoint_every: int | Sequence[int] = 0,
                                 whole_block: bool = False, frozen: bool = False) -> int:
    """FLOPs per token of the blocks' linear layers alone (what ``--model.float8`` runs in float8): ``6n`` per weight
    (``4n`` where the base is frozen: LoRA), and each recomputed block's forward again (``recomputed_blocks``; its
    last matrix only where ``whole_block``, as in ``recompute_flops_per_token``). Attention's products, the head and a
    mixture's router and fused experts (not linear layers: they stay in the compute dtype) are not in it."""
    shape = matmul_shape(config)
    blocks = shape.each_block()
    again = sum(blocks[block].linear - (0 if whole_block else blocks[block].last)
                for block in recomputed_blocks(shape.layers, checkpoint_every))
    return (4 if frozen else 6) * sum(block.linear for block in blocks) + 2 * again
