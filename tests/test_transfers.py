"""Emulated asynchronous copies on CPU: copies land only when their stream reaches them, as on a GPU."""

from concurrent.futures import Future

import torch

from offload.transfers import EMULATED_DELAY_VARIABLE, Transfers


def test_a_copy_lands_only_after_what_its_stream_waits_for_and_waiting_on_its_event_sees_it():
    transfers = Transfers(torch.device("cpu"), emulated_delay_ms=1)
    source, target = torch.arange(4.0), torch.zeros(4)
    gate = Future()  # stands for the last use of the target buffer, still running
    with transfers.on_h2d_stream(after=gate):
        transfers.h2d(target, source)
        ready = transfers.record()
    assert not ready.done() and target.sum() == 0  # the copy waits behind the gate: reading now is the bug
    gate.set_result(None)
    transfers.wait(ready)
    assert torch.equal(target, source)


def test_a_device_to_host_copy_is_read_after_its_event_and_counted_once_per_step():
    transfers = Transfers(torch.device("cpu"), emulated_delay_ms=1)
    host = torch.zeros(3)
    done = transfers.d2h(host, torch.ones(3))
    assert isinstance(done, Future)
    transfers.synchronize(done)
    assert torch.equal(host, torch.ones(3))
    with transfers.on_h2d_stream():
        transfers.h2d(torch.zeros(5), torch.ones(5))
    totals = transfers.take_totals()  # waits for both streams' copies
    assert (totals.d2h_bytes, totals.h2d_bytes) == (12, 20) and transfers.take_totals().h2d_bytes == 0


def test_work_ordered_after_copies_waits_for_them_and_plain_cpu_copies_in_place(monkeypatch):
    transfers = Transfers(torch.device("cpu"), emulated_delay_ms=20)
    target = torch.zeros(2)
    with transfers.on_h2d_stream():
        transfers.h2d(target, torch.ones(2))
        transfers.order_after_copies()  # a collective on the copied rows comes next
        assert torch.equal(target, torch.ones(2))

    monkeypatch.delenv(EMULATED_DELAY_VARIABLE, raising=False)
    plain = Transfers(torch.device("cpu"))
    assert plain.emulated is None and plain.d2h(target, torch.full((2,), 3.0)) is None and target[0] == 3
    monkeypatch.setenv(EMULATED_DELAY_VARIABLE, "2")
    assert Transfers(torch.device("cpu")).emulated["h2d"].max_delay_s == 0.002



def _compute_by_hand(monkeypatch, transfers: Transfers) -> list[Future]:
    """The emulated compute stream's events, completed by the test (``set_result``) instead of after a delay."""
    events = []
    monkeypatch.setattr(transfers.compute, "record", lambda: events.append(Future()) or events[-1])
    return events


def test_a_device_to_host_copy_reads_garbage_unless_it_waited_for_the_compute_that_wrote_its_source(monkeypatch):
    """The device runs behind the host: an event recorded on the emulated compute stream completes later. A copy to
    the host ordered after the compute queued before it (``wait_stream``) reads its source once that completed; one
    that is not reads it before the device has written it, and delivers NaN."""
    transfers = Transfers(torch.device("cpu"), emulated_delay_ms=1)
    assert isinstance(transfers.record(), Future)  # e.g. a weight slot's last use (``DeviceWindow.release``)
    compute = _compute_by_hand(monkeypatch, transfers)
    host = torch.zeros(3)
    done = transfers.d2h(host, torch.ones(3))
    assert not done.done()  # behind the compute that wrote the source
    compute[-1].set_result(None)
    transfers.synchronize(done)
    assert torch.equal(host, torch.ones(3))

    monkeypatch.setattr(transfers.d2h_stream, "wait_stream", lambda compute: None)  # the compute→copy wait removed
    transfers.synchronize(transfers.d2h(host, torch.ones(3)))
    assert host.isnan().all()


def test_a_source_freed_before_its_copy_to_the_host_ran_is_read_as_garbage_unless_its_stream_was_recorded(monkeypatch):
    """An emulated copy holds its device tensor as the caching allocator does: only through ``record_stream``. A
    gradient freed by the engine right after queueing its copy (a temporary) still arrives; without the record, its
    memory may have gone to another tensor, and the copy delivers NaN."""
    transfers = Transfers(torch.device("cpu"), emulated_delay_ms=1)
    compute = _compute_by_hand(monkeypatch, transfers)
    host = torch.zeros(3)
    done = transfers.d2h(host, torch.full((3,), 2.0))  # the source is freed once d2h returns
    compute[-1].set_result(None)
    transfers.synchronize(done)
    assert torch.equal(host, torch.full((3,), 2.0))

    monkeypatch.setattr(transfers.d2h_stream, "hold", lambda tensor: None)  # record_stream removed
    kept = torch.full((3,), 4.0)  # an owner that keeps its tensor needs no record
    done = transfers.d2h(host, kept)
    compute[-1].set_result(None)
    transfers.synchronize(done)
    assert torch.equal(host, kept)
    done = transfers.d2h(host, torch.full((3,), 2.0))  # a freed temporary does
    compute[-1].set_result(None)
    transfers.synchronize(done)
    assert host.isnan().all()


def test_a_copy_into_memory_the_compute_stream_handed_out_starts_after_the_compute_queued_before_it(monkeypatch):
    """``after_compute``: an activation's copy back to the device is written into memory the compute stream's
    allocator handed out, which the compute queued before may still read: the copy waits for that compute."""
    transfers = Transfers(torch.device("cpu"), emulated_delay_ms=1)
    compute = _compute_by_hand(monkeypatch, transfers)
    target = torch.zeros(2)
    with transfers.on_h2d_stream(after_compute=True):
        transfers.h2d(target, torch.ones(2))
        ready = transfers.record()
    assert compute, "the copy was not ordered after the compute stream"
    assert not ready.done() and target.sum() == 0
    compute[-1].set_result(None)
    transfers.wait(ready)
    assert torch.equal(target, torch.ones(2))
