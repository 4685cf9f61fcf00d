"""Host <-> device copies on their own streams, with the bytes and the time they took counted per step.

On a GPU, host-to-device copies run on one side stream and device-to-host copies on another, so
they overlap compute; each copy returns a CUDA event that the consumer waits on (on its stream, the
host is not blocked). On a CPU "device" the same calls copy in place and return no event: the code
paths are the ones a GPU run takes, with the streams as no-ops.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

Event = torch.cuda.Event | None


@dataclass
class TransferTotals:
    """Bytes moved and seconds spent in each direction (GPU: measured between CUDA events on the copy streams)."""

    h2d_bytes: int = 0
    h2d_s: float = 0.0
    d2h_bytes: int = 0
    d2h_s: float = 0.0
    _timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)


class Transfers:
    """Copies between pinned host buffers and the device, timed; ``take_totals`` ends a step's count."""

    def __init__(self, device: torch.device):
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.h2d_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.d2h_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.totals = TransferTotals()

    @contextmanager
    def on_h2d_stream(self, after: Event = None) -> Iterator[None]:
        """Work queued inside runs on the host-to-device stream, after ``after`` (e.g. the last use of a buffer)."""
        if not self.on_cuda:
            yield
            return
        with torch.cuda.stream(self.h2d_stream):
            if after is not None:
                self.h2d_stream.wait_event(after)
            yield

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (host) into ``dst`` (device) on the current stream; call inside ``on_h2d_stream``."""
        self._copy("h2d", dst, src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Copy ``src`` (device, just computed) into ``dst`` (pinned host) on the D2H stream; returns its event."""
        if not self.on_cuda:
            self._copy("d2h", dst, src)
            return None
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            self._copy("d2h", dst, src)
            done = self.record()
        src.record_stream(self.d2h_stream)  # the caching allocator must not reuse src before the copy ran
        return done

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = src.numel() * src.element_size()
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            self.totals._timed.append((direction, start, end))
        else:
            began = time.perf_counter()
            dst.copy_(src)
            setattr(self.totals, f"{direction}_s", getattr(self.totals, f"{direction}_s") + time.perf_counter() - began)
        setattr(self.totals, f"{direction}_bytes", getattr(self.totals, f"{direction}_bytes") + nbytes)

    def record(self) -> Event:
        """An event at the current point of the current stream (None on CPU)."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event(blocking=True)  # the worker thread waits on it: sleep, do not spin a core
        event.record()
        return event

    def wait(self, event: Event) -> None:
        """Make the current stream wait for ``event`` (the host does not block)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def synchronize(event: Event) -> None:
        """Block the calling host thread until ``event`` has happened."""
        if event is not None:
            event.synchronize()

    def take_totals(self) -> TransferTotals:
        """The step's totals (waits for the timed copies to finish), and a fresh count for the next step."""
        totals, self.totals = self.totals, TransferTotals()
        for direction, start, end in totals._timed:
            end.synchronize()
            key = f"{direction}_s"
            setattr(totals, key, getattr(totals, key) + start.elapsed_time(end) / 1000)
        totals._timed.clear()
        return totals
