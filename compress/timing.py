"""Device time without host waits: the hooks record where their work starts and ends, a callback reads it once a step.

On CUDA a ``DeviceClock`` records a pair of timing events on the current stream around each block of
queued work and returns at once; ``read()`` waits for the device once (``wait_for_device``, the one seam
through which the communication path blocks the host) and adds the events' elapsed times. On CPU the
work has run by the time the block ends, so the block's wall time is added directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: pending event pairs beyond which ``DeviceClock`` collects those already finished, without waiting
MAX_PENDING = 4096
#: pending pairs beyond which it waits for the device (a run whose clock nobody reads stays bounded)
HARD_LIMIT = 65536


def wait_for_device(device: torch.device) -> None:
    """Block the host until ``device`` has finished its queued work: the communication path's only such wait.

    Tests count calls of this function (``tests/sync_counter.py``) as host synchronisations.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DeviceClock:
    """Seconds per named counter, measured on the device where work is queued, read without a wait per block.

    Blocks may nest: a counter gets its block's time less that of the blocks nested in it (PowerSGD's
    compression time excludes the all-reduces inside it, which count as collective time).
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._pending: list[tuple[str, str | None, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: list[str] = []
        self._device: torch.device | None = None

    def _add(self, name: str, outer: str | None, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        if outer is not None:
            self._seconds[outer] = self._seconds.get(outer, 0.0) - seconds

    @contextmanager
    def time(self, name: str, device: torch.device) -> Iterator[None]:
        """Time the work queued inside the block (on ``device``'s current stream) under ``name``."""
        outer = self._open[-1] if self._open else None
        self._open.append(name)
        try:
            if device.type != "cuda":
                start = time.perf_counter()
                yield
                self._add(name, outer, time.perf_counter() - start)
                return
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            yield
            end.record()
            self._device = device
            self._pending.append((name, outer, begin, end))
        finally:
            self._open.pop()
        if len(self._pending) >= MAX_PENDING and not self._open:
            self._collect_finished()
            if len(self._pending) >= HARD_LIMIT:
                self._resolve()

    def _collect_finished(self) -> None:
        """Add the pairs whose end the device has reached, in order, without waiting for the others."""
        done = 0
        for name, outer, begin, end in self._pending:
            if not end.query():
                break
            self._add(name, outer, begin.elapsed_time(end) / 1000)
            done += 1
        del self._pending[:done]

    def _resolve(self) -> None:
        if not self._pending:
            return
        wait_for_device(self._device)  # one wait for every pending pair
        for name, outer, begin, end in self._pending:
            self._add(name, outer, begin.elapsed_time(end) / 1000)
        self._pending.clear()

    def read(self) -> dict[str, float]:
        """Seconds per counter since the last read (one device wait if CUDA work was timed), and start again."""
        self._resolve()
        seconds, self._seconds = self._seconds, {}
        return seconds
