"""Deep Gradient Compression (Lin et al., 2018) around top-k: momentum correction and factor masking,
local gradient clipping and a density warm-up.

Plain error feedback accumulates the gradients top-k left out. DGC accumulates the *velocity* instead
(momentum correction: ``u = m u + g``, ``v = v + u``), sends the top-k of ``v``, and clears both ``v`` and
``u`` where it sent (momentum factor masking), so stale momentum does not push coordinates that were
already applied. Each chunk's gradient is clipped to ``clip_norm`` before it is accumulated, and the
density starts dense and falls exponentially to the target over ``warmup_steps`` calls per chunk.
Velocities and accumulations are kept in ``residual_dtype`` between calls and computed in float32.
"""

from __future__ import annotations

import math

import torch

from compress.error_feedback import ErrorFeedback
from compress.payload import Compressor, Payload
from compress.sparsify import Sparsified, TopK


def warmup_density(target: float, step: int, warmup_steps: int) -> float:
    """Density at ``step`` (0-based): 1 at step 0, ``target ** (step / warmup_steps)`` after, ``target`` from then on."""
    if step >= warmup_steps:
        return target
    return target ** (step / warmup_steps)


class DeepGradientCompression(ErrorFeedback):
    """Top-k (optionally quantised, ``Sparsified``) with DGC's velocity accumulation; state per chunk ``key``."""

    def __init__(self, inner: Compressor, momentum: float = 0.0, clip_norm: float | None = None, warmup_steps: int = 0,
                 residual_dtype: torch.dtype = torch.float32):
        super().__init__(inner, residual_dtype)
        self.topk = inner.sparsifier if isinstance(inner, Sparsified) else inner
        if not isinstance(self.topk, TopK):
            raise ValueError(f"DGC (momentum, clip_norm, warmup_steps) applies to topk, got {type(self.topk).__name__}")
        if not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
            raise ValueError(f"topk: momentum={momentum!r} is not in [0, 1)")
        if clip_norm is not None and not (isinstance(clip_norm, (int, float)) and math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"topk: clip_norm={clip_norm!r} is not a finite number > 0")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"topk: warmup_steps={warmup_steps!r} is not an integer >= 0")
        if warmup_steps and self.topk.ratio is None:
            raise ValueError("topk: warmup_steps needs ratio= (the target density), not k=")
        self.momentum, self.clip_norm, self.warmup_steps = momentum, clip_norm, warmup_steps
        self.target_ratio = self.topk.ratio
        self.velocities: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}

    def density(self, key: str) -> float | None:
        """The share of chunk ``key`` the next call sends (None: a fixed k)."""
        if self.target_ratio is None:
            return None
        return warmup_density(self.target_ratio, self.steps.get(key, 0), self.warmup_steps)

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        gradient = tensor.float()
        if self.clip_norm is not None:
            gradient = gradient * (self.clip_norm / (gradient.norm() + 1e-12)).clamp(max=1.0)
        if self.momentum:
            velocity = self.velocities.get(key)
            velocity = gradient.clone() if velocity is None else velocity.float().mul(self.momentum).add_(gradient)
            gradient = velocity
        residual = self.residuals.get(key)
        accumulated = gradient if residual is None else residual + gradient
        self.topk.ratio = self.density(key)
        payload = self.inner.compress(accumulated, key, seed)
        sent = self.inner.decompress(payload)
        self.residuals[key] = (accumulated - sent).to(self.residual_dtype)
        if self.momentum:  # momentum factor masking
            self.velocities[key] = velocity.masked_fill_(sent != 0, 0.0).to(self.residual_dtype)
        self.steps[key] = self.steps.get(key, 0) + 1
        return payload

    @property
    def memory_bytes(self) -> int:
        return super().memory_bytes + sum(v.numel() * v.element_size() for v in self.velocities.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Accumulations, velocities and calls per chunk: a resumed run continues the warm-up and the masks."""
        return {
            **super().state_dict(),
            **{f"velocity/{key}": value for key, value in self.velocities.items()},
            **{f"steps/{key}": torch.tensor(count) for key, count in self.steps.items()},
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict(state)
        self.velocities = {k.removeprefix("velocity/"): v.to(self.residual_dtype) for k, v in state.items()
                           if k.startswith("velocity/")}
        self.steps = {k.removeprefix("steps/"): int(v) for k, v in state.items() if k.startswith("steps/")}
