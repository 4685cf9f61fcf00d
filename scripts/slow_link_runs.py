"""One run of the slow-link benchmark: ``python -m lit_fsdp fit`` with a rank in each of ``SlowLink``'s namespaces.

Lightning's multi-node environment (2 nodes x 1 device) over gloo on the veth pair; each rank pinned to its own
core(s) with as many threads, so that its compute does not depend on the other rank's. The measuring callbacks
replace the method config's list, and the methods' dense warm-ups are cut, so that the timed steps are compressed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from slow_link import SlowLink

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# Method name -> its config; `none` is the baseline (no hook: FSDP2's own fp32 all-reduce). The semi-synchronous
# configs (diloco, diloco_streaming) exchange every sync_every steps (``--sync-every``).
METHODS = {"none": CONFIGS / "baseline.yaml"} | {
    p.stem: p for p in sorted(CONFIGS.glob("*.yaml"))
    if ("compression:" in p.read_text() or "sync_every:" in p.read_text()) and p.stem != "baseline"
}
# The methods' dense warm-ups cut to what they cannot go below, so that the steps timed are compressed ones: PowerSGD's
# start_step and DGC's density warm-up to 0; 1-bit Adam's freeze and 0/1 Adam's variance freeze after the first step,
# and 0/1 Adam's periods doubling every round up to local_step_clipper (local rounds and a sync per period).
STEADY_STATE = {"start_step": "0", "warmup_steps": "0", "freeze_step": "1", "var_freeze_step": "1", "local_step_scaler": "1"}
# Environment that would make Lightning pick another cluster environment or another rank layout.
FOREIGN_ENV = ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
FOREIGN_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "LSB_", "TORCHELASTIC_")


def write_callbacks(path: Path, warmup: int, steps: int, profiler: bool) -> Path:
    """The measuring callbacks every run uses (they replace the method config's list).

    ``CommProfiler`` records the timed steps (those after ``warmup``), so the communication share is
    of the steps whose time is reported; its own start-up step is the last warm-up step.
    """
    callbacks = [
        {"class_path": "callbacks.CompressionStats"},
        {"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": warmup}},
        {"class_path": "callbacks.Results"},
    ]
    if profiler and warmup >= 1:
        schedule = {"wait": warmup - 1, "warmup": 1, "active": steps - warmup}
        callbacks.insert(2, {"class_path": "callbacks.CommProfiler", "init_args": schedule})
    path.write_text(json.dumps({"trainer": {"callbacks": callbacks}}))
    return path


def fit_arguments(args: argparse.Namespace, method: str, callbacks: Path, run_dir: Path) -> list[str]:
    """``lit_fsdp fit`` arguments, the same on both nodes."""
    return [
        "-m", "lit_fsdp", "fit",
        "--config", str(METHODS[method]), "--config", str(callbacks),
        "--trainer.accelerator", "cpu", "--trainer.num_nodes", "2", "--trainer.devices", "1",
        "--trainer.strategy.init_args.sharding", args.sharding,
        *(["--trainer.strategy.init_args.compression.param_all_gather", args.param_all_gather]
          if args.param_all_gather else []),
        "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0",
        "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.logger", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--model.config_overrides", json.dumps(model_overrides(args)),
        "--data.seq_len", str(args.seq_len), "--data.batch_size", str(args.batch_size),
        "--data.num_train_blocks", str(args.batch_size * 2 * (args.steps + 1)),
        *steady_state(method),
        *(["--trainer.strategy.init_args.sync_every", str(args.sync_every)]
          if args.sync_every and "sync_every:" in METHODS[method].read_text() else []),
    ]


def steady_state(method: str) -> list[str]:
    """Arguments that turn ``method``'s dense warm-up steps off, so that its measured steps are compressed ones."""
    config = yaml.safe_load(METHODS[method].read_text())
    compression = config["trainer"]["strategy"]["init_args"].get("compression") or {}
    return [arg for key, value in STEADY_STATE.items() if key in compression
            for arg in (f"--trainer.strategy.init_args.compression.{key}", value)]


def model_overrides(args: argparse.Namespace) -> dict[str, int]:
    return {"n_layer": args.layers, "n_embd": args.width, "n_head": args.heads}


def rank_launch(
    link: SlowLink, node: int, fit_args: list[str], port: int, cores: list[int]
) -> tuple[list[str], dict[str, str]]:
    """Command and environment of the rank on ``node``: Lightning's multi-node variables, gloo on the veth.

    ``LOCAL_RANK`` tells Lightning's default environment that the processes are launched outside it,
    so it starts none itself; the world size comes from ``num_nodes x devices``. Each rank is pinned
    to its own half of ``cores`` with as many threads, so its compute does not compete with the other's.
    """
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV and not k.startswith(FOREIGN_PREFIXES)}
    threads = max(1, len(cores) // 2)
    env.update(
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        MASTER_ADDR=link.addresses[0], MASTER_PORT=str(port), NODE_RANK=str(node), LOCAL_RANK="0",
        GLOO_SOCKET_IFNAME=link.veths[node], OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
    )
    mine = cores[node * threads : (node + 1) * threads] or cores[-threads:]  # one core: both ranks share it
    pin = ",".join(map(str, mine))
    return [*link.exec_prefix(node), "taskset", "-c", pin, sys.executable, *fit_args], env


def run_ranks(launches: list[tuple[list[str], dict[str, str]]], logs: list[Path], timeout: float) -> str | None:
    """Start every rank, wait for all; None on success, else why it failed.

    When one rank fails the other would wait on a collective until gloo's timeout, so it is killed
    at once; on timeout, error or Ctrl-C every rank still running is killed (its whole process group).
    """
    processes: list[subprocess.Popen] = []
    try:
        for (argv, env), log in zip(launches, logs):
            with open(log, "w") as out:
                processes.append(subprocess.Popen(
                    argv, env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                ))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in processes]
            for code, log in zip(codes, logs):
                if code not in (None, 0):
                    return f"{log.stem} exited {code}: {last_line(log)}"
            if all(code == 0 for code in codes):
                return None
            if time.monotonic() > deadline:
                return f"timed out after {timeout:.0f} s"
            time.sleep(0.5)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def run_method(link: SlowLink, method: str, repeat: int, args: argparse.Namespace, callbacks: Path, port: int) -> dict:
    """One fit across the link; the run's results record, or ``{"failed": reason}``, with its rate, method and repeat."""
    run_dir = args.out / link.rate / method / str(repeat)
    run_dir.mkdir(parents=True, exist_ok=True)
    results = run_dir / "results.jsonl"
    before = len(results.read_text().splitlines()) if results.exists() else 0
    fit_args = fit_arguments(args, method, callbacks, run_dir)
    cores = sorted(os.sched_getaffinity(0))[: 2 * args.threads]
    launches = [rank_launch(link, node, fit_args, port, cores) for node in (0, 1)]
    start = time.perf_counter()
    failure = run_ranks(launches, [run_dir / "rank0.log", run_dir / "rank1.log"], args.timeout)
    base = {"rate": link.rate, "method": method, "repeat": repeat, "wall_s": round(time.perf_counter() - start, 1)}
    if failure is None:
        lines = results.read_text().splitlines() if results.exists() else []
        if len(lines) > before:
            return {**base, **json.loads(lines[-1])}
        failure = f"no new record in {results}"
    return {**base, "failed": failure}
