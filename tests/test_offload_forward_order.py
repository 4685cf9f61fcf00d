"""SlideFSDP's ordered update (``update: forward`` and ``split``): each step's updates after the norm, in forward order,
hidden behind the next forward, is the synchronous update bit for bit: clipping firing, on one process, on two
sharing a staging copy at window 2 (a prefetch blocks until its unit's update is done) and on three sharing it at
window 1, accumulating on the device, with LoRA, with a bfloat16 master, across a resume from a checkpoint taken
between steps, with a validation between steps while the step's updates still run, and with every unit's update
slowed and every copy made asynchronous (emulated), so that a load that did not wait for its unit's update would read
other weights. The losses, gradient norms and validation losses are the synchronous run's, and so are the master
weights and both AdamW moments the run ends with (read after fit, past the strategy's teardown, as a script that
trained finds them: the end of training waits for the last step's updates, queued behind a forward that never comes);
a split whose speculated units are rolled back when clipping fires takes the same steps too."""

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
VALIDATED_STEP = 4  # one validation, after step 4's updates were queued; none after the last step, whose loads would
#                     wait for every unit's update before the end of training does


def update(name: str, *extra: str) -> list[str]:
    return ["--trainer.strategy.init_args.update", name, *extra]


def validation(micro_batches: int) -> list[str]:
    """A validation of 2 batches after step ``VALIDATED_STEP`` (``val_check_interval`` counts micro-batches), and no
    sanity check before training (nothing is outstanding there)."""
    return ["--trainer.limit_val_batches", "2", "--trainer.val_check_interval", str(VALIDATED_STEP * micro_batches),
            "--trainer.num_sanity_val_steps", "0"]


def metrics(folder) -> list[dict[str, list[float]]]:
    """Each fit's logged metrics in ``folder``, in the order they ran."""
    return [read_metrics(path) for path in sorted(folder.glob("lightning_logs/version_*/metrics.csv"),
                                                  key=lambda path: int(path.parent.name.split("_")[1]))]


def save_host_state(folder) -> dict:
    return {"class_path": "tests.probes.SaveHostState", "init_args": {"path": str(folder / "host_state")}}


def host_state(folder, world: int) -> list[dict]:
    """Each rank's master rows and AdamW state at the end of the last fit in ``folder`` (``SaveHostState``)."""
    return [torch.load(folder / f"host_state.rank{rank}") for rank in range(world)]


def one_fit(tmp, name: str, world: int, *args: str, batch_size: int) -> list[list[str]]:
    """``fit`` arguments of a run of ``STEPS`` steps in ``tmp / name`` that saves its host state at the end, with no
    checkpoint (a save waits for the updates): a run of one fit for ``fit_runs``."""
    return [fit_arguments(tmp / name, *args, "--trainer.enable_checkpointing", "false", devices=world,
                          batch_size=batch_size, steps=STEPS, callbacks=[STATS, save_host_state(tmp / name)])]


def fit_runs(tmp, world: int, runs: dict[str, list[list[str]]]) -> dict[str, tuple[list[dict], list[dict]]]:
    """Each run (name: its fits' ``fit`` arguments, run in ``tmp / name``) on the same ``world`` processes, one fit
    after another (one start-up for all), copies asynchronous and updates slowed; each run's metrics per fit, and its
    ranks' host state at the end of its last fit."""
    from tests.distributed import fit_in_process, run

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(EMULATED_DELAY_VARIABLE, "2")
        patch.setenv(EMULATED_UPDATE_DELAY_VARIABLE, "20")
        run(fit_in_process, tmp, [arguments for fits in runs.values() for arguments in fits], world=world)
    return {name: (metrics(tmp / name), host_state(tmp / name, world)) for name in runs}


def assert_same_state(got: list[dict], want: list[dict]) -> None:
    """Master rows, ``exp_avg``, ``exp_avg_sq`` and step counts equal to the last bit, unit by unit, on every rank;
    ``want`` took every step."""
    for rank, (mine, theirs) in enumerate(zip(got, want)):
        assert len(mine["master"]) == len(theirs["master"]) and len(mine["moments"]) == len(theirs["moments"])
        for unit, (rows, wanted) in enumerate(zip(mine["master"], theirs["master"])):
            assert torch.equal(rows, wanted), f"rank {rank} unit {unit}: master rows differ"
        for unit, (pieces, wanted) in enumerate(zip(mine["moments"], theirs["moments"])):
            assert len(pieces) == len(wanted)
            for piece, (state, expected) in enumerate(zip(pieces, wanted)):
                assert int(expected["step"]) == STEPS, f"rank {rank} unit {unit} piece {piece}: {expected['step']}"
                differ = [key for key in ("exp_avg", "exp_avg_sq", "step") if not torch.equal(state[key], expected[key])]
                assert differ == [], f"rank {rank} unit {unit} piece {piece}"


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """Two processes sharing a staging copy (``param_transfer: full``) at window 2, 2 micro-batches summed on the
    device, a validation after step 4: the synchronous run, the forward-ordered run, a split of the last 2 blocks, and
    a forward-ordered run stopped after step 3 and resumed from its checkpoint (its metrics per fit, and the host state
    the resumed fit ends with)."""
    tmp = tmp_path_factory.mktemp("forward_two")
    ckpts, stop = tmp / "ckpt", {"class_path": "tests.probes.StopAtStep", "init_args": {"step": 3}}
    common = [*SLIDE, "--trainer.gradient_clip_val", str(CLIP), "--trainer.accumulate_grad_batches", "2",
              "--trainer.strategy.init_args.param_transfer", "full", "--trainer.strategy.init_args.window", "2",
              *validation(2)]
    runs = {name: one_fit(tmp, name, 2, *common, *extra, batch_size=1) for name, extra in (
        ("synchronous", update("synchronous")), ("forward", update("forward")),
        ("split", update("split", "--trainer.strategy.init_args.speculated_blocks", "2")))}
    # auto: forward for 4 steps, then the step model's choice with the run's rates, taken before step 5's backward
    runs["auto"] = [fit_arguments(tmp / "auto", *common, *update("auto"), "--trainer.enable_checkpointing", "false",
                                  batch_size=1, steps=STEPS, callbacks=[STATS, save_host_state(tmp / "auto"),
                                                                        {"class_path": "callbacks.Results"}])]
    resumed, probes = [*common, *update("forward")], [STATS, save_host_state(tmp / "resumed")]
    runs["resumed"] = [fit_arguments(tmp / "resumed", *resumed, batch_size=1, steps=STEPS,
                                     callbacks=[*probes, stop, checkpoint_every(3, ckpts)]),
                       fit_arguments(tmp / "resumed", *resumed, "--ckpt_path", "last", batch_size=1, steps=STEPS,
                                     callbacks=[*probes, checkpoint_every(3, ckpts)])]
    return {**fit_runs(tmp, 2, runs), "auto_folder": tmp / "auto"}


def clipped(run: dict[str, list[float]]) -> list[bool]:
    norms = run["train/grad_norm"]
    return [norm > CLIP for norm in norms]


def assert_same_steps(got: dict[str, list[float]], want: dict[str, list[float]]) -> None:
    """Losses, gradient norms and the validation's loss equal to the last bit."""
    assert len(want["val/loss"]) == 1
    assert [key for key in ("val/loss", "train/loss", "train/grad_norm") if got[key] != want[key]] == []


def test_auto_chooses_by_the_step_model_after_step_4_and_takes_the_synchronous_steps(two_processes):
    """``update: auto`` runs forward for its first 4 steps, then the step model's choice with the run's own rates and
    clip rate (``offload.auto_update``), on both ranks: the steps, the master and both moments are the synchronous
    run's bit for bit, and results.jsonl says what auto took and why."""
    (auto,), state = two_processes["auto"]
    (synchronous,), want = two_processes["synchronous"]
    assert_same_steps(auto, synchronous)
    assert_same_state(state, want)
    record = json.loads((next(iter(two_processes["auto_folder"].rglob("results.jsonl")))).read_text().splitlines()[-1])
    assert record["offload_update"].startswith(("split", "forward order"))
    assert record["offload_update_reason"].startswith("by the step model with this run's rates over steps 2-4 (")
    assert "clip rate" in record["offload_update_reason"]


def test_the_forward_order_is_the_synchronous_update_bit_for_bit_on_two_processes_sharing_a_staging_copy(two_processes):
    """At window 2: losses and gradient norms equal to the last bit at every step, clipping firing at some; the forward
    waited for the slowed updates (``forward_wait_ms``) where the synchronous run waited at the optimizer step
    instead."""
    ((want,), _), ((got,), _) = two_processes["synchronous"], two_processes["forward"]
    fired = clipped(want)
    assert any(fired) and not all(fired), want["train/grad_norm"]
    assert_same_steps(got, want)
    assert sum(got["offload/forward_wait_ms"]) > 0 and sum(want["offload/forward_wait_ms"]) == 0
    assert sum(want["offload/update_wait_ms"]) > sum(got["offload/update_wait_ms"])


@pytest.mark.parametrize("name", ["forward", "split", "resumed"])
def test_the_forward_order_ends_with_the_synchronous_master_and_moments_on_two_processes(two_processes, name):
    """After the last step's updates, queued behind a forward that never comes (the end of training waits for them),
    and after a resume: every rank's master rows and both moments are the synchronous run's, bit for bit."""
    assert_same_state(two_processes[name][1], two_processes["synchronous"][1])


def test_a_split_rolls_its_speculated_blocks_back_when_clipping_fires_and_takes_the_synchronous_steps(two_processes):
    """The last 2 blocks and the head side speculated during the backward: a rollback at each step whose norm was above
    max_norm (counted with the next step's figures: it runs behind the next forward), and the synchronous steps."""
    ((want,), _), ((got,), _) = two_processes["synchronous"], two_processes["split"]
    assert_same_steps(got, want)
    assert got["offload/rollbacks"][1:] == [float(fired) for fired in clipped(want)[:-1]]
    assert 0 < got["offload/speculated_share"][0] < 1


def test_the_forward_order_resumes_from_a_checkpoint_taken_between_steps_with_the_same_bits(two_processes):
    """Stopped after step 3 (its updates still running behind the next forward when the checkpoint is asked for: it
    waits for them; Lightning validates a fit stopped early) and resumed: the uninterrupted synchronous run's steps,
    and its validation after step 4."""
    ((want,), _), ((first, second), _) = two_processes["synchronous"], two_processes["resumed"]
    assert len(first["train/loss"]) == 3
    assert first["train/loss"] + second["train/loss"] == want["train/loss"]
    assert first["train/grad_norm"] + second["train/grad_norm"] == want["train/grad_norm"]
    assert second["val/loss"] == want["val/loss"]


@pytest.fixture(scope="module")
def three_processes(tmp_path_factory):
    """Three processes sharing a staging copy at window 1 (each load waits until every rank has written its rows of
    the unit), clipping, a validation after step 4: synchronous, forward-ordered, and a split of the last block."""
    tmp = tmp_path_factory.mktemp("forward_three")
    common = [*SLIDE, "--trainer.gradient_clip_val", str(CLIP), "--trainer.strategy.init_args.param_transfer", "full",
              "--trainer.strategy.init_args.window", "1", *validation(1)]
    return fit_runs(tmp, 3, {name: one_fit(tmp, name, 3, *common, *extra, batch_size=1) for name, extra in (
        ("synchronous", update("synchronous")), ("forward", update("forward")),
        ("split", update("split", "--trainer.strategy.init_args.speculated_blocks", "1")))})


@pytest.mark.parametrize("name", ["forward", "split"])
def test_three_processes_sharing_a_staging_copy_take_the_synchronous_steps_and_end_with_its_state(three_processes,
                                                                                                  name):
    """Losses, norms and the validation's loss, then every rank's master rows and moments: the synchronous run's, bit
    for bit, clipping firing at some steps; the forward waited for the slowed updates."""
    ((want,), state), ((got,), mine) = three_processes["synchronous"], three_processes[name]
    fired = clipped(want)
    assert any(fired) and not all(fired), want["train/grad_norm"]
    assert_same_steps(got, want)
    assert_same_state(mine, state)
    assert sum(got["offload/forward_wait_ms"]) > 0


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, clipping, a validation after step 4: a LoRA fine-tune and a bfloat16 master, each synchronous and
    forward-ordered."""
    from transformers import AutoModelForCausalLM

    from lit_fsdp.presets import build_config

    tmp = tmp_path_factory.mktemp("forward_one")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(build_config("gpt2-tiny")).save_pretrained(tmp / "base")
    lora = ["--model.pretrained_path", str(tmp / "base"), "--model.lora", json.dumps({"rank": 4}),
            "--trainer.gradient_clip_val", "0.56", "--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]
    bfloat16 = [*SLIDE, "--trainer.gradient_clip_val", "1.0", "--trainer.strategy.init_args.param_dtype", "bfloat16",
                "--trainer.strategy.init_args.master_dtype", "bfloat16"]
    return fit_runs(tmp, 1, {f"{name}_{schedule}": one_fit(tmp, f"{name}_{schedule}", 1, *settings, *validation(1),
                                                           *update(schedule), batch_size=2)
                             for name, settings in (("lora", lora), ("bf16", bfloat16))
                             for schedule in ("synchronous", "forward")})


@pytest.mark.parametrize("name", ["lora", "bf16"])
def test_the_forward_order_is_the_synchronous_update_with_lora_and_with_a_bfloat16_master(one_process, name):
    """LoRA (the adapters trained, the frozen root sending nothing) and a bfloat16 master (rounded stochastically,
    the master the staging copy): the synchronous run's losses, norms and validation loss, and its master rows and
    moments at the end, to the last bit."""
    ((want,), state), ((got,), mine) = one_process[f"{name}_synchronous"], one_process[f"{name}_forward"]
    assert_same_steps(got, want)
    assert_same_state(mine, state)
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
    assert choose_split(4, lambda k: True, step_s=lambda k: 10.0 - min(k, 2) if k is not None else 9.5) == 2  # the fewest
    assert choose_split(4, lambda k: True, step_s=lambda k: 10.0 - min(k, 2) if k is not None else 8.0) is None  # forward
    assert choose_split(4, lambda k: False, step_s=lambda k: 1.0) is None  # nothing fits: forward


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
