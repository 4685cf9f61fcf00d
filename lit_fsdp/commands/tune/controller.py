"""The Controller: runs the search within its budget, one trial at a time, and never the same candidate twice.

It starts with the default (the configs as given: the reference for speed and losses) and, when the
default's micro-batch is not 1, the default at micro-batch 1 (without SlideFSDP's delayed update, which cannot
accumulate). The first measured trial calibrates the
memory filter, and the micro-batch-1 trial calibrates it again (its activations are the smallest, so
the constant is least confounded with them). Then, until the trial budget, the time budget or ``patience`` trials without a gain
end it, it takes the next proposal (the LLM adviser's first, if there is one, then the Coder's from
the Judge's findings on the best trial) and either rejects it without running, recorded with the
reason (outside the space, an invalid mesh or setting, over the memory filter), or runs it under a
deadline of ``min(trial timeout, time left)``. A new best clears the queue: the next proposals are
moves from it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from lit_fsdp.commands.tune.coder import Coder, Proposal
from lit_fsdp.commands.tune.judge import Evidence, Finding, judge
from lit_fsdp.commands.tune.llm import AdviserError, LLMAdviser
from lit_fsdp.commands.tune.memory import GIB, MemoryFilter
from lit_fsdp.commands.tune.space import Candidate, RunShape, outside
from lit_fsdp.commands.tune.trials import Trial

RunTrial = Callable[[Candidate, int, str, float], Trial]


@dataclass
class Budget:
    """When the search stops."""

    trials: int = 12
    time_s: float | None = None
    patience: int = 4  # trials in a row without a gain of min_gain
    min_gain: float = 0.02


@dataclass
class Search:
    """What the Controller works with, built once from the configs and the options."""

    default: Candidate
    allowed: dict[str, list]
    run: RunShape
    memory: MemoryFilter
    coder: Coder
    validate: Callable[[Candidate], str | None]  # the strategy's own checks: its constructor, mesh and preflight
    run_trial: RunTrial
    loss_tolerance: float
    trial_timeout_s: float
    facts: dict[str, Any] = field(default_factory=dict)  # hardware, model and run, for the LLM adviser


@dataclass
class SearchResult:
    trials: list[Trial]  # in the order considered, rejected candidates included
    best: Trial | None
    default: Trial | None
    stop_reason: str
    notes: list[str]


class Controller:
    """Keeps the budget, filters proposals and runs the trials."""

    def __init__(self, search: Search, budget: Budget, adviser: LLMAdviser | None = None,
                 on_trial: Callable[[Trial], None] = lambda trial: None, clock: Callable[[], float] = time.monotonic):
        self.search, self.budget, self.adviser, self.on_trial, self.clock = search, budget, adviser, on_trial, clock
        self.trials: list[Trial] = []
        self.notes: list[str] = []
        self.seen: set[str] = set()
        self.best: Trial | None = None
        self.default: Trial | None = None
        self.since_gain = 0
        self.start = clock()

    # --- budget ------------------------------------------------------------------------------------

    @property
    def ran(self) -> int:
        return sum(trial.index is not None for trial in self.trials)

    def time_left(self) -> float:
        return float("inf") if self.budget.time_s is None else self.budget.time_s - (self.clock() - self.start)

    def stop_reason(self) -> str | None:
        if self.ran >= self.budget.trials:
            return f"the trial budget ({self.budget.trials}) is spent"
        if self.time_left() <= 0:
            return f"the time budget ({self.budget.time_s:g} s) is spent"
        if self.since_gain >= self.budget.patience:
            return f"{self.since_gain} trials in a row without a {self.budget.min_gain:.0%} gain"
        return None

    # --- one proposal ------------------------------------------------------------------------------

    def record(self, trial: Trial) -> Trial:
        self.trials.append(trial)
        self.on_trial(trial)
        return trial

    def rejection(self, candidate: Candidate, measured_first: bool) -> str | None:
        """Why ``candidate`` is not run. The default and the calibration are the configs' own setting: they run
        whatever the space and the memory filter say, if the strategy itself accepts them."""
        if measured_first:
            return self.search.validate(candidate)
        reason = outside(candidate, self.search.allowed, self.search.run) or self.search.validate(candidate)
        if reason is None:
            memory = self.search.memory.rejection(candidate)
            reason = None if memory is None else f"memory filter: {memory}"
        return reason

    def consider(self, proposal: Proposal) -> Trial | None:
        """Reject or run ``proposal``; None when it was seen before."""
        candidate, source = proposal.candidate, proposal.reason
        if candidate.key() in self.seen:
            return None
        self.seen.add(candidate.key())
        memory = self.search.memory
        expected = memory.estimate(candidate)
        estimate = {**expected.parts_gb(), "analytic": round(expected.analytic / GIB, 4)}
        reason = self.rejection(candidate, measured_first=source in ("default", "calibration"))
        if reason is not None:
            return self.record(Trial(candidate, source, "rejected", error=reason, estimate=estimate))
        deadline = min(self.search.trial_timeout_s, self.time_left())
        trial = self.search.run_trial(candidate, self.ran + 1, source, deadline)
        trial.estimate = estimate
        self.calibrate(trial)
        judge(trial, Evidence(self.default, self.search.loss_tolerance, memory.memory_gb, memory.device_budget / GIB))
        if source == "default":
            self.default = trial
        self.update_best(trial)
        return self.record(trial)

    def calibrate(self, trial: Trial) -> None:
        """The first measured trial calibrates the memory filter; the configs' setting at micro-batch 1 does again."""
        memory = self.search.memory
        if trial.peak_gb is None or trial.status != "ok":
            return
        first_micro_batch_1 = trial.candidate.micro_batch == 1 and trial.source in ("default", "calibration")
        if first_micro_batch_1 or memory.calibrated_by is None:
            memory.calibrate(trial.candidate, trial.peak_gb, trial.index)

    def update_best(self, trial: Trial) -> None:
        """A new best needs ``min_gain`` over the last; other trials count towards ``patience`` (not the calibration)."""
        if trial.eligible and (self.best is None or trial.tokens_per_s > self.best.tokens_per_s * (1 + self.budget.min_gain)):
            self.best, self.since_gain = trial, 0
        elif trial.source != "calibration":
            self.since_gain += 1

    # --- proposals ---------------------------------------------------------------------------------

    def situation(self, base: Trial, findings: list[Finding]) -> dict[str, Any]:
        """What the LLM adviser is told: the facts, the space, the best trial, the judge's findings and the history."""
        history = [{"knobs": t.candidate.knobs(), "status": t.status, "tokens_per_s": t.tokens_per_s, "peak_gb": t.peak_gb,
                    "comm_ratio": t.comm_ratio, "flags": t.flags, "error": t.error} for t in self.trials]
        return {**self.search.facts, "search_space": self.search.allowed, "best": base.candidate.knobs(),
                "best_tokens_per_s": base.tokens_per_s, "diagnosis": [asdict(f) for f in findings], "history": history}

    def plan(self) -> list[Proposal]:
        """The adviser's proposals (if any), then the Coder's, all moves from the best trial (or the default), none seen before."""
        base = self.best or self.default
        if base is None:
            return []
        findings = [Finding(**f) for f in base.findings]
        proposals: list[Proposal] = []
        if self.adviser is not None:
            try:
                for knobs in self.adviser.propose(self.situation(base, findings)):
                    try:
                        proposals.append(Proposal(base.candidate.with_knobs(knobs), "llm"))
                    except (ValueError, TypeError) as error:
                        self.record(Trial(base.candidate, "llm", "rejected", error=f"llm proposed {knobs}: {error}"))
            except AdviserError as error:
                self.notes.append(f"LLM adviser after trial {self.ran}: {error}; the rules' proposals were used")
        return [p for p in proposals + self.search.coder.propose(findings, base.candidate) if p.candidate.key() not in self.seen]

    def run(self) -> SearchResult:
        default = self.search.default
        queue = deque([Proposal(default, "default")])
        if default.micro_batch != 1 and 1 in self.search.allowed["micro_batch"]:
            # a delayed update cannot accumulate; it changes the host's buffers only, not what is calibrated
            queue.append(Proposal(default.with_knobs({"micro_batch": 1, "update": "auto"}), "calibration"))
        try:
            while (stop := self.stop_reason()) is None:
                if not queue:
                    queue.extend(self.plan())
                    if not queue:
                        stop = "no untried candidate is left"
                        break
                best_before = self.best
                self.consider(queue.popleft())
                if self.best is not best_before:  # re-plan from the new best
                    queue = deque(p for p in queue if p.reason in ("default", "calibration"))
        except KeyboardInterrupt:  # the trial in flight was killed (launch does); what ran is still reported
            stop = "interrupted (Ctrl-C); the trial that was running is not recorded"
        if self.search.memory.calibrated_by is None:
            self.notes.append("the memory filter was not calibrated: no trial was measured")
        return SearchResult(self.trials, self.best, self.default, stop, self.notes)
