"""1-bit Adam (Tang et al., 2021) on sharded FSDP2: the hooks' half (local momenta, signs) and the optimizer's half.

Warm-up (``freeze_step`` optimizer steps): plain AdamW, with gradients reduced exactly as FSDP2 reduces them.
Then the variance is frozen and what travels is preconditioned momentum, not gradient:

- at the freeze each unit's frozen denominators ``d = sqrt(v / (1 - b2^T)) + eps`` are all-gathered once,
  so that every rank holds them for the unit's whole unsharded gradient;
- every rank keeps a *local* momentum of its own unsharded gradients, ``m_r = b1 m_r + (1 - b1) g_r``,
  starting from zero at the freeze, and sends the signs of ``m_r / d`` with one scale per chunk
  (``SignSGD``), with worker-side error feedback (``ErrorFeedback``). Divided by ``d``, the coordinates of a
  chunk share one scale; the signs of ``m_r`` itself would give a coordinate whose ``v`` is small the
  chunk's magnitude, and the division after decoding would turn that into a large step;
- each shard's owner decodes every rank's payload for its shard and averages them in rank order: by
  linearity the average of the local momenta is the momentum of the averaged gradients;
- the optimizer adds the AdamW momentum it held at the freeze, decayed by ``b1`` each step, over ``d``:
  ``p -= lr * (b1^k M_T / d + avg(m / d)) / (1 - b1^t)``.

Server-side error feedback is not needed: DeepSpeed compresses the averaged momentum a second time
because every worker must apply it to a full copy of the model; here the owner applies it to its own
shard, and FSDP2 all-gathers the updated parameters (exactly, or with ``param_all_gather``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from compress.communicator import CompressedAllReduce, CompressedReduceScatter, compressing
from compress.error_feedback import ErrorFeedback
from compress.layout import UnitLayout
from compress.payload import Payload
from compress.quantize import SignSGD
from compress.torch_compat import all_gather_flat


class FreezePhase:
    """Where a 1-bit Adam run is, shared by its optimizer (which counts the steps it applied) and the hooks."""

    def __init__(self, freeze_step: int):
        self.freeze_step = freeze_step
        self.steps = 0  # optimizer steps applied (a step the non-finite guard skipped is not one)
        self.optimizer: OneBitAdam | None = None  # set when it is built: its betas and frozen variance

    @property
    def frozen(self) -> bool:
        """Whether the variance is frozen and the hooks send momentum signs."""
        return self.steps >= self.freeze_step


class OneBitMomentum:
    """The hooks' side: before the freeze, nothing (the communicators reduce exactly); after it, each chunk's
    local momentum over its frozen denominators, compressed to signs and a scale per ``chunk_size`` with error
    feedback.

    State per chunk ``key`` (a row of a unit's unsharded gradient): the local momentum and the residual, kept
    in ``state_dtype`` between steps, and the denominators (``denominators``, set by the hooks at the freeze
    and again after a resume, from the optimizer's state). ``second_stage()`` is the same compressor without
    the momentum, for HYBRID_SHARD's replicate all-reduce, whose input is already averaged preconditioned momentum.
    """

    linear = False
    unbiased = False

    def __init__(self, chunk_size: int = 128, freeze_step: int = 100, state_dtype: torch.dtype = torch.float32):
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"onebit_adam: freeze_step={freeze_step!r} is not an integer >= 1 (AdamW steps before the freeze)")
        self.phase = FreezePhase(freeze_step)
        self.inner = ErrorFeedback(SignSGD(chunk_size), residual_dtype=state_dtype)
        self.state_dtype = state_dtype
        self.momenta: dict[str, torch.Tensor] = {}
        self.denominators: dict[str, torch.Tensor] = {}
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
            tensor = self._preconditioned(tensor, key)
        return self.inner.compress(tensor, key, seed)

    def _preconditioned(self, gradient: torch.Tensor, key: str) -> torch.Tensor:
        """The local momentum of chunk ``key`` after this gradient, over its frozen denominators."""
        previous = self.momenta.get(key)
        beta1 = self.phase.optimizer.beta1 if self.phase.optimizer is not None else None
        if beta1 is None:
            raise RuntimeError("onebit_adam: the hooks ran before the optimizer was built; the strategy builds OneBitAdam")
        momentum = gradient.float() * (1 - beta1)
        if previous is not None:
            momentum = momentum.add_(previous.float(), alpha=beta1)
        self.momenta[key] = momentum.to(self.state_dtype)
        return momentum / self.denominators[key].float()

    def compared_with(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """What a sampled step compares the decoded payload with: the preconditioned local momentum it encodes."""
        if not self.accumulates:
            return tensor
        return self.momenta[key].float() / self.denominators[key].float()

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.inner.decompress(payload)

    @property
    def residual_norm(self) -> float:
        return self.inner.residual_norm

    @property
    def memory_bytes(self) -> int:
        """Residuals, local momenta and frozen denominators, unsharded on every rank."""
        held = [*self.momenta.values(), *self.denominators.values()]
        return self.inner.memory_bytes + sum(t.numel() * t.element_size() for t in held)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Local momenta and residuals (the phase is the optimizer's step count, in its own state)."""
        return {**self.inner.state_dict(), **{f"momentum/{key}": value for key, value in self.momenta.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Residuals and local momenta; the denominators follow from the optimizer's state, gathered again."""
        self.inner.load_state_dict(state)
        self.momenta = {k.removeprefix("momentum/"): v.to(self.state_dtype) for k, v in state.items()
                        if k.startswith("momentum/")}
        self.denominators = {}


class _Denominators:
    """What both 1-bit Adam hooks do at their first call after the freeze: hold the unit's frozen denominators."""

    compressor: OneBitMomentum
    layout: UnitLayout

    def shard_denominators(self, device: torch.device) -> torch.Tensor:
        """This rank's shard of the unit's denominators, in the reduce-scatter's layout (padding: 1)."""
        optimizer = self.compressor.phase.optimizer
        shard = torch.ones(self.layout.shard_numel, device=device)
        for place, view in zip(self.layout.places, self.layout.local_views(shard)):
            view.copy_(optimizer.denominator(place.param))
        return shard


class OneBitAdamReduceScatter(_Denominators, CompressedReduceScatter):
    """The reduce-scatter hook: at the freeze, all-gathers the unit's denominators (once), then as its parent."""

    def __init__(self, compressor: OneBitMomentum, stats, name: str, layout: UnitLayout, restored=None):
        super().__init__(compressor, stats, name, restored)
        self.compressor, self.layout = compressor, layout

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        keys = [f"{self.mover.name}/{d}" for d in range(group.size())]
        if compressing(self.compressor) and keys[0] not in self.compressor.denominators:
            mine = self.shard_denominators(input_tensor.device)
            everyone = mine.new_empty(group.size() * mine.numel())
            self.mover.collective(all_gather_flat, everyone, mine, group=group, extra=True)
            self.mover.stats.bytes_sent += (group.size() - 1) * mine.numel() * mine.element_size()
            for key, row in zip(keys, everyone.view(group.size(), -1)):
                self.compressor.denominators[key] = row.to(self.compressor.state_dtype)
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


class OneBitAdamAllReduce(_Denominators, CompressedAllReduce):
    """The all-reduce hook where it is the gradients' first stage (NO_SHARD, one process): local denominators."""

    def __init__(self, compressor: OneBitMomentum, stats, name: str, group, layout: UnitLayout, restored=None):
        super().__init__(compressor, stats, name, group, restored)
        self.compressor, self.layout = compressor, layout

    def __call__(self, reduce_output: torch.Tensor) -> None:
        key = f"{self.mover.name}/ar"
        if compressing(self.compressor) and self.compressor.accumulates and key not in self.compressor.denominators:
            self.compressor.denominators[key] = self.shard_denominators(reduce_output.device).to(self.compressor.state_dtype)
        super().__call__(reduce_output)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class OneBitAdam(torch.optim.AdamW):
    """AdamW until ``phase.freeze_step`` steps, then Adam with the variance frozen on the momentum the hooks averaged.

    After the freeze a parameter's ``grad`` holds the average of the local momenta over the frozen
    denominators (what the hooks delivered), and the state's ``exp_avg`` the AdamW momentum of the freeze,
    decayed by ``b1`` every step. Gradient clipping stops at the freeze (``clipping_applies``): ``grad`` is then
    an update direction already divided by ``sqrt(v)``, whose norm grows with the parameter count. The state has AdamW's keys and shapes, so sharded
    checkpoints save and load it as AdamW's; the phase is the number of steps in it.
    """

    def __init__(self, params: Iterable[Any], phase: FreezePhase, **adamw: Any):
        if adamw.get("amsgrad") or adamw.get("maximize"):
            raise ValueError("onebit_adam: amsgrad and maximize are not supported; leave them off")
        super().__init__(params, **adamw)
        beta1s = {group["betas"][0] for group in self.param_groups}
        if len(beta1s) != 1:
            raise ValueError(f"onebit_adam: every parameter group needs the same beta1 (the hooks' momentum), got {sorted(beta1s)}")
        self.beta1 = beta1s.pop()
        self.phase = phase
        phase.optimizer = self
        self._groups = {param: group for group in self.param_groups for param in group["params"]}

    @property
    def clipping_applies(self) -> bool:
        """Whether the strategy's gradient clipping applies to this step (before the freeze only)."""
        return not self.phase.frozen

    def denominator(self, param: torch.Tensor) -> torch.Tensor:
        """The frozen ``sqrt(v / (1 - b2^T)) + eps`` of ``param``'s local shard (float32)."""
        group = self._groups[param]
        bias = 1 - group["betas"][1] ** self.phase.freeze_step
        return (_local(self.state[param]["exp_avg_sq"]).float() / bias).sqrt_().add_(group["eps"])

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
                direction = (carried / self.denominator(param)).add_(_local(param.grad))  # the grad: avg(m / d)
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
