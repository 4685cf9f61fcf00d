"""Ctrl-C and preemption during fit: a checkpoint at the step reached, the resume command as the last line, a non-zero
exit, and a resume that ends on the uninterrupted run's losses, under FSDP2 and under SlideFSDP with ``update: forward``.

The interrupted runs are real CLI processes, each in its own session, signalled at the end of step 3 of 6 by
``tests.probes.SignalGroupAtStep`` sending to its process group, as a terminal's Ctrl-C reaches the launcher and every
rank; they run side by side. The uninterrupted runs and the resumes (``--ckpt_path last``, as the last line says) run
in one 2-process spawn, one after another.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.fabric.plugins.environments import SLURMEnvironment

from callbacks import interrupt
from callbacks.run_summary import RESUME
from lit_fsdp import checkpoints
from lit_fsdp.commands import compare_runs
from offload.cpu_adam import EMULATED_UPDATE_DELAY_VARIABLE
from tests.distributed import in_process_cli, run
from tests.helpers import REPO, checkpoint_every, fit_arguments

STEPS, STOP = 6, 3
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--trainer.strategy.init_args.update", "forward",
         "--model.config_overrides", '{"n_layer": 4}']
# name: (the signal, the strategy's arguments, the uninterrupted run it must match)
CASES = {"sigint": ("SIGINT", [], "fsdp2"), "sigterm": ("SIGTERM", [], "fsdp2"),
         "slide_forward_sigterm": ("SIGTERM", SLIDE, "slide")}
REFERENCES = {"fsdp2": [], "slide": SLIDE}
NOT_RESUMABLE = "your dataloader is not resumable"
RESULTS = {"class_path": "callbacks.Results"}


def interrupted_arguments(folder: Path, signal_name: str, strategy: list[str]) -> list[str]:
    """A run of ``STEPS`` steps checkpointing every 100 (none before the signal), signalled after step ``STOP``."""
    signaller = {"class_path": "tests.probes.SignalGroupAtStep", "init_args": {"signal": signal_name, "step": STOP}}
    return fit_arguments(folder, *strategy, steps=STEPS, callbacks=[checkpoint_every(100, folder / "ckpt"), signaller,
                                                                    RESULTS])


def interrupt_all(root: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every case's interrupted run, side by side; SlideFSDP's host updates slowed (20 ms each), so that its save finds
    step 3's updates still running and must wait for them."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           EMULATED_UPDATE_DELAY_VARIABLE: "20"}
    started = {}
    for name, (signal_name, strategy, _) in CASES.items():
        command = [sys.executable, "-m", "lit_fsdp", *interrupted_arguments(root / name, signal_name, strategy)]
        started[name] = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, start_new_session=True)  # its own group, as a terminal gives it
    results = {}
    for name, process in started.items():
        try:
            out, err = process.communicate(timeout=600)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return results


def fit_recording_warnings(rank: int, world: int, runs: list[list[str]]) -> list[list[str]]:
    """Each of ``runs`` through the CLI in this rank, in order; the warnings each gave."""
    cli = in_process_cli(rank, world)
    said = []
    for arguments in runs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cli(arguments)
        said.append([str(warning.message) for warning in caught])
    return said


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("interrupt")
    results = interrupt_all(root)
    saved = {name: checkpoints.inspect(root / name / "ckpt" / "interrupted.ckpt") for name in CASES}
    fits = [fit_arguments(root / name, *strategy, steps=STEPS) for name, strategy in REFERENCES.items()]
    fits += [fit_arguments(root / name, *strategy, "--ckpt_path", "last", steps=STEPS,
                           callbacks=[checkpoint_every(100, root / name / "ckpt"), RESULTS])
             for name, (_, strategy, _) in CASES.items()]
    said = run(fit_recording_warnings, root, fits)[0]
    return {"root": root, "results": results, "saved": saved, "resume_warnings": dict(zip(CASES, said[len(REFERENCES):]))}


def losses(folder: Path, version: int = 0) -> dict[int, float]:
    with open(folder / "lightning_logs" / f"version_{version}" / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}


@pytest.mark.parametrize("name", CASES)
def test_a_signal_saves_the_step_reached_says_how_to_resume_and_exits_non_zero(runs, name):
    signal_name = CASES[name][0]
    result, saved = runs["results"][name], runs["saved"][name]
    assert result.returncode == 128 + getattr(signal, signal_name), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr[-3000:]
    assert saved.problem is None and saved.manifest["step"] == STOP and saved.manifest["world_size"] == 2
    last = result.stdout.strip().splitlines()[-1]
    assert last == f"stopped by {signal_name} after step {STOP}, saved as {saved.path.resolve()} ({RESUME})"


@pytest.mark.parametrize("name", CASES)
def test_the_resume_ends_on_the_uninterrupted_runs_losses_without_lightnings_not_resumable_warning(runs, name):
    folder, whole = runs["root"] / name, losses(runs["root"] / CASES[name][2])
    before, after = losses(folder, 0), losses(folder, 1)
    assert sorted(whole) == list(range(STEPS))
    assert before == {step: whole[step] for step in range(STOP)}
    assert after == {step: whole[step] for step in range(STOP, STEPS)}  # under SlideFSDP: step 3's updates were saved
    assert not [line for line in runs["resume_warnings"][name] if NOT_RESUMABLE in line]
    assert not (folder / "ckpt" / "interrupted.ckpt").exists()  # trained past it: the run's own checkpoints cover it


def test_under_slurm_the_requeue_signal_stops_the_run_too_and_rank_0_requeues_the_job(monkeypatch):
    """With Lightning's SLURMEnvironment (``auto_requeue``), its requeue signal is a stop signal, and after the save the
    job (an array job's task by its own id) is requeued with ``scontrol requeue``."""
    slurm = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=SLURMEnvironment(auto_requeue=True)),
                            precision="32-true")
    assert interrupt.stop_signals(slurm) == [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1]
    no_requeue = SimpleNamespace(strategy=SimpleNamespace(cluster_environment=SLURMEnvironment(auto_requeue=False)),
                                 precision="32-true")
    assert interrupt.stop_signals(no_requeue) == [signal.SIGINT, signal.SIGTERM]
    ran = []
    monkeypatch.setattr(interrupt.subprocess, "run", lambda command, **_: ran.append(command) or
                        subprocess.CompletedProcess(command, 0, "", ""))
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "12")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    interrupt.requeue_slurm_job()
    assert ran == [["scontrol", "requeue", "12_3"]]


def test_the_interrupted_run_is_recorded_as_such_and_its_resume_as_its_continuation(runs):
    """results.jsonl: the interrupted part (``status: interrupted``), then the resume naming it (``resumed_from``),
    which compare_runs joins into one run."""
    records = [json.loads(line) for line in (runs["root"] / "sigint" / "results.jsonl").read_text().splitlines()]
    assert [(r["status"], r["steps"]) for r in records] == [("interrupted", STOP), ("ok", STEPS)]
    assert records[1]["resumed_from"] == records[0]["run_name"] and records[0]["resumed_from"] is None
    joined, notes = compare_runs.join_resumes([{**r, "history": []} for r in records])
    assert [r["run_name"] for r in joined] == [records[1]["run_name"]] and len(notes) == 1
