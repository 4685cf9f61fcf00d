"""How the GPU check's steps run things and keep what they measured: a step's record, a command in the checkout, and
one ``python -m lit_fsdp fit`` run measured in steady state with ``estimate``'s figures beside it.

Every step runs in a process of its own (``scripts/gpu_check.py``'s runner); this module is what that process uses.
Nothing here imports torch or the project at module level: a step's process puts the checkout on ``sys.path`` first
(the GPU machine runs it uninstalled), and the runner's ``--help`` and argument errors need neither.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator, Sequence

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
#: Optimizer steps left out of every rate by default: allocation and first touch, and the delayed update's first step,
#: which has no update to overlap.
WARMUP_STEPS = 2
WARMUP_VARIABLE = "GPU_CHECK_WARMUP_STEPS"  # --warmup-steps, handed to the steps' processes
HOST_MEMORY_VARIABLE = "GPU_CHECK_HOST_MEMORY_GB"  # --host-memory-gb, handed to the steps' processes


class Record(dict):
    """A step's record, written to ``<work>/<step>.json`` after every update so a killed step still reports."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def put(self, **values: Any) -> None:
        self.update(values)
        self.path.write_text(json.dumps(self, indent=1, default=str))


def meminfo() -> dict[str, float]:
    """The host's memory from ``/proc/meminfo`` in GiB: total, available, free, and the huge page size."""
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable", "MemFree", "Hugepagesize"):
            values[f"{key}_gib"] = round(int(rest.split()[0]) * 1024 / GIB, 2)
    return values


def environment() -> dict[str, str]:
    """The children's environment: the checkout importable (scripts run as files; the project need not be installed)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def command(name: str, argv: list[str], work: Path, record: Record) -> list[str]:
    """Run ``argv`` in the checkout, its output streamed to a file (a command that hangs still shows where) and
    then printed; the record gets its exit status and last line. Returns its output lines. In the CPU mode
    (``IN_PROCESS``) a script of the checkout or ``-m lit_fsdp`` runs in this process (``run_here``)."""
    print("$", " ".join(argv), flush=True)
    output = work / f"{name}.txt"
    with open(output, "w") as sink:
        if IN_PROCESS and argv[0] == sys.executable and (argv[1].endswith(".py") or argv[1:3] == ["-m", "lit_fsdp"]):
            returncode = run_here(argv[1:], sink)
        else:
            returncode = subprocess.run(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                        env=environment()).returncode
    lines = [line for line in output.read_text().splitlines() if line.strip()]
    print("\n".join(lines[-200:]), flush=True)
    record.put(rc=returncode, result=lines[-1] if lines else "")
    if returncode != 0:
        raise RuntimeError(f"{name}: {Path(argv[1]).name if argv[1] != '-m' else argv[2]} exited {returncode}")
    return lines


@contextlib.contextmanager
def as_a_process() -> Iterator[None]:
    """Run a command in this process (the CPU mode) from the checkout, as a child would run, and put back after it
    what the child's end would have left untouched: the working directory, ``sys.argv``, the environment (Lightning's
    MASTER_PORT among it), torch's threads, and no process group (the port it holds)."""
    import torch
    import torch.distributed as dist

    saved = (os.getcwd(), sys.argv, dict(os.environ), torch.get_num_threads())
    os.chdir(ROOT)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.chdir(saved[0])
        sys.argv = saved[1]
        os.environ.clear()
        os.environ.update(saved[2])
        torch.set_num_threads(saved[3])


def exit_status(stop: SystemExit) -> int:
    """The status a process would exit with on ``stop``: its int, 0 for None, 1 for a message."""
    return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1


def lit_fsdp_here(argv: list[str]) -> int:
    """``python -m lit_fsdp *argv`` in this process; its exit status, as the process's (a refusal exits 2)."""
    from lit_fsdp.commands.main import main

    sys.argv = ["lit_fsdp", *argv]
    try:
        main(argv)
    except SystemExit as stop:
        return exit_status(stop)
    return 0


def run_here(argv: list[str], sink: Any) -> int:
    """``python *argv`` (a script's path, or ``-m lit_fsdp ...``) in this process (``as_a_process``), its output in
    ``sink``: the libraries it imports are imported once (9 s a process on 2 cores). Its exit status as a process's;
    what it raises is printed to ``sink`` as a process's traceback would be, with status 1."""
    with as_a_process(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            if argv[0] == "-m":
                return lit_fsdp_here(argv[2:])
            sys.argv = list(argv)
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
            return 0
        except SystemExit as stop:
            return exit_status(stop)
        except Exception:
            traceback.print_exc()
            return 1
        finally:
            sink.flush()


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def logged_losses(folder: Path) -> dict[int, float]:
    """Per-step training losses from the CSV logger's file (flushed every step)."""
    losses: dict[int, float] = {}
    for metrics in sorted((folder / "csv").glob("*/metrics.csv")):
        try:
            rows = list(csv.DictReader(metrics.open()))
        except (OSError, csv.Error):
            continue
        losses.update({int(row["step"]): float(row["train/loss"]) for row in rows if row.get("train/loss")})
    return losses


def warmup_steps() -> int:
    return int(os.environ.get(WARMUP_VARIABLE, WARMUP_STEPS))


def measuring(offload: bool, extra: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """A measured run's callbacks: ``extra`` first, then the rates with the first ``--warmup-steps`` left out
    (Throughput, and OffloadStats under SlideFSDP), peaks, and the results record last (it reads the others)."""
    warmup = {"init_args": {"warmup_steps": warmup_steps()}}
    offload_stats = [{"class_path": "callbacks.OffloadStats", **warmup}] if offload else []
    return [*extra, {"class_path": "callbacks.Throughput", **warmup}, {"class_path": "callbacks.Memory"}, *offload_stats,
            {"class_path": "callbacks.Results"}]


def write_estimate(name: str, work: Path, fit_args: list[str]) -> dict[str, Any]:
    """``estimate``'s JSON for a run's configs, with the probe's ``hardware.json`` (this machine, detected, where
    the probe has not run), written to ``<work>/<name>.estimate.json`` before the run starts; the figures the run is
    compared with are returned (or the error: an estimate that fails does not stop the measurement)."""
    from lit_fsdp.commands.estimate import estimate_step, parse
    from lit_fsdp.commands.tune.hardware import load

    hardware = work / "hardware.json"
    try:
        trainer, module, data = parse(fit_args, load(hardware) if hardware.is_file() else None)
        figures = estimate_step(trainer, module, data, trainer.hardware)
    except (Exception, SystemExit) as error:  # jsonargparse exits on a config it refuses
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    path = work / f"{name}.estimate.json"
    path.write_text(json.dumps(figures, indent=2) + "\n")  # what `python -m lit_fsdp estimate --json` prints
    return {"file": path.name, "hardware": hardware.name if hardware.is_file() else "detected",
            "step_time_s": figures["step_time_s"], "mfu": figures["mfu"],
            "cpu_update_bytes": figures["cpu_update_bytes"],
            "device_peak_gib": figures["device_peak_bytes"] / GIB, "host_gib": figures["host_bytes"] / GIB,
            "fits": figures["fits"]}


#: The CPU mode (``gpu_check.py --device cpu``) runs every fit in the runner's process, one after another: the
#: libraries a fit imports are imported once, and a fit that fails raises where it failed.
IN_PROCESS = False


def fit(name: str, work: Path, configs: list[str], record: Record, steps: int, min_free_gib: float = 4.0,
        checkpoints: bool = False, ckpt_path: str | None = None, folder: Path | None = None,
        measure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One ``python -m lit_fsdp fit`` run in ``folder`` (default: work/name): CSV logger (W&B may be missing), no
    validation, no checkpoints unless asked (a config then names its ModelCheckpoint), a loss per step. A run given
    ``measure`` (its callbacks, from ``measuring``) runs ``--warmup-steps`` more steps than ``steps``, left out of
    every rate. ``estimate``'s JSON for its configs is written first (``write_estimate``). While it runs, its progress
    (set-up time, steps done, steps/s after the warm-up) goes into the record every few seconds, so a step cut by its
    deadline still says how far it got; a watchdog ends it before the host runs out of memory (MemAvailable under
    ``min_free_gib``). Returns its record: results.jsonl's line, per-step losses and its ``figures``."""
    folder = folder or work / name
    warmup = warmup_steps() if measure is not None else 0
    fit_args = fit_arguments(name, work, configs, steps, checkpoints, folder, measure)
    run: dict[str, Any] = {"rc": None, "losses": [], "estimate": write_estimate(name, work, fit_args)}
    if measure is not None:
        run["warmup_steps_left_out"] = warmup
    record.put(**{name: run})
    argv = ["fit", *fit_args] + (["--ckpt_path", ckpt_path] if ckpt_path else [])
    progress = Progress(name, folder, run, record, warmup)
    run["rc"] = (fit_here if IN_PROCESS else fit_in_child)(argv, progress, min_free_gib)
    results, throughput = folder / "results.jsonl", folder / "throughput.json"
    losses = logged_losses(folder)
    run.update(wall_s=round(time.perf_counter() - progress.begin, 1), steps_done=len(losses),
               result=json.loads(results.read_text().splitlines()[-1]) if results.is_file() else {},
               losses=[losses[k] for k in sorted(losses)],
               step_times_ms=json.loads(throughput.read_text()).get("step_times_ms") if throughput.is_file() else None)
    if measure is not None:
        run["figures"] = figures(run)
    record.put(**{name: run})
    if run["rc"] != 0:
        raise RuntimeError(f"{name}: fit exited {run['rc']}" + (f" ({run['stopped']})" if "stopped" in run else ""))
    return run


def fit_arguments(name: str, work: Path, configs: list[str], steps: int, checkpoints: bool = False,
                  folder: Path | None = None, measure: list[dict[str, Any]] | None = None) -> list[str]:
    """``fit``'s ``--config`` arguments for a run: ``configs``, then ``<work>/<name>.yaml`` with its trainer settings
    (``--warmup-steps`` more steps where it is measured)."""
    folder = folder or work / name
    trainer = {
        "max_steps": (warmup_steps() if measure is not None else 0) + steps, "limit_val_batches": 0,
        "enable_checkpointing": checkpoints, "enable_progress_bar": False, "log_every_n_steps": 1,
        "default_root_dir": str(folder),
        "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                   "init_args": {"save_dir": str(folder), "name": "csv", "flush_logs_every_n_steps": 1}},
        **({"callbacks": measure} if measure is not None else {}),
    }
    override = write_yaml(work / f"{name}.yaml", {"trainer": trainer})
    return [*[a for c in configs for a in ("--config", c)], "--config", str(override)]


class Progress:
    """A running fit's progress in its record: set-up time, steps done, steps/s after the warm-up, lowest
    MemAvailable; ``look()`` reads the CSV log and returns whether the host is still above the watchdog's floor."""

    def __init__(self, name: str, folder: Path, run: dict[str, Any], record: Record, warmup: int):
        self.name, self.folder, self.run, self.record, self.warmup = name, folder, run, record, warmup
        self.begin = time.perf_counter()
        self.first_step_at: float | None = None
        self.steady_from: tuple[float, int] | None = None

    def look(self, min_free_gib: float) -> bool:
        run, losses = self.run, logged_losses(self.folder)
        now = time.perf_counter() - self.begin
        if losses and self.first_step_at is None:
            self.first_step_at = now
        if self.steady_from is None and len(losses) >= max(self.warmup, 1):  # the steps/s leave the warm-up out too
            self.steady_from = (now, len(losses))
        run.update(wall_s=round(now, 1), steps_done=len(losses),
                   first_step_s=self.first_step_at and round(self.first_step_at, 1),
                   min_mem_available_gib=min(run.get("min_mem_available_gib", 1e9), meminfo()["MemAvailable_gib"]))
        if self.steady_from is not None and len(losses) > self.steady_from[1]:
            run["steps_per_s"] = round((len(losses) - self.steady_from[1]) / max(now - self.steady_from[0], 1e-9), 3)
        self.record.put(**{self.name: run})
        return run["min_mem_available_gib"] >= min_free_gib


def fit_in_child(argv: list[str], progress: Progress, min_free_gib: float) -> int:
    """``python -m lit_fsdp *argv`` in a process group of its own, looked at every 2 s (at once when it ends) and
    killed by the watchdog; its exit status."""
    command = [sys.executable, "-m", "lit_fsdp", *argv]
    print("$", " ".join(command), flush=True)
    child = subprocess.Popen(command, cwd=ROOT, stdout=sys.stdout, stderr=subprocess.STDOUT, start_new_session=True,
                             env=environment())
    while child.poll() is None:
        try:
            child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        if not progress.look(min_free_gib):
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            progress.run["stopped"] = f"watchdog: MemAvailable {progress.run['min_mem_available_gib']} GiB < {min_free_gib}"
            break
    return child.returncode


def fit_here(argv: list[str], progress: Progress, min_free_gib: float) -> int:
    """``python -m lit_fsdp *argv`` in this process (the CPU mode, ``as_a_process``), looked at every 2 s from a thread
    and once at the end (the watchdog only records: a tiny CPU run cannot exhaust the host); its exit status, as the
    process's."""
    print("$ python -m lit_fsdp", " ".join(argv), flush=True)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(2):
            progress.look(min_free_gib)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with as_a_process():
        try:
            return lit_fsdp_here(argv)
        finally:
            done.set()
            watcher.join()
            progress.look(min_free_gib)


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of a measured run that the records' summaries and the tables show: results.jsonl's rates (the
    warm-up left out) and step-time percentiles, every measured step's time (throughput.json), peaks and offload
    figures, the lowest MemAvailable (sampled by the check every 2 s, and by ``callbacks.Memory`` at each phase of
    every step: ``host_available_min_gb``) beside ``estimate``'s host figure, and the CPU update's GB/s: the bytes
    ``estimate`` counts for it over its measured time (absent where either is)."""
    result, estimate = run.get("result", {}), run.get("estimate", {})
    keys = ("tokens_per_s", "mfu", "steps_measured", "warmup_steps_included", "step_time_ms_mean", "step_time_ms_p10",
            "step_time_ms_p50", "step_time_ms_p90", "peak_allocated_gb", "peak_reserved_gb", "train_loss")
    found = {key: value for key, value in result.items()
             if key in keys or key.startswith(("offload_", "host_", "memory_", "perf_", "mfu", "tokens"))}
    found.update(warmup_steps_left_out=run.get("warmup_steps_left_out"),
                 min_mem_available_gib=run.get("min_mem_available_gib"), step_times_ms=run.get("step_times_ms"))
    update_ms, update_bytes = result.get("offload_cpu_update_ms"), estimate.get("cpu_update_bytes")
    if update_ms and update_bytes:
        found["offload_cpu_update_gbps"] = update_bytes / 1e9 / (update_ms / 1e3)
    if estimate.get("step_time_s") is not None:
        found["estimate_step_time_s"] = estimate["step_time_s"]
    if estimate.get("host_gib") is not None:  # beside the host's lowest MemAvailable during each step (callbacks.Memory)
        found["estimate_host_gib"] = estimate["host_gib"]
    return found
