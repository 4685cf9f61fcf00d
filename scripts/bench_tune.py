"""``lit_fsdp tune`` on cases whose default is not the best, then best.yaml against the default, side by side.

For each case: ``python -m lit_fsdp tune`` with the case's configs and arguments (``OUT/<case>/tune``), then
``fit`` with the default and with the default + ``best.yaml``, alternated ``--repeats`` times, ``--steps``
optimizer steps each (same model, data and seed; the first ``--warmup`` steps dropped). The table
(``OUT/table.md``, records in ``OUT/bench.jsonl``) gives the trials the search ran and the one that won
(the trials it took), the winner's changes, tokens/s of the default and of best.yaml (median of the repeats,
their range in brackets), the speed-up of the medians, the speed-up the search itself saw, the memory
estimate's mean error on the measured trials, and the judge's first finding on the default and on the best.

    python scripts/bench_tune.py                                  # the CPU cases, 2 processes
    python scripts/bench_tune.py --cases gpu-gpt2-124m gpu-llama-1b  # one GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lit_fsdp.commands.launch import launch

REPO = Path(__file__).resolve().parents[1]

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
CASES: dict[str, dict[str, Any]] = {
    "cpu-gpt2-small-checkpointed": {
        "default": "not the best: every block checkpointed and micro-batch 1 x 8 accumulation, a memory-saving setting "
                   "on a model that uses a fraction of the memory, so the forward is recomputed and each step runs 8 "
                   "small micro-batches, each with its own all-gathers",
        "args": ["--config", QUICKSTART, "--model.preset", "gpt2-small", "--data.vocab_size", "8192", "--data.seq_len", "256",
                 "--data.batch_size", "1", "--trainer.accumulate_grad_batches", "8",
                 "--trainer.strategy.init_args.activation_checkpointing", "1"],
    },
    "cpu-gpt2-tiny-quickstart": {
        "default": "the quickstart as shipped (FULL_SHARD, micro-batch 8, no checkpointing): a control, a tiny model "
                   "whose step is short enough for collectives and per-step overhead to matter",
        "args": ["--config", QUICKSTART],
    },
    "gpu-gpt2-124m": {
        "default": "not the best: every block checkpointed at micro-batch 4 x 4 on one GPU with room for larger micro-batches",
        "args": ["--config", QUICKSTART, "--config", str(REPO / "configs" / "gpt2_124m.yaml"), "--trainer.devices", "1",
                 "--data.vocab_size", "50257", "--data.batch_size", "4", "--trainer.accumulate_grad_batches", "4",
                 "--trainer.strategy.init_args.activation_checkpointing", "1"],
    },
    "gpu-llama-1b": {
        "default": "configs/llama_1b_low_memory.yaml on one GPU: every block checkpointed at micro-batch 4",
        "args": ["--config", QUICKSTART, "--config", str(REPO / "configs" / "llama_1b_low_memory.yaml"),
                 "--trainer.devices", "1",
                 "--data.vocab_size", "128256"],
    },
}


def tune(case: str, args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], float]:
    """Runs the search; its summary.json and wall time."""
    command = [sys.executable, "-m", "lit_fsdp", "tune", *CASES[case]["args"], "--tune.trials", str(args.trials),
               "--tune.out", str(out), "--tune.trial.steps", str(args.trial_steps)]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    with open(out.parent / "tune.log", "w") as log:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"bench_tune: tune for {case} failed; see {out.parent / 'tune.log'}")
    return json.loads((out / "summary.json").read_text()), time.perf_counter() - start


def measure(case: str, overlay: list[str], args: argparse.Namespace, out: Path) -> float | None:
    """Tokens/s of one ``fit`` of the case (plus ``overlay``), warm-up dropped."""
    callbacks = [{"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": args.warmup}},
                 {"class_path": "callbacks.Results", "init_args": {"run_name": out.name}}]
    fit_args = [*CASES[case]["args"], *overlay, "--trainer.max_steps", str(args.steps), "--trainer.max_epochs", "-1",
                "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false",
                "--trainer.callbacks", json.dumps(callbacks)]
    outcome = launch([], fit_args, out, timeout_s=args.timeout)
    results = out / "results.jsonl"
    if outcome["status"] != "ok" or not results.is_file():
        print(f"{out.name}: failed: {outcome['error']}", flush=True)
        return None
    return json.loads(results.read_text().splitlines()[-1]).get("tokens_per_s")


def first_finding(trial: dict[str, Any] | None) -> str:
    findings = (trial or {}).get("findings") or []
    return f"{findings[0]['kind']}: {findings[0]['evidence']}" if findings else ""


def bench(case: str, args: argparse.Namespace) -> dict[str, Any]:
    folder = args.out / case
    folder.mkdir(parents=True, exist_ok=True)
    summary, tune_s = tune(case, args, folder / "tune")
    best = summary["best"]
    row: dict[str, Any] = {"case": case, "default": CASES[case]["default"], "trials": summary["trials_run"],
                           "rejected": summary["rejected"], "tune_s": tune_s, "best_trial": best and best["index"],
                           "changes": best and best["changes"], "search_speedup": summary["speedup"],
                           "default_finding": first_finding(summary["default"]), "best_finding": first_finding(best)}
    errors = summary["memory"]["estimate_errors"]
    row["estimate_error"] = statistics.fmean(abs(e) for e in errors) if errors else None
    overlay = ["--config", str(folder / "tune" / "best.yaml")] if best else []
    speeds: dict[str, list[float]] = {"default": [], "best": []}
    for repeat in range(args.repeats):  # alternated, so that drift in the machine's load hits both
        for name, extra in (("default", []), ("best", overlay)):
            tokens = measure(case, extra, args, folder / f"{name}-{repeat}")
            if tokens is not None:
                speeds[name].append(tokens)
    for name, values in speeds.items():  # the median: one run slowed by another job on the machine moves it least
        row[f"{name}_tokens_per_s"] = statistics.median(values) if values else None
        row[f"{name}_range"] = f"{min(values):,.0f}-{max(values):,.0f}" if len(values) > 1 else None
    row["runs"] = speeds
    if row["default_tokens_per_s"] and row["best_tokens_per_s"]:
        row["speedup"] = row["best_tokens_per_s"] / row["default_tokens_per_s"]
    return row


def cell(value: Any, unit: str = "", spread: str | None = None) -> str:
    if value is None:
        return "—"
    if spread:
        return f"{cell(value)} ({spread})"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "%":
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value).replace("|", "/")


def table(rows: list[dict[str, Any]]) -> str:
    columns = [("case", "case", ""), ("trials run", "trials", ""), ("best trial", "best_trial", ""),
               ("best's changes", "changes", ""), ("default tokens/s", "default_tokens_per_s", "range"),
               ("best.yaml tokens/s", "best_tokens_per_s", "range"), ("speed-up", "speedup", "x"),
               ("in the search", "search_speedup", "x"), ("estimate error", "estimate_error", "%"), ("tune s", "tune_s", ""),
               ("judge on the default", "default_finding", ""), ("judge on the best", "best_finding", "")]
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key), unit, row.get(key.replace("tokens_per_s", "range")) if unit == "range" else None)
                                for _, key, unit in columns) + " |" for row in rows]
    lines += ["", *(f"- **{row['case']}**: the default is {row['default']}." for row in rows)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=[c for c in CASES if c.startswith("cpu-")], choices=list(CASES))
    parser.add_argument("--trials", type=int, default=12, help="--tune.trials")
    parser.add_argument("--trial-steps", type=int, default=5, help="--tune.trial.steps (measured steps per trial)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each side-by-side fit")
    parser.add_argument("--warmup", type=int, default=5, help="steps of each side-by-side fit left out of tokens/s")
    parser.add_argument("--repeats", type=int, default=2, help="side-by-side fits of each of default and best.yaml")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per side-by-side fit")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_tune")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(args.out / "bench.jsonl", "a") as records:
        for case in args.cases:
            row = bench(case, args)
            records.write(json.dumps(row, default=str) + "\n")
            records.flush()
            rows.append(row)
            print(table([row]).splitlines()[2], flush=True)
    text = table(rows)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
