"""SlideFSDP's gradient accumulation on the device (``accumulate_on: device``, the default): the micro-batches' float32
sum stays on the device and reaches the host once a step, so the host's steps are the ones it takes accumulating on the
host, the speculative update validates them as without accumulation, and the delayed update accumulates."""

from __future__ import annotations

import pytest

from tests.distributed import fit_in_process, run
from tests.helpers import fit_arguments, read_metrics
from tests.test_offload import SLIDE, STEPS, common, knobs


def metrics(folder) -> dict[str, list[float]]:
    return read_metrics(max(folder.glob("lightning_logs/version_*/metrics.csv")))


def test_the_device_sum_takes_the_host_sums_steps_bit_for_bit_and_sends_one_gradient_a_step(tmp_path):
    """float32, clipping (updates after the backward), 2 micro-batches of 2: the device's sum is the host's, added
    in the same order, so the losses and norms are equal to the bit; its gradient copies are half the host's bytes.
    The speculative update over the device's sum validates the same steps (clipping fires on some: float32 rounding)."""
    settings = [*common(1, 2, clip=True), *SLIDE, *knobs(window=1)]
    stats = {"class_path": "callbacks.OffloadStats"}
    runs = {"host": knobs(accumulate_on="host"), "device": knobs(accumulate_on="device"),
            "speculative": knobs(accumulate_on="device", update="speculative")}
    run(fit_in_process, tmp_path, [fit_arguments(tmp_path / name, *settings, *extra, devices=1, batch_size=2,
                                                 steps=STEPS, callbacks=[stats]) for name, extra in runs.items()], world=1)
    got = {name: metrics(tmp_path / name) for name in runs}
    assert len(got["device"]["train/loss"]) == STEPS
    for key in ("train/loss", "train/grad_norm"):
        assert got["device"][key] == got["host"][key], key
        assert got["speculative"][key] == pytest.approx(got["device"][key], rel=1e-6), key
    assert got["device"]["train/loss"][-1] < got["device"]["train/loss"][0] - 0.1
    for host, device in zip(got["host"]["offload/d2h_gb"], got["device"]["offload/d2h_gb"]):
        assert device == pytest.approx(host / 2, rel=1e-3)


def test_a_delayed_update_accumulates_on_the_device_with_every_micro_batch_of_a_step_on_the_same_weights(tmp_path):
    """Two processes (reduce-scatter, then the device's sum of each rank's shard), the delayed update with clipping:
    2 micro-batches of 1 sequence per rank take the steps 1 micro-batch of 2 takes, norms and losses within float32
    rounding, and each step's update stays hidden behind the next step. A staging row rewritten between a step's
    micro-batches would give its second micro-batch newer weights than its first, and other norms."""
    runs = {"whole": (1, 2), "accumulated": (2, 1)}
    run(fit_in_process, tmp_path, [
        fit_arguments(tmp_path / name, *common(2, accumulation, clip=True), *SLIDE,
                      *knobs(update="delayed", window=1), devices=2, batch_size=batch, steps=STEPS,
                      callbacks=[{"class_path": "callbacks.OffloadStats"}])
        for name, (accumulation, batch) in runs.items()], world=2)
    whole, accumulated = metrics(tmp_path / "whole"), metrics(tmp_path / "accumulated")
    assert accumulated["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=1e-5)
    assert len(accumulated["train/grad_norm"]) == STEPS and whole["train/loss"][-1] < whole["train/loss"][0] - 0.1
    hidden = accumulated["offload/cpu_update_hidden_share"][1:]  # step 0 has no update waiting
    assert len(hidden) == STEPS - 1 and all(share > 0 for share in hidden), hidden


def test_a_delayed_update_accumulating_on_the_host_is_refused_before_launch_naming_the_fix():
    from dataclasses import replace

    from offload import SlideFSDPStrategy
    from offload.plan import SlidePlan, SlideRun

    with pytest.raises(ValueError, match="^SlideFSDP accumulate_on='gpu': set it to device or host$"):
        SlideFSDPStrategy(accumulate_on="gpu")

    plan = SlidePlan(window=1, param_transfer="full", grad_sync="gpu_reduce", activation_offload="none",
                     activation_checkpointing=0, optimizer_state_dtype=None, update="delayed", gradient_slots=None,
                     on_nonfinite="stop", run=SlideRun(1, 1, 4, True, "cpu"), compute_dtype=None, reduce_dtype=None,
                     accumulate_on="host")
    with pytest.raises(ValueError, match="^SlideFSDP update: delayed with accumulate_on: host would rewrite .* set "
                                         "accumulate_on: device"):
        plan.check_knobs()
    plan = replace(plan, accumulate_on="device")
    plan.check_knobs()
    assert plan.schedule.accumulate_on_device and not plan.schedule.keep_gradients and plan.host_accumulation == 1


def test_a_sum_no_last_micro_batch_sent_goes_to_the_host_at_the_optimizer_step_and_none_is_left_for_the_next():
    """A part the step's last backward did not reach keeps its sum on the device until the optimizer step sends it,
    as the last micro-batch would have: the update equals the one from the sum sent in the last micro-batch."""
    import torch

    from offload.schedule import UpdateSchedule
    from tests.test_offload_speculative import pipeline_of, random_gradients, snapshot

    schedule = UpdateSchedule.of("synchronous", False, 2, "warn", accumulate_on="device")
    assert schedule.accumulate_on_device and not schedule.keep_gradients
    results = []
    for reached in (True, False):
        pipeline, params = pipeline_of(schedule, slots=8)
        gradients = random_gradients(params, torch.Generator().manual_seed(1), 1.0)
        for unit in (1, 0):  # the first micro-batch: every part adds to the device's sum
            for part, members in enumerate(pipeline.parts[unit]):
                pipeline.reduce_and_offload(unit, part, [gradients[unit][i] for i in members.places], False, last=False)
        zeros = [[torch.zeros_like(g) for g in unit] for unit in gradients]
        for unit in ((1, 0) if reached else (1,)):  # the last micro-batch: unit 0 gets no gradient when not reached
            for part, members in enumerate(pipeline.parts[unit]):
                pipeline.reduce_and_offload(unit, part, [zeros[unit][i] for i in members.places], True, last=True)
        assert bool(pipeline.accumulated) is not reached
        pipeline.send_leftover_sums(update_now=True)
        pipeline.adam.wait()
        assert not pipeline.accumulated
        results.append(snapshot(pipeline))
        pipeline.adam.close()
    for sent_last, sent_at_step in zip(*results):
        assert torch.equal(sent_last, sent_at_step)


def test_the_devices_sums_are_views_of_one_buffer_allocated_at_placement_not_in_the_backward():
    """Accumulation on the device: every gradient part's float32 sum is a view of one flat buffer the pipeline
    allocated when it was built (placement, before the free memory is measured), of the plan's size; the first
    micro-batch's backward writes into it and allocates no sum of its own."""
    import torch

    from offload.schedule import UpdateSchedule
    from tests.test_offload_speculative import pipeline_of, random_gradients

    pipeline, params = pipeline_of(UpdateSchedule.of("synchronous", False, 2, "warn", accumulate_on="device"), slots=8)
    sums = list(pipeline.device_sums.values())
    storage = sums[0].untyped_storage()
    assert all(s.untyped_storage().data_ptr() == storage.data_ptr() and s.dtype == torch.float32 for s in sums)
    assert storage.nbytes() == sum(layout.shard_numel for layout in pipeline.layouts) * 4  # accumulator_bytes
    gradients = random_gradients(params, torch.Generator().manual_seed(1), 1.0)
    for unit in (1, 0):
        for part, members in enumerate(pipeline.parts[unit]):
            pipeline.reduce_and_offload(unit, part, [gradients[unit][i] for i in members.places], False, last=False)
    assert pipeline.accumulated and all(kept is pipeline.device_sums[key] for key, kept in pipeline.accumulated.items())
    pipeline.adam.close()
