"""1-bit Adam (Tang et al., 2021) and 0/1 Adam (Lu et al., 2023) on sharded FSDP2: the hooks' half (local momenta,
signs) and the optimizer's half.

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

Server-side error feedback is not needed: DeepSpeed compresses the averaged momentum a second time
because every worker must apply it to a full copy of the model; here the owner applies it to its own
shard, and FSDP2 all-gathers the updated parameters (exactly, or with ``param_all_gather``).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from compress.communicator import CompressedAllReduce, CompressedReduceScatter, apply_op, compressing
from compress.error_feedback import ErrorFeedback
from compress.layout import UnitLayout
from compress.payload import Payload
from compress.quantize import SignSGD
from compress.torch_compat import all_gather_flat


EXACT, ONEBIT, LOCAL, SYNC = "exact", "onebit", "local", "sync"  # the kinds of round (see the module docstring)


class FreezePhase:
    """Where a 1-bit Adam run is, shared by its optimizer (which counts the steps it applied) and the hooks.

    Every optimizer step is one round: ``exact`` (AdamW, gradients reduced as FSDP2 reduces them) before
    ``freeze_step``, ``onebit`` (momentum signs over the frozen variance) from then on.
    """

    def __init__(self, freeze_step: int):
        _check_int("freeze_step", freeze_step, 1, "AdamW steps before the freeze")
        self.freeze_step = freeze_step
        self.steps = 0  # optimizer steps applied (a step the non-finite guard skipped is not one)
        self.optimizer: OneBitAdam | None = None  # set when it is built: its betas and frozen variance

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


class _Rounds:
    """What both 1-bit Adam hooks share: the unit's denominators after each exact round, 0/1 Adam's local rounds."""

    compressor: OneBitMomentum
    layout: UnitLayout
    mover: Any

    def shard_denominators(self, device: torch.device) -> torch.Tensor:
        """This rank's shard of the unit's denominators, in the reduce-scatter's layout (padding: 1)."""
        optimizer = self.compressor.phase.optimizer
        shard = torch.ones(self.layout.shard_numel, device=device)
        for place, view in zip(self.layout.places, self.layout.local_views(shard)):
            view.copy_(optimizer.denominator(place.param))
        return shard

    def local_round(self, rows: torch.Tensor, keys: list[str], mine: int) -> torch.Tensor:
        """A round that sends nothing: every row's momentum advances, this rank's own is what its shard gets."""
        preconditioned = self._advanced(rows, keys)
        return preconditioned[mine]

    def _advanced(self, rows: torch.Tensor, keys: list[str]) -> list[torch.Tensor]:
        """Every row's momentum after this round's gradient (over its denominators), counted as one call."""
        self.mover.stats.calls += 1
        self.mover.stats.numel += rows.numel()
        return [self.compressor.advance(row, key) for row, key in zip(rows, keys)]

    def sync_round(self, rows: torch.Tensor, keys: list[str], mine: int, seed: int) -> tuple[list[Payload], torch.Tensor]:
        """A sync round's payloads (each row's accumulated momentum) and what this rank's shard already received."""
        mover = self.mover
        preconditioned = self._advanced(rows, keys)
        periods = [self.compressor.period(key, value) for key, value in zip(keys, preconditioned)]
        totals = [total for total, _ in periods]
        with mover.timed("compress_s", rows.device):
            payloads = [self.compressor.inner.compress(total, key, seed + d) for d, (total, key) in enumerate(zip(totals, keys))]
        mover.stats.values_sent += rows.numel()
        mover.sample(payloads, totals, keys)
        return payloads, periods[mine][1]


class OneBitAdamReduceScatter(_Rounds, CompressedReduceScatter):
    """The reduce-scatter hook: after each exact round, all-gathers the unit's denominators (once), then as its
    parent; 0/1 Adam's local rounds send nothing and its sync rounds correct what the owner applied alone."""

    def __init__(self, compressor: OneBitMomentum, stats, name: str, layout: UnitLayout, restored=None):
        super().__init__(compressor, stats, name, restored)
        self.compressor, self.layout = compressor, layout

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        compressor, world, rank = self.compressor, group.size(), group.rank()
        keys = [f"{self.mover.name}/{d}" for d in range(world)]
        if not compressing(compressor):
            compressor.restart()
        elif keys[0] not in compressor.denominators:
            mine = self.shard_denominators(input_tensor.device).to(compressor.denominator_dtype)
            everyone = mine.new_empty(world * mine.numel())
            self.mover.collective(all_gather_flat, everyone, mine, group=group, extra=True)
            self.mover.stats.bytes_sent += (world - 1) * mine.numel() * mine.element_size()
            for key, row in zip(keys, everyone.view(world, -1)):
                compressor.denominators[key] = row.to(compressor.state_dtype)
        if compressor.phase.round not in (LOCAL, SYNC):
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        mover, stats = self.mover, self.mover.stats
        seed = mover.next_seed()
        rows = mover.screen(input_tensor.float()).view(world, -1)
        stats.bytes_raw += (world - 1) * rows.shape[1] * 4
        if compressor.phase.round == LOCAL:
            output_tensor.copy_(apply_op(self.local_round(rows, keys, rank) * world, op, world, prescaled=False))
            return None
        payloads, applied = self.sync_round(rows, keys, rank, seed)
        result = mover.decompress(self._all_to_all(payloads, [None] * world, group, rank), rows.device)
        output_tensor.copy_(apply_op(result, op, world, prescaled=False) - applied)
        return None


class OneBitAdamAllReduce(_Rounds, CompressedAllReduce):
    """The all-reduce hook where it is the gradients' first stage (NO_SHARD, one process): local denominators."""

    def __init__(self, compressor: OneBitMomentum, stats, name: str, group, layout: UnitLayout, restored=None):
        super().__init__(compressor, stats, name, group, restored)
        self.compressor, self.layout = compressor, layout

    def __call__(self, reduce_output: torch.Tensor) -> None:
        compressor, key = self.compressor, f"{self.mover.name}/ar"
        if not compressing(compressor):
            if compressor.accumulates:
                compressor.restart()
        elif compressor.accumulates and key not in compressor.denominators:
            compressor.denominators[key] = self.shard_denominators(reduce_output.device).to(compressor.state_dtype)
        if compressor.phase.round not in (LOCAL, SYNC) or not compressor.accumulates:
            return super().__call__(reduce_output)
        # one process (local rounds are refused where replicas share a shard): nothing to send either way
        flat = self.mover.screen(reduce_output.float()).view(1, -1)
        seed = self.mover.next_seed()
        if compressor.phase.round == LOCAL:
            reduce_output.copy_(self.local_round(flat, [key], 0).view_as(reduce_output))
            return None
        payloads, applied = self.sync_round(flat, [key], 0, seed)
        result = self.mover.decompress(payloads, flat.device) - applied
        reduce_output.copy_(result.view_as(reduce_output))
        return None


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
