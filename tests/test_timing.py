"""``DeviceClock`` on CUDA (``compress.timing``), with fake events: blocks queue events, reads wait once."""

from __future__ import annotations

import pytest
import torch

import compress.timing
from compress.timing import DeviceClock
from tests.fake_cuda import FakeGpu

CUDA = torch.device("cuda", 0)


def test_cuda_blocks_never_wait_a_read_waits_once_and_nested_time_is_taken_from_the_enclosing_block(monkeypatch):
    gpu, clock = FakeGpu(monkeypatch), DeviceClock()
    with clock.time("compress_s", CUDA):
        gpu.run(5)
        with clock.time("extra_collective_s", CUDA):  # as PowerSGD's all-reduces inside its compression
            gpu.run(3)
        gpu.run(1)
    with clock.time("decompress_s", CUDA):
        gpu.run(2)
    assert gpu.waits == 0
    assert clock.read() == pytest.approx({"compress_s": 0.006, "extra_collective_s": 0.003, "decompress_s": 0.002})
    assert gpu.waits == 1
    assert clock.read() == {} and gpu.waits == 1  # nothing timed since: nothing to wait for


def test_an_unread_clock_adds_finished_pairs_without_waiting_and_waits_only_at_its_hard_limit(monkeypatch):
    monkeypatch.setattr(compress.timing, "MAX_PENDING", 4)
    monkeypatch.setattr(compress.timing, "HARD_LIMIT", 8)
    gpu, clock = FakeGpu(monkeypatch), DeviceClock()

    def block() -> None:
        with clock.time("compress_s", CUDA):
            gpu.run(1)

    for _ in range(3):
        block()
    gpu.catch_up()
    block()  # the 4th pending pair: the 3 finished ones are added, the unfinished 4th is kept
    assert (len(clock._pending), gpu.waits) == (1, 0)
    for _ in range(6):
        block()  # 7 pending, none finished: still no wait
    assert (len(clock._pending), gpu.waits) == (7, 0)
    block()  # the hard limit: one wait for every pending pair
    assert (len(clock._pending), gpu.waits) == (0, 1)
    assert clock.read() == pytest.approx({"compress_s": 0.011}) and gpu.waits == 1
