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
