"""The slow-link benchmark's report: a Markdown table per rate, a row per method over its repeats."""

from __future__ import annotations

from repeats import Spread


def _cell(spread: Spread | None, spec: str = ".0f", suffix: str = "") -> str:
    return "n/a" if spread is None else spread.format(spec, suffix)


def table(records: list[dict], rate: str, statistic: str = "p50") -> str:
    """Markdown for one rate: a row per method over its repeats, speed-up against ``none`` from the medians of each
    run's ``statistic`` step time (``mean`` counts a semi-synchronous method's rare exchange steps)."""
    key = f"step_time_ms_{statistic}"
    runs: dict[str, list[dict]] = {}
    for r in records:
        if r["rate"] == rate:
            runs.setdefault(r["method"], []).append(r)
    base = {r["repeat"]: r[key] for r in runs.get("none", []) if r.get(key)}
    base_step = Spread.of(base.values())
    lines = [
        f"| method | runs | step ms {statistic} | speed-up vs none | comm ms/step | comm share | compression ratio "
        "| outer exchange hidden |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, rows in runs.items():
        done = [r for r in rows if "failed" not in r]
        failed = [r["failed"][:120].replace("|", "/") for r in rows if "failed" in r]
        count = f"{len(done)} of {len(rows)}" + (f"; failed: {failed[-1]}" if failed else "")
        step = Spread.of(r.get(key) for r in done)
        speedup = None
        paired = [base[r["repeat"]] / r[key] for r in done if r.get(key) and r["repeat"] in base]
        if base_step and step and paired:  # the ratio of the medians, with the range of the per-repeat ratios
            speedup = Spread(base_step.median / step.median, min(paired), max(paired), len(paired))
        share = Spread.of(None if r.get("comm_ratio") is None else 100 * r["comm_ratio"] for r in done)
        ratio = Spread.of(r.get("compression_ratio") for r in done)
        hidden = Spread.of(None if not r.get("outer_syncs") else 100 * (r.get("outer_hidden_share") or 0) for r in done)
        lines.append(
            f"| {method} | {count} | {_cell(step)} | {_cell(speedup, '.2f', 'x')} "
            f"| {_cell(Spread.of(r.get('comm_time_ms_total') for r in done))} | {_cell(share, '.0f', '%')} "
            f"| {'n/a' if ratio is None else f'{ratio.median:.1f}x'} | {_cell(hidden, '.0f', '%')} |"
        )
    return "\n".join(lines)


def report(setup: str, headings: dict[str, str], records: list[dict], statistic: str = "p50") -> str:
    """The setup, the legend and a table per rate that has runs."""
    legend = (
        f"Step ms {statistic}: each run's {statistic} over its timed steps; the median over the repeats (min-max in brackets). "
        "Speed-up vs none: median of none / median of the method (min-max of the per-repeat ratios in brackets). "
        "Comm ms/step and comm share: CommProfiler over the same timed steps (whose times include its recording). "
        "Outer exchange hidden: the share of a semi-synchronous method's exchange time its inner steps hid."
    )
    sections = [f"{heading}\n\n{table(records, rate, statistic)}" for rate, heading in headings.items()
                if any(r["rate"] == rate for r in records)]
    return "\n\n".join([setup, legend, *sections])
