"""1-bit Adam (Tang et al., 2021) on sharded FSDP2: the hooks' half (local momenta, signs) and the optimizer's half.

Warm-up (``freeze_step`` optimizer steps): plain AdamW, with gradients reduced exactly as FSDP2 reduces them.
Then the variance is frozen and what travels is momentum, not gradient:

- every rank keeps a *local* momentum of its own unsharded gradients, ``m_r = b1 m_r + (1 - b1) g_r``,
  starting from zero at the freeze, and sends its signs with one scale per chunk (``SignSGD``), with
  worker-side error feedback (``ErrorFeedback``);
- each shard's owner decodes every rank's payload for its shard and averages them in rank order: by
  linearity the average of the local momenta is the momentum of the averaged gradients;
- the optimizer adds the AdamW momentum it held at the freeze, decayed by ``b1`` each step, and divides by
  the frozen variance: ``p -= lr * ((b1^k M_T + avg m) / (1 - b1^t)) / (sqrt(v_T / (1 - b2^T)) + eps)``.

Server-side error feedback is not needed: DeepSpeed compresses the averaged momentum a second time
because every worker must apply it to a full copy of the model; here the owner applies it to its own
shard, and FSDP2 all-gathers the updated parameters (exactly, or with ``param_all_gather``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from compress.error_feedback import ErrorFeedback
from compress.payload import Payload
from compress.quantize import SignSGD


class FreezePhase:
    """Where a 1-bit Adam run is, shared by its optimizer (which counts the steps it applied) and the hooks."""

    def __init__(self, freeze_step: int):
        self.freeze_step = freeze_step
        self.steps = 0  # optimizer steps applied (a step the non-finite guard skipped is not one)
        self.beta1: float | None = None  # the optimizer's, set when it is built

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen and the hooks send momentum signs."""
        return self.steps >= self.freeze_step


class OneBitMomentum:
    """The hooks' side: before the freeze, nothing (the communicators reduce exactly); after it, each chunk's
    local momentum, compressed to signs and a scale per ``chunk_size`` with error feedback.

    State per chunk ``key`` (a row of a unit's unsharded gradient): the local momentum and the residual, both
    kept in ``state_dtype`` between steps. ``second_stage()`` is the same compressor without the momentum,
    for HYBRID_SHARD's replicate all-reduce, whose input is already a shard of averaged momentum.
    """

    linear = False
    unbiased = False

    def __init__(self, chunk_size: int = 1024, freeze_step: int = 100, state_dtype: torch.dtype = torch.float32):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"onebit_adam: freeze_step={freeze_step!r} is not an integer >= 1 (AdamW steps before the freeze)")
        self.phase = FreezePhase(freeze_step)
        self.inner = ErrorFeedback(SignSGD(chunk_size), residual_dtype=state_dtype)
        self.state_dtype = state_dtype
        self.momenta: dict[str, torch.Tensor] = {}
        self.accumulates = True

    @property
    def compressing(self) -> bool:
        """False during the warm-up: the communicators then reduce the uncompressed gradients, as FSDP2 would."""
        return self.phase.frozen

    def second_stage(self) -> OneBitMomentum:
        """This compressor for a hook whose input is averaged momentum already: same phase, residuals and codec."""
        stage = object.__new__(OneBitMomentum)
        stage.__dict__.update(self.__dict__)
        stage.accumulates = False
        return stage

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        if self.accumulates:
            tensor = self._momentum(tensor, key)
        return self.inner.compress(tensor, key, seed)

    def _momentum(self, gradient: torch.Tensor, key: str) -> torch.Tensor:
        beta1 = self.phase.beta1
        if beta1 is None:
            raise RuntimeError("onebit_adam: the hooks ran before the optimizer was built; the strategy builds OneBitAdam")
        previous = self.momenta.get(key)
        momentum = gradient.float() * (1 - beta1)
        if previous is not None:
            momentum = momentum.add_(previous.float(), alpha=beta1)
        self.momenta[key] = momentum.to(self.state_dtype)
        return momentum

    def compared_with(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """What a sampled step compares the decoded payload with: the local momentum it encodes."""
        return self.momenta[key] if self.accumulates else tensor

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.inner.decompress(payload)

    @property
    def residual_norm(self) -> float:
        return self.inner.residual_norm

    @property
    def memory_bytes(self) -> int:
        """Residuals and local momenta, unsharded on every rank."""
        return self.inner.memory_bytes + sum(m.numel() * m.element_size() for m in self.momenta.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Local momenta and residuals (the phase is the optimizer's step count, in its own state)."""
        return {**self.inner.state_dict(), **{f"momentum/{key}": value for key, value in self.momenta.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(state)
        self.momenta = {k.removeprefix("momentum/"): v.to(self.state_dtype) for k, v in state.items()
                        if k.startswith("momentum/")}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class OneBitAdam(torch.optim.AdamW):
    """AdamW until ``phase.freeze_step`` steps, then Adam with the variance frozen on the momentum the hooks averaged.

    After the freeze a parameter's ``grad`` holds the averaged local momenta (what the hooks delivered), and
    the state's ``exp_avg`` the AdamW momentum of the freeze, decayed by ``b1`` every step. Gradient clipping
    then bounds the norm of that averaged momentum. The state has AdamW's keys and shapes, so sharded
    checkpoints save and load it as AdamW's; the phase is the number of steps in it.
    """

    def __init__(self, params: Iterable[Any], phase: FreezePhase, **adamw: Any):
        if adamw.get("amsgrad") or adamw.get("maximize"):
            raise ValueError("onebit_adam: amsgrad and maximize are not supported; leave them off")
        super().__init__(params, **adamw)
        beta1s = {group["betas"][0] for group in self.param_groups}
        if len(beta1s) != 1:
            raise ValueError(f"onebit_adam: every parameter group needs the same beta1 (the hooks' momentum), got {sorted(beta1s)}")
        self.phase = phase
        phase.beta1 = beta1s.pop()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        applied = any(p.grad is not None for group in self.param_groups for p in group["params"])
        if not self.phase.frozen:
            super().step()
        else:
            self._frozen_step()
        self.phase.steps += applied
        return loss

    def _frozen_step(self) -> None:
        freeze = self.phase.freeze_step
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
            lr = float(lr) if isinstance(lr, torch.Tensor) else lr
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                state["step"] += 1
                step = float(state["step"])
                carried = _local(state["exp_avg"]).mul_(beta1)
                momentum = carried + _local(param.grad)
                denominator = (_local(state["exp_avg_sq"]) / (1 - beta2 ** freeze)).sqrt_().add_(eps)
                weights = _local(param)
                if decay:
                    weights.mul_(1 - lr * decay)
                weights.addcdiv_(momentum, denominator, value=-lr / (1 - beta1 ** step))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.phase.steps = self.steps_in_state()

    def steps_in_state(self) -> int:
        """Steps applied, from the state (host tensors: no device read); 0 before the first step."""
        steps = [int(s["step"]) for s in self.state.values() if "step" in s]
        return max(steps, default=0)
