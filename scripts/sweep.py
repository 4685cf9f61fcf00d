"""Methods x seeds x world sizes, one ``python -m lit_fsdp fit`` subprocess each; every run recorded, failures too.

Each run trains in ``OUT/<method>-w<world>-s<seed>/``, its ``default_root_dir``: ``results.jsonl``,
``history.jsonl``, ``throughput.json``, ``compression.json``, ``stdout.log`` and ``stderr.log`` land
there. Its configs are the ``--config`` files (default ``configs/quickstart.yaml``), then
``configs/<method>.yaml`` (or METHOD itself when it is a YAML path), then every argument this script
does not know, passed to ``lit_fsdp fit`` as it is (``--trainer.max_steps 100``, ``--trainer.accelerator
gpu``). The world size is ``--trainer.devices`` on one node, the seed ``--seed_everything``. The run's
callbacks are its configs' list with ``Results`` (named ``<method>-w<world>-s<seed>-<time>``),
``Quality``, ``Throughput`` and ``CompressionStats`` added where missing; it logs to CSV in its folder
unless ``--trainer.logger`` says otherwise. Each run appends a line to
``OUT/sweep.jsonl``: status ok or failed, return code, last error line, wall time, command. A failed run
does not stop the sweep. Compare the runs with ``python scripts/compare_runs.py OUT``.

    python scripts/sweep.py --methods baseline int8 topk --seeds 1234 1235 --world-sizes 2 --trainer.max_steps 200
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
from typing import Any, Sequence

import yaml

REPO = Path(__file__).resolve().parents[1]
METHODS = [p.stem for p in sorted(REPO.glob("configs/*.yaml")) if "compression:" in p.read_text()]
# Before the caller's arguments, so they can be overridden: a CSV log in the run folder, no progress bar in the log.
LAUNCH_DEFAULTS = ("--trainer.enable_progress_bar", "false", "--trainer.logger", "lightning.pytorch.loggers.CSVLogger")


def launch(configs: Sequence[Path], args: Sequence[str], out: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """``python -m lit_fsdp fit --config C ... ARGS`` with run folder ``out``; its outcome, never an exception.

    The run's stdout and stderr go to ``out/stdout.log`` and ``out/stderr.log``. Returns ``status`` (ok or
    failed), ``returncode``, ``error`` (last line of stderr on failure), ``wall_s`` and the ``command``.
    After ``timeout_s`` the run and every process it started (its ranks) are killed.
    """
    out.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "lit_fsdp", "fit", *(arg for config in configs for arg in ("--config", str(config))),
        *LAUNCH_DEFAULTS, "--trainer.logger.save_dir", str(out), *args, "--trainer.default_root_dir", str(out),
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    with open(out / "stdout.log", "w") as stdout, open(out / "stderr.log", "w") as stderr:
        # Its own session: the ranks Lightning spawns share its process group, so a timeout can end them all.
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
            error = None
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as interrupted:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            if isinstance(interrupted, KeyboardInterrupt):
                raise
            returncode, error = process.returncode, f"timed out after {timeout_s:g} s"
    wall_s = time.perf_counter() - start
    if returncode != 0 and error is None:
        lines = [line for line in (out / "stderr.log").read_text(errors="replace").splitlines() if line.strip()]
        error = lines[-1].strip() if lines else f"exit code {returncode}, nothing on stderr"
    return {"status": "ok" if returncode == 0 else "failed", "returncode": returncode, "error": error,
            "wall_s": wall_s, "command": command}


def _last(configs: Sequence[Path], *keys: str) -> Any:
    """The value at ``keys`` in the last config that sets it (later configs win, lists are replaced whole)."""
    found = None
    for config in configs:
        node: Any = yaml.safe_load(config.read_text()) or {}
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        found = node if node is not None else found
    return found


def run_callbacks(configs: Sequence[Path], run_name: str, quality: dict[str, float]) -> list[dict[str, Any]]:
    """The configs' callbacks plus what compare_runs reads: Results (with ``run_name``), Quality, Throughput, CompressionStats."""
    entries = [{"class_path": c} if isinstance(c, str) else dict(c) for c in _last(configs, "trainer", "callbacks") or []]
    for class_path, init_args in (
        ("callbacks.Results", {"run_name": run_name}), ("callbacks.Quality", quality),
        ("callbacks.Throughput", {}), ("callbacks.CompressionStats", {}),
    ):
        name = class_path.rsplit(".", 1)[-1]
        entry = next((e for e in entries if e["class_path"].rsplit(".", 1)[-1] == name), None)
        if entry is None:
            entries.append({"class_path": class_path, "init_args": init_args})
        else:
            entry["init_args"] = {**(entry.get("init_args") or {}), **init_args}
    return entries


def method_config(method: str) -> Path:
    """``configs/<method>.yaml``, or ``method`` itself when it names a YAML file."""
    return Path(method) if method.endswith((".yaml", ".yml")) else REPO / "configs" / f"{method}.yaml"


def run_one(method: str, world: int, seed: int, base: Sequence[Path], passthrough: Sequence[str],
            quality: dict[str, float], out: Path, timeout_s: float | None) -> dict[str, Any]:
    """One run of the sweep in ``out/<method>-w<world>-s<seed>``; its ``sweep.jsonl`` record."""
    folder = f"{Path(method).stem}-w{world}-s{seed}"
    name = f"{folder}-{time.strftime('%Y%m%d-%H%M%S')}"  # the form of run_folder.run_name's default
    record: dict[str, Any] = {"method": Path(method).stem, "world_size": world, "seed": seed, "run_name": name,
                              "folder": folder, "compress_method": None}
    configs = [*base, method_config(method).resolve()]
    failed = {"status": "failed", "returncode": None, "wall_s": 0.0, "command": None}
    if not configs[-1].is_file():
        return {**record, **failed, "error": f"{configs[-1]} not found; methods: {' '.join(METHODS)} or a YAML path"}
    try:
        compression = _last(configs, "trainer", "strategy", "init_args", "compression") or {}
        callbacks = run_callbacks(configs, name, quality)
    except (yaml.YAMLError, AttributeError, TypeError) as error:
        return {**record, **failed, "error": f"{configs[-1]}: not a lit_fsdp config ({error}); fix the YAML"}
    record["compress_method"] = compression.get("method", "none")
    args = ["--seed_everything", str(seed), "--trainer.devices", str(world), "--trainer.callbacks", json.dumps(callbacks)]
    return {**record, **launch(configs, [*args, *passthrough], out / folder, timeout_s)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Unknown arguments go to every `lit_fsdp fit`, e.g. --trainer.max_steps 100 --data.batch_size 4.",
    )
    parser.add_argument("--methods", nargs="+", default=METHODS, help=f"config names in configs/ or YAML paths (default: all: {' '.join(METHODS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234], help="--seed_everything values")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2], help="--trainer.devices values (one node)")
    parser.add_argument("--config", type=Path, action="append", help="base config before the method's, repeatable (default: configs/quickstart.yaml)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "sweep", help="sweep folder (default: runs/sweep)")
    parser.add_argument("--target-val-loss", type=float, help="Quality: report time and step to this validation loss")
    parser.add_argument("--time-budget-s", type=float, help="Quality: report the validation loss at this many seconds of training")
    parser.add_argument("--timeout-s", type=float, help="kill a run and record it failed after this many seconds")
    args, passthrough = parser.parse_known_args(argv)
    passthrough = [a for a in passthrough if a != "--"]
    base = [path.resolve() for path in args.config or [REPO / "configs" / "quickstart.yaml"]]
    for path in base:
        if not path.is_file():
            parser.error(f"--config {path} not found; pass an existing YAML file")
    quality = {k: v for k, v in (("target_val_loss", args.target_val_loss), ("time_budget_s", args.time_budget_s)) if v is not None}
    args.out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for method in args.methods:
        for world in args.world_sizes:
            for seed in args.seeds:
                record = run_one(method, world, seed, base, passthrough, quality, args.out, args.timeout_s)
                failed += record["status"] == "failed"
                with open(args.out / "sweep.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
                status = record["status"] if record["status"] == "ok" else f"failed: {record['error']}"
                print(f"{record['folder']}: {status} ({record['wall_s']:.0f} s)", flush=True)
    print(f"{failed} of {len(args.methods) * len(args.seeds) * len(args.world_sizes)} runs failed; "
          f"records in {args.out / 'sweep.jsonl'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
