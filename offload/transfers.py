"""Host <-> device copies on their own streams, with the bytes and the time they took counted per step.

On a GPU, host-to-device copies run on one side stream and device-to-host copies on another, so
they overlap compute; each copy returns a CUDA event that the consumer waits on (on its stream, the
host is not blocked). On a CPU "device" the same calls copy in place and return no event: the code
paths are the ones a GPU run takes, with the streams as no-ops.

**Emulated asynchronous copies** (CPU, for tests): with ``LIT_FSDP_EMULATED_COPY_DELAY_MS=<ms>`` the copy streams
and the compute stream are stand-ins (``offload.emulated_streams``), and the ordering code below is the GPU's, called
on them: removing one ordering removes it from the emulation too, and the losses change as they would on a GPU.

**The backward's clock** (``BackwardClock``): what the CPU updates hide is measured against the device's
backward, not the host's. The host's backward is stretched by its waits for a free gradient buffer (a CPU-bound step
waits for the update that frees one), and the device, out of queued work, idles through them: timing events on the
compute stream at the backward's ends and around each such wait give the device's compute and its idle gaps, read
once the step has waited for its CPU updates. On a CPU "device" the computing thread is the device: host times.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from offload.emulated_streams import DeviceMemory, EmulatedCompute, EmulatedStream, garbage

Event = torch.cuda.Event | Future | None
EMULATED_DELAY_VARIABLE = "LIT_FSDP_EMULATED_COPY_DELAY_MS"


@dataclass(frozen=True)
class Mark:
    """A point of the computing thread: its host time, and on a GPU a timing event on the compute stream there."""

    host_s: float
    event: torch.cuda.Event | None = None


def device_seconds(start: Mark, end: Mark) -> float:
    """Seconds the compute stream took from ``start`` to ``end`` (events complete); without a device, the host's."""
    if start.event is None or end.event is None:
        return end.host_s - start.host_s
    return start.event.elapsed_time(end.event) / 1000


@dataclass
class _Span:
    begin: Mark
    end: Mark | None = None
    waits: list[tuple[Mark, Mark]] = field(default_factory=list)


@dataclass(frozen=True)
class BackwardTimes:
    """One backward: its host interval (perf_counter), the device's compute in it, and the device's idle gaps at the
    host's waits, placed on the host clock (each ends where its wait ended: an idle device starts the next work as
    soon as the host queues it)."""

    host: tuple[float, float]
    device_s: float
    idle: tuple[tuple[float, float], ...]


class BackwardClock:
    """Marks each backward's ends and the computing thread's waits in it (see the module docstring); no host sync."""

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self._spans: list[_Span] = []

    def mark(self) -> Mark:
        event = None
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return Mark(time.perf_counter(), event)  # after the record: an idle device reaches the event about now

    def begin(self) -> None:
        self._spans.append(_Span(self.mark()))

    def end(self) -> None:
        if self._spans and self._spans[-1].end is None:
            self._spans[-1].end = self.mark()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait of the computing thread (for a gradient buffer); outside a backward, nothing is marked."""
        span = self._spans[-1] if self._spans and self._spans[-1].end is None else None
        if span is None:
            yield
            return
        before = self.mark()
        try:
            yield
        finally:
            span.waits.append((before, self.mark()))

    def take(self) -> list[BackwardTimes]:
        """The backwards ended since the last call, and a fresh count. Call after the step has waited for its CPU
        updates: they waited for every gradient's copy, which the copy stream started after the backward's kernels,
        so the end events are complete and the one ``synchronize`` below returns at once (a GPU read needs it)."""
        spans, self._spans = [span for span in self._spans if span.end is not None], []
        times = []
        for span in spans:
            if span.end.event is not None:
                span.end.event.synchronize()
            idle = []
            for before, after in span.waits:
                # the device idles from when it ran out of work to the wait's end: at most the wait
                gap = min(max(0.0, device_seconds(before, after)), after.host_s - before.host_s)
                idle.append((after.host_s - gap, after.host_s))
            device_s = device_seconds(span.begin, span.end) - sum(stop - start for start, stop in idle)
            times.append(BackwardTimes((span.begin.host_s, span.end.host_s), max(0.0, device_s), tuple(idle)))
        return times


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
        self.compute: EmulatedCompute | None = None  # the emulated compute stream (a GPU's is the current stream)
        if not self.on_cuda and emulated_delay_ms is not None:
            seed = int(os.environ.get("RANK", "0"))
            self.emulated = {direction: EmulatedStream(direction, emulated_delay_ms / 1000, seed * 2 + index)
                             for index, direction in enumerate(("h2d", "d2h"))}
            self.h2d_stream, self.d2h_stream = self.emulated["h2d"], self.emulated["d2h"]
            self.compute = EmulatedCompute(emulated_delay_ms / 1000, (1 << 16) + seed)
        self._on_stream = threading.local()  # the emulated stream this thread queues on (None: compute)
        self._lock = threading.Lock()
        self.totals = TransferTotals()
        self.clock = BackwardClock(self.on_cuda)  # the engine marks the backward, the gradient pipeline its waits

    @contextmanager
    def on_h2d_stream(self, after: Event = None, after_compute: bool = False) -> Iterator[None]:
        """Work queued inside runs on the host-to-device stream, after ``after`` (e.g. the last use of a buffer) and,
        with ``after_compute``, after the compute queued so far (the copy writes into memory the compute stream's
        allocator handed out, which its queued work may still read)."""
        if self.h2d_stream is None:  # a CPU device without emulation: copies in place
            yield
            return
        if after_compute:
            self.h2d_stream.wait_stream(self._compute_stream())
        with self._on(self.h2d_stream):
            if after is not None:
                self.h2d_stream.wait_event(after)
            yield

    def _compute_stream(self) -> torch.cuda.Stream | EmulatedCompute:
        return self.compute if self.emulated is not None else torch.cuda.current_stream(self.device)

    @contextmanager
    def _on(self, stream: torch.cuda.Stream | EmulatedStream) -> Iterator[None]:
        """Work queued inside goes to ``stream``."""
        if self.emulated is None:
            with torch.cuda.stream(stream):
                yield
            return
        self._on_stream.current = stream
        try:
            yield
        finally:
            self._on_stream.current = None

    def _record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream | EmulatedStream) -> None:
        """The caching allocator must not hand out device ``tensor``'s memory before ``stream`` ran what is queued."""
        if self.emulated is None:
            tensor.record_stream(stream)
        else:
            stream.hold(tensor)

    def read_by_h2d(self, tensor: torch.Tensor) -> None:
        """The caching allocator must not hand out device ``tensor``'s memory again before the host-to-device copies
        queued so far ran (one written there, should it be freed unread)."""
        if self.h2d_stream is not None:
            self._record_stream(tensor, self.h2d_stream)

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

    def measure_h2d(self, dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
        """Bytes per second of copying ``src`` (pinned host) into ``dst`` (device), timed on the H2D stream, not counted
        in the step's totals (``activation_plan: auto`` weighs the link with it)."""
        numel = min(dst.numel(), src.numel())
        with torch.cuda.stream(self.h2d_stream):
            dst[:numel].copy_(src[:numel], non_blocking=True)  # the first copy pays for setting up the mapping
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(repeats):
                dst[:numel].copy_(src[:numel], non_blocking=True)
            end.record()
        end.synchronize()
        return repeats * numel * src.element_size() / (begin.elapsed_time(end) / 1e3)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Copy ``src`` (device, just computed) into ``dst`` (pinned host) on the D2H stream; returns its event."""
        if self.d2h_stream is None:  # a CPU device without emulation: in place
            self._copy_now("d2h", dst, src)
            return None
        self.d2h_stream.wait_stream(self._compute_stream())  # src is written by the compute queued so far
        with self._on(self.d2h_stream):
            self._copy("d2h", dst, src)
            done = self.record()
        self._record_stream(src, self.d2h_stream)  # the caching allocator must not reuse src before the copy ran
        return done

    def _copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = getattr(self._on_stream, "current", None)
        if stream is not None:
            self._emulated_copy(stream, direction, dst, src)
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

    def _emulated_copy(self, stream: EmulatedStream, direction: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue the copy on ``stream``, holding the device side only as the allocator would (``DeviceMemory``)."""
        host, device = (dst, DeviceMemory(src)) if direction == "d2h" else (src, DeviceMemory(dst))
        nbytes = src.numel() * src.element_size()

        def work(source_written: bool) -> None:  # references no device tensor: the owner's frees are seen
            began = time.perf_counter()
            memory = device.get()
            if direction == "d2h":
                if memory is None or not source_written:
                    garbage(host)  # the source is not computed yet, or its memory went to another tensor
                else:
                    host.copy_(memory)
            elif memory is not None:  # freed unread: the bytes would land in the memory's next owner (not emulated)
                memory.copy_(host)
            self._count(direction, nbytes, time.perf_counter() - began)

        stream.copy(work, self.compute if direction == "d2h" else None)

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
        """An event at the current point of the current stream (None on a CPU device without emulation, where the
        computing thread is the stream)."""
        stream = getattr(self._on_stream, "current", None)
        if stream is not None:
            return stream.record()
        if self.compute is not None:
            return self.compute.record()
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
