"""The Judge: rules that name what limits a trial, from its measured figures, most pressing first.

Each rule reads one kind of evidence and returns a ``Finding`` or nothing:

- ``failure``: the run crashed or hit its deadline;
- ``memory_pressure``: out of memory, a measured peak over the memory a process has (the trial is
  flagged: it would not run on the hardware described), or inside the memory filter's margin;
- ``numerics``: the validation loss after the trial's steps, or (at the default's micro-batch) the
  training loss of a step, differs from the default's beyond the tolerance, or a loss is not finite
  (a lossy compressor, a too-narrow dtype): the trial is flagged and cannot be the best;
- ``cpu_update``: SlideFSDP's CPU AdamW update gates the device: the device waits for it (idle inside the
  backward for a gradient buffer, or the optimizer step waiting for the update) 10% of the step or more, or
  under half of it is hidden behind the device's compute;
- ``communication``: collectives not overlapped with compute take a sizeable share of the step;
- ``host_overhead``: the step has time with neither compute nor communication (Python, kernel
  launches, data loading): on a CPU, the share of the step outside any ATen op;
- ``memory_headroom``: the peak uses under half the memory: room for bigger micro-batches, less
  checkpointing or less sharding;
- ``compute``: the compute share of the step and MFU (when the device's peak is known); last, as what
  remains when nothing above limits the step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

from lit_fsdp.commands.tune.trials import Trial

EXPOSED_COMM_SHARE = 0.10
IDLE_SHARE = 0.25
HEADROOM = 0.50
HIDDEN_UPDATE_SHARE = 0.50
EXPOSED_UPDATE_SHARE = 0.10  # of the step: a device waiting longer for the CPU update is gated by it


@dataclass(frozen=True)
class Finding:
    """One bottleneck the judge names, with the figures that show it."""

    kind: str
    evidence: str
    disqualifies: bool = False  # the trial ran but must not be the best (numerics, over the memory it has)


@dataclass(frozen=True)
class Evidence:
    """What the rules compare a trial with."""

    reference: Trial | None  # the default's trial: its losses after the same steps on the same data
    loss_tolerance: float  # relative
    memory_gb: float  # the device memory one process has
    budget_gb: float  # that, less the memory filter's margin


def _failure(trial: Trial, evidence: Evidence) -> Finding | None:
    if trial.status in ("failed", "timeout"):
        return Finding("failure", f"{trial.status}: {trial.error}")
    return None


def _memory_pressure(trial: Trial, evidence: Evidence) -> Finding | None:
    if trial.status == "oom":
        return Finding("memory_pressure", f"out of memory: {trial.error}")
    if trial.peak_gb is None:
        return None
    if trial.peak_gb > evidence.memory_gb:
        return Finding("memory_pressure", f"peak {trial.peak_gb:.2f} GB is over the {evidence.memory_gb:.2f} GB a process has",
                       disqualifies=True)
    if trial.peak_gb > evidence.budget_gb:
        return Finding("memory_pressure", f"peak {trial.peak_gb:.2f} GB is inside the margin the memory filter keeps "
                                          f"(budget {evidence.budget_gb:.2f} of {evidence.memory_gb:.2f} GB)")
    return None


def _numerics(trial: Trial, evidence: Evidence) -> Finding | None:
    losses = [*trial.losses, *([trial.check_loss] if trial.check_loss is not None else [])]
    if any(not math.isfinite(loss) for loss in losses):
        return Finding("numerics", "a loss is not finite", disqualifies=True)
    reference = evidence.reference
    if reference is None or reference is trial:
        return None
    pairs = []  # (what, the trial's loss, the default's)
    if trial.check_loss is not None and reference.check_loss is not None:
        pairs.append(("validation loss after the trial", trial.check_loss, reference.check_loss))
    if trial.candidate.micro_batch == reference.candidate.micro_batch:  # the logged loss is the last micro-batch's
        pairs += [(f"training loss of step {step}", mine, theirs)
                  for step, (mine, theirs) in enumerate(zip(trial.losses, reference.losses), 1)]
    if not pairs:
        return None
    what, loss, default = max(pairs, key=lambda pair: abs(pair[1] - pair[2]) / abs(pair[2]))
    change = abs(loss - default) / abs(default)
    if change > evidence.loss_tolerance:
        return Finding("numerics", f"{what} {loss:.4f} vs the default's {default:.4f} "
                                   f"({change:.1%} > {evidence.loss_tolerance:.1%} tolerance)", disqualifies=True)
    return None


def _cpu_update(trial: Trial, evidence: Evidence) -> Finding | None:
    if trial.candidate.strategy != "slide_fsdp" or trial.offload_cpu_update_ms is None:
        return None
    hidden, step = trial.offload_cpu_update_hidden_share, trial.step_time_ms_p50
    idle, wait = trial.offload_device_idle_ms or 0.0, trial.offload_update_wait_ms or 0.0
    waiting = idle + wait
    exposed = bool(step) and waiting / step >= EXPOSED_UPDATE_SHARE
    if not exposed and (hidden is None or hidden >= HIDDEN_UPDATE_SHARE):
        return None
    shares = f"{hidden:.0%} of it hidden" if hidden is not None else "its hidden share unknown"
    if trial.offload_cpu_update_hideable_share is not None:
        shares += f", at most {trial.offload_cpu_update_hideable_share:.0%} hideable under the device's backward"
    waits = (f"; the device waits for it {waiting:.0f} ms of the {step:.0f} ms step ({waiting / step:.0%}: idle in the "
             f"backward {idle:.0f} ms, at the optimizer step {wait:.0f} ms)" if step else "")
    return Finding("cpu_update", f"the CPU AdamW update ({trial.offload_cpu_update_ms:.0f} ms, {shares}) gates the "
                                 f"device{waits}")


def _communication(trial: Trial, evidence: Evidence) -> Finding | None:
    step, exposed = trial.profiled_step_ms, trial.comm_exposed_ms
    if not step or exposed is None or exposed / step < EXPOSED_COMM_SHARE:
        return None
    return Finding("communication", f"{exposed:.1f} ms of communication not hidden behind compute: "
                                    f"{exposed / step:.0%} of the profiled step (all collectives: {trial.comm_ratio or 0:.0%})")


def _host_overhead(trial: Trial, evidence: Evidence) -> Finding | None:
    step, compute = trial.profiled_step_ms, trial.compute_time_ms
    if not step or compute is None:
        return None
    idle = 1 - (compute + (trial.comm_exposed_ms or 0.0)) / step
    if idle < IDLE_SHARE:
        return None
    return Finding("host_overhead", f"{idle:.0%} of the profiled step runs neither compute nor communication "
                                    "(Python, launches, data loading)")


def _memory_headroom(trial: Trial, evidence: Evidence) -> Finding | None:
    if trial.peak_gb is None or trial.peak_gb >= HEADROOM * evidence.memory_gb:
        return None
    return Finding("memory_headroom", f"peak {trial.peak_gb:.2f} GB uses {trial.peak_gb / evidence.memory_gb:.0%} of the "
                                      f"{evidence.memory_gb:.2f} GB a process has")


def _compute(trial: Trial, evidence: Evidence) -> Finding | None:
    if trial.status != "ok":
        return None
    mfu = f"MFU {trial.mfu:.0%}" if trial.mfu is not None else "MFU unknown (no peak for this device)"
    share = f", compute {trial.compute_time_ms / trial.profiled_step_ms:.0%} of the step" if trial.compute_time_ms and trial.profiled_step_ms else ""
    return Finding("compute", f"{mfu}{share}")


RULES: list[Callable[[Trial, Evidence], Finding | None]] = [
    _failure, _memory_pressure, _numerics, _cpu_update, _communication, _host_overhead, _memory_headroom, _compute,
]


def judge(trial: Trial, evidence: Evidence) -> list[Finding]:
    """Every finding for ``trial``, most pressing first; also sets its ``findings`` and ``flags``."""
    findings = [finding for rule in RULES if (finding := rule(trial, evidence)) is not None]
    trial.findings = [asdict(finding) for finding in findings]
    trial.flags = [finding.kind for finding in findings if finding.disqualifies]
    return findings
