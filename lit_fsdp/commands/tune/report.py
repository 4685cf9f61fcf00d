"""What a search leaves in ``OUT``: ``best.yaml`` (a config overlay ``fit --config`` accepts), ``report.md`` with a table
of the trials and the rejected candidates, ``tokens_per_s.png`` (tokens/s per trial, the best marked) and
``summary.json`` (the same outcome for scripts). ``trials.jsonl`` is appended trial by trial while the search runs
(``append_trial``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib
import yaml

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from lit_fsdp.commands.tune.controller import SearchResult  # noqa: E402
from lit_fsdp.commands.tune.memory import GIB, MemoryFilter  # noqa: E402
from lit_fsdp.commands.tune.space import RunShape  # noqa: E402
from lit_fsdp.commands.tune.trials import Trial  # noqa: E402

PLOT = "tokens_per_s.png"


def append_trial(out: Path, trial: Trial) -> None:
    """One line of ``OUT/trials.jsonl``: the trial's knobs, status, figures, memory estimate and the judge's findings."""
    with open(out / "trials.jsonl", "a") as f:
        f.write(json.dumps(trial.record(), default=str) + "\n")


def speedup(result: SearchResult) -> float | None:
    """The best trial's tokens/s over the default's, measured in the same search."""
    if result.best is None or result.default is None or not result.default.tokens_per_s:
        return None
    return result.best.tokens_per_s / result.default.tokens_per_s


def write_best(path: Path, result: SearchResult, run: RunShape, base_compression: dict[str, Any] | None) -> None:
    """The best candidate as a config overlay, with where it came from in comments."""
    best = result.best
    assert best is not None
    gain = speedup(result)
    header = [
        "# lit_fsdp tune: the fastest candidate that fit, as an overlay of the configs the search ran:",
        "#   python -m lit_fsdp fit --config <those configs> --config best.yaml",
        f"# trial {best.index} of {sum(t.index is not None for t in result.trials)}: {best.tokens_per_s:,.0f} tokens/s"
        + (f", {gain:.2f}x the default's {result.default.tokens_per_s:,.0f} in the same search" if gain else ""),
        f"# changes from the default: {best.candidate.changes(result.default.candidate) if result.default else 'n/a'}",
    ]
    body = yaml.safe_dump(best.candidate.overlay(run, base_compression), sort_keys=False)
    path.write_text("\n".join(header) + "\n" + body)


def _number(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"


def estimate_error(trial: Trial, memory: MemoryFilter) -> float | None:
    """(estimate - measured) / measured of the peak, with the final calibration; None for the calibrating trial."""
    if trial.estimate is None or not trial.peak_gb or trial.index == memory.calibrated_by:
        return None
    return (trial.estimate["analytic"] + memory.overhead / GIB - trial.peak_gb) / trial.peak_gb


def _row(trial: Trial, result: SearchResult, memory: MemoryFilter) -> str:
    reference = result.default.candidate if result.default else trial.candidate
    error = estimate_error(trial, memory)
    estimate = None if trial.estimate is None else trial.estimate["analytic"] + memory.overhead / GIB
    loss = (None if trial.check_loss is None or result.default is None or result.default.check_loss is None
            else trial.check_loss - result.default.check_loss)
    status = trial.status + (f" ({', '.join(trial.flags)})" if trial.flags else "")
    if trial.status != "ok":
        status += f": {(trial.error or '')[:100]}"
    finding = trial.findings[0]["kind"] + ": " + trial.findings[0]["evidence"] if trial.findings else ""
    best = " **best**" if trial is result.best else ""
    cells = [
        f"{trial.index}{best}", trial.source, f"`{trial.candidate.changes(reference)}`", status.replace("|", "/"),
        _number(trial.tokens_per_s), _number(trial.step_time_ms_p50), _number(trial.step_time_ms_p90),
        _number(trial.peak_gb), _number(estimate), "—" if error is None else f"{error:+.0%}",
        "—" if trial.comm_ratio is None else f"{trial.comm_ratio:.0%}", _number(trial.comm_exposed_ms),
        "—" if loss is None else f"{loss:+.4f}", finding.replace("|", "/"),
    ]
    return "| " + " | ".join(cells) + " |"


def plot(trials: list[Trial], best: Trial | None, path: Path) -> None:
    """Tokens/s of each trial (failed ones at 0, marked x), the highest so far as a step line, the best as a star."""
    ran = [t for t in trials if t.index is not None]
    figure, axis = plt.subplots(figsize=(max(6.0, 0.5 * len(ran) + 3), 4))
    best_so_far, line = 0.0, []
    for trial in ran:
        value = trial.tokens_per_s or 0.0
        if trial.eligible:
            best_so_far = max(best_so_far, value)
        line.append(best_so_far)
        style = dict(marker="o", color="C0") if trial.eligible else dict(marker="x", color="C3")
        axis.plot([trial.index], [value], linestyle="none", **style)
    axis.step([t.index for t in ran], line, where="post", color="C1", label="highest so far")
    if best is not None:
        axis.plot([best.index], [best.tokens_per_s], marker="*", markersize=16, color="C2", linestyle="none", label="best")
    axis.set(xlabel="trial", ylabel="tokens/s", title="tokens/s per trial (x: failed, flagged or over memory)")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_summary(out: Path, result: SearchResult, memory: MemoryFilter) -> dict[str, Any]:
    """``summary.json``: trials run and rejected, why the search stopped, the best against the default, the filter."""
    ran = [t for t in result.trials if t.index is not None]
    errors = [e for t in ran if (e := estimate_error(t, memory)) is not None]

    def describe(trial: Trial | None) -> dict[str, Any] | None:
        if trial is None:
            return None
        changes = trial.candidate.changes(result.default.candidate) if result.default else None
        return {"index": trial.index, "source": trial.source, "tokens_per_s": trial.tokens_per_s, "peak_gb": trial.peak_gb,
                "knobs": trial.candidate.knobs(), "changes": changes, "findings": trial.findings}

    summary = {
        "trials_run": len(ran), "rejected": len(result.trials) - len(ran), "stop_reason": result.stop_reason,
        "default": describe(result.default), "best": describe(result.best), "speedup": speedup(result),
        "memory": {"calibrated_by": memory.calibrated_by, "overhead_gb": memory.overhead / GIB,
                   "budget_gb": memory.device_budget / GIB, "estimate_errors": errors},
        "notes": result.notes,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def write_report(out: Path, result: SearchResult, memory: MemoryFilter, header: list[str]) -> None:
    """``report.md`` (the ``header`` lines, the trials, the rejected candidates, notes), the plot and ``summary.json``."""
    ran = [t for t in result.trials if t.index is not None]
    rejected = [t for t in result.trials if t.index is None]
    by_memory = sum((t.error or "").startswith("memory filter") for t in rejected)
    errors = [abs(e) for e in write_summary(out, result, memory)["memory"]["estimate_errors"]]
    lines = ["# lit_fsdp tune", "", *header, ""]
    statuses = ", ".join(f"{sum(t.status == s for t in ran)} {s}" for s in ("ok", "failed", "oom", "timeout")
                         if any(t.status == s for t in ran))
    lines.append(f"{len(ran)} trials run ({statuses}); {len(rejected)} candidates rejected without running "
                 f"({by_memory} by the memory filter). Stopped: {result.stop_reason}.")
    gain = speedup(result)
    if result.best is not None:
        lines.append(f"Best: trial {result.best.index} ({result.best.source}), {result.best.tokens_per_s:,.0f} tokens/s"
                     + (f", **{gain:.2f}x** the default's {result.default.tokens_per_s:,.0f}" if gain else "")
                     + " in these short trials; overlay in `best.yaml`.")
    calibration = (f"calibrated by trial {memory.calibrated_by} (overhead {memory.overhead / GIB:+.2f} GB per process)"
                   if memory.calibrated_by is not None else "not calibrated")
    lines.append(f"Memory filter: {calibration}; budget {memory.device_budget / GIB:.2f} GB per process"
                 + (f"; estimate error on the other measured trials: mean {sum(errors) / len(errors):.0%}, max {max(errors):.0%}"
                    if errors else "") + ".")
    lines += ["", "Changes are from the default; loss Δ is the validation loss after the trial's steps minus the default's; "
              "the judge column is its most pressing finding.", "",
              "| trial | source | changes | status | tokens/s | step ms p50 | step ms p90 | peak GB | estimate GB | "
              "estimate error | comm share | exposed comm ms | loss Δ | judge |",
              "|" + "---|" * 14]
    lines += [_row(trial, result, memory) for trial in ran]
    if rejected:
        lines += ["", "## Rejected without running", "", "| source | changes | reason |", "|---|---|---|"]
        reference = result.default.candidate if result.default else None
        for trial in rejected:
            changes = trial.candidate.changes(reference) if reference else trial.candidate.key()
            lines.append(f"| {trial.source} | `{changes}` | {(trial.error or '').replace('|', '/')} |")
    if result.notes:
        lines += ["", "## Notes", "", *(f"- {note}" for note in result.notes)]
    if ran:
        plot(result.trials, result.best, out / PLOT)
        lines += ["", f"![tokens/s per trial]({PLOT})"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
