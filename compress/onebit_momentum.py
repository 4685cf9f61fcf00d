"""1-bit Adam (Tang et al., 2021) and 0/1 Adam (Lu et al., 2023) on sharded FSDP2: their rounds and the hooks'
compressor (local momenta, signs). The hooks are in ``compress.onebit_communicator``, the optimizer in
``compress.onebit_adam``.

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

After the freeze each coordinate's ``m_r / d`` is clipped to ``[-bound, bound]`` before it is sent: Adam's own
step per coordinate stays near ``lr`` because ``v`` follows ``g^2``; with ``v`` frozen, a coordinate that was
quiet during the warm-up (an embedding row of a rare token) has a tiny ``d`` and, once its gradient arrives,
an unbounded ``m / d``, which the sign code then spreads over its whole chunk as the chunk's scale.

0/1 Adam (``ZeroOnePhase``) uses the same hooks and optimizer with three more kinds of round:

- before ``var_freeze_step`` the variance is updated on exponentially spaced *exact* rounds (``var_update_scaler``
  rounds at each interval, then the interval doubles): AdamW steps with FSDP2's own reduce-scatter, after which
  the local momenta restart and the new denominators are gathered (in bfloat16); in between, 1-bit rounds as
  above;
- after it, *local* rounds send nothing: each shard's owner applies its own local momentum and every rank
  adds ``s_t x_r`` (``s_t`` the step size ``lr / (1 - b1^t)``, ``x_r = m_r / d``) to an accumulator ``u_r``;
  every ``H`` rounds (``H`` doubles every ``local_step_scaler`` rounds up to ``local_step_clipper``) a *sync*
  round sends the signs of ``u_r / s_t`` with error feedback, and the owner replaces what it applied locally
  during the period by the average: the period moves each shard by the average of every rank's momenta, as if
  every round had been synchronised, up to the sign code's error.
  Local rounds need one owner per shard: with replicas (NO_SHARD on several processes, HYBRID_SHARD) each replica
  would apply its own momentum to the same shard, so there ``local_step_clipper`` must be 1.
"""

from __future__ import annotations

from typing import Iterable, Protocol

import torch

from compress.error_feedback import ErrorFeedback
from compress.payload import Payload
from compress.quantize import SignSGD


EXACT, ONEBIT, LOCAL, SYNC = "exact", "onebit", "local", "sync"  # the kinds of round (see the module docstring)


class PhaseOptimizer(Protocol):
    """What the hooks read from the optimizer built on their phase (``compress.onebit_adam.OneBitAdam``)."""

    beta1: float

    def step_size(self) -> float:
        """This step's ``lr / (1 - b1^t)``."""
        ...

    def denominator(self, param: torch.Tensor) -> torch.Tensor:
        """The frozen ``sqrt(v / (1 - b2^T)) + eps`` of ``param``'s local shard."""
        ...


class FreezePhase:
    """Where a 1-bit Adam run is, shared by its optimizer (which counts the steps it applied) and the hooks.

    Every optimizer step is one round: ``exact`` (AdamW, gradients reduced as FSDP2 reduces them) before
    ``freeze_step``, ``onebit`` (momentum signs over the frozen variance) from then on.
    """

    def __init__(self, freeze_step: int):
        _check_int("freeze_step", freeze_step, 1, "AdamW steps before the freeze")
        self.freeze_step = freeze_step
        self.steps = 0  # optimizer steps applied (a step the non-finite guard skipped is not one)
        self.optimizer: PhaseOptimizer | None = None  # set when it is built: its betas and frozen variance

    def kind(self, step: int) -> str:
        """The round of optimizer step ``step`` (0-based)."""
        return EXACT if step < self.freeze_step else ONEBIT

    @property
    def round(self) -> str:
        """This step's round."""
        return self.kind(self.steps)

    @property
    def frozen(self) -> bool:
        """Whether this step's round compresses (the variance is frozen until the next exact round, if any)."""
        return self.round != EXACT

    @property
    def warmup(self) -> int:
        """Rounds before the first compressed one: what the ratio after the warm-up leaves out."""
        return self.freeze_step

    @property
    def variance_updates(self) -> int:
        """Exact rounds before this step: the updates the variance has seen (its bias correction)."""
        return min(self.steps, self.freeze_step)

    @property
    def local_steps(self) -> bool:
        """Whether some rounds send nothing (owners apply their own momentum until the next sync)."""
        return False


class ZeroOnePhase(FreezePhase):
    """0/1 Adam's rounds: exact ones on an exponentially spaced schedule before ``var_freeze_step``, 1-bit ones in
    between; after it, local rounds and a sync round every ``H`` (``H`` doubles every ``local_step_scaler`` rounds, up
    to ``local_step_clipper``)."""

    def __init__(self, var_freeze_step: int, var_update_scaler: int, local_step_scaler: int, local_step_clipper: int):
        _check_int("var_update_scaler", var_update_scaler, 1, "variance updates at each interval before it doubles")
        _check_int("local_step_scaler", local_step_scaler, 1, "rounds at each local interval before it doubles")
        _check_int("local_step_clipper", local_step_clipper, 1, "the longest interval between syncs, in rounds")
        super().__init__(var_freeze_step)
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.variance_steps = set(self._variance_steps())
        self._syncs: set[int] = set()
        self._synced_to = var_freeze_step - 1  # the last step whose kind _syncs already decides

    def _variance_steps(self) -> Iterable[int]:
        step, interval, at_interval = 0, 1, 0
        while step < self.freeze_step:
            yield step
            at_interval += 1
            if at_interval == self.var_update_scaler:
                interval, at_interval = interval * 2, 0
            step += interval

    def local_interval(self, step: int) -> int:
        """Rounds per period that starts at ``step`` (after the variance freeze)."""
        doublings = (step - self.freeze_step) // self.local_step_scaler
        return min(self.local_step_clipper, 2 ** min(doublings, 62))

    def kind(self, step: int) -> str:
        if step < self.freeze_step:
            return EXACT if step in self.variance_steps else ONEBIT
        if not self.local_steps:  # every period one round long: a sync is a 1-bit round
            return ONEBIT
        while self._synced_to < step:  # periods end one after another: extend the sync steps as far as asked
            start = self._synced_to + 1
            self._synced_to = start + self.local_interval(start) - 1
            self._syncs.add(self._synced_to)
        return SYNC if step in self._syncs else LOCAL

    @property
    def warmup(self) -> int:
        return min(self.var_update_scaler, self.freeze_step)

    @property
    def variance_updates(self) -> int:
        return sum(1 for step in self.variance_steps if step < self.steps)

    @property
    def local_steps(self) -> bool:
        return self.local_step_clipper > 1


def _check_int(name: str, value: object, least: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"onebit_adam / zero_one_adam: {name}={value!r} is not an integer >= {least} ({what})")


class OneBitMomentum:
    """The hooks' side: in exact rounds, nothing (the communicators reduce exactly, and the local momenta restart);
    otherwise each chunk's local momentum over its denominators, clipped to ``bound``, compressed to signs and a
    scale per ``chunk_size`` with error feedback (in a sync round: the period's accumulated momentum).

    State per chunk ``key`` (a row of a unit's unsharded gradient): the local momentum, the residual and (0/1
    Adam) the period's accumulator, kept in ``state_dtype`` between steps, and the denominators
    (``denominators``, gathered by the hooks after each exact round and again after a resume, from the
    optimizer's state). ``second_stage()`` is the same compressor without the momentum, for HYBRID_SHARD's
    replicate all-reduce, whose input is already averaged preconditioned momentum.
    """

    linear = False
    unbiased = False

    def __init__(self, chunk_size: int = 128, freeze_step: int = 100, bound: float = 1.0,
                 state_dtype: torch.dtype = torch.float32, phase: FreezePhase | None = None):
        if not isinstance(bound, (int, float)) or isinstance(bound, bool) or bound < 0:
            raise ValueError(f"onebit_adam / zero_one_adam: bound={bound!r} is not a number >= 0 "
                             "(the largest momentum over its denominator sent per coordinate; 0 turns the clip off)")
        self.phase = phase if phase is not None else FreezePhase(freeze_step)
        self.inner = ErrorFeedback(SignSGD(chunk_size), residual_dtype=state_dtype)
        self.bound = float(bound)
        self.state_dtype = state_dtype
        self.momenta: dict[str, torch.Tensor] = {}
        self.accumulated: dict[str, torch.Tensor] = {}  # 0/1 Adam: sum of s_t * m / d since the last sync, per chunk
        self.denominators: dict[str, torch.Tensor] = {}
        # denominators travel once per exact round: in float32 for 1-bit Adam's one gather, bfloat16 for 0/1 Adam's many
        self.denominator_dtype = torch.bfloat16 if isinstance(self.phase, ZeroOnePhase) else torch.float32
        self.accumulates = True

    @property
    def compressing(self) -> bool:
        """False in exact rounds: the communicators then reduce the uncompressed gradients, as FSDP2 would."""
        return self.phase.frozen

    def second_stage(self) -> OneBitMomentum:
        """This compressor for a hook whose input is averaged momentum already: same phase, residuals and codec."""
        stage = object.__new__(OneBitMomentum)
        stage.__dict__.update(self.__dict__)
        stage.accumulates = False
        return stage

    def restart(self) -> None:
        """An exact round: the optimizer takes the momentum the rounds before delivered; local momenta start again
        from zero and the denominators change (the residuals still owe the model what they held)."""
        self.momenta.clear()
        self.denominators.clear()
        self.accumulated.clear()

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        if self.accumulates:
            tensor = self.advance(tensor, key)
        return self.inner.compress(tensor, key, seed)

    def advance(self, gradient: torch.Tensor, key: str) -> torch.Tensor:
        """The local momentum of chunk ``key`` after this gradient, over its denominators, clipped to ``bound``; in
        0/1 Adam's local and sync rounds also added, times the step size, to the period's accumulator."""
        previous = self.momenta.get(key)
        momentum = gradient.float() * (1 - self._beta1())
        if previous is not None:
            momentum = momentum.add_(previous.float(), alpha=self._beta1())
        self.momenta[key] = momentum.to(self.state_dtype)
        preconditioned = momentum / self.denominators[key].float()
        if self.bound:
            preconditioned = preconditioned.clamp_(-self.bound, self.bound)
        if self.phase.round in (LOCAL, SYNC):
            step_size = self.phase.optimizer.step_size()
            total = preconditioned * step_size
            if key in self.accumulated:
                total = total.add_(self.accumulated[key].float())
            self.accumulated[key] = total.to(self.state_dtype)
        return preconditioned

    def period(self, key: str, preconditioned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A sync round's input for chunk ``key`` (the period's accumulated momentum over this step's size) and what
        this rank applied locally before this step (in the same units), and the period starts again."""
        step_size = self.phase.optimizer.step_size()
        total = self.accumulated.pop(key).float() / step_size
        return total, total - preconditioned

    def _beta1(self) -> float:
        optimizer = self.phase.optimizer
        if optimizer is None:
            raise RuntimeError("onebit_adam: the hooks ran before the optimizer was built; the strategy builds OneBitAdam")
        return optimizer.beta1

    def compared_with(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """What a sampled step compares the decoded payload with: the preconditioned local momentum it encodes."""
        if not self.accumulates or self.phase.round == SYNC:
            return tensor
        preconditioned = self.momenta[key].float() / self.denominators[key].float()
        return preconditioned.clamp_(-self.bound, self.bound) if self.bound else preconditioned

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.inner.decompress(payload)

    @property
    def residual_norm(self) -> float:
        return self.inner.residual_norm

    @property
    def memory_bytes(self) -> int:
        """Residuals, local momenta, accumulators and denominators, unsharded on every rank."""
        held = [*self.momenta.values(), *self.accumulated.values(), *self.denominators.values()]
        return self.inner.memory_bytes + sum(t.numel() * t.element_size() for t in held)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Local momenta, accumulators and residuals (the phase is the optimizer's step count, in its own state)."""
        return {**self.inner.state_dict(), **{f"momentum/{key}": value for key, value in self.momenta.items()},
                **{f"accumulated/{key}": value for key, value in self.accumulated.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Residuals, local momenta and accumulators; the denominators follow from the optimizer's state, gathered again."""
        self.inner.load_state_dict(state)
        self.momenta = {k.removeprefix("momentum/"): v.to(self.state_dtype) for k, v in state.items()
                        if k.startswith("momentum/")}
        self.accumulated = {k.removeprefix("accumulated/"): v.to(self.state_dtype) for k, v in state.items()
                            if k.startswith("accumulated/")}
        self.denominators = {}


def zero_one_momentum(chunk_size: int = 128, var_freeze_step: int = 64, var_update_scaler: int = 1,
                      local_step_scaler: int = 25, local_step_clipper: int = 16, bound: float = 1.0,
                      state_dtype: torch.dtype = torch.float32) -> OneBitMomentum:
    """0/1 Adam's hooks: 1-bit Adam's, on ``ZeroOnePhase``'s rounds."""
    phase = ZeroOnePhase(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
    return OneBitMomentum(chunk_size, bound=bound, state_dtype=state_dtype, phase=phase)
