"""One ``python -m lit_fsdp fit`` in a subprocess with a deadline: how sweeps, benchmarks and tune trials run a training.

The run's stdout and stderr go to files in its run folder; the outcome is a record, never an
exception, so a caller can go on after a crash, an out-of-memory or a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[2]
# Before the caller's arguments, so they can be overridden: a CSV log in the run folder, no progress bar in the log.
LAUNCH_DEFAULTS = ("--trainer.enable_progress_bar", "false", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger")


def launch(configs: Sequence[Path], args: Sequence[str], out: Path, timeout_s: float | None = None,
           cwd: Path = REPO) -> dict[str, Any]:
    """``python -m lit_fsdp fit --config C ... ARGS`` with run folder ``out``; its outcome, never an exception.

    The run's stdout and stderr go to ``out/stdout.log`` and ``out/stderr.log``. Returns ``status`` (ok or
    failed), ``returncode``, ``error`` (last line of stderr on failure, or the signal that killed it),
    ``timed_out``, ``wall_s`` and the ``command``. After ``timeout_s`` the run and every process it started
    (its ranks) are killed. Relative paths in the configs and arguments are relative to ``cwd``.
    """
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "lit_fsdp", "fit", *(arg for config in configs for arg in ("--config", str(config))),
        *LAUNCH_DEFAULTS, "--trainer.logger.save_dir", str(out), *args, "--trainer.default_root_dir", str(out),
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    timed_out = False
    with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
        # Its own session: the ranks Lightning spawns share its process group, so a timeout can end them all.
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
            error = None
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as interrupted:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            if isinstance(interrupted, KeyboardInterrupt):
                raise
            returncode, error, timed_out = process.returncode, f"timed out after {timeout_s:g} s", True
    wall_s = time.perf_counter() - start
    if returncode < 0 and error is None:
        error = f"killed by {signal.Signals(-returncode).name} (out of host memory, or stopped from outside)"
    if returncode != 0 and error is None:
        lines = [line for line in (out / "stderr.log").read_text(errors="replace").splitlines() if line.strip()]
        error = lines[-1].strip() if lines else f"exit code {returncode}, nothing on stderr"
    return {"status": "ok" if returncode == 0 else "failed", "returncode": returncode, "error": error,
            "timed_out": timed_out, "wall_s": wall_s, "command": command}
