"""CPU stand-ins for a GPU's copy streams and compute stream, so that tests see what a missing ordering does.

With ``LIT_FSDP_EMULATED_COPY_DELAY_MS=<ms>`` (``offload.transfers.Transfers``) each direction's copies run in order
on a thread of their own (the "stream"), each after a seeded random delay of up to that many milliseconds, and
events are futures that complete when the stream reaches them. The computing thread issues the compute stream's
work: waiting on an event blocks it. The code that orders the streams is the GPU's, called on these stand-ins, so
removing one ordering removes it from the emulation too, and the numbers change as they would on a GPU:
- copy→compute: a consumer that does not wait for a copy's event reads the buffer before the copy landed;
- compute→copy: the device runs behind the host (``EmulatedCompute``: an event recorded on the compute stream
  completes a seeded random delay, up to the same bound, after the host recorded it). A device-to-host copy
  reads its source when its stream reaches it: unless the stream waited for the compute queued before the copy
  (``wait_stream``), that compute has not completed then, and the copy delivers garbage (NaN);
- the caching allocator: an emulated copy holds its device tensor's memory only weakly, as the allocator does
  once the tensor's owner frees it, unless ``record_stream`` was called (``EmulatedStream.hold`` keeps it until
  the stream has run what was queued). A device-to-host copy whose source was freed first delivers garbage.
What it cannot show: a write into memory the allocator handed to another tensor (a host-to-device copy into a
target freed unread, or into memory the compute queued before still reads): it has no allocator to hand it out.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from compress.torch_compat import storage_weak_ref


class EmulatedCompute:
    """A CPU stand-in for the compute stream as the copy streams see it: the device runs behind the host, so an event
    recorded on it completes a seeded random delay (up to ``max_delay_s``) after the host recorded it, in order."""

    def __init__(self, max_delay_s: float, seed: int):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lit_fsdp_compute_lag")
        self._random = random.Random(seed)
        self.max_delay_s = max_delay_s
        self._deadline = 0.0
        self._lock = threading.Lock()

    def record(self) -> Future:
        """An event after the compute queued so far: it completes once the device has caught up with it."""
        with self._lock:
            self._deadline = max(self._deadline, time.perf_counter() + self._random.uniform(0, self.max_delay_s))
            deadline = self._deadline
        return self._thread.submit(lambda: time.sleep(max(0.0, deadline - time.perf_counter())))


class EmulatedStream:
    """A CPU stand-in for a CUDA copy stream: work submitted runs in order on one thread, each copy after a random delay."""

    def __init__(self, name: str, max_delay_s: float, seed: int):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lit_fsdp_{name}_copies")
        self._random = random.Random(seed)
        self.max_delay_s = max_delay_s
        self._after_compute: Future | None = None  # what ``wait_stream`` waited for, not yet taken by a copy

    def copy(self, work: Callable[[bool], None], compute: EmulatedCompute | None = None) -> Future:
        """Queue ``work``; with ``compute``, it reads memory the compute stream wrote, when the stream reaches it, and
        is told whether the compute queued before it was issued had completed then (``wait_stream`` orders it so)."""
        written = None
        if compute is not None:
            written, self._after_compute = self._after_compute or compute.record(), None
        delay = self._random.uniform(0, self.max_delay_s)  # drawn on the submitting thread: reproducible order

        def run() -> None:
            complete = written is None or written.done()
            time.sleep(delay)
            work(complete)

        return self._thread.submit(run)

    def wait_for(self, event: Future | None) -> None:
        """Later work on this stream starts after ``event`` (the host does not block)."""
        if isinstance(event, Future):
            self._thread.submit(event.result)

    wait_event = wait_for

    def wait_stream(self, compute: EmulatedCompute) -> None:
        """Later work on this stream starts after the compute queued so far."""
        self._after_compute = compute.record()
        self.wait_for(self._after_compute)

    def hold(self, tensor: torch.Tensor) -> None:
        """``record_stream``: ``tensor``'s memory stays allocated until this stream has run the work queued so far."""
        self._thread.submit(lambda _kept=tensor: None)

    def record(self) -> Future:
        """An event that completes when the work submitted so far has run."""
        return self._thread.submit(lambda: None)


class DeviceMemory:
    """A device tensor as an emulated copy holds it: as the caching allocator does, not at all (its owner may free it
    and the memory go to another tensor) unless ``record_stream`` was called; ``get`` is None once it was freed. The
    weak reference is to the storage, which views share: torch's own, as its multiprocessing uses it."""

    def __init__(self, tensor: torch.Tensor):
        self._storage = storage_weak_ref(tensor)
        self._view = (tensor.storage_offset(), tensor.shape, tensor.stride())
        self._dtype = tensor.dtype

    def get(self) -> torch.Tensor | None:
        storage = self._storage()
        return None if storage is None else torch.empty(0, dtype=self._dtype).set_(storage, *self._view)


def garbage(tensor: torch.Tensor) -> None:
    """What a copy that read memory not (or no longer) holding its source delivers: NaN (an integer's largest value)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.fill_(float("nan"))
    else:
        tensor.fill_(True if tensor.dtype == torch.bool else torch.iinfo(tensor.dtype).max)
