"""A trial: one candidate trained for a few steps as a real ``lit_fsdp fit`` subprocess, measured by the project's callbacks.

Each trial runs in ``OUT/trials/NN/`` with the user's configs and arguments, then ``candidate.yaml``
(the candidate as a config overlay), then the trial's own settings: ``warmup_steps + steps`` optimizer
steps; ``CommProfiler`` on the last warm-up step (its trace stays in ``profiler/``), ``Throughput``
over the steps after warm-up, ``Memory``, ``Quality`` (the loss of every step), ``OffloadStats`` under
SlideFSDP and ``Results``; then ``check_batches`` validation batches on the trained weights, whose loss
is compared with the default's. A crash, an out-of-memory or the deadline is recorded, never raised.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from lit_fsdp.commands.launch import launch
from lit_fsdp.commands.tune.hardware import Hardware
from lit_fsdp.commands.tune.memory import compute_dtype
from lit_fsdp.commands.tune.space import Candidate, RunShape

_OOM_SIGNS = ("out of memory", "outofmemoryerror", "can't allocate memory", "cannot allocate memory")
# Figures a trial keeps from its results record (callbacks.Results), by the same names.
FIGURES = ("tokens_per_s", "step_time_ms_p50", "step_time_ms_p90", "comm_ratio", "comm_exposed_ms", "compute_time_ms",
           "profiled_step_ms", "mfu", "offload_cpu_update_hidden_share", "offload_h2d_gbps", "offload_cpu_update_ms",
           "offload_cpu_update_hideable_share", "offload_device_backward_ms", "offload_device_idle_ms",
           "offload_update_wait_ms")


@dataclass
class TrialSchedule:
    """How long each trial trains and how it is measured."""

    steps: int = 5
    """optimizer steps measured per trial (after the warm-up)"""
    warmup_steps: int = 3
    """optimizer steps dropped before measuring (allocator, caches, compilation); the last one is profiled"""
    check_batches: int = 2
    """validation batches after the last step: their loss is compared with the default's (0: no check)"""
    timeout_s: float = 900.0
    """deadline of one trial in seconds; the run and its ranks are killed after it"""

    def check(self) -> None:
        if self.steps < 1 or self.warmup_steps < 2 or self.check_batches < 0 or self.timeout_s <= 0:
            raise ValueError(f"--tune.trial: steps >= 1, warmup_steps >= 2 (one is profiled), check_batches >= 0 and "
                             f"timeout_s > 0 are needed; got {self.steps}, {self.warmup_steps}, {self.check_batches}, {self.timeout_s}")

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps


@dataclass
class Trial:
    """A candidate's outcome: ``ok`` (measured), ``failed``, ``oom``, ``timeout``, or ``rejected`` before running."""

    candidate: Candidate
    source: str  # default, calibration, rules: <finding>, llm
    status: str
    index: int | None = None  # order of the runs; None for a rejected candidate
    error: str | None = None
    tokens_per_s: float | None = None
    step_time_ms_p50: float | None = None
    step_time_ms_p90: float | None = None
    comm_ratio: float | None = None
    comm_exposed_ms: float | None = None
    compute_time_ms: float | None = None
    profiled_step_ms: float | None = None
    mfu: float | None = None
    offload_cpu_update_hidden_share: float | None = None
    offload_h2d_gbps: float | None = None
    offload_cpu_update_ms: float | None = None
    offload_cpu_update_hideable_share: float | None = None  # the device's backward / the update, at most 1
    offload_device_backward_ms: float | None = None
    offload_device_idle_ms: float | None = None  # the device waiting inside the backward for a gradient buffer
    offload_update_wait_ms: float | None = None  # the host waiting at the optimizer step for the CPU update
    peak_gb: float | None = None  # GPU: peak reserved; CPU: peak RSS (rank 0)
    losses: list[float] = field(default_factory=list)  # training loss of each step
    check_loss: float | None = None
    estimate: dict[str, float] | None = None  # the memory filter's estimate by part, GB
    findings: list[dict[str, Any]] = field(default_factory=list)  # the judge's
    flags: list[str] = field(default_factory=list)  # why a trial that ran cannot be the best (numerics, over_memory)
    wall_s: float | None = None
    folder: str | None = None

    @property
    def eligible(self) -> bool:
        """Measured, and nothing the judge found rules it out."""
        return self.status == "ok" and not self.flags and self.tokens_per_s is not None

    def record(self) -> dict[str, Any]:
        """The line of ``trials.jsonl``."""
        return {"index": self.index, **{k: v for k, v in asdict(self).items() if k not in ("index", "candidate")},
                "knobs": self.candidate.knobs()}


class TrialRunner:
    """Runs candidates as ``lit_fsdp fit`` subprocesses in ``OUT/trials/NN`` and reads their figures."""

    def __init__(self, fit_args: Sequence[str], out: Path, cwd: Path, run: RunShape, schedule: TrialSchedule,
                 hardware: Hardware, base_compression: dict[str, Any] | None):
        self.fit_args, self.out, self.cwd = list(fit_args), out, cwd
        self.run, self.schedule, self.hardware, self.base_compression = run, schedule, hardware, base_compression

    def callbacks(self, candidate: Candidate, index: int) -> list[dict[str, Any]]:
        warmup = self.schedule.warmup_steps
        peak = self.hardware.peak_for(compute_dtype(candidate, self.run.accelerator))
        callbacks = [
            # First: its trace is written inside a warm-up step, before Throughput stamps that step's end.
            {"class_path": "callbacks.CommProfiler", "init_args": {"wait": warmup - 2, "warmup": 1, "active": 1, "repeat": 1}},
            {"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": warmup, "peak_tflops": peak}},
            {"class_path": "callbacks.Memory"},
            {"class_path": "callbacks.Quality"},
            {"class_path": "callbacks.Results", "init_args": {"run_name": f"trial-{index:02d}"}},
        ]
        if candidate.strategy == "slide_fsdp":
            callbacks.insert(3, {"class_path": "callbacks.OffloadStats", "init_args": {"warmup_steps": warmup}})
        return callbacks

    def arguments(self, candidate: Candidate, index: int, folder: Path) -> list[str]:
        """``fit`` arguments after the user's: the candidate's overlay, then the trial's length and measuring."""
        overlay = folder / "candidate.yaml"
        overlay.write_text(yaml.safe_dump(candidate.overlay(self.run, self.base_compression), sort_keys=False))
        steps = self.schedule.total_steps
        micro_batches = steps * self.run.batch_per_process // candidate.micro_batch  # validation counts micro-batches
        return [
            *self.fit_args, "--config", str(overlay),
            "--trainer.max_steps", str(steps), "--trainer.max_epochs", "-1",
            "--trainer.callbacks", json.dumps(self.callbacks(candidate, index)),
            "--trainer.limit_val_batches", str(self.schedule.check_batches),
            "--trainer.val_check_interval", str(micro_batches), "--trainer.check_val_every_n_epoch", "null",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_checkpointing", "false",
            "--trainer.log_every_n_steps", "1", "--trainer.enable_model_summary", "false",
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(folder),
        ]

    def __call__(self, candidate: Candidate, index: int, source: str, deadline_s: float) -> Trial:
        folder = self.out / "trials" / f"{index:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        outcome = launch([], self.arguments(candidate, index, folder), folder, timeout_s=deadline_s, cwd=self.cwd)
        trial = Trial(candidate, source, "ok", index=index, wall_s=outcome["wall_s"], folder=str(folder))
        if outcome["status"] != "ok":
            tail = "\n".join((folder / "stderr.log").read_text(errors="replace").splitlines()[-60:]).lower()
            trial.status = "timeout" if outcome["timed_out"] else "oom" if any(s in tail for s in _OOM_SIGNS) else "failed"
            trial.error = outcome["error"]
            return trial
        self.read_figures(trial, folder)
        return trial

    def read_figures(self, trial: Trial, folder: Path) -> None:
        """Fill ``trial`` from the run's ``results.jsonl`` and ``history.jsonl``."""
        results = folder / "results.jsonl"
        lines = results.read_text().splitlines() if results.is_file() else []
        record = json.loads(lines[-1]) if lines else {}
        for name in FIGURES:
            setattr(trial, name, record.get(name))
        peak = ("peak_reserved_gb", "peak_allocated_gb") if self.run.accelerator == "cuda" else ("peak_rss_gb",)
        trial.peak_gb = next((record[key] for key in peak if record.get(key) is not None), None)
        trial.check_loss = record.get("val_loss")
        history = folder / "history.jsonl"
        steps = [json.loads(line) for line in history.read_text().splitlines()] if history.is_file() else []
        trial.losses = [line["train_loss"] for line in steps if line.get("train_loss") is not None]
        if trial.tokens_per_s is None:
            trial.status, trial.error = "failed", f"no measured steps in {results} (did training run?)"
