"""SlideFSDP's speculative update: each update runs as its gradient arrives and the optimizer step validates it, so a
step that clipping and the guard leave alone is the synchronous one bit for bit, and one they change is undone
exactly, then redone clipped or left undone."""

from __future__ import annotations

import pytest
import torch

from offload import cpu_adam, host
from offload.host_memory import FLAG_ELEMENTS, HostSetup, UnitSize, host_buffers
from offload.schedule import UpdateSchedule
from offload.strategy import SlideFSDPStrategy
from tests.helpers import checkpoint_every, fit_arguments, read_metrics

CAPACITY = 128  # ring buffer elements: the root's parameters go in 3, 1 and 2 pieces
PIECES_PER_STEP = 1 + 3 + 1 + 2


def pipeline_of(schedule: UpdateSchedule, slots: int = 2):
    """One process's gradient pipeline under ``schedule``: a block and a larger root (3 parameters) in a bfloat16
    staging copy, the same master rows whatever the schedule, copies emulated as asynchronous."""
    from compress.layout import UnitLayout
    from offload.gradients import GradientPipeline
    from offload.transfers import Transfers

    shapes = [[(4, 8)], [(40, 8), (10,), (30, 8)]]
    params = [[torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in unit] for unit in shapes]
    layouts = [UnitLayout.build(f"unit{u}", [((f"p{u}{i}",), p) for i, p in enumerate(unit)], 1, 0)
               for u, unit in enumerate(params)]
    state = host.HostState(layouts, torch.bfloat16, torch.bfloat16, full_staging=True,
                           keep_gradients=schedule.keep_gradients, incoming_full=False, ring_size=1, pin=False, shared=None)
    generator = torch.Generator().manual_seed(0)
    for unit, master in enumerate(state.master):
        master.copy_(torch.randn(master.shape, generator=generator))
        state.write_staging(unit)
    state.piece_capacity = CAPACITY
    state.incoming = host.BufferRing(slots, CAPACITY + FLAG_ELEMENTS, torch.bfloat16, pin=False)
    held = torch.optim.AdamW([p for unit in params for p in unit], lr=1e-2, weight_decay=0.1)
    adam = cpu_adam.CpuAdam(layouts, state.master, held)
    transfers = Transfers(torch.device("cpu"), emulated_delay_ms=1.0)
    return GradientPipeline(layouts, state, adam, transfers, gpu_reduce=True, reduce_dtype=torch.bfloat16, world_size=1,
                            shard_rank=0, shard_group=None, replicate_group=None, host_group=None, schedule=schedule), params


def backward(pipeline, gradients, micro_batches: int = 1) -> None:
    """Send ``gradients`` (per unit, per parameter) as ``micro_batches`` backwards would, the root's first, as the engine
    does: updates start on arrival at the last micro-batch unless the schedule defers them."""
    for micro_batch in range(micro_batches):
        for unit in (1, 0):
            for part, members in enumerate(pipeline.parts[unit]):
                last = micro_batch == micro_batches - 1
                pipeline.reduce_and_offload(unit, part, [gradients[unit][i] for i in members.places],
                                            update_now=last and not pipeline.schedule.defer)
    pipeline.adam.wait()


def synchronous_step(pipeline, max_norm) -> torch.Tensor:
    """The synchronous update's optimizer step: the norm, then every unit's update after it, waited for."""
    norm = pipeline.ordered_norm(max_norm, None, "stop")
    pipeline.start_ordered()
    pipeline.adam.wait()
    return norm


def snapshot(pipeline) -> list[torch.Tensor]:
    """Master rows, staging rows, moments and step counts, copied."""
    adam = pipeline.adam
    states = [adam.optimizers[unit].state[piece] for unit in (0, 1) for piece in adam.pieces[unit]]
    return [t.clone() for t in [*pipeline.host.master, *pipeline.host.staging,
                                *(state[key] for state in states for key in sorted(state))]]


def random_gradients(params, generator, scale: float) -> list[list[torch.Tensor]]:
    return [[(torch.randn(p.shape, generator=generator) * scale).bfloat16() for p in unit] for unit in params]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_speculative_step_is_the_synchronous_one_bit_for_bit_unless_clipping_fires_then_it_is_redone_clipped(
        accumulation):
    """Steps 0 and 2 leave clipping alone (max_norm far above the norm): the speculative update, applied on arrival
    from the bfloat16 pieces (or, accumulating, from the fp32 sum), is the deferred update's bit for bit and nothing is
    rolled back. Steps 1 and 3 clip (gradients 100 times larger): the step is undone and redone with the coefficient,
    equal to the synchronous clipped update within float32 rounding, not bit for bit: the norm is summed piece by piece
    in float64 as the pieces arrive (``clip_kept`` stacks per-parameter float32 norms) and the coefficient multiplies
    inside the update rather than the kept gradient first. The held pieces go back to the ring at each validation."""
    synchronous_schedule = UpdateSchedule.of("synchronous", True, accumulation, "stop")
    speculative_schedule = UpdateSchedule.of("speculative", True, accumulation, "stop")
    assert speculative_schedule.speculate and not speculative_schedule.defer and speculative_schedule.norms_on_arrival
    assert speculative_schedule.holds_pieces == (accumulation == 1)
    (synchronous, params), (speculative, _) = (pipeline_of(synchronous_schedule, slots=PIECES_PER_STEP),
                                               pipeline_of(speculative_schedule, slots=PIECES_PER_STEP))
    generator = torch.Generator().manual_seed(1)
    for step, clips in enumerate([False, True, False, True]):
        gradients = random_gradients(params, generator, 100.0 if clips else 0.01)
        max_norm = 1.0
        backward(synchronous, gradients, accumulation)
        want_norm = synchronous_step(synchronous, max_norm)
        backward(speculative, gradients, accumulation)
        assert speculative.host.incoming._free.qsize() == (0 if accumulation == 1 else PIECES_PER_STEP)
        norm = speculative.validate(max_norm, None, "stop")
        torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
        rolled_back, seconds = speculative.take_rollback()
        assert rolled_back == clips and (seconds > 0) == clips
        assert speculative.host.incoming._free.qsize() == PIECES_PER_STEP
        same = (lambda a, b: torch.equal(a, b)) if step == 0 else (
            lambda a, b: torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7) is None)
        for got, want in zip(snapshot(speculative), snapshot(synchronous)):
            assert same(got, want), step
    for pipeline in (synchronous, speculative):
        pipeline.adam.close()


@pytest.mark.parametrize("on_nonfinite", ["skip_step", "stop"])
def test_a_step_with_an_infinite_gradient_is_undone_to_the_last_bit_and_the_next_step_goes_on(on_nonfinite):
    """An infinity in one root piece: every unit's speculative update ran (the infinity made NaNs of that part's
    master and moments), and the validation's non-finite norm undoes them all: master, both moments, step counts
    and the bfloat16 staging rows (rewritten from the restored master) equal the state before the step bit for bit.
    With ``skip_step`` the guard's ``drop_gradients`` then changes nothing more, and the next step is the one a
    pipeline that never saw the bad step takes; ``stop`` stops with nothing non-finite left."""
    schedule = UpdateSchedule.of("speculative", False, 1, on_nonfinite)
    assert schedule.speculate and not schedule.check_units_finite
    (pipeline, params), (clean, _) = (pipeline_of(schedule, slots=PIECES_PER_STEP),
                                      pipeline_of(schedule, slots=PIECES_PER_STEP))
    generator = torch.Generator().manual_seed(2)
    first, bad, after = (random_gradients(params, generator, 0.01) for _ in range(3))
    bad[1][0][3, 5] = float("inf")
    for target in (pipeline, clean):
        backward(target, first)
        target.validate(None, None, on_nonfinite)
        target.take_rollback()
    before = snapshot(pipeline)
    backward(pipeline, bad)
    assert not torch.isfinite(pipeline.host.master[1]).all()  # applied speculatively
    assert not torch.isfinite(pipeline.validate(None, None, on_nonfinite))
    pipeline.discard(undo=True)  # the guard's drop_gradients (after a stop, nothing is read again)
    assert all(torch.equal(got, want) for got, want in zip(snapshot(pipeline), before))
    assert pipeline.take_rollback()[0] and pipeline.host.incoming._free.qsize() == PIECES_PER_STEP
    for target in (pipeline, clean):
        backward(target, after)
        assert torch.isfinite(target.validate(None, None, on_nonfinite))
        assert not target.take_rollback()[0]
    assert all(torch.equal(got, want) for got, want in zip(snapshot(pipeline), snapshot(clean)))
    for target in (pipeline, clean):
        target.adam.close()


def test_an_unknown_update_is_refused_and_the_speculative_backup_is_counted_as_allocated():
    """One line at construction for an update that is not a choice; without clipping and with ``on_nonfinite: warn``
    nothing could undo a step, so it is the plain overlapped update; the backup (master and both moments per trained shard
    row) is counted by the host accounting as allocated, and a ring too small to hold a step's pieces is refused."""
    from offload.host_memory import GradientSlotsError, gradient_slots

    with pytest.raises(ValueError, match=r"^SlideFSDP update='speculate': set it to auto \(the fastest exact schedule "
                                         r"that fits\), synchronous, forward, split, speculative or delayed"):
        SlideFSDPStrategy(update="speculate")
    assert UpdateSchedule.of("speculative", False, 1, "warn") == UpdateSchedule.of("synchronous", False, 1, "warn")
    schedule = UpdateSchedule.of("speculative", True, 1, "warn")
    pipeline, _ = pipeline_of(schedule, slots=PIECES_PER_STEP)
    units = [UnitSize(layout.full_numel, layout.shard_numel) for layout in pipeline.layouts]
    for moments in (torch.float32, torch.bfloat16):
        setup = HostSetup.of_knobs(torch.bfloat16, torch.bfloat16, moments, 1, "full", "gpu_reduce", 2, False,
                                   speculate=True)
        assert host_buffers(units, setup)["speculation_backup"] == sum(u.shard_numel for u in units) * (
            4 + 2 * moments.itemsize)
    assert pipeline.speculation_bytes() == host_buffers(units, HostSetup.of_knobs(
        torch.bfloat16, torch.bfloat16, torch.float32, 1, "full", "gpu_reduce", 2, False, speculate=True))[
        "speculation_backup"]
    capacity_units = [UnitSize(128, 128)] * 3 + [UnitSize(448, 448, (320, 128))]
    held = HostSetup.of_knobs(torch.bfloat16, torch.bfloat16, torch.float32, 1, "full", "gpu_reduce", 2, False,
                              gradient_slots=6, speculate=True)
    with pytest.raises(GradientSlotsError, match=r"update: speculative holds one step's 7 gradient pieces"):
        gradient_slots(capacity_units, held)
    pipeline.adam.close()


STEPS = 8
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]
SPECULATIVE = ["--trainer.strategy.init_args.update", "speculative"]
SYNCHRONOUS = ["--trainer.strategy.init_args.update", "synchronous"]
STATS = {"class_path": "callbacks.OffloadStats"}


def metrics(folder) -> dict[str, list[float]]:
    return read_metrics(max(folder.glob("lightning_logs/version_*/metrics.csv")))


def test_the_shipped_8b_with_the_speculative_update_is_refused_on_a_128_gib_host_naming_its_backup():
    """The 8B's backup (fp32 rows and bfloat16 moments: 8 B per parameter) does not fit beside its 94 GiB: the
    preflight's plan says so, with the knob and the mode that overlaps without one."""
    from tests.test_offload_host import GIB, _llama_8b_offload

    strategy, trainer, module, data = _llama_8b_offload()
    strategy.update = "speculative"
    units = strategy.model_units(module, data, trainer.num_devices)
    plan = strategy.plan(trainer)
    assert plan.schedule.speculate and round(plan.host_buffers(units)["speculation_backup"] / GIB, 1) == 59.8
    with pytest.raises(ValueError, match=r"^SlideFSDP needs 153.5 GiB .* but 128.0 GiB are available; set "
                                         r"update: auto \(its backup is 59.8 GiB; auto speculates only the blocks the host has room for\)"):
        plan.check_host(units, 128 * GIB, "available")


def test_speculative_clipping_takes_the_synchronous_steps_on_one_and_two_processes_across_a_resume_after_a_rollback(
        tmp_path, monkeypatch):
    """With max_norm 1.1 clipping fires at some steps of the tiny model and not at others (norms 0.8 to 1.65): the
    speculative run takes the synchronous clipped run's steps, on one process and on two sharing a staging copy with
    asynchronous copies; OffloadStats counts a rollback at exactly the steps whose norm was above max_norm, with its
    time. The two-process run stops after step 3, which was rolled back, and resumes from its checkpoint exactly."""
    from offload.transfers import EMULATED_DELAY_VARIABLE
    from tests.distributed import fit_in_process, run

    settings = ["--model.config_overrides", '{"n_layer": 4}', "--trainer.gradient_clip_val", "1.1", *SLIDE]
    run(fit_in_process, tmp_path, [fit_arguments(tmp_path / name, *settings, *extra, devices=1, batch_size=4, steps=STEPS,
                                                 callbacks=[STATS])
                                   for name, extra in (("synchronous", SYNCHRONOUS), ("one", SPECULATIVE))], world=1)
    monkeypatch.setenv(EMULATED_DELAY_VARIABLE, "2")
    ckpts, stop = tmp_path / "ckpt", {"class_path": "tests.probes.StopAtStep", "init_args": {"step": 3}}
    two = [*settings, *SPECULATIVE, "--trainer.strategy.init_args.param_transfer", "full"]
    run(fit_in_process, tmp_path, [
        fit_arguments(tmp_path / "two", *two, steps=STEPS, callbacks=[STATS, stop, checkpoint_every(3, ckpts)]),
        fit_arguments(tmp_path / "two", *two, "--ckpt_path", "last", steps=STEPS,
                      callbacks=[STATS, checkpoint_every(3, ckpts)]),
    ], world=2)
    want, one = metrics(tmp_path / "synchronous"), metrics(tmp_path / "one")
    first, second = (read_metrics(path) for path in sorted((tmp_path / "two").glob("lightning_logs/version_*/metrics.csv")))
    clipped = [norm > 1.1 for norm in want["train/grad_norm"]]
    assert any(clipped) and not all(clipped), want["train/grad_norm"]
    assert clipped[2], "the checkpoint after step 3 should follow a rolled-back step"
    assert want["offload/rollbacks"] == [0.0] * STEPS
    for got in (one, {key: first[key] + second[key] for key in first}):
        assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
        assert got["offload/rollbacks"] == [float(c) for c in clipped]
        assert all((ms > 0) == c for ms, c in zip(got["offload/rollback_ms"], clipped))
    assert len(first["train/loss"]) == 3 and first["offload/rollbacks"][-1] == 1.0


def test_speculative_clipping_with_lora_and_accumulation_takes_the_synchronous_steps(tmp_path):
    """A LoRA fine-tune (adapters on the host; the frozen root sends nothing) accumulating 2 micro-batches on 2
    processes: the speculative update runs from the fp32 sum kept for accumulation, its norm taken there, and takes
    the synchronous run's steps; max_norm 0.56 fires at some of its steps (norms 0.54 to 0.59) and not at others."""
    import json

    from transformers import AutoModelForCausalLM

    from lit_fsdp.presets import build_config
    from tests.distributed import fit_in_process, run

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config("gpt2-tiny")).save_pretrained(tmp_path / "base")
    settings = ["--model.pretrained_path", str(tmp_path / "base"), "--model.lora", json.dumps({"rank": 4}),
                "--data.seq_len", "64", "--trainer.gradient_clip_val", "0.56", "--trainer.accumulate_grad_batches", "2",
                *SLIDE, "--trainer.strategy.init_args.window", "1"]
    run(fit_in_process, tmp_path, [fit_arguments(tmp_path / name, *settings, *extra, batch_size=1, steps=6,
                                                 callbacks=[STATS])
                                   for name, extra in (("synchronous", SYNCHRONOUS), ("speculative", SPECULATIVE))], world=2)
    want, got = metrics(tmp_path / "synchronous"), metrics(tmp_path / "speculative")
    clipped = [norm > 0.56 for norm in want["train/grad_norm"]]
    assert any(clipped) and not all(clipped), want["train/grad_norm"]
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    assert got["offload/rollbacks"] == [float(c) for c in clipped]
