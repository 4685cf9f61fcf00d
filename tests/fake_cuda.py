"""``FakeGpu``: a CUDA device as ``compress.timing`` uses it (timing events, ``torch.cuda.synchronize``), on the CPU."""

from __future__ import annotations

import pytest
import torch


class FakeEvent:
    """A ``torch.cuda.Event``: stamped with the device's time when recorded, finished once the device catches up."""

    def __init__(self, gpu: FakeGpu, enable_timing: bool = False) -> None:
        self.gpu, self.enable_timing = gpu, enable_timing
        self.at_ms: float | None = None
        self.done = False

    def record(self, stream=None) -> None:
        self.at_ms, self.done = self.gpu.now_ms, False
        self.gpu.recorded.append(self)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.gpu.waits += 1
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if not (self.done and end.done):  # as CUDA refuses: the host would have read a time not yet written
            raise RuntimeError("Both events must be completed before calculating elapsed time")
        return end.at_ms - self.at_ms


class FakeGpu:
    """Queued work moves the device's clock (``run``); recorded events finish when the host waits (``waits``
    counts ``torch.cuda.synchronize`` and ``Event.synchronize`` calls) or when the device catches up by itself
    (``catch_up``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now_ms = 0.0
        self.waits = 0
        self.recorded: list[FakeEvent] = []
        monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False, **_: FakeEvent(self, enable_timing))
        monkeypatch.setattr(torch.cuda, "synchronize", self.synchronize)

    def run(self, ms: float) -> None:
        """Queue ``ms`` of work."""
        self.now_ms += ms

    def catch_up(self) -> None:
        """The device finishes what was queued, without the host waiting."""
        for event in self.recorded:
            event.done = True

    def synchronize(self, device=None) -> None:
        self.waits += 1
        self.catch_up()
