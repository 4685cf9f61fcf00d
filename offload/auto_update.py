"""``update: auto`` at run time: the split chosen again by the step-time model, fed this run's own rates.

When the model is placed, ``auto`` takes the largest split whose backup the host has room for (``offload.plan``) as
its ceiling, and runs ``forward`` (nothing speculated, no backup) until its first choice; each choice allocates the
backup of its own split alone (``offload.speculation.SpeculativeBackup.retarget``). The run measures what the model needs, per optimizer step: the device's forward
and backward as the host saw them (the forward's waits for updates left out), the CPU update's time (its backup
passes and rollbacks left out) and whether clipping or the non-finite guard fired. After ``FIRST_DECISION`` steps
(the first ``LEFT_OUT`` left out of the rates) and every ``DECISION_EVERY`` steps after, ``AutoUpdate.decide`` runs
``offload.step_time.ForwardOrder`` with the medians of those rates for ``forward`` (nothing speculated) and each
split up to the one allocated, its rollback counted at the clip rate the run has seen, and takes the fastest (among
equals the fewest blocks). Every rank takes global rank 0's choice. Each choice is exact, so a change between steps
changes no result, only which updates overlap what.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from offload.host_memory import UnitSize
from offload.step_time import ForwardOrder, forward_order

#: Steps observed before the first choice, and of those the first ones left out of the rates (allocation, first
#: touch of the host buffers, compilation)
FIRST_DECISION = 4
LEFT_OUT = 1
#: Steps between later choices (the clip rate moves as training goes on)
DECISION_EVERY = 50


@dataclass
class StepRates:
    """One optimizer step as the runtime model reads it, in seconds."""

    forward_s: float  # the host's forward of every micro-batch, its waits for updates left out
    backward_s: float  # the device's backward of every micro-batch
    update_s: float  # the CPU update, its backup passes and rollbacks left out
    clipped: bool  # clipping or the guard fired: a split's speculated units were (or would have been) redone


@dataclass
class AutoUpdate:
    """The run's choice of split (``split_blocks``; None: ``forward``) among ``forward`` and the splits up to the
    ``allocated`` one, by the step model fed the ``StepRates`` observed (see the module docstring)."""

    plan: Any  # offload.plan.SlidePlan, its split taken at placement
    units: Sequence[UnitSize]
    backup_share: float  # offload.step_time.backup_share
    clipping: bool  # clipping or the guard can fire at all
    steps: list[StepRates] = field(default_factory=list)
    reason: str = ""  # why the current choice, in words (the log line and results.jsonl)

    @property
    def allocated(self) -> int | None:
        return self.plan.split_blocks

    def observe(self, step: StepRates) -> bool:
        """Record one step; whether a choice is due after it."""
        self.steps.append(step)
        count = len(self.steps)
        return count == FIRST_DECISION or (count > FIRST_DECISION and (count - FIRST_DECISION) % DECISION_EVERY == 0)

    def clip_rate(self) -> float:
        """The share of the observed steps whose clipping or guard fired (0 where neither can)."""
        if not self.clipping or not self.steps:
            return 0.0
        return sum(step.clipped for step in self.steps) / len(self.steps)

    def rates(self) -> tuple[float, float, float]:
        """The medians of the forward, the backward and the update over the observed steps, the first left out."""
        measured = self.steps[LEFT_OUT:] or self.steps
        return (statistics.median(step.forward_s for step in measured),
                statistics.median(step.backward_s for step in measured),
                statistics.median(step.update_s for step in measured))

    def step_s(self, blocks: int | None) -> float:
        """The step's time by the model with the observed rates, ``blocks`` speculated (None: ``forward``)."""
        forward, backward, update = self.rates()
        order: ForwardOrder = forward_order(replace(self.plan, split_blocks=blocks), list(self.units), update,
                                            self.plan.window, self.backup_share, self.clip_rate())
        micro_batches = self.plan.run.accumulation
        return forward + backward + order.forward_wait_s(forward / micro_batches, backward / micro_batches)

    def decide(self) -> int | None:
        """The fastest of ``forward`` and the splits up to the allocated one (``reason`` says why)."""
        candidates = [None, *range((self.allocated if self.allocated is not None else -1) + 1)]
        times = {blocks: self.step_s(blocks) for blocks in candidates}
        chosen = min(candidates, key=lambda k: (round(times[k], 6), -1 if k is None else k))
        runner_up = min((k for k in candidates if k != chosen), key=lambda k: times[k], default=None)
        other = "" if len(candidates) < 2 else f" against {name(runner_up)}'s {times[runner_up]:.3f} s"
        forward, backward, update = self.rates()
        self.reason = (f"by the step model with this run's rates over steps {LEFT_OUT + 1}-{len(self.steps)} "
                       f"(forward {forward:.3f} s, backward {backward:.3f} s, CPU update {update:.3f} s, clip rate "
                       f"{self.clip_rate():.0%} of {len(self.steps)} steps): {times[chosen]:.3f} s a step{other}")
        return chosen


def name(blocks: int | None) -> str:
    """A choice in words: ``forward``, ``split of the head side`` or ``split of the head side and N blocks``."""
    if blocks is None:
        return "forward"
    return f"split of the head side and {blocks} block{'s' * (blocks != 1)}" if blocks else "split of the head side"
