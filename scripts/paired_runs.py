"""What the paired-seed loss benchmarks share (``bench_master_dtype``, ``bench_float8``): their arguments, and every arm
of every seed run in turn, each run appended to the results file as it ends, so that a partial run is usable."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path


def arguments(parser: argparse.ArgumentParser, seeds: list[int], steps: int, lr: float, lr_source: str,
              arms: list[str], out: Path) -> None:
    """The options every such benchmark takes."""
    parser.add_argument("--seeds", type=int, nargs="+", default=seeds)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--lr", type=float, default=lr, help=f"peak learning rate ({lr_source}'s: {lr:g})")
    parser.add_argument("--arms", nargs="+", choices=arms, default=arms)
    parser.add_argument("--tail", type=int, default=50, help="steps the final train loss is averaged over")
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--table", action="store_true", help="print the table from --out and stop")


def run_all(args: argparse.Namespace, run: Callable[[int, str, Path], dict]) -> list[dict]:
    """``run(seed, arm, folder)`` for every seed and arm, each row appended to ``args.out`` as it ends (unless
    ``--table``); then every row the file holds."""
    if not args.table:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as work:
            for seed in args.seeds:
                for index, arm in enumerate(args.arms):
                    row = run(seed, arm, Path(work) / f"{index}-{seed}")
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    validation = row["val_loss"][-1] if row.get("val_loss") else float("nan")
                    print(f"seed {seed} {arm}: last {args.tail} steps {statistics.fmean(row['train_loss'][-args.tail:]):.4f}, "
                          f"validation {validation:.4f}", flush=True)
    return [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
