"""What a GPU check call leaves: the files a device window brings back (``summary.json``, ``hardware.json``,
``estimate.json``) and the two tables printed last, the training runs' rates and then the steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def runs(records: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every training run of the records, by name: the values that are a ``gpu_fit.fit`` record."""
    return [(name, run) for record in records for name, run in record.items()
            if isinstance(run, dict) and "losses" in run and "rc" in run]


def bring_back(records: list[dict[str, Any]], work: Path, out: Path) -> None:
    """The call's files under ``out``, few so that a device window brings them back: ``summary.json`` (the records),
    ``hardware.json`` (the probe's) and ``estimate.json`` (every run's estimate, by run name, as written beside it)."""
    (out / "summary.json").write_text(json.dumps(records, indent=1, default=str))
    if (work / "hardware.json").is_file():
        (out / "hardware.json").write_text((work / "hardware.json").read_text())
    estimates = {name: json.loads((work / run["estimate"]["file"]).read_text())
                 for name, run in runs(records) if "file" in run.get("estimate", {})}
    if estimates:
        (out / "estimate.json").write_text(json.dumps(estimates, indent=1) + "\n")


#: The runs table's columns: heading, the key in a run's figures, format.
RUN_COLUMNS = (("left out", "warmup_steps_left_out", "d"), ("measured", "steps_measured", "d"),
               ("tokens/s", "tokens_per_s", ",.0f"), ("MFU", "mfu", ".1%"),
               ("update ms", "offload_cpu_update_ms", ",.0f"),
               ("update GB/s", "offload_cpu_update_gbps", ".1f"), ("idle ms", "offload_device_idle_ms", ",.0f"),
               ("hidden", "offload_cpu_update_hidden_share", ".2f"),
               ("hideable", "offload_cpu_update_hideable_share", ".2f"), ("peak GiB", "peak_allocated_gb", ".2f"),
               ("min avail GiB", "min_mem_available_gib", ".1f"), ("est. step s", "estimate_step_time_s", ".2f"))


def runs_table(records: list[dict[str, Any]]) -> str:
    """The measured runs' rates, the first steps left out (the column says how many), ``n/a`` for a figure the run's
    record does not hold; update GB/s is ``estimate``'s bytes over the measured update time."""
    width = max([18, *(len(name) for name, run in runs(records) if "figures" in run)]) + 2
    lines = [f"{'run':<{width}}" + "".join(f"{heading:>{max(len(heading), 8) + 2}}" for heading, _, _ in RUN_COLUMNS)]
    for name, run in runs(records):
        if "figures" not in run:
            continue
        cells = []
        for heading, key, form in RUN_COLUMNS:
            value = run["figures"].get(key)
            cells.append(f"{'n/a' if value is None else format(value, form):>{max(len(heading), 8) + 2}}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)


def steps_table(records: list[dict[str, Any]]) -> str:
    """A line a step: its status, seconds, and the record's plain figures (and its summary's rates), cut at 400
    characters."""
    width = max([18, *(len(r["step"]) for r in records)]) + 2
    lines = [f"{'step':<{width}}{'status':<9}{'s':>7}  figures"]
    for r in records:
        shown = {k: v for k, v in r.items() if k not in ("step", "status", "rc", "seconds", "versions", "hardware", "cpu",
                                                         "nvidia_smi", "failed") and not isinstance(v, (dict, list))}
        if isinstance(r.get("summary"), dict):
            shown.update({k: v for k, v in r["summary"].items()
                          if k in ("warmup_steps_left_out", "tokens_per_s", "mfu") or "hidden" in k})
        text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        lines.append(f"{r['step']:<{width}}{r['status']:<9}{r['seconds']:>7.1f}  {text[:400]}")
    return "\n".join(lines)
