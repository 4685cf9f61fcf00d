"""Running the real CLI in a subprocess and reading what it logged."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import free_port

REPO = Path(__file__).resolve().parents[1]

# A few steps of a tiny model, logged every step to CSV, no progress bar, no validation.
FAST = [
    "--config", str(REPO / "configs" / "quickstart.yaml"),
    "--trainer.limit_val_batches", "0",
    "--trainer.log_every_n_steps", "1",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--model.warmup_steps", "2",
]


def run_cli(*args: str, cwd: Path, check: bool = True, nodes: int = 1) -> subprocess.CompletedProcess:
    """``python -m lit_fsdp *args`` in ``cwd``; with ``check``, fail the test with its output on error.

    With ``nodes`` > 1, one process per node is started on this machine with Lightning's multi-node
    variables (one device per node); the result is node 0's, with every node's return code checked.
    """
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "lit_fsdp", *args]
    if nodes == 1:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    else:
        port = str(free_port())
        processes = [
            subprocess.Popen(
                [*command, "--trainer.num_nodes", str(nodes), "--trainer.devices", "1"], cwd=cwd, text=True,
                env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node), "LOCAL_RANK": "0"},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
            for node in range(nodes)
        ]
        outputs = [process.communicate(timeout=600) for process in processes]
        codes = [process.returncode for process in processes]
        result = subprocess.CompletedProcess(command, max(codes, key=abs), *outputs[codes.index(max(codes, key=abs))])
    if check and result.returncode != 0:
        raise AssertionError(f"lit_fsdp {' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def fit_arguments(
    tmp: Path, *args: str, devices: int = 2, batch_size: int = 2, steps: int = 6, callbacks: list[dict] | None = None
) -> list[str]:
    """``fit`` arguments for a short run logged to CSV in ``tmp``; ``callbacks`` replace the config's callbacks."""
    tmp.mkdir(parents=True, exist_ok=True)
    extra_config = tmp / f"callbacks{len(list(tmp.glob('callbacks*.yaml')))}.yaml"
    extra_config.write_text(json.dumps({"trainer": {"callbacks": callbacks or []}}))
    return [
        "fit", *FAST, "--config", str(extra_config),
        "--trainer.devices", str(devices),
        "--data.batch_size", str(batch_size),
        "--trainer.max_steps", str(steps),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp),
        *args,
        "--trainer.default_root_dir", str(tmp),  # last: the method configs name their own run folder
    ]


def fit(
    tmp: Path, *args: str, devices: int = 2, batch_size: int = 2, steps: int = 6, callbacks: list[dict] | None = None,
    nodes: int = 1,
) -> dict[str, list[float]]:
    """A short fit logged to ``tmp``; returns each logged metric as a list over steps.

    ``callbacks`` (``{"class_path": ..., "init_args": ...}`` dicts) replace the config's callbacks. With
    ``nodes`` > 1 there are that many "nodes" of one process each on this machine (``devices`` is ignored).
    """
    arguments = fit_arguments(tmp, *args, devices=devices, batch_size=batch_size, steps=steps, callbacks=callbacks)
    run_cli(*arguments, cwd=tmp, nodes=nodes)
    return read_metrics(max(tmp.glob("lightning_logs/version_*/metrics.csv")))


def read_metrics(path: Path) -> dict[str, list[float]]:
    """Per-step values of each metric in a CSVLogger file (rows without the metric skipped)."""
    metrics: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("step", "epoch"):
                    metrics.setdefault(key, {})[int(row["step"])] = float(value)
    return {key: [by_step[s] for s in sorted(by_step)] for key, by_step in metrics.items()}
