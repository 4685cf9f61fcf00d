"""SlideFSDP's ordered update (``update: forward`` and ``split``): each step's updates after the norm, in forward order,
hidden behind the next forward, is the synchronous update bit for bit: clipping firing, on one process and on two
sharing a staging copy, accumulating on the device, with LoRA, with a bfloat16 master, across a resume from a
checkpoint taken between steps, and with every unit's update slowed and every copy made asynchronous (emulated), so
that a load that did not wait for its unit's update would read other weights; a split whose speculated units are
rolled back when clipping fires takes the same steps too."""

from __future__ import annotations

import json

import pytest
import torch

from offload.cpu_adam import EMULATED_UPDATE_DELAY_VARIABLE
from offload.transfers import EMULATED_DELAY_VARIABLE
from tests.helpers import checkpoint_every, fit_arguments, read_metrics

STEPS = 6
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--model.config_overrides", '{"n_layer": 4}']
STATS = {"class_path": "callbacks.OffloadStats", "init_args": {"warmup_steps": 0}}
CLIP = 1.1  # the tiny model's norms run 0.8 to 1.7: clipping fires at some steps and not at others


def update(name: str, *extra: str) -> list[str]:
    return ["--trainer.strategy.init_args.update", name, *extra]


def metrics(folder) -> list[dict[str, list[float]]]:
    """Each fit's logged metrics in ``folder``, in the order they ran."""
    return [read_metrics(path) for path in sorted(folder.glob("lightning_logs/version_*/metrics.csv"),
                                                  key=lambda path: int(path.parent.name.split("_")[1]))]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Two processes sharing a staging copy (``param_transfer: full``), 2 micro-batches summed on the device, every
    copy emulated as asynchronous and every unit's update slowed by 20 ms: the synchronous run, the forward-ordered
    run, a split of the last 2 blocks, and a forward-ordered run stopped after step 3 and resumed from its
    checkpoint."""
    from tests.distributed import fit_in_process, run

    tmp = tmp_path_factory.mktemp("forward_two")
    ckpts, stop = tmp / "ckpt", {"class_path": "tests.probes.StopAtStep", "init_args": {"step": 3}}
    common = [*SLIDE, "--trainer.gradient_clip_val", str(CLIP), "--trainer.accumulate_grad_batches", "2",
              "--trainer.strategy.init_args.param_transfer", "full", "--trainer.strategy.init_args.window", "1"]
    runs = {"synchronous": update("synchronous"), "forward": update("forward"),
            "split": update("split", "--trainer.strategy.init_args.speculated_blocks", "2")}
    arguments = [fit_arguments(tmp / name, *common, *extra, batch_size=1, steps=STEPS, callbacks=[STATS])
                 for name, extra in runs.items()]
    resumed = [*common, *update("forward")]
    arguments += [fit_arguments(tmp / "resumed", *resumed, batch_size=1, steps=STEPS,
                                callbacks=[STATS, stop, checkpoint_every(3, ckpts)]),
                  fit_arguments(tmp / "resumed", *resumed, "--ckpt_path", "last", batch_size=1, steps=STEPS,
                                callbacks=[STATS, checkpoint_every(3, ckpts)])]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(EMULATED_DELAY_VARIABLE, "2")
        patch.setenv(EMULATED_UPDATE_DELAY_VARIABLE, "20")
        run(fit_in_process, tmp, arguments, world=2)
    return {name: metrics(tmp / name) for name in [*runs, "resumed"]}


def clipped(run: dict[str, list[float]]) -> list[bool]:
    norms = run["train/grad_norm"]
    return [norm > CLIP for norm in norms]


def test_the_forward_order_is_the_synchronous_update_bit_for_bit_on_two_processes_sharing_a_staging_copy(two_processes):
    """Losses and gradient norms equal to the last bit at every step, clipping firing at some; the forward waited for
    the slowed updates (``forward_wait_ms``) where the synchronous run waited at the optimizer step instead."""
    (want,), (got,) = two_processes["synchronous"], two_processes["forward"]
    fired = clipped(want)
    assert any(fired) and not all(fired), want["train/grad_norm"]
    assert got["train/loss"] == want["train/loss"] and got["train/grad_norm"] == want["train/grad_norm"]
    assert sum(got["offload/forward_wait_ms"]) > 0 and sum(want["offload/forward_wait_ms"]) == 0
    assert sum(want["offload/update_wait_ms"]) > sum(got["offload/update_wait_ms"])


def test_a_split_rolls_its_speculated_blocks_back_when_clipping_fires_and_takes_the_synchronous_steps(two_processes):
    """The last 2 blocks and the head side speculated during the backward: a rollback at each step whose norm was above
    max_norm (counted with the next step's figures: it runs behind the next forward), and the synchronous steps."""
    (want,), (got,) = two_processes["synchronous"], two_processes["split"]
    assert got["train/loss"] == want["train/loss"] and got["train/grad_norm"] == want["train/grad_norm"]
    assert got["offload/rollbacks"][1:] == [float(fired) for fired in clipped(want)[:-1]]
    assert 0 < got["offload/speculated_share"][0] < 1


def test_the_forward_order_resumes_from_a_checkpoint_taken_between_steps_with_the_same_bits(two_processes):
    """Stopped after step 3 (its updates still running behind the next forward when the checkpoint is asked for: it
    waits for them) and resumed: the uninterrupted synchronous run's steps."""
    (want,), (first, second) = two_processes["synchronous"], two_processes["resumed"]
    assert len(first["train/loss"]) == 3
    assert first["train/loss"] + second["train/loss"] == want["train/loss"]
    assert first["train/grad_norm"] + second["train/grad_norm"] == want["train/grad_norm"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, clipping, updates slowed and copies asynchronous: a LoRA fine-tune and a bfloat16 master, each
    synchronous and forward-ordered."""
    from transformers import AutoModelForCausalLM

    from lit_fsdp.presets import build_config
    from tests.distributed import fit_in_process, run

    tmp = tmp_path_factory.mktemp("forward_one")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config("gpt2-tiny")).save_pretrained(tmp / "base")
    lora = ["--model.pretrained_path", str(tmp / "base"), "--model.lora", json.dumps({"rank": 4}),
            "--trainer.gradient_clip_val", "0.56", "--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]
    bfloat16 = [*SLIDE, "--trainer.gradient_clip_val", "1.0", "--trainer.strategy.init_args.param_dtype", "bfloat16",
                "--trainer.strategy.init_args.master_dtype", "bfloat16"]
    runs = {f"{name}_{schedule}": [*settings, *update(schedule)] for name, settings in (("lora", lora), ("bf16", bfloat16))
            for schedule in ("synchronous", "forward")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(EMULATED_DELAY_VARIABLE, "2")
        patch.setenv(EMULATED_UPDATE_DELAY_VARIABLE, "20")
        run(fit_in_process, tmp, [fit_arguments(tmp / name, *extra, devices=1, batch_size=2, steps=STEPS, callbacks=[STATS])
                                  for name, extra in runs.items()], world=1)
    return {name: metrics(tmp / name)[0] for name in runs}


@pytest.mark.parametrize("name", ["lora", "bf16"])
def test_the_forward_order_is_the_synchronous_update_with_lora_and_with_a_bfloat16_master(one_process, name):
    """LoRA (the adapters trained, the frozen root sending nothing) and a bfloat16 master (rounded stochastically,
    the master the staging copy): the synchronous run's losses and norms, to the last bit."""
    want, got = one_process[f"{name}_synchronous"], one_process[f"{name}_forward"]
    assert got["train/loss"] == want["train/loss"] and got["train/grad_norm"] == want["train/grad_norm"]
    assert sum(got["offload/forward_wait_ms"]) > 0


def test_the_update_knobs_that_cannot_work_are_refused_in_one_line_naming_the_fix():
    from offload import SlideFSDPStrategy
    from offload.plan import SlidePlan, SlideRun

    for knobs, message in (
            ({"update": "forward", "speculated_blocks": 2}, r"^SlideFSDP speculated_blocks=2: the blocks update: split "
                                                            r"\(or auto\) speculates, >= 0; or null"),
            ({"speculated_blocks": -1}, r"^SlideFSDP speculated_blocks=-1: "),
            ({"delayed_update_warmup": 10}, r"^SlideFSDP delayed_update_warmup=10 warms up update: delayed; set "
                                            r"update: delayed, or delayed_update_warmup: 0$")):
        with pytest.raises(ValueError, match=message):
            SlideFSDPStrategy(**knobs)
    plan = SlidePlan(window=1, param_transfer="full", grad_sync="gpu_reduce", activation_offload="none",
                     activation_checkpointing=0, optimizer_state_dtype=torch.float32, update="split",
                     gradient_slots=None, on_nonfinite="stop", run=SlideRun(1, 1, 2, True, "cpu"),
                     compute_dtype=torch.float32, reduce_dtype=torch.float32, accumulate_on="host")
    with pytest.raises(ValueError, match=r"^SlideFSDP update: split speculates .* set accumulate_on: device, or "
                                         r"update: forward$"):
        plan.check_knobs()


def test_the_split_speculates_the_first_arriving_units_and_counts_their_backup_as_allocated():
    """The root's parameters used after the blocks (final norm, head) arrive first, then the last blocks; a split of
    ``k`` blocks backs up those rows alone (``speculated_units``), which the host accounting counts, and ``auto``
    takes as many blocks as fit, or the fewest of the fastest by the step-time model."""
    from transformers import AutoModelForCausalLM

    from lit_fsdp.parallelize import find_blocks
    from lit_fsdp.presets import build_config
    from offload.host_memory import HostSetup, host_buffers
    from offload.layout import build_layouts, leading_root_places
    from offload.plan import sizes_of
    from offload.host_memory import speculated_units
    from offload.update_split import choose_split

    for preset, leading in (("gpt2-tiny", 2), ("llama-tiny", 1)):  # wte and wpe (the head tied to wte); embed_tokens
        with torch.device("meta"):
            network = AutoModelForCausalLM.from_config(build_config(preset))
        blocks = find_blocks(network, None)
        layouts = [*build_layouts(network, blocks, 1, 0)[0], build_layouts(network, blocks, 1, 0)[1]]
        assert leading_root_places(network, blocks, layouts[-1]) == leading, preset
    units = sizes_of(layouts, layouts, gpu_reduce=True, leading_places=1)  # llama-tiny: embed, norm, head
    root = units[-1]
    embed = root.parts[0]
    assert speculated_units(units, 0) == {len(units) - 1: (embed, root.shard_numel)}
    assert speculated_units(units, 1) == {len(units) - 1: (embed, root.shard_numel), len(units) - 2: (0, units[-2].shard_numel)}
    setup = HostSetup.of_knobs(torch.float32, torch.float32, torch.bfloat16, 1, "full", "gpu_reduce", 2, False,
                               ordered=True, split_blocks=1)
    backup = (root.shard_numel - embed + units[-2].shard_numel) * (4 + 2 * 2)
    assert host_buffers(units, setup)["speculation_backup"] == backup
    assert choose_split(len(units) - 1, lambda k: k <= 1) == 1 and choose_split(4, lambda k: False) is None
    assert choose_split(4, lambda k: True, step_s=lambda k: 10.0 - min(k, 2)) == 2  # no faster past 2: the fewest


@pytest.mark.parametrize(("on_nonfinite", "clipping"), [("skip_step", False), ("stop", True)])  # stop alone: on arrival
def test_a_split_step_with_an_infinite_gradient_is_undone_to_the_last_bit_and_the_next_step_goes_on(on_nonfinite,
                                                                                                    clipping):
    """The guard with a split (one process's pipeline, copies emulated as asynchronous): an infinity in the root's
    speculated head piece made NaNs of the rows updated on arrival; the non-finite norm undoes them at once, the
    guard's ``drop_gradients`` leaves nothing to update after the norm, and master, moments, step counts and staging
    rows are as before the step, bit for bit; the next step is the one a pipeline that never saw the bad step takes."""
    from offload.host_memory import UnitSize, speculated_units
    from offload.schedule import UpdateSchedule
    from tests.test_offload_speculative import PIECES_PER_STEP, backward, pipeline_of, random_gradients, snapshot

    schedule = UpdateSchedule.of("split", clipping, 1, on_nonfinite)
    assert schedule.split and schedule.behind_forward and schedule.norms_on_arrival and not schedule.check_units_finite
    pipelines = []
    for _ in range(2):
        pipeline, params = pipeline_of(schedule, slots=PIECES_PER_STEP)
        sizes = [UnitSize(layout.full_numel, layout.shard_numel, tuple(p.layout.shard_numel for p in parts) if unit else (),
                          leading_parts=1 if unit else 0)
                 for unit, (layout, parts) in enumerate(zip(pipeline.layouts, pipeline.parts))]
        pipeline.speculated = speculated_units(sizes, 1)  # the root's 2nd and 3rd parameters, and the block
        pipeline.attach(pipeline.adam)
        pipelines.append(pipeline)
    (pipeline, clean) = pipelines

    def step(target, gradients) -> torch.Tensor:
        backward(target, gradients)
        norm = target.ordered_norm(None, None, on_nonfinite)
        if not torch.isfinite(norm):
            target.discard(undo=True)  # the guard's drop_gradients
        target.start_ordered()
        target.adam.wait()
        return norm

    generator = torch.Generator().manual_seed(2)
    first, bad, after = (random_gradients(params, generator, 0.01) for _ in range(3))
    bad[1][2][3, 5] = float("inf")  # the head: speculated, updated on arrival
    for target in (pipeline, clean):
        assert torch.isfinite(step(target, first))
    before = snapshot(pipeline)
    backward(pipeline, bad)
    assert not torch.isfinite(pipeline.host.master[1]).all()  # applied speculatively
    norm = pipeline.ordered_norm(None, None, on_nonfinite)
    assert not torch.isfinite(norm)
    pipeline.discard(undo=True)
    pipeline.start_ordered()
    pipeline.adam.wait()
    assert all(torch.equal(got, want) for got, want in zip(snapshot(pipeline), before))
    assert pipeline.host.incoming._free.qsize() == PIECES_PER_STEP
    for target in (pipeline, clean):
        assert torch.isfinite(step(target, after))
    assert all(torch.equal(got, want) for got, want in zip(snapshot(pipeline), snapshot(clean)))
    for target in (pipeline, clean):
        target.adam.close()
