"""SlideFSDP's host side on a GPU's terms, checked on CPU: pinning that fails, the worker's device, the ring."""

from __future__ import annotations

import math
import threading
import types

import pytest
from functools import partial
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


def test_teardown_unpins_the_staging_copy_and_the_gradient_ring_once(monkeypatch):
    cudart = fake_cudart(0, True)
    cudart.cudaHostUnregister = lambda ptr: cudart.calls.append(("unregister", ptr))
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    _, layout, _ = _unit([(6, 5), (6,)])
    state = host.HostState([layout], torch.bfloat16, torch.bfloat16, full_staging=True, keep_gradients=False,
                           incoming_full=False, ring_size=2, pin=True, shared=None)
    from lit_fsdp.lifecycle import CausalLMStrategy

    monkeypatch.setattr(CausalLMStrategy, "teardown", lambda self: None)  # no process group to end here
    strategy = SlideFSDPStrategy()
    strategy.host = state
    strategy.teardown()
    strategy.teardown()  # a second teardown (fit, then test) unregisters nothing twice
    unregistered = [call[1] for call in cudart.calls if call[0] == "unregister"]
    assert sorted(unregistered) == sorted([state.staging_region.tensor.data_ptr(), state.incoming.region.tensor.data_ptr()])


def test_a_failed_registration_is_cleared_through_the_loaded_runtime_or_stops_with_the_fix(monkeypatch):
    # torch's binding has no cudaGetLastError: a CUDA build (torch 2.11's, the GPU machine's) has libcudart loaded,
    # whose own is used; where none can be found the run stops with the fix
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake_cudart(2, False))
    cleared = []
    monkeypatch.setattr(host, "loaded_cuda_get_last_error", lambda: lambda: cleared.append(True) or 2)
    with pytest.warns(UserWarning, match="host-to-device copies from it use pageable memory"):
        assert not host.register_host_memory(torch.zeros(4), 16)
    assert cleared == [True]
    monkeypatch.setattr(host, "loaded_cuda_get_last_error", lambda: None)
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
    from offload import preflight as strategy

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
    trainer = types.SimpleNamespace(num_devices=1, num_nodes=1, gradient_clip_val=config["trainer"]["gradient_clip_val"],
                                    accumulate_grad_batches=1)
    data = types.SimpleNamespace(vocab_size=128_256, tokenizer=None, **{
        key: config["data"]["init_args"][key] for key in ("batch_size", "seq_len")})
    return strategy, trainer, CausalLM(**config["model"]), data


def _check_host(strategy, trainer, module, data, available=None):
    """The preflight's host check of ``strategy``'s plan (``available`` bytes, else what the host or the knob says)."""
    from offload.preflight import host_memory_budget

    budget = (available, "available") if available is not None else host_memory_budget(strategy.host_memory_gb)
    units = strategy.model_units(module, data, trainer.num_devices)
    return strategy.split_plan(trainer, module, data, units, host_bytes=budget[0]).check_host(units, *budget)


def test_the_8b_offload_config_fits_a_128_gib_host_its_split_taking_the_room_left_and_is_refused_on_80():
    """The shipped 8B config (bfloat16 moments, update: auto with clipping, 64k tokens in one micro-batch): the
    preflight counts the gradient ring that holds a step's pieces until the norm (no fp32 gradient copy), no
    offloaded activations, and the split's backup of as many of the last blocks as the 34 GiB left hold."""
    strategy, trainer, module, data = _llama_8b_offload()
    assert strategy.update == "auto" and trainer.gradient_clip_val and data.batch_size * data.seq_len == 65_536
    parts = _check_host(strategy, trainer, module, data, available=128 * GIB)
    assert round(parts["master"] / GIB, 1) == 29.9 and round(parts["adam_moments"] / GIB, 1) == 29.9
    assert round(parts["staging"] / GIB, 1) == 15.0  # bfloat16, one exact-size region: no power-of-two rounding
    # a step's pieces, each the largest block's bfloat16 gradient and its flag: 32 blocks and the root's 1.05B in
    # 7 pieces (head 3, embeddings 3, final norm 1), held until the norm
    assert parts["gradient_ring"] == (32 + 7) * (218_112_000 + 1) * 2
    assert parts["activations"] == 0 and parts["kept_gradients"] == 0  # clipping keeps no fp32 copy
    # the head's and the final norm's rows and 18 blocks' (218M each) backed up: fp32 master and two bfloat16
    # moments, 8 B a row
    assert parts["speculation_backup"] == (128_256 * 4096 + 4096 + 18 * 218_112_000) * 8
    assert 128 * GIB - 218_112_000 * 8 < sum(parts.values()) <= 128 * GIB  # one block more would not fit
    with pytest.raises(ValueError, match=r"^SlideFSDP needs 93.6 GiB of host memory per node for 8.03B parameters "
                                         r"\(master 29.9, adam_moments 29.9, .*\) but 80.0 GiB are available; use"):
        _check_host(strategy, trainer, module, data, available=80 * GIB)


def test_the_8b_offload_configs_update_moves_22_bytes_per_parameter_24_delayed_and_20_without_clipping():
    """bfloat16 moments: master (4 + 4), moments (4 + 4), the bfloat16 gradient read and the staging row written from
    the chunk in cache (2): 20; with clipping the ordered update reads the held gradient once more on arrival for its
    norm (2); delayed, the staging row is rewritten from the master after the unit's last load of the next step (4
    read, 2 written) instead of the norm's read."""
    from lit_fsdp.commands.estimate import cpu_update_bytes

    strategy, trainer, module, data = _llama_8b_offload()
    trainer.strategy = strategy
    assert cpu_update_bytes(trainer, 10**9, torch.bfloat16, torch.bfloat16) == 22 * 10**9
    strategy.update = "delayed"
    assert cpu_update_bytes(trainer, 10**9, torch.bfloat16, torch.bfloat16) == 24 * 10**9
    strategy.update, trainer.gradient_clip_val = "auto", None
    assert cpu_update_bytes(trainer, 10**9, torch.bfloat16, torch.bfloat16) == 20 * 10**9


def _unit(shapes: list[tuple[int, ...]], shards: int = 1, shard_rank: int = 0):
    """Parameters of ``shapes``, their unit layout and this rank's master rows (a copy of the parameters' rows)."""
    from compress.layout import UnitLayout

    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    layout = UnitLayout.build("unit", [((f"p{i}",), p) for i, p in enumerate(params)], shards, shard_rank)
    master = torch.zeros(layout.shard_numel)
    for rows, place in zip(layout.local_views(master), layout.places):
        rows.copy_(place.param.detach()[place.start_row : place.stop_row])
    return params, layout, master


@pytest.mark.parametrize("gradient_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_moments_follow_adamw_in_float64_within_bfloat16_rounding(monkeypatch, gradient_dtype):
    monkeypatch.setattr(cpu_adam, "CHUNK", 1000)  # the 2500-element matrix spans 3 chunks, the last one partial
    torch.manual_seed(0)
    params, layout, master = _unit([(25, 100), (70,)])

    def groups(weights: list) -> list[dict]:  # weight decay on the matrix, none on the vector
        return [{"params": [weights[0]], "weight_decay": 0.1}, {"params": [weights[1]], "weight_decay": 0.0}]

    adam = cpu_adam.CpuAdam([layout], [master], torch.optim.AdamW(groups(params), lr=1e-2, betas=(0.9, 0.95)),
                            state_dtype=torch.bfloat16)
    exact = [torch.nn.Parameter(p.detach().double().clone()) for p in params]
    reference = torch.optim.AdamW(groups(exact), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    for _ in range(5):
        gradients = [torch.randn(p.shape).to(gradient_dtype) for p in params]
        adam.update(0, gradients)
        for p, gradient in zip(exact, gradients):
            p.grad = gradient.double()
        reference.step()
    adam.close()
    for piece, p, initial in zip(adam.pieces[0], exact, params):
        state, want = adam.optimizers[0].state[piece], reference.state[p]
        assert {k: (v.shape, v.dtype) for k, v in state.items()} == {
            "step": (torch.Size([]), torch.float32), "exp_avg": (p.shape, torch.bfloat16), "exp_avg_sq": (p.shape, torch.bfloat16)}
        assert state["step"].item() == 5
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key].double(), want[key], rtol=2e-2, atol=1e-3)
        # 5 steps of about lr (1e-2) each, off by at most 1.3e-4 from the moments' rounding; a missed weight decay
        # (5e-3 x the weight) or bias correction (x10 in the first step) is far outside this
        torch.testing.assert_close((piece.detach() - initial.detach()).double(), p.detach() - initial.detach().double(),
                                   rtol=0, atol=4e-4)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("gradient_dtype", [torch.bfloat16, torch.float32])
def test_one_pass_per_chunk_is_torchs_fused_adamw_bit_for_bit_and_writes_the_staging_rows(monkeypatch, gradient_dtype, amsgrad):
    """Float32 moments: the chunked pass (a bfloat16 gradient widened in cache, the staging rows written from the chunk)
    gives the same bits as torch's fused AdamW stepping the whole tensors on the widened gradient."""
    monkeypatch.setattr(cpu_adam, "CHUNK", 1000)  # the 2500-element matrix spans 3 chunks, the last one partial
    torch.manual_seed(0)
    params, layout, master = _unit([(25, 100), (70,)])

    def groups(weights: list) -> list[dict]:
        return [{"params": [weights[0]], "weight_decay": 0.1}, {"params": [weights[1]], "weight_decay": 0.0}]

    adam = cpu_adam.CpuAdam([layout], [master], torch.optim.AdamW(groups(params), lr=1e-2, amsgrad=amsgrad))
    whole = [torch.nn.Parameter(rows.clone()) for rows in layout.local_views(master)]
    reference = torch.optim.AdamW(groups(whole), lr=1e-2, amsgrad=amsgrad, fused=True)
    staging = torch.full((layout.shard_numel,), float("nan"), dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        gradients = [torch.randn(p.shape, generator=generator).bfloat16() for p in params]
        adam.update(0, [g.to(gradient_dtype) for g in gradients], layout.local_views(staging))
        for p, gradient in zip(whole, gradients):
            p.grad = gradient.float()
        reference.step()
    adam.close()
    for piece, rows, p, target in zip(adam.pieces[0], layout.local_views(master), whole, layout.local_views(staging)):
        assert torch.equal(rows, p.detach()) and torch.equal(target, p.detach().bfloat16())
        state, want = adam.optimizers[0].state[piece], reference.state[p]
        assert state.keys() == want.keys() and all(torch.equal(state[key], want[key]) for key in want)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_the_host_accounting_of_the_moments_is_what_cpu_adam_allocates(state_dtype):
    from offload.host_memory import HostSetup, UnitSize, host_buffers

    shapes = [[(5, 3), (7,)], [(9, 2), (1, 4)]]  # uneven rows over 2 ranks: rank 1 holds fewer of them
    allocated = 0
    for rank in (0, 1):
        units = [_unit(unit, shards=2, shard_rank=rank) for unit in shapes]
        layouts, masters = [layout for _, layout, _ in units], [master for _, _, master in units]
        held = torch.optim.AdamW([p for params, _, _ in units for p in params])
        adam = cpu_adam.CpuAdam(layouts, masters, held, state_dtype=state_dtype)
        allocated += adam.nbytes()
        adam.close()
    setup = HostSetup.of_knobs(torch.float32, torch.float32, state_dtype, 2, "full", "gpu_reduce", 2, False)
    counted = host_buffers([UnitSize(layout.full_numel, layout.shard_numel) for layout in layouts], setup)
    assert counted["adam_moments"] == allocated == sum(n for unit in shapes for n in map(math.prod, unit)) * 2 * state_dtype.itemsize


def test_a_bad_optimizer_state_dtype_and_amsgrad_with_bfloat16_moments_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^SlideFSDP optimizer_state_dtype='float16': set it to float32 or bfloat16$"):
        SlideFSDPStrategy(optimizer_state_dtype="float16")
    held = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), amsgrad=True)
    with pytest.raises(ValueError, match=r"^SlideFSDP's bfloat16 optimizer state has no amsgrad: set amsgrad=False "
                                         r"in configure_optimizers or optimizer_state_dtype: float32$"):
        cpu_adam.CpuAdam([], [], held, state_dtype=torch.bfloat16)


def _save_then_resume_with_other_moments(rank: int, world: int, folder: str) -> list[dict]:
    """The state of a piece after 2 steps with float32 moments, saved, and after loading that into bfloat16 moments."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from offload.state_dict import HostStateDict

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    params, layout, master = _unit([(6, 5), (6,)])
    host_state = HostStateDict(torch.nn.ParameterList(params), [layout], [master], mesh)
    held = torch.optim.AdamW(params)
    saved = cpu_adam.CpuAdam([layout], [master], held)
    for _ in range(2):
        saved.update(0, [torch.randn(p.shape) for p in params])
    dcp.save({"optimizer_0": host_state.optimizer_state(saved)}, checkpoint_id=folder)
    resumed = cpu_adam.CpuAdam([layout], [master], held, state_dtype=torch.bfloat16)
    dcp.load({"optimizer_0": host_state.optimizer_state(resumed)}, checkpoint_id=folder)
    for adam in (saved, resumed):
        adam.close()
    return [adam.optimizers[0].state[adam.pieces[0][0]] for adam in (saved, resumed)]


def test_a_checkpoint_of_float32_moments_resumes_with_bfloat16_moments_rounded_to_nearest(tmp_path):
    from tests.distributed import run

    ((saved, loaded),) = run(_save_then_resume_with_other_moments, tmp_path, str(tmp_path / "ckpt"), world=1)
    assert loaded["exp_avg"].dtype == torch.bfloat16 and loaded["step"].item() == saved["step"].item() == 2
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded[key], saved[key].bfloat16())  # rounded to nearest on the way in


def _pipeline(capacity: int, keep: bool, seed: int = 0, slots: int = 2, delay: bool = False):
    """One process's gradient pipeline over a block and a root (3 parameters), its ring buffers holding ``capacity``
    gradient elements (as if its largest block had that many), copies emulated as asynchronous; the master rows start
    from ``seed``; ``delay``: its updates delayed to the next step, the norm summed as the pieces arrive; ``keep``: a
    kept float32 gradient per unit, its norm taken after the backward (``clip_kept``, an ordered schedule's)."""
    from offload.host_memory import FLAG_ELEMENTS
    from compress.layout import UnitLayout
    from offload.gradients import GradientPipeline
    from offload.schedule import UpdateSchedule
    from offload.transfers import Transfers

    generator = torch.Generator().manual_seed(seed)
    shapes = [[(4, 8)], [(40, 8), (10,), (30, 8)]]  # the root is larger than the block: it goes in pieces
    params = [[torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in unit] for unit in shapes]
    layouts = [UnitLayout.build(f"unit{u}", [((f"p{u}{i}",), p) for i, p in enumerate(unit)], 1, 0)
               for u, unit in enumerate(params)]
    state = host.HostState(layouts, torch.float32, torch.bfloat16, full_staging=True, keep_gradients=keep,
                           incoming_full=False, ring_size=2, pin=False, shared=None)
    for master in state.master:
        master.copy_(torch.randn(master.shape, generator=generator))
    for unit in range(len(layouts)):
        state.write_staging(unit)
    state.piece_capacity = capacity
    state.incoming = host.BufferRing(slots, capacity + FLAG_ELEMENTS, torch.bfloat16, pin=False)
    held = torch.optim.AdamW([p for unit in params for p in unit], lr=1e-2)
    adam = cpu_adam.CpuAdam(layouts, state.master, held)
    pipeline = GradientPipeline(layouts, state, adam, Transfers(torch.device("cpu"), emulated_delay_ms=2.0),
                                gpu_reduce=True, reduce_dtype=torch.bfloat16, world_size=1, shard_rank=0, shard_group=None,
                                replicate_group=None, host_group=None,
                                schedule=UpdateSchedule(delay=delay, defer=delay, norms_on_arrival=delay,
                                                        check_units_finite=True, ordered=keep))
    return pipeline, params


@pytest.mark.parametrize("keep", [False, True], ids=["overlapped", "kept"])
def test_a_root_larger_than_a_ring_buffer_goes_in_pieces_and_lands_as_if_whole(keep):
    """The root's parameters go one by one, each in ring-buffer-sized pieces with the device's verdict after each: the
    weights, moments and staging rows equal one whole-unit update's; a non-finite parameter withholds its own part."""
    runs = []
    for capacity in (1024, 128):  # every part whole, against the root's parts in pieces of 128 (320: 3, 240: 2)
        pipeline, params = _pipeline(capacity, keep)
        assert [len(parts) for parts in pipeline.parts] == [1, 3]  # the block whole, the root parameter by parameter
        generator = torch.Generator().manual_seed(1)
        for step in range(3):
            micro_batches = 2 if keep else 1
            for micro_batch in range(micro_batches):
                for unit in (1, 0):
                    for part, members in enumerate(pipeline.parts[unit]):
                        grads = [torch.randn(params[unit][i].shape, generator=generator).bfloat16() for i in members.places]
                        if step == 2 and unit == 1 and part == 1:
                            grads[0][3] = float("inf")
                        pipeline.reduce_and_offload(unit, part, grads, update_now=micro_batch == micro_batches - 1)
            pipeline.adam.wait()
            if step == 2:
                assert pipeline.take_nonfinite() == 1  # the root: the part with the infinity (kept: the whole root)
        pipeline.adam.close()
        runs.append(pipeline)
    whole, pieces = runs
    assert whole.pieces_per_unit == [1, 3] and pieces.pieces_per_unit == [1, 3 + 1 + 2]
    for unit in (0, 1):
        assert torch.equal(whole.host.master[unit], pieces.host.master[unit])
        assert torch.equal(whole.host.staging[unit], pieces.host.staging[unit])
        assert torch.equal(pieces.host.staging[unit], pieces.host.master[unit])  # float32 staging: the new weights
        for a, b in zip(whole.adam.pieces[unit], pieces.adam.pieces[unit]):
            sa, sb = whole.adam.optimizers[unit].state[a], pieces.adam.optimizers[unit].state[b]
            assert all(torch.equal(sa[key], sb[key]) for key in sa)


@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_a_delayed_update_applies_each_steps_clipped_gradient_at_its_learning_rate_during_the_next_step(max_norm):
    """``delayed_update`` (DPU): a step's gradients wait in their bfloat16 buffers (no fp32 copy), their norm summed as
    they arrive; at the optimizer step the updates are queued with that step's learning rate and clipping coefficient
    and run during the next step, master and moments only; a unit's staging rows are rewritten when its next gradient
    arrives (its last load of the step is over). The master then equals the undelayed run's after step t, bit for bit
    without clipping and within float32 rounding with it (the coefficient multiplies inside the fused kernel, not the
    kept fp32 gradient); what is still queued at the end is applied by ``apply_delayed``."""
    pieces_per_step = 1 + 3 + 1 + 2  # the block, then the root's parameters in pieces of 128 elements
    (undelayed, params), (delayed, _) = (_pipeline(128, keep=True),
                                         _pipeline(128, keep=False, slots=pieces_per_step + 2, delay=True))
    generator = torch.Generator().manual_seed(3)
    same = torch.equal if max_norm is None else partial(torch.testing.assert_close, rtol=2e-6, atol=1e-7)

    def check(got, want):
        assert same(got, want) is not False

    def send(pipeline, gradients):
        for unit in (0, 1)[::-1]:
            for part, members in enumerate(pipeline.parts[unit]):
                pipeline.reduce_and_offload(unit, part, [gradients[unit][i] for i in members.places], update_now=False)
        pipeline.adam.wait()

    def masters(pipeline):
        return [master.clone() for master in pipeline.host.master]

    initial, after, staged = masters(delayed), [], []
    for step in range(4):
        gradients = [[torch.randn(p.shape, generator=generator).bfloat16() * (step + 1) for p in unit] for unit in params]
        rate = 1e-2 / (step + 1)
        send(undelayed, gradients)
        undelayed.adam.held.param_groups[0]["lr"] = rate
        want_norm = undelayed.clip_kept(max_norm, None)
        for unit in undelayed.kept_units():
            undelayed.update(unit)
        after.append(masters(undelayed))
        staged.append([rows.clone() for rows in undelayed.host.staging])

        send(delayed, gradients)  # step - 1's updates ran first; the arrivals rewrote their staging rows
        for got, want in zip(masters(delayed), after[step - 1] if step else initial):
            check(got, want)
        if step:
            for got, want in zip(delayed.host.staging, staged[step - 1]):
                check(got, want)
        assert delayed.host.incoming._free.qsize() == 2  # this step's pieces wait in their buffers
        torch.testing.assert_close(delayed.delayed_norm(max_norm, None), want_norm, rtol=1e-6, atol=0)
        delayed.adam.held.param_groups[0]["lr"] = rate
        delayed.start_delayed()
        assert len(delayed.adam._pending) == 2  # the block's and the root's updates queued on the worker, none run here
        delayed.adam.held.param_groups[0]["lr"] = 100.0  # the scheduler moves on: the delayed update keeps its rate
    delayed.apply_delayed()
    assert not delayed.stale and delayed.host.incoming._free.qsize() == pieces_per_step + 2
    for unit in (0, 1):
        check(delayed.host.master[unit], undelayed.host.master[unit])
        check(delayed.host.staging[unit], undelayed.host.staging[unit])
        for a, b in zip(undelayed.adam.pieces[unit], delayed.adam.pieces[unit]):
            sa, sb = undelayed.adam.optimizers[unit].state[a], delayed.adam.optimizers[unit].state[b]
            for key in sa:
                check(sa[key], sb[key])
    undelayed.adam.close()
    delayed.adam.close()


def test_gradient_slots_are_one_per_piece_of_a_backward_plus_two_when_delayed_and_too_few_are_refused():
    """The gradient ring by default holds every piece of a backward (the device never waits for an update to free
    one); a delayed update holds a step's pieces until the next step, so it gets two more and fewer than a step's
    pieces and one are refused in one line; a kept fp32 gradient frees each buffer on arrival: max(2, window)."""
    from offload.host_memory import GradientSlotsError, HostSetup, UnitSize, gradient_slots

    units = [UnitSize(128, 128)] * 3 + [UnitSize(448, 448, (320, 128))]  # the root's parts: 3 and 1 pieces of 128

    def setup(**knobs):
        return HostSetup.of_knobs(torch.bfloat16, torch.bfloat16, torch.float32, 1, "full", "gpu_reduce",
                                  knobs.pop("window", 2), knobs.pop("keep", False), **knobs)

    assert gradient_slots(units, setup()) == 3 + 3 + 1
    assert gradient_slots(units, setup(delayed_update=True, window=3)) == 7 + 3
    assert gradient_slots(units, setup(keep=True, window=3)) == 3
    assert gradient_slots(units, setup(gradient_slots=5)) == 5
    assert gradient_slots(units, setup(delayed_update=True, gradient_slots=8)) == 8
    with pytest.raises(GradientSlotsError, match=r"^SlideFSDP gradient_slots=7: update: delayed holds one step's 7 "
                                                 r"gradient pieces until the next step's updates, so it needs at least "
                                                 r"8; set gradient_slots >= 8, or null to have it chosen$"):
        gradient_slots(units, setup(delayed_update=True, gradient_slots=7))


def test_host_memory_gb_replaces_memavailable_where_a_vm_grants_memory_as_it_is_used(monkeypatch):
    """On a VM whose MemAvailable starts far below what it will grant, a preflight on MemAvailable refuses a run that
    fits; ``host_memory_gb`` states the memory instead, and each refusal names where its figure came from."""
    from offload import SlideFSDPStrategy
    from offload import preflight as slide

    strategy, trainer, module, data = _llama_8b_offload()
    monkeypatch.setattr(slide, "available_host_bytes", lambda: 20 * GIB)  # what such a VM reports at start
    with pytest.raises(ValueError, match=r"but 18.8 GiB are available \(MemAvailable 20.0 GiB; set host_memory_gb on a "
                                         r"VM that grows its memory on demand, less a reserve of 1.2 GiB: "
                                         r"host_reserve_gb\); use"):
        _check_host(strategy, trainer, module, data)
    strategy.host_memory_gb = 120.0
    assert 93.6 < sum(_check_host(strategy, trainer, module, data).values()) / GIB <= 112.5  # the split fills the rest
    strategy.host_memory_gb = 64.0
    with pytest.raises(ValueError, match=r"but 60.0 GiB are allowed by host_memory_gb \(64 GiB, less a reserve of 4.0 "
                                         r"GiB: host_reserve_gb\); use"):
        _check_host(strategy, trainer, module, data)
    with pytest.raises(ValueError, match=r"^SlideFSDP host_memory_gb=0 must be > 0, or null for MemAvailable$"):
        SlideFSDPStrategy(host_memory_gb=0)
