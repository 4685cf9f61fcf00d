"""The router of a mixture-of-experts model: its load-balancing loss and the tokens each expert gets.

A MoE block sends each token to the top ``k`` of its ``E`` experts by the router's logits. The model defines an
auxiliary load-balancing loss (Switch Transformer's, transformers' ``load_balancing_loss_func``), which the model
computes when ``output_router_logits`` is set in its config and adds to its loss scaled by ``router_aux_loss_coef``;
``CausalLM`` does the same (``trained_aux_loss``), and logs it apart from the language-model loss.

``ExpertLoad`` counts the tokens each expert of each MoE layer received, from the router logits the model returns
(the top ``k`` of each token's logits: the experts the block sent it to, for families that select by the logits, as
Qwen2/3-MoE, OLMoE and Mixtral do; one that adds a selection bias, as DeepSeek-V3, is counted without it). Its load
imbalance is a layer's largest count over its mean: 1 is perfectly balanced, ``E / k`` every token on the same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PretrainedConfig


def experts_per_token(config: PretrainedConfig) -> int | None:
    """``k`` of a mixture-of-experts config (``num_experts_per_tok``); None for a dense model."""
    return getattr(config, "num_experts_per_tok", None) if expert_count(config) else None


def expert_count(config: PretrainedConfig) -> int | None:
    """``E``, the experts of a MoE layer; None for a dense model. transformers maps Mixtral's ``num_local_experts`` to
    ``num_experts`` (its attribute map); DeepSeek's configs name it ``n_routed_experts``."""
    for field in ("num_experts", "n_routed_experts"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def trained_aux_loss(config: PretrainedConfig, aux_loss: torch.Tensor | None) -> torch.Tensor | None:
    """What the model adds to its loss: ``router_aux_loss_coef x aux_loss`` where its config sets
    ``output_router_logits`` (as ``from_pretrained``'s forward with labels does); None where it does not."""
    if aux_loss is None or not getattr(config, "output_router_logits", False):
        return None
    return getattr(config, "router_aux_loss_coef", 0.0) * aux_loss


class ExpertLoad:
    """Tokens per expert of each MoE layer: those of the last micro-batch, and of the whole run on this rank."""

    def __init__(self, experts: int, top_k: int):
        self.experts, self.top_k = experts, top_k
        self.run: torch.Tensor | None = None  # (MoE layers, experts), float64: exact token counts well past 2**53
        self.last: torch.Tensor | None = None

    def observe(self, router_logits: tuple[torch.Tensor, ...]) -> None:
        """Count the experts each token was sent to in each layer (``router_logits``: one (tokens, E) per layer)."""
        with torch.no_grad():
            counts = torch.stack([
                torch.bincount(logits.topk(self.top_k, dim=-1).indices.flatten(), minlength=self.experts)
                for logits in router_logits
            ]).double()
        self.last = counts
        self.run = counts if self.run is None else self.run + counts

    def run_totals(self) -> torch.Tensor | None:
        """The run's counts summed over the ranks (a collective: every rank calls it), on the CPU."""
        if self.run is None:
            return None
        totals = self.run.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(totals)
        return totals.cpu()


def imbalance(counts: torch.Tensor) -> torch.Tensor:
    """Each layer's largest token count over its mean (``counts``: layers x experts)."""
    return counts.max(dim=-1).values / counts.mean(dim=-1).clamp_min(1e-12)
