"""SlideFSDP's host side on a GPU's terms, checked on CPU: pinning that fails, the worker's device, the ring."""

from __future__ import annotations

import threading
import types

import pytest
import torch
import yaml

from lit_fsdp.model import CausalLM
from offload import cpu_adam, host
from offload.host_memory import GIB
from offload.strategy import SlideFSDPStrategy
from tests.helpers import REPO


def test_a_region_whose_registration_fails_stays_pageable_and_exactly_sized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake_cudart(2, True))
    with pytest.warns(UserWarning, match="host-to-device copies from it use pageable memory"):
        region = host.HostRegion.empty(1000, torch.float32, pin=True)
    assert region.tensor.numel() == 1000 and not region.pinned and not region.tensor.is_pinned()


def fake_cudart(register_code: int, with_get_last_error: bool) -> types.SimpleNamespace:
    calls = []
    cudart = types.SimpleNamespace(calls=calls, cudaHostRegister=lambda ptr, size, flags: calls.append(("register", flags)) or register_code)
    if with_get_last_error:
        cudart.cudaGetLastError = lambda: calls.append(("get_last_error",)) or register_code
    return cudart


def test_host_registration_is_portable_and_a_failure_clears_cudas_error_state(monkeypatch):
    cudart = fake_cudart(0, True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    assert host.register_host_memory(torch.zeros(4), 16) and cudart.calls == [("register", 1)]  # cudaHostRegisterPortable

    cudart = fake_cudart(2, True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    with pytest.warns(UserWarning, match="cudaHostRegister of 0.0 GiB failed .CUDA error 2."):
        assert not host.register_host_memory(torch.zeros(4), 16)
    assert cudart.calls == [("register", 1), ("get_last_error",)]  # read back, so cleared


def test_a_failed_registration_that_cannot_be_cleared_stops_with_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake_cudart(2, False))
    with pytest.raises(RuntimeError, match="set --trainer.strategy.init_args.pin_memory false"):
        host.register_host_memory(torch.zeros(4), 16)


def test_the_update_worker_uses_the_ranks_device(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.append((device, threading.current_thread().name)))
    layer = torch.nn.Linear(2, 2)
    adam = cpu_adam.CpuAdam([], [], torch.optim.AdamW(layer.parameters()), torch.device("cuda", 3))
    adam.submit(lambda: None)
    adam.wait()
    adam.close()
    assert seen == [(torch.device("cuda", 3), seen[0][1])] and seen[0][1].startswith("slide-fsdp-adam")


def test_a_full_ring_raises_the_workers_error_instead_of_waiting_forever(monkeypatch):
    monkeypatch.setattr(host.BufferRing, "POLL_S", 0.01)
    ring = host.BufferRing(1, 8, torch.float32, pin=False)
    ring.acquire(8)  # the only buffer, never given back: its worker failed
    polls = []

    def failure():
        polls.append(1)
        return RuntimeError("unit 2: injected") if len(polls) >= 3 else None

    with pytest.raises(RuntimeError, match="unit 2: injected"):
        ring.acquire(8, failure)
    assert len(polls) == 3


def test_update_threads_share_the_usable_cores_and_leave_one_for_launching_kernels(monkeypatch):
    from offload import strategy

    monkeypatch.setattr(strategy.os, "sched_getaffinity", lambda pid: set(range(16)))  # a 16-core affinity mask
    monkeypatch.setattr(strategy.Path, "read_text", lambda self: "400000 100000\n")  # a cgroup quota of 4 CPUs
    assert strategy.usable_cores() == 4 and strategy.update_threads(1) == 3 and strategy.update_threads(8) == 1
    monkeypatch.setattr(strategy.Path, "read_text", lambda self: "max 100000\n")  # no quota
    assert strategy.usable_cores() == 16 and strategy.update_threads(2) == 7


def _window(blocks: int, slots: int):
    """A DeviceWindow on CPU over ``blocks`` one-matrix blocks and a root, each block's staging copy filled with its number."""
    from compress.layout import UnitLayout
    from offload.residency import DeviceWindow
    from offload.transfers import Transfers

    params = [torch.nn.Parameter(torch.zeros(2, 3)) for _ in range(blocks + 1)]
    layouts = [UnitLayout.build(f"unit{i}", [((f"p{i}",), p)], shards=1, shard_rank=0) for i, p in enumerate(params)]
    staging = [torch.full((6,), float(i)) for i in range(blocks + 1)]
    window = DeviceWindow(layouts, blocks, types.SimpleNamespace(staging=staging), Transfers(torch.device("cpu")),
                          slots, torch.float32, torch.device("cpu"), None)
    return window, params


def test_a_block_reloaded_into_another_slot_than_its_forward_used_fails_its_backward():
    window, params = _window(blocks=3, slots=2)
    window.ensure(0)  # forward of block 0 (not checkpointed): its saved tensors view slot 0
    window.remember_slot(0)
    window.release(0)
    window.ensure(0)  # the schedules reload it into the first free slot: the same one
    window.check_same_slot(0)
    assert torch.equal(params[0].data, torch.zeros(2, 3))

    window.remember_slot(0)
    window.release(0)
    window.ensure(1)  # another block took slot 0 first
    window.ensure(0)
    with pytest.raises(RuntimeError, match="block 0 was reloaded into device slot 1 for its backward, but its forward "
                                           "saved views of slot 0"):
        window.check_same_slot(0)


def _llama_8b_offload():
    """configs/llama_8b_offload.yaml's strategy, model and data, as the preflight sees them on one GPU (no GPU needed)."""
    config = yaml.safe_load((REPO / "configs" / "llama_8b_offload.yaml").read_text())
    strategy = SlideFSDPStrategy(**config["trainer"]["strategy"]["init_args"])
    strategy.parallel_devices = [torch.device("cuda", 0)]
    trainer = types.SimpleNamespace(num_devices=1, num_nodes=1, gradient_clip_val=None, accumulate_grad_batches=1)
    data = types.SimpleNamespace(vocab_size=128_256, tokenizer=None, **{
        key: config["data"]["init_args"][key] for key in ("batch_size", "seq_len")})
    return strategy, trainer, CausalLM(**config["model"]), data


def test_the_8b_offload_config_fits_a_128_gib_host_with_8_gib_to_spare_and_is_refused_on_96():
    strategy, trainer, module, data = _llama_8b_offload()
    parts = strategy.check_host_memory(trainer, module, data, available=128 * GIB)
    assert round(parts["master"] / GIB, 1) == 29.9 and round(parts["adam_moments"] / GIB, 1) == 59.8
    assert round(parts["staging"] / GIB, 1) == 15.0  # bfloat16, one exact-size region: no power-of-two rounding
    assert parts["gradient_ring"] == 2 * 1_050_677_248 * 4  # window 2 x the root's float32 gradient
    assert parts["activations"] == 32 * 8 * 2048 * 4096 * 2  # every block's checkpointed input, bfloat16
    assert parts["kept_gradients"] == parts["scratch"] == 0  # no clipping, no accumulation, float32 reduce
    assert 128 * GIB - sum(parts.values()) >= 8 * GIB
    with pytest.raises(ValueError, match=r"^SlideFSDP needs 119.5 GiB of host memory per node for 8.03B parameters "
                                         r"\(adam_moments 59.8, master 29.9, .*\) but 96.0 GiB are available; use"):
        strategy.check_host_memory(trainer, module, data, available=96 * GIB)


def test_a_ring_hands_out_views_of_one_exact_region_and_takes_them_back():
    ring = host.BufferRing(3, 10, torch.float32, pin=False)
    assert ring.region.tensor.numel() == 30  # one allocation of exactly count x numel
    taken = [ring.acquire(7) for _ in range(3)]
    assert [t.numel() for t in taken] == [7, 7, 7] and len({t.data_ptr() for t in taken}) == 3
    ring.release(taken[1])
    again = ring.acquire(10)
    assert again.data_ptr() == taken[1].data_ptr() and again.numel() == 10


def test_a_dev_shm_too_small_for_the_shared_staging_copy_is_refused_before_launch(monkeypatch):
    strategy, trainer, module, data = _llama_8b_offload()
    trainer.num_devices = 2  # param_transfer: full with 2 ranks: the node's staging copy is one file in /dev/shm
    monkeypatch.setattr(host, "shared_memory_free", lambda: 2 * GIB)
    with pytest.raises(ValueError, match=r"^SlideFSDP needs 15.0 GiB in /dev/shm for the node's shared staging copy, "
                                         r"2.0 GiB are free; enlarge it \(docker run --shm-size\) or set param_transfer"):
        strategy.check_host_memory(trainer, module, data, available=512 * GIB)
    trainer.num_devices = 1  # one process keeps its staging copy in private memory
    strategy.check_host_memory(trainer, module, data, available=512 * GIB)
