"""Host <-> device copies on their own streams, with the bytes and the time they took counted per step.

On a GPU, host-to-device copies run on one side stream and device-to-host copies on another, so
they overlap compute; each copy returns a CUDA event that the consumer waits on (on its stream, the
host is not blocked). On a CPU "device" the same calls copy in place and return no event: the code
paths are the ones a GPU run takes, with the streams as no-ops.

**Emulated asynchronous copies** (CPU, for tests): with ``LIT_FSDP_EMULATED_COPY_DELAY_MS=<ms>`` each
direction's copies run in order on a thread of their own (the "stream"), each after a seeded random delay
of up to that many milliseconds, and events are futures that complete when the stream reaches them. The
computing thread stands for the compute stream: waiting on an event blocks it. A missing wait, or a buffer
reused before its copy ran, then changes the numbers, as it would on a GPU.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

Event = torch.cuda.Event | Future | None
EMULATED_DELAY_VARIABLE = "LIT_FSDP_EMULATED_COPY_DELAY_MS"


class EmulatedStream:
    """A CPU stand-in for a CUDA stream: work submitted runs in order on one thread, each copy after a random delay."""

    def __init__(self, name: str, max_delay_s: float, seed: int):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lit_fsdp_{name}_copies")
        self._random = random.Random(seed)
        self.max_delay_s = max_delay_s

    def copy(self, work: Callable[[], None]) -> Future:
        delay = self._random.uniform(0, self.max_delay_s)  # drawn on the submitting thread: reproducible order
        return self._thread.submit(lambda: (time.sleep(delay), work()))

    def wait_for(self, event: Event) -> None:
        """Later work on this stream starts after ``event`` (the host does not block)."""
        if isinstance(event, Future):
            self._thread.submit(event.result)

    def record(self) -> Future:
        """An event that completes when the work submitted so far has run."""
        return self._thread.submit(lambda: None)


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

    def __init__(self, device: torch.device, emulated_delay_ms: float | None = None):
        """
        Args:
            emulated_delay_ms: On a CPU device, emulate asynchronous copies with delays up to this (default: the
                ``LIT_FSDP_EMULATED_COPY_DELAY_MS`` variable; unset: copies in place).
        """
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.h2d_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.d2h_stream = torch.cuda.Stream(device) if self.on_cuda else None
        if emulated_delay_ms is None and os.environ.get(EMULATED_DELAY_VARIABLE):
            emulated_delay_ms = float(os.environ[EMULATED_DELAY_VARIABLE])
        self.emulated = None
        if not self.on_cuda and emulated_delay_ms is not None:
            seed = int(os.environ.get("RANK", "0"))
            self.emulated = {direction: EmulatedStream(direction, emulated_delay_ms / 1000, seed * 2 + index)
                             for index, direction in enumerate(("h2d", "d2h"))}
        self._on_stream = threading.local()  # the emulated stream this thread queues on (None: compute)
        self._lock = threading.Lock()
        self.totals = TransferTotals()

    @contextmanager
    def on_h2d_stream(self, after: Event = None) -> Iterator[None]:
        """Work queued inside runs on the host-to-device stream, after ``after`` (e.g. the last use of a buffer)."""
        if self.emulated is not None:
            stream = self.emulated["h2d"]
            stream.wait_for(after)
            self._on_stream.current = stream
            try:
                yield
            finally:
                self._on_stream.current = None
            return
        if not self.on_cuda:
            yield
            return
        with torch.cuda.stream(self.h2d_stream):
            if after is not None:
                self.h2d_stream.wait_event(after)
            yield

    def order_after_copies(self) -> None:
        """Inside ``on_h2d_stream``: the host-issued work that follows (a collective) needs the copies queued so far.

        On a GPU the stream orders it; an emulated stream runs copies on its own thread, so this waits for them.
        """
        stream = getattr(self._on_stream, "current", None)
        if stream is not None:
            stream.record().result()

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (host) into ``dst`` (device) on the current stream; call inside ``on_h2d_stream``."""
        self._copy("h2d", dst, src)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Copy ``src`` (device, just computed) into ``dst`` (pinned host) on the D2H stream; returns its event."""
        if self.emulated is not None:
            return self.emulated["d2h"].copy(lambda: self._copy_now("d2h", dst, src))
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
        stream = getattr(self._on_stream, "current", None)
        if stream is not None:
            stream.copy(lambda: self._copy_now(direction, dst, src))
            return
        if not self.on_cuda:
            self._copy_now(direction, dst, src)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        self.totals._timed.append((direction, start, end))
        self._count(direction, src.numel() * src.element_size(), 0.0)

    def _copy_now(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        began = time.perf_counter()
        dst.copy_(src)
        self._count(direction, src.numel() * src.element_size(), time.perf_counter() - began)

    def _count(self, direction: str, nbytes: int, seconds: float) -> None:
        with self._lock:  # emulated streams count from their own threads
            totals = self.totals
            setattr(totals, f"{direction}_bytes", getattr(totals, f"{direction}_bytes") + nbytes)
            setattr(totals, f"{direction}_s", getattr(totals, f"{direction}_s") + seconds)

    def record(self) -> Event:
        """An event at the current point of the current stream (None on CPU, where the computing thread is the stream)."""
        stream = getattr(self._on_stream, "current", None)
        if stream is not None:
            return stream.record()
        if not self.on_cuda:
            return None
        event = torch.cuda.Event(blocking=True)  # the worker thread waits on it: sleep, do not spin a core
        event.record()
        return event

    def wait(self, event: Event) -> None:
        """Make the current stream wait for ``event`` (the host does not block; an emulated one's compute thread does)."""
        if isinstance(event, Future):
            event.result()
        elif event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def synchronize(event: Event) -> None:
        """Block the calling host thread until ``event`` has happened."""
        if isinstance(event, Future):
            event.result()
        elif event is not None:
            event.synchronize()

    def take_totals(self) -> TransferTotals:
        """The step's totals (waits for the timed copies to finish), and a fresh count for the next step."""
        for stream in (self.emulated or {}).values():
            stream.record().result()
        with self._lock:
            totals, self.totals = self.totals, TransferTotals()
        for direction, start, end in totals._timed:
            end.synchronize()
            key = f"{direction}_s"
            setattr(totals, key, getattr(totals, key) + start.elapsed_time(end) / 1000)
        totals._timed.clear()
        return totals
