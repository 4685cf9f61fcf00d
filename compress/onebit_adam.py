"""1-bit Adam's and 0/1 Adam's optimizer: the half of the method that applies what the hooks delivered.

Warm-up (and 0/1 Adam's exact rounds): AdamW. Compressed rounds: the AdamW momentum held at the last exact round,
decayed by ``b1`` each step, over the frozen denominators ``d``, plus the average of the local momenta over ``d``
that the hooks (``compress.onebit_communicator``) delivered as the gradient:
``p -= lr * (b1^k M_T / d + avg(m / d)) / (1 - b1^t)``. The rounds are described in ``compress.onebit_momentum``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from compress.onebit_momentum import EXACT, FreezePhase, ZeroOnePhase


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class OneBitAdam(torch.optim.AdamW):
    """AdamW in exact rounds; in the others, Adam with the variance frozen on the momentum the hooks delivered.

    In a compressed round a parameter's ``grad`` holds the average of the local momenta over the denominators
    (what the hooks delivered; in 0/1 Adam's local rounds the owner's own, in its sync rounds the period's
    average less what the owner applied alone), and the state's ``exp_avg`` the AdamW momentum of the last exact
    round, decayed by ``b1`` every step. Where an exact round follows a compressed one (0/1 Adam), the momentum the
    hooks delivered in the compressed one is folded into ``exp_avg`` there, for the AdamW step next: kept aside until
    then, it would be a state key that a fresh optimizer lacks, and sharded checkpoints load only the keys a fresh
    optimizer has (a resumed run lost it). Gradient
    clipping applies in exact rounds only (``clipping_applies``): ``grad`` is otherwise an update direction
    already divided by ``sqrt(v)``, whose norm grows with the parameter count; the hooks clip each coordinate to
    ``bound`` instead. Sharded checkpoints save and load the state as AdamW's; the phase is the number of steps in it.
    """

    def __init__(self, params: Iterable[Any], phase: FreezePhase, **adamw: Any):
        if adamw.get("amsgrad") or adamw.get("maximize"):
            raise ValueError("onebit_adam: amsgrad and maximize are not supported; leave them off")
        super().__init__(params, **adamw)
        beta1s = {group["betas"][0] for group in self.param_groups}
        if len(beta1s) != 1:
            raise ValueError(f"onebit_adam: every parameter group needs the same beta1 (the hooks' momentum), got {sorted(beta1s)}")
        if phase.local_steps and len({float(group["lr"]) for group in self.param_groups}) != 1:
            raise ValueError("zero_one_adam: local rounds weigh momenta by the step size, so every parameter group needs "
                             "the same learning rate; set local_step_clipper 1 or give the groups one lr")
        self.beta1 = beta1s.pop()
        self.phase = phase
        phase.optimizer = self
        self._groups = {param: group for group in self.param_groups for param in group["params"]}

    @property
    def clipping_applies(self) -> bool:
        """Whether the strategy's gradient clipping applies to this step (exact rounds only)."""
        return not self.phase.frozen

    def step_size(self) -> float:
        """This step's ``lr / (1 - b1^t)``, ``t`` the step it is about to take (every group has the same lr)."""
        lr = self.param_groups[0]["lr"]
        return float(lr) / (1 - self.beta1 ** (self.phase.steps + 1))

    def denominator(self, param: torch.Tensor, updates: int | None = None) -> torch.Tensor:
        """The frozen ``sqrt(v / (1 - b2^T)) + eps`` of ``param``'s local shard (float32), ``T`` the ``updates`` ``v``
        has seen (default: the exact rounds before this step)."""
        group = self._groups[param]
        updates = self.phase.variance_updates if updates is None else updates
        bias = 1 - group["betas"][1] ** updates
        return (_local(self.state[param]["exp_avg_sq"]).float() / bias).sqrt_().add_(group["eps"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        applied = any(p.grad is not None for group in self.param_groups for p in group["params"])
        if not self.phase.frozen:
            self._exact_step()
        else:
            self._frozen_step()
        self.phase.steps += applied
        return loss

    def _exact_step(self) -> None:
        """AdamW, on the momentum that includes what the compressed rounds since the last exact one delivered (folded
        in by ``_frozen_step``)."""
        if not isinstance(self.phase, ZeroOnePhase) or self.phase.steps < self.phase.warmup:
            super().step()  # 1-bit Adam's warm-up and 0/1 Adam's first rounds: AdamW itself, bit for bit
            return
        updates = self.phase.variance_updates
        for group in self.param_groups:
            (beta1, beta2), lr, decay = group["betas"], float(group["lr"]), group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                exp_avg, exp_avg_sq, gradient = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(param.grad)
                state["step"] += 1
                exp_avg.mul_(beta1).add_(gradient, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
                weights = _local(param)
                if decay:
                    weights.mul_(1 - lr * decay)
                step_size = lr / (1 - beta1 ** (self.phase.steps + 1))
                weights.addcdiv_(exp_avg, self.denominator(param, updates + 1), value=-step_size)

    def _frozen_step(self) -> None:
        keep = isinstance(self.phase, ZeroOnePhase) and self.phase.kind(self.phase.steps + 1) == EXACT
        for group in self.param_groups:
            beta1 = group["betas"][0]
            lr, decay = group["lr"], group["weight_decay"]
            lr = float(lr) if isinstance(lr, torch.Tensor) else lr
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                state["step"] += 1
                step = float(state["step"])
                carried = _local(state["exp_avg"]).mul_(beta1)
                denominator = self.denominator(param)
                direction = (carried / denominator).add_(_local(param.grad))  # the grad: avg(m / d)
                if keep:  # an exact round follows: its AdamW momentum includes the momentum delivered now
                    carried.add_(_local(param.grad).float() * denominator)
                weights = _local(param)
                if decay:
                    weights.mul_(1 - lr * decay)
                weights.add_(direction, alpha=-lr / (1 - beta1 ** step))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.phase.steps = self.steps_in_state()

    def steps_in_state(self) -> int:
        """Steps applied, from the state (host tensors: no device read); 0 before the first step."""
        steps = [int(s["step"]) for s in self.state.values() if "step" in s]
        return max(steps, default=0)
