"""Benchmark rows run in turns and summarised by median and range, for the scripts that time runs against each other.

Running every row once before any row runs again spreads a drift in the machine's load (another job,
thermal throttling) over all rows instead of over whichever row ran last; the median moves least for
one disturbed run, and the range shows how far runs of the same row disagree.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence, TypeVar

Row = TypeVar("Row")


def in_turns(rows: Sequence[Row], repeats: int) -> list[tuple[int, Row]]:
    """``(repeat, row)`` in run order: every row once, in order, then every row again, ``repeats`` times."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    return [(repeat, row) for repeat in range(repeats) for row in rows]


@dataclass(frozen=True)
class Spread:
    """Median, lowest and highest of one figure over the repeats of a row."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Spread | None:
        """The spread of the values that are not None; None when there are none."""
        present = [v for v in values if v is not None]
        if not present:
            return None
        return cls(statistics.median(present), min(present), max(present), len(present))

    def format(self, spec: str = ".0f", suffix: str = "") -> str:
        """``median (low-high)`` with ``suffix`` on each number; the median alone where low and high print alike."""
        median, low, high = (f"{value:{spec}}{suffix}" for value in (self.median, self.low, self.high))
        return median if low == high else f"{median} ({low}-{high})"
