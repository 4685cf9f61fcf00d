"""Compare runs: a table of quality, speed and communication per method and world size, and plots.

Inputs are run folders, sweep folders or ``results.jsonl`` files: every ``results.jsonl`` under them is
read (a run's loss curve from the sibling ``history.jsonl``, written by ``callbacks.Quality``), and a
``sweep.jsonl`` adds the runs that failed. With ``--wandb ENTITY/PROJECT`` the runs come from W&B instead
(online only). A run and its resumes (``resumed_from`` in their records) are one run. Runs are grouped by
compression method, world size and length in steps (runs of another length are not seeds of one another); each
figure is the mean ± sd across seeds, and its change against the baseline method at the same world size and length
in %, paired by seed where both ran it. Runs made under several strategies (``sweep.py --strategies``) are labelled by
strategy too (``ddp``, ``fsdp2``, ``fsdp2 int8``, ...), so ``--baseline ddp`` compares with DDP. Writes
``OUT/comparison.md``, ``OUT/comparison.csv`` and ``loss_vs_step.png``, ``loss_vs_wall.png``,
``tokens_per_s.png``, ``comm_share.png``, ``ratio_vs_ppl.png``.

    python -m lit_fsdp compare_runs runs/sweep                   # -> runs/sweep/comparison/
    python -m lit_fsdp compare_runs runs/a runs/b --baseline none --out runs/ab
    python -m lit_fsdp compare_runs runs/strategies --baseline ddp
    python -m lit_fsdp compare_runs --wandb my-team/lit_fsdp --out runs/wandb_comparison

(``python scripts/compare_runs.py`` is the same command.)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import socket
import statistics
import sys
from pathlib import Path
from typing import Any, Iterable, NoReturn, Sequence
from urllib.parse import urlsplit

import matplotlib

matplotlib.use("Agg")  # files only: no display on clusters and in tests
import matplotlib.pyplot as plt  # noqa: E402

# Results-record key -> column heading.
METRICS = {
    "val_loss": "val loss", "val_ppl": "val ppl", "step_time_ms_mean": "step ms", "step_time_ms_p50": "step ms p50",
    "step_time_ms_p90": "step ms p90", "tokens_per_s": "tokens/s", "comm_ratio": "comm share",
    "comm_time_ms_total": "comm ms/step", "compression_ratio": "ratio vs fp32", "time_to_target_s": "time to target s",
    "peak_allocated_gb": "GPU peak GB", "peak_rss_gb": "host RSS GB",
}
# Names the trainer logs under, for W&B runs whose summary lacks the results record.
LOGGED = {"train/loss": "train_loss", "val/loss": "val_loss", "val/ppl": "val_ppl", "compress/ratio_vs_fp32": "compression_ratio"}
FAILED_STATES = ("failed", "crashed", "killed")
# The loss plots' line styles and (hollow) markers, one of each per group in turn.
LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "x")


def fail(message: str) -> NoReturn:
    sys.exit(f"compare_runs: error: {message}")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                fail(f"{path}:{number} is not JSON ({error}); fix or delete that line")
    return records


def load_local(paths: Sequence[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    """Run records from every results.jsonl (with ``history``) and failed runs from every sweep.jsonl under ``paths``."""
    results: list[Path] = []
    sweeps: list[Path] = []
    for path in paths:
        if not path.exists():
            fail(f"{path} does not exist; pass run folders, sweep folders or results.jsonl files")
        results += sorted(path.rglob("results.jsonl")) if path.is_dir() else [path] if path.name == "results.jsonl" else []
        sweeps += sorted(path.rglob("sweep.jsonl")) if path.is_dir() else [path] if path.name == "sweep.jsonl" else []
    notes: list[str] = []
    # A sweep's latest word on each of its run folders: a failed re-run hides an earlier success there.
    failed: dict[Path, dict[str, Any]] = {}
    for sweep in sweeps:
        latest = {(sweep.parent / line["folder"]).resolve(): line for line in read_jsonl(sweep)}
        failed.update({folder: line for folder, line in latest.items() if line["status"] == "failed"})
    records = []
    for path in dict.fromkeys(p.resolve() for p in results):
        if path.parent in failed:
            continue
        history = read_jsonl(path.parent / "history.jsonl") if (path.parent / "history.jsonl").is_file() else []
        lines = [line for line in read_jsonl(path) if "compress_method" in line]
        if not lines:
            notes.append(f"{path}: no callbacks.Results records (another tool's file?), left out")
            continue
        # A run folder reused with the same seed appends a record per run: each is a run of its own (its run name
        # tells it apart, and picks its loss curve), said in a note rather than merged into one.
        # A run its resume continues is not another run (join_resumes), nor is one of another length.
        continued = {record.get("resumed_from") for record in lines}
        same: dict[tuple, list[str]] = {}
        for record in lines:
            if record.get("run_name") in continued:
                continue
            same.setdefault((record.get("compress_method"), json.dumps(record.get("compress_config"), sort_keys=True),
                             record.get("world_size"), record.get("seed"), record.get("steps")),
                            []).append(str(record.get("run_name")))
        for (method, _, world, seed, _), names in same.items():
            if len(names) > 1:
                notes.append(f"{path}: {len(names)} runs of {method} on {world} processes with seed {seed} "
                             f"({', '.join(names)}), each counted as a run")
        for record in lines:
            curve = [h for h in history if h.get("run_name") == record.get("run_name")]
            # callbacks.Results writes status failed (with the error) for a run that stopped on an error or NaN, and
            # interrupted for one a signal stopped
            records.append({**record, "status": record.get("status") or "ok", "history": curve})
    for line in failed.values():
        records.append({
            "run_name": line.get("run_name"), "compress_method": line.get("compress_method") or line.get("method"),
            "strategy": line.get("strategy"), "world_size": line.get("world_size"), "seed": line.get("seed"), "status": "failed",
            "error": line.get("error"), "history": [],
        })
    return records, notes


def wandb_record(run: Any) -> dict[str, Any]:
    """A results-like record from a W&B public-API run: its summary (the published record), config, tags, history."""
    summary = {key: value for key, value in dict(run.summary_metrics).items() if not key.startswith("_")}
    config = dict(run.config)
    record: dict[str, Any] = {key[len("perf/"):]: value for key, value in summary.items() if key.startswith("perf/")}
    record.update({name: summary[key] for key, name in LOGGED.items() if key in summary})
    record.update({key: value for key, value in summary.items() if "/" not in key})
    trainer = config.get("trainer") or {}
    devices = trainer.get("devices")
    record.setdefault("compress_method", (list(run.tags) or ["none"])[0])  # lit_fsdp's WandbLogger tags the method
    record.setdefault("seed", config.get("seed_everything"))
    record.setdefault("world_size", devices * (trainer.get("num_nodes") or 1) if isinstance(devices, int) else None)
    record["run_name"] = run.name
    if run.state in FAILED_STATES:
        return {**record, "status": "failed", "error": f"W&B state {run.state}", "history": []}
    history = []
    for key, name in (("train/loss", "train_loss"), ("val/loss", "val_loss")):
        # _runtime counts from the W&B run's start, a little before training starts.
        for row in run.history(keys=[key, "_runtime"], x_axis="trainer/global_step", pandas=False, samples=2000):
            history.append({"step": row.get("trainer/global_step"), "wall_s": row.get("_runtime"), name: row.get(key)})
    return {**record, "status": record.get("status") or "ok", "history": history}


def load_wandb(project: str, timeout_s: float) -> list[dict[str, Any]]:
    """Runs of ``ENTITY/PROJECT`` through ``wandb.Api()``; a one-line error, not a hang, when W&B is out of reach."""
    mode = os.environ.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun"):
        fail(f"--wandb needs W&B online but WANDB_MODE={mode}; unset it (and `wandb login`), upload offline runs with "
             "`wandb sync <run folder>/wandb/offline-run-*`, or compare the run folders themselves")
    import wandb

    url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
    address = urlsplit(url)
    try:  # the public API retries for minutes when offline; a socket says so in seconds
        socket.create_connection((address.hostname, address.port or 443), timeout=timeout_s).close()
    except OSError as error:
        fail(f"cannot reach W&B at {url} ({error}); go online and `wandb login`, then `wandb sync` offline runs, "
             "or compare the local run folders instead")
    try:
        return [wandb_record(run) for run in wandb.Api(timeout=int(timeout_s)).runs(project)]
    except Exception as error:  # noqa: BLE001 - W&B raises many types; one line is what the user needs
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        fail(f"W&B could not list the runs of {project!r}: {first_line}; check ENTITY/PROJECT and `wandb login`")


def join_resumes(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """A run and its resumes as one run (a record's ``resumed_from`` names the run whose checkpoint it started from):
    the last part's record, with each part's loss curve up to the step the next part took over from, its wall time
    following on; a note for each joined run."""
    by_name = {record["run_name"]: record for record in records if record.get("run_name")}
    continued = {record.get("resumed_from") for record in records} & by_name.keys()
    joined, notes = [], []
    for record in records:
        if record.get("run_name") in continued:
            continue  # its resume carries it on
        parts = [record]
        while by_name.get(parts[0].get("resumed_from")) is not None and by_name[parts[0]["resumed_from"]] not in parts:
            parts.insert(0, by_name[parts[0]["resumed_from"]])
        if len(parts) == 1:
            joined.append(record)
            continue
        history: list[dict[str, Any]] = []
        for part, following in zip(parts, [*parts[1:], None]):
            taken_over = min((h["step"] for h in following["history"] if h.get("step") is not None), default=None) \
                if following is not None else None
            offset = max((h["wall_s"] for h in history if h.get("wall_s") is not None), default=0.0)
            history += [{**h, "wall_s": h["wall_s"] + offset} if h.get("wall_s") is not None else h
                        for h in part["history"] if taken_over is None or (h.get("step") or 0) < taken_over]
        joined.append({**record, "history": history})
        notes.append(f"{' resumed as '.join(str(part.get('run_name')) for part in parts)}: one run, counted once "
                     f"with the last part's figures")
    return joined, notes


def label_methods(records: list[dict[str, Any]]) -> None:
    """Sets ``method``: the compression method, with the parameters that tell its configs apart when several ran,
    after the strategy when the runs used several (``ddp``, ``fsdp2``, ``fsdp2 int8``)."""
    configs: dict[str, dict[str, dict]] = {}
    for record in records:
        if record.get("compress_config"):  # failed runs have none: they keep the bare method name
            config = record["compress_config"]
            configs.setdefault(record["compress_method"], {})[json.dumps(config, sort_keys=True)] = config
    for record in records:
        config = record.get("compress_config") or {}
        variants = list(configs.get(record["compress_method"], {}).values()) if config else []
        keys = sorted({k for v in variants for k in v if len({json.dumps(w.get(k)) for w in variants}) > 1})
        extra = " ".join(f"{k}={config[k]}" for k in keys if config.get(k) is not None)
        record["method"] = f"{record['compress_method']} {extra}".strip()
    if len({record["strategy"] for record in records if record.get("strategy")}) > 1:
        for record in (r for r in records if r.get("strategy")):  # records from before the field keep the method
            strategy = record["strategy"]
            record["method"] = strategy if record["method"] == "none" else f"{strategy} {record['method']}"


def stats(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (None with fewer than two values)."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def change(runs: list[dict], base: list[dict], key: str) -> tuple[float | None, float | None]:
    """Change of ``key`` against ``base`` in %: over seeds both have (mean ± sd of the pairs), else of the means."""
    base_by_seed = {r.get("seed"): r[key] for r in base if r.get(key) is not None}
    pairs = [(r[key], base_by_seed[r["seed"]]) for r in runs
             if r.get(key) is not None and r.get("seed") is not None and r["seed"] in base_by_seed]
    if not pairs:
        mean = stats([r[key] for r in runs if r.get(key) is not None])[0]
        base_mean = stats([r[key] for r in base if r.get(key) is not None])[0]
        pairs = [] if mean is None or base_mean is None else [(mean, base_mean)]
    return stats([100 * (x / b - 1) for x, b in pairs if b])


def run_length(record: dict[str, Any], lengths: dict[tuple, set]) -> int | None:
    """The steps a run is grouped by: its own where it finished, else (failed, interrupted) the one length its method's
    finished runs at its world size have, None where they have several or none."""
    if record["status"] == "ok":
        return record.get("steps")
    known = lengths.get((record["method"], record.get("world_size")), set())
    return next(iter(known)) if len(known) == 1 else None


def compare(records: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """One row per (method, world size, steps): runs, failures, and per metric mean, sd, count, change and its sd."""
    lengths: dict[tuple, set] = {}
    for record in records:
        if record["status"] == "ok":
            lengths.setdefault((record["method"], record.get("world_size")), set()).add(record.get("steps"))
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault((record["method"], record.get("world_size"), run_length(record, lengths)), []).append(record)
    rows = []
    # baseline first, then by method, world size and length
    order = sorted(groups, key=lambda group: (group[0] != baseline, group[0], group[1] or 0, group[2] or 0))
    for method, world, steps in order:
        runs = groups[(method, world, steps)]
        ok = [r for r in runs if r["status"] == "ok"]
        errors = [r["error"] for r in runs if r["status"] != "ok"]
        base = [r for r in groups.get((baseline, world, steps), []) if r["status"] == "ok"]
        row: dict[str, Any] = {"method": method, "world_size": world, "steps": steps, "runs": len(ok),
                               "failed": len(errors), "error": errors[-1] if errors else None, "_runs": ok,
                               "_lengths": len(lengths.get((method, world), ()))}
        for key in METRICS:
            values = [r[key] for r in ok if isinstance(r.get(key), (int, float))]
            row[f"{key}_mean"], row[f"{key}_sd"] = stats(values)
            row[f"{key}_n"] = len(values)
            row[f"{key}_change_pct"], row[f"{key}_change_sd"] = change(ok, base, key) if base and ok else (None, None)
        rows.append(row)
    return rows


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _cell(row: dict[str, Any], key: str, baseline: str) -> str:
    mean, sd, n = row[f"{key}_mean"], row[f"{key}_sd"], row[f"{key}_n"]
    if mean is None:
        return "—"
    text = _number(mean) + ("" if sd is None else f" ± {_number(sd)}")
    pct, pct_sd = row[f"{key}_change_pct"], row[f"{key}_change_sd"]
    if pct is not None and row["method"] != baseline:
        text += f" ({pct:+.1f}%" + ("" if pct_sd is None else f" ± {pct_sd:.1f}") + ")"
    return text + (f" [{n}/{row['runs']}]" if n < row["runs"] else "")


def markdown(rows: list[dict[str, Any]], baseline: str, notes: list[str], plots: list[str]) -> str:
    lines = [
        "# Run comparison", "",
        f"Mean ± sd across seeds (a run and its resumes are one run); in brackets the change against `{baseline}` at "
        "the same world size and steps in %, paired by seed where both ran it (mean ± sd of the pairs). [k/n]: only k "
        "of the n runs have the figure.", "",
        "| method | world | steps | runs | " + " | ".join(METRICS.values()) + " |",
        "|---|---|---|---|" + "---|" * len(METRICS),
    ]
    for row in rows:
        runs = str(row["runs"])
        if row["failed"]:
            error = (row["error"] or "").replace("|", "/")[:120]
            runs += f" ({row['failed']} failed: {error})"
        steps = "—" if row["steps"] is None else row["steps"]
        lines.append(f"| {row['method']} | {row['world_size']} | {steps} | {runs} | "
                     + " | ".join(_cell(row, key, baseline) for key in METRICS) + " |")
    if plots:
        lines += ["", *(f"![{name[:-4]}]({name})" for name in plots)]
    if notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    columns = ["method", "world_size", "steps", "runs", "failed", "error"]
    columns += [f"{key}_{part}" for key in METRICS for part in ("mean", "sd", "n", "change_pct", "change_sd")]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _name(row: dict[str, Any]) -> str:
    """``int8 w2``; ``int8 w2 300 steps`` where the method ran several lengths at that world size."""
    return f"{row['method']} w{row['world_size']}" + (f" {row['steps']} steps" if row["_lengths"] > 1 else "")


def _save(figure: Any, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_losses(rows: list[dict[str, Any]], x: str, path: Path) -> str | None:
    """Training and validation loss of every run against ``x`` (step or wall_s); a note if no run has a curve."""
    if not any(r["history"] for row in rows for r in row["_runs"]):
        return f"{path.name} not drawn: no history.jsonl lines (add callbacks.Quality to the runs)"
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, row in enumerate(rows):
        # A colour, line style and marker per group: curves that coincide (the same seed and steps) stay visible.
        look = {"color": f"C{index % 10}", "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
                "marker": MARKERS[index % len(MARKERS)], "lw": 1.2, "ms": 5, "mfc": "none"}
        for number, run in enumerate(row["_runs"]):
            for axis, key in ((axes[0], "train_loss"), (axes[1], "val_loss")):
                points = sorted((h[x], h[key]) for h in run["history"] if h.get(key) is not None and h.get(x) is not None)
                if points:  # markers on every k-th point, each group's from its own start: none lands on another's
                    every = max(len(rows), len(points) // 12)
                    axis.plot(*zip(*points), markevery=(index % every, every), label=_name(row) if number == 0 else None,
                              **look)
    for axis, title in zip(axes, ("training loss", "validation loss")):
        xlabel = "optimizer step" if x == "step" else "wall time since training started (s)"
        axis.set(title=title, xlabel=xlabel, ylabel="loss")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    _save(figure, path)
    return None


def plot_bars(rows: list[dict[str, Any]], key: str, label: str, path: Path, scale: float = 1.0) -> str | None:
    """Mean of ``key`` per group with sd error bars; a note if no group has it."""
    shown = [row for row in rows if row[f"{key}_mean"] is not None]
    if not shown:
        return f"{path.name} not drawn: no run has {key}"
    figure, axis = plt.subplots(figsize=(max(5.0, 0.8 * len(shown) + 2), 4))
    axis.bar([_name(r) for r in shown], [scale * r[f"{key}_mean"] for r in shown], capsize=3,
             yerr=[scale * (r[f"{key}_sd"] or 0) for r in shown], color=[f"C{i % 10}" for i in range(len(shown))])
    axis.set(ylabel=label)
    axis.tick_params(axis="x", labelrotation=30)
    _save(figure, path)
    return None


def plot_ratio_vs_ppl(rows: list[dict[str, Any]], baseline: str, path: Path) -> str | None:
    """Compression ratio against the change in validation perplexity, one point per group."""
    shown = [r for r in rows if r["compression_ratio_mean"] is not None and r["val_ppl_change_pct"] is not None]
    if not shown:
        return f"{path.name} not drawn: no group has a compression ratio and a perplexity change against {baseline}"
    figure, axis = plt.subplots(figsize=(6.5, 4.5))
    for index, row in enumerate(shown):
        axis.errorbar(row["compression_ratio_mean"], row["val_ppl_change_pct"], yerr=row["val_ppl_change_sd"] or 0,
                      fmt="o", color=f"C{index % 10}", capsize=3)
        axis.annotate(_name(row), (row["compression_ratio_mean"], row["val_ppl_change_pct"]), fontsize=8,
                      xytext=(4, 4), textcoords="offset points")
    axis.axhline(0, color="grey", lw=0.8)
    axis.set(xscale="log", xlabel="compression ratio vs fp32 gradients", ylabel=f"val perplexity change vs {baseline} (%)")
    _save(figure, path)
    return None


def report(records: list[dict[str, Any]], baseline: str, out: Path, notes: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Writes the tables and plots for ``records`` into ``out``; returns the table's rows."""
    records, joined = join_resumes(records)
    label_methods(records)
    rows = compare(records, baseline)
    notes = [*notes, *joined]
    if rows and not any(row["method"] == baseline for row in rows):
        methods = ", ".join(sorted({row["method"] for row in rows}))
        notes.append(f"no {baseline!r} runs: no changes computed; pass --baseline one of: {methods}")
    out.mkdir(parents=True, exist_ok=True)
    plots = {
        "loss_vs_step.png": plot_losses(rows, "step", out / "loss_vs_step.png"),
        "loss_vs_wall.png": plot_losses(rows, "wall_s", out / "loss_vs_wall.png"),
        "tokens_per_s.png": plot_bars(rows, "tokens_per_s", "tokens/s (mean ± sd)", out / "tokens_per_s.png"),
        "comm_share.png": plot_bars(rows, "comm_ratio", "communication share of a step (%)", out / "comm_share.png", scale=100),
        "ratio_vs_ppl.png": plot_ratio_vs_ppl(rows, baseline, out / "ratio_vs_ppl.png"),
    }
    notes += [note for note in plots.values() if note]
    drawn = [name for name, note in plots.items() if note is None]
    for name in set(plots) - set(drawn):
        (out / name).unlink(missing_ok=True)  # an earlier comparison's plot would no longer match the table
    (out / "comparison.md").write_text(markdown(rows, baseline, notes, drawn))
    write_csv(rows, out / "comparison.csv")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lit_fsdp compare_runs [PATHS] [--baseline METHOD] [--out FOLDER]``."""
    parser = argparse.ArgumentParser(prog="python -m lit_fsdp compare_runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="run folders, sweep folders or results.jsonl files (default: runs)")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read the runs of this W&B project instead (online only)")
    parser.add_argument("--baseline", default="none", help="method the changes are measured against (default: none)")
    parser.add_argument("--out", type=Path, help="output folder (default: FIRST_PATH/comparison, or runs/comparison)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="W&B: seconds to wait for the server")
    args = parser.parse_args(argv)
    if args.wandb:
        if args.paths:
            parser.error("give run folders or --wandb, not both")
        if not re.fullmatch(r"[^/\s]+/[^/\s]+", args.wandb):
            parser.error(f"--wandb {args.wandb!r} is not ENTITY/PROJECT")
        records, notes = load_wandb(args.wandb, args.timeout_s), []
    else:
        records, notes = load_local(args.paths or [Path("runs")])
    if not records:
        fail(f"no runs found in {args.wandb or ' '.join(map(str, args.paths or ['runs']))}; "
             "runs write results.jsonl through callbacks.Results")
    first = args.paths[0] if args.paths else None
    out = args.out or (first / "comparison" if first is not None and first.is_dir() else Path("runs") / "comparison")
    report(records, args.baseline, out, notes)
    print((out / "comparison.md").read_text())
    print(f"written to {out}: comparison.md, comparison.csv and the PNGs it shows")

