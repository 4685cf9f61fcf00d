"""SlideFSDP's bfloat16 master (``master_dtype: bfloat16``): the update rounds it stochastically with bits that depend
on (step, unit, piece, rank, position) alone, in the native kernel as in torch's path; the master is the staging copy
where the layouts allow; the host accounting counts it; a resumed run takes the same bits."""

from __future__ import annotations

import pytest
import torch

from offload import adamw_kernel, cpu_adam, host
from offload.host_memory import HostSetup, UnitSize, host_buffers, master_in_staging
from offload.rounding import MasterRounding, seed, stochastic_round
from tests.helpers import checkpoint_every, fit_arguments, read_metrics

GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}


def steps_of(native: bool, moments: torch.dtype, chunk: int, threads: int, steps: int = 3):
    """``steps`` updates of a bfloat16 master (300,001 elements: a tail past every vector width) by the native kernel
    or by torch's path in ``chunk``-element chunks; the master, the staging copy and the moments after them."""
    generator = torch.Generator().manual_seed(0)
    numel = 300_001
    master = (torch.randn(numel, generator=generator) * 0.02).bfloat16()
    gradients = [torch.randn(numel, generator=generator).bfloat16() for _ in range(steps)]
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(numel, dtype=moments),
             "exp_avg_sq": torch.zeros(numel, dtype=moments)}
    staging = torch.empty(numel, dtype=torch.bfloat16)
    previous_enabled, previous_threads = adamw_kernel.enabled, torch.get_num_threads()
    adamw_kernel.enabled = native
    torch.set_num_threads(threads)
    try:
        for step, gradient in enumerate(gradients, 1):
            how = MasterRounding(True, seed(step, 0, 0, 0), 0)
            cpu_adam.adamw_step_in_chunks(master, gradient, state, GROUP, torch.empty(4, chunk), staging, None, 1.0, how)
    finally:
        adamw_kernel.enabled = previous_enabled
        torch.set_num_threads(previous_threads)
    return master, staging, state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_the_kernels_stochastic_rounding_is_torchs_path_bit_for_bit_on_any_threads_and_chunks(moments):
    """The native kernel's one pass against torch's fused AdamW on float32 copies rounded by ``stochastic_round``
    (the reference): the same master, staging and moment bits, on 1 and 2 threads, with 64k and 1M chunks."""
    if adamw_kernel.library() is None:
        pytest.skip("no C compiler: the native kernel is not built")
    want = steps_of(False, moments, 65_536, 1)
    for threads in (1, 2):
        got = steps_of(True, moments, 1 << 20, threads)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    assert torch.equal(want[0].view(torch.int16), want[1].view(torch.int16))  # the staging copy takes the master's bits


def test_stochastic_rounding_keeps_the_updates_that_rounding_to_nearest_loses():
    """100 updates of +1e-3 to 1.0 in bfloat16 (its gap there is 2**-7, so each is under half of it): to nearest the
    weight never moves; stochastically it reaches 1.1 on average (unbiased), each element by its own bits."""
    weights = {True: torch.ones(100_000, dtype=torch.bfloat16), False: torch.ones(100_000, dtype=torch.bfloat16)}
    for step in range(1, 101):
        for stochastic, weight in weights.items():
            weight.copy_(stochastic_round(weight.float() + 1e-3, MasterRounding(stochastic, seed(step, 0, 0, 0))))
    assert torch.equal(weights[False], torch.ones(100_000, dtype=torch.bfloat16))
    assert weights[True].float().mean().item() == pytest.approx(1.1, abs=1e-3)
    assert weights[True].float().std().item() > 0


def test_the_rounding_bits_depend_on_step_unit_piece_rank_and_position_alone():
    """The same seed and position give the same bits (a resumed run's); another step, unit, piece, rank or position
    others; a NaN and the infinities round as to nearest."""
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    base = stochastic_round(values, MasterRounding(True, seed(7, 1, 2, 0), 0)).view(torch.int16)
    assert torch.equal(base, stochastic_round(values, MasterRounding(True, seed(7, 1, 2, 0), 0)).view(torch.int16))
    for other in (seed(8, 1, 2, 0), seed(7, 2, 2, 0), seed(7, 1, 3, 0), seed(7, 1, 2, 1)):
        assert not torch.equal(base, stochastic_round(values, MasterRounding(True, other, 0)).view(torch.int16))
    shifted = stochastic_round(values[5:], MasterRounding(True, seed(7, 1, 2, 0), 5)).view(torch.int16)
    assert torch.equal(shifted, base[5:])  # element i's counter is position + i: a chunk rounds as the whole
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38])
    rounded = stochastic_round(special, MasterRounding(True, 12345, 0))
    assert rounded[0].isnan() and rounded[1] == float("inf") and rounded[2] == -float("inf")


def setup_of(master: torch.dtype, compute: torch.dtype = torch.bfloat16, processes: int = 1, transfer: str = "full",
             delayed: bool = False, speculate: bool = False) -> HostSetup:
    return HostSetup.of_knobs(compute, compute, torch.bfloat16, processes, transfer, "gpu_reduce", 2, False,
                              delayed_update=delayed, speculate=speculate, master_dtype=master)


def test_the_master_is_the_staging_copy_only_where_their_layouts_and_the_schedule_allow_and_is_counted_so():
    """A bfloat16 master with bfloat16 compute is the staging copy on one process or with param_transfer: shard; not
    with a float32 master or compute, a delayed update (the device may still load the old rows), several processes
    sharing a full staging copy, or a frozen base (LoRA); the host accounting counts 2 B/param for a master of its own
    and none in the staging copy, and a speculative backup of master + 2 moments."""
    units = [UnitSize(1000, 500), UnitSize(400, 200)]
    lora = [UnitSize(1000, 500, (), 900, 450), UnitSize(400, 200)]
    assert master_in_staging(units, setup_of(torch.bfloat16))
    assert master_in_staging(units, setup_of(torch.bfloat16, processes=2, transfer="shard"))
    for setup in (setup_of(torch.float32), setup_of(torch.bfloat16, torch.float32),
                  setup_of(torch.bfloat16, delayed=True), setup_of(torch.bfloat16, processes=2, transfer="full")):
        assert not master_in_staging(units, setup)
    assert not master_in_staging(lora, setup_of(torch.bfloat16))
    shard = setup_of(torch.bfloat16, processes=2, transfer="shard", speculate=True)
    assert host_buffers(units, shard)["master"] == 0 and host_buffers(units, shard)["staging"] == 2 * 700 * 2
    assert host_buffers(units, shard)["speculation_backup"] == 2 * 700 * (2 + 2 * 2)
    assert host_buffers(units, setup_of(torch.bfloat16, delayed=True))["master"] == 700 * 2
    assert host_buffers(units, setup_of(torch.float32))["master"] == 700 * 4


def test_a_master_in_the_staging_copy_is_updated_in_place_and_the_device_loads_its_bits():
    """HostState with ``master_in_staging``: each unit's master is its staging rows (no allocation of its own, none
    counted); a CpuAdam update writes the master once, and that is what the staging copy holds."""
    from compress.layout import UnitLayout

    params = [torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in ((40, 8), (30,))]
    layouts = [UnitLayout.build("unit0", [(("w",), params[0])], 1, 0), UnitLayout.build("root", [(("b",), params[1])], 1, 0)]
    state = host.HostState(layouts, torch.bfloat16, torch.bfloat16, full_staging=True, keep_gradients=False,
                           incoming_full=False, ring_size=1, pin=False, shared=None, master_dtype=torch.bfloat16,
                           master_in_staging=True)
    assert all(m.data_ptr() == s.data_ptr() and m.dtype == torch.bfloat16 for m, s in zip(state.master, state.staging))
    assert state.buffer_bytes(count_shared=True)["master"] == 0
    for master in state.master:
        master.copy_(torch.randn(master.shape))
    before = [m.clone() for m in state.master]
    held = torch.optim.AdamW(params, lr=1e-2)
    adam = cpu_adam.CpuAdam(layouts, state.master, held)
    adam.update(0, [torch.ones(320, dtype=torch.bfloat16)], state.staging_targets(0))
    adam.close()
    assert not torch.equal(state.staging[0], before[0]) and torch.equal(state.staging[1], before[1])
    assert adam.optimizers[0].state[adam.pieces[0][0]]["step"] == 1


SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy",
         "--trainer.strategy.init_args.param_dtype", "bfloat16", "--trainer.strategy.init_args.master_dtype", "bfloat16",
         "--trainer.strategy.init_args.param_transfer", "shard", "--model.config_overrides", '{"n_layer": 2}']


def test_a_bfloat16_master_trains_and_resumes_with_the_same_bits_on_two_processes(tmp_path):
    """Two processes, each rank's bfloat16 master rows inside its staging copy (param_transfer: shard), clipping by
    the speculative update: the loss falls, and a run stopped after step 3 and resumed from its checkpoint logs the
    uninterrupted run's losses exactly (the stochastic rounding's seeds come from the saved step counts)."""
    from tests.distributed import fit_in_process, run

    steps, ckpts = 6, tmp_path / "ckpt"
    stop = {"class_path": "tests.probes.StopAtStep", "init_args": {"step": 3}}
    settings = [*SLIDE, "--trainer.gradient_clip_val", "1.0", "--trainer.strategy.init_args.update", "speculative"]
    run(fit_in_process, tmp_path, [
        fit_arguments(tmp_path / "whole", *settings, steps=steps),
        fit_arguments(tmp_path / "resumed", *settings, steps=steps, callbacks=[stop, checkpoint_every(3, ckpts)]),
        fit_arguments(tmp_path / "resumed", *settings, "--ckpt_path", "last", steps=steps,
                      callbacks=[checkpoint_every(3, ckpts)]),
    ], world=2)
    whole = read_metrics(max((tmp_path / "whole").glob("lightning_logs/version_*/metrics.csv")))
    first, second = (read_metrics(path) for path in sorted((tmp_path / "resumed").glob("lightning_logs/version_*/metrics.csv")))
    assert len(whole["train/loss"]) == steps and whole["train/loss"][-1] < whole["train/loss"][0]
    assert first["train/loss"] + second["train/loss"] == whole["train/loss"]



def shipped(config: str):
    """``configs/<config>`` as the preflight sees it on one GPU (no GPU needed): strategy, trainer, module, data."""
    import types

    import yaml

    from lit_fsdp.model import CausalLM
    from offload.strategy import SlideFSDPStrategy
    from tests.helpers import REPO

    settings = yaml.safe_load((REPO / "configs" / config).read_text())
    strategy = SlideFSDPStrategy(**settings["trainer"]["strategy"]["init_args"])
    strategy.parallel_devices = [torch.device("cuda", 0)]
    trainer = types.SimpleNamespace(num_devices=1, num_nodes=1, accumulate_grad_batches=1,
                                    gradient_clip_val=settings["trainer"]["gradient_clip_val"])
    data = types.SimpleNamespace(tokenizer=None, **settings["data"]["init_args"])
    return strategy, trainer, CausalLM(**settings["model"]), data


def test_the_14b_full_fine_tune_fits_a_128_gib_host_with_its_master_in_the_staging_copy_and_not_80():
    """configs/qwen_14b_full.yaml through the preflight's plan: 14.77B parameters, the bfloat16 master the staging copy
    (27.5 GiB, no master of its own), bfloat16 moments (55.0), 8 ring buffers: 89.6 GiB with the runtime, so 38 GiB
    to spare on 128; refused in one line on 80."""
    from offload.host_memory import GIB

    strategy, trainer, module, data = shipped("qwen_14b_full.yaml")
    units = strategy.model_units(module, data, 1)
    plan = strategy.plan(trainer)
    assert round(sum(unit.full_numel for unit in units) / 1e9, 2) == 14.77 and plan.master_in_staging(units)
    parts = plan.check_host(units, 128 * GIB, "available")
    assert parts["master"] == 0 and round(parts["staging"] / GIB, 1) == 27.5 and round(parts["adam_moments"] / GIB, 1) == 55.0
    assert parts["kept_gradients"] == parts["speculation_backup"] == 0
    assert 128 * GIB - sum(parts.values()) > 38 * GIB
    with pytest.raises(ValueError, match=r"^SlideFSDP needs 89.6 GiB of host memory per node for 14.77B parameters"):
        plan.check_host(units, 80 * GIB, "available")


def test_the_32b_lora_fits_a_128_gib_host_with_its_unquantised_base_in_the_staging_copy():
    """configs/qwen_32b_lora.yaml: the frozen base once, in bfloat16 (61.3 GiB of staging copy), the adapters' (rank 16
    on every linear layer of the 64 blocks: 134,217,728) float32 master (4 B), moments (8) and the speculative update's
    backup of both (12): 3 GiB together."""
    from offload.host_memory import GIB

    strategy, trainer, module, data = shipped("qwen_32b_lora.yaml")
    units = strategy.model_units(module, data, 1)
    plan = strategy.plan(trainer)
    parts = plan.check_host(units, 128 * GIB, "available")
    assert round(sum(unit.full_numel for unit in units) / 1e9, 2) == 32.90 and not plan.master_in_staging(units)
    assert round(parts["staging"] / GIB, 1) == 61.3
    assert parts["master"] + parts["adam_moments"] + parts["speculation_backup"] == 24 * 134_217_728
    assert 128 * GIB - sum(parts.values()) > 55 * GIB
