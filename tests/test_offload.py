"""SlideFSDP takes the same steps as FSDP2, resumes exactly, keeps at most `window` blocks on the device, and exports."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from offload.layout import UnitLayout
from lit_fsdp.commands.estimate import estimate_step, parse
from lit_fsdp.commands.tune.hardware import detect
from offload.transfers import EMULATED_DELAY_VARIABLE
from tests.distributed import fit_in_process, run
from tests.helpers import (REPO, assert_export_gives_logits, checkpoint_every, digests, fit, fit_arguments, read_metrics,
                           record, run_cli)

STEPS = 8
GLOBAL_BATCH = 4
FOUR_BLOCKS = ["--model.config_overrides", '{"n_layer": 4}']  # more blocks than the window holds
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]


def knobs(**values) -> list[str]:
    return [arg for key, value in values.items() for arg in (f"--trainer.strategy.init_args.{key}", str(value))]


def common(devices: int, accumulate: int, clip: bool) -> list[str]:
    return [*FOUR_BLOCKS, "--trainer.accumulate_grad_batches", str(accumulate),
            "--trainer.gradient_clip_val", "1.0" if clip else "0"]


_references: dict = {}


def reference(tmp_path_factory, devices: int, accumulate: int, clip: bool) -> dict:
    """FSDP2's losses for one setting (computed once per module run)."""
    key = (devices, accumulate, clip)
    if key not in _references:
        folder = tmp_path_factory.mktemp(f"fsdp2-{devices}-{accumulate}-{clip}")
        _references[key] = fit(folder, *common(*key), devices=devices,
                               batch_size=GLOBAL_BATCH // devices // accumulate, steps=STEPS)
    return _references[key]


# Each case covers several knobs at once: the four param_transfer x grad_sync pairs, window 1 and 2,
# activation offload on and off, accumulation, and clipping on (updates wait for the norm) and off
# (updates overlap the backward).
CASES = [
    (1, 1, True, dict(window=1)),
    (2, 1, True, dict(param_transfer="full", grad_sync="gpu_reduce", window=2)),
    (2, 1, False, dict(param_transfer="full", grad_sync="cpu_reduce", window=1, activation_checkpointing=1,
                       activation_offload="cpu")),
    (2, 1, False, dict(param_transfer="shard", grad_sync="gpu_reduce", window=2, activation_checkpointing=1)),
    (2, 2, True, dict(param_transfer="shard", grad_sync="cpu_reduce", window=1, activation_checkpointing=2,
                      activation_offload="cpu")),
    (1, 2, False, dict(window=2, activation_checkpointing=1, activation_offload="cpu")),
]


@pytest.mark.parametrize("devices, accumulate, clip, settings", CASES,
                         ids=["-".join(map(str, [d, a, c, *s.values()])) for d, a, c, s in CASES])
def test_same_losses_as_fsdp2_and_at_most_window_blocks_on_device(tmp_path_factory, tmp_path, monkeypatch, devices,
                                                                  accumulate, clip, settings):
    want = reference(tmp_path_factory, devices, accumulate, clip)
    # SlideFSDP's copies run as a GPU's would: on copy threads, each after a random delay of up to 3 ms, so a
    # missing wait or a buffer reused too early changes the losses (offload/transfers.py). The in-place CPU
    # copies are the same code less the threads; the other tests of this file run them.
    monkeypatch.setenv(EMULATED_DELAY_VARIABLE, "3")
    probe = tmp_path / "resident"
    got = fit(tmp_path, *common(devices, accumulate, clip), *SLIDE, *knobs(**settings), devices=devices,
              batch_size=GLOBAL_BATCH // devices // accumulate, steps=STEPS,
              callbacks=[{"class_path": "tests.probes.MaxResidentBlocks", "init_args": {"path": str(probe)}}])
    assert len(got["train/loss"]) == STEPS
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)
    if clip:
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)
    for rank in range(devices):
        assert int((tmp_path / f"resident.rank{rank}").read_text()) == settings["window"]


def test_two_nodes_of_one_process_match_fsdp2(tmp_path_factory, tmp_path, monkeypatch):
    """Master state is sharded within a node and replicated across nodes: gradients all-reduce between the nodes."""
    want = reference(tmp_path_factory, 2, 1, True)
    monkeypatch.setenv(EMULATED_DELAY_VARIABLE, "3")  # asynchronous copies, as above
    got = fit(tmp_path, *common(2, 1, True), *SLIDE, *knobs(grad_sync="gpu_reduce", activation_checkpointing=1),
              nodes=2, batch_size=GLOBAL_BATCH // 2, steps=STEPS)
    assert got["train/loss"] == pytest.approx(want["train/loss"], rel=1e-5)
    assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=1e-5)


def test_resume_at_step_4_of_8_continues_exactly_exports_and_fine_tunes_from_the_export(tmp_path):
    settings = [*SLIDE, *knobs(activation_checkpointing=1, activation_offload="cpu"), "--trainer.gradient_clip_val", "0"]
    whole = fit(tmp_path / "whole", *settings, steps=STEPS, callbacks=[record(tmp_path / "whole.b")])
    part, ckpts, logits_file = tmp_path / "part", tmp_path / "ckpt", tmp_path / "logits.pt"
    first = fit(part, *settings, steps=STEPS,
                callbacks=[record(tmp_path / "part.b"), {"class_path": "tests.probes.StopAtStep", "init_args": {"step": 4}},
                           checkpoint_every(4, ckpts)])
    second = fit(part, *settings, "--ckpt_path", "last", steps=STEPS,
                 callbacks=[record(tmp_path / "part.b"), checkpoint_every(4, ckpts),
                            {"class_path": "tests.probes.SaveLogits", "init_args": {"path": str(logits_file)}}])
    assert len(first["train/loss"]) == 4 and len(second["train/loss"]) == 4
    assert first["train/loss"] + second["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-5, abs=1e-6)
    for rank in (0, 1):
        assert digests(tmp_path / "part.b", rank) == digests(tmp_path / "whole.b", rank)
    assert_export_gives_logits(ckpts / "last.ckpt", logits_file, tmp_path)

    # --model.pretrained_path: the exported weights are read into the master rows, as FSDP2 reads them into its shards
    tuned = {name: fit(tmp_path / name, "--model.pretrained_path", str(tmp_path / "hf"), *extra, devices=1, batch_size=4,
                       steps=2) for name, extra in (("fsdp2", []), ("slide", SLIDE))}
    assert tuned["slide"]["train/loss"] == pytest.approx(tuned["fsdp2"]["train/loss"], rel=1e-5)
    # the same first batch as the run from scratch, with 8 steps of training behind it (6.25 -> about 5.9)
    assert tuned["slide"]["train/loss"][0] < whole["train/loss"][0] - 0.15


def test_offload_config_records_every_measuring_callback_and_moves_the_bytes_estimate_predicts(tmp_path):
    configs = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(REPO / "configs" / "offload.yaml"),
               "--data.batch_size", "2"]
    run(fit_in_process, tmp_path, [[
        "fit", *configs, "--trainer.max_steps", "12", "--trainer.limit_val_batches", "0", "--trainer.logger", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path)]], cwd=tmp_path)
    record_ = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    hardware = detect("cpu")  # the configs train on the CPU, also where the test host has a GPU
    predicted = estimate_step(*parse(configs, hardware), hardware)  # `python -m lit_fsdp estimate` on the same configs
    assert record_["offload_h2d_gb"] == pytest.approx(predicted["h2d_bytes"] / 1e9, rel=1e-6)
    assert record_["offload_d2h_gb"] == pytest.approx(predicted["d2h_bytes"] / 1e9, rel=1e-6)
    assert record_["offload_h2d_gb"] > 0 and record_["offload_d2h_gb"] > 0
    assert record_["offload_h2d_gbps"] > 0 and record_["offload_cpu_update_ms"] > 0
    # clipping (the quickstart's): the updates after the norm, hidden behind the next forward (update: auto)
    assert record_["offload_cpu_update_hidden_share"] > 0.5
    assert record_["offload_update_threads"].endswith("update threads: Lightning's setting on CPU runs")
    # What was allocated equals what the preflight counted (offload.host_memory, from the same layouts): fp32 master 4
    # + moments 8 + fp32 staging 4 B/param, the split's backup (the host has room for every block), the gradient ring
    # holding a step's pieces until the norm (clipping) and the checkpointed inputs on the host (a large share at this
    # size: the tiny model's root is most of it)
    assert record_["host_state_gb_per_node"] == pytest.approx(record_["host_estimate_gb_per_node"], rel=0.02)
    assert record_["host_gb_per_billion_params"] > 20
    assert record_["tokens_per_s"] > 0 and record_["peak_rss_gb"] > 0
    assert record_["comm_time_ms_total"] > 0 and record_["profiled_steps"] == 6  # 3 active steps x 2 ranks
    assert (tmp_path / "checkpoints" / "last.ckpt").is_dir()


def test_without_clipping_the_cpu_updates_run_while_the_backward_goes_on(tmp_path):
    # Each unit's AdamW update starts on the worker thread once its gradients are on the host, while the
    # device goes on with the blocks before it (with clipping they wait for the norm: share 0, above).
    got = fit(tmp_path, *common(2, 1, clip=False), *SLIDE, steps=4, callbacks=[{"class_path": "callbacks.OffloadStats"}])
    shares = got["offload/cpu_update_hidden_share"]
    assert len(shares) == 4 and all(0 < share <= 1 for share in shares), shares


@pytest.mark.parametrize("where, grad_sync", [("update", "gpu_reduce"), ("d2h", "gpu_reduce"), ("reduce", "cpu_reduce")])
def test_a_host_side_failing_on_one_rank_stops_every_rank_with_one_line_naming_the_unit(tmp_path, where, grad_sync):
    # Once the ring of gradient buffers is empty the backward waits for one: it must see the worker's error, not
    # wait forever (before, a failing update left its buffer taken and the run hung with nothing printed).
    failed_at = tmp_path / "failed_at"
    failing = {"class_path": "tests.probes.FailHostSide",
               "init_args": {"rank": 1, "step": 2, "where": where, "failed_at": str(failed_at)}}
    result = run_cli(*fit_arguments(tmp_path, *common(2, 1, clip=False), *SLIDE, *knobs(grad_sync=grad_sync), steps=6,
                                    callbacks=[failing]), cwd=tmp_path, check=False)
    assert result.returncode != 0
    # every rank has exited (run_cli waited for the launcher, which waits for its ranks) within 60 s of the failure
    assert time.time() - float(failed_at.read_text()) < 60, "the ranks did not stop within 60 s of the failure"
    lines = [line for line in result.stderr.splitlines() if f"injected {where} failure" in line]
    assert lines and all("SlideFSDP: the host side of unit" in line for line in lines), result.stderr[-3000:]


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_layout_round_trips_uneven_rows_through_rank_major_buffers(shards):
    shapes = [(5, 3), (7,), (1, 4), (2, 2, 2)]
    params = [((f"p{i}",), torch.nn.Parameter(torch.empty(s))) for i, s in enumerate(shapes)]
    layouts = [UnitLayout.build("unit", params, shards, rank) for rank in range(shards)]
    values = [torch.randn(s) for s in shapes]
    rank_major = torch.full((layouts[0].shard_numel * shards,), float("nan"))
    layouts[0].scatter_to_rank_major(values, rank_major)
    full = torch.empty(layouts[0].full_numel)
    layouts[0].gather_to_full(rank_major, full)
    for got, want in zip(layouts[0].full_views(full), values):
        torch.testing.assert_close(got, want)
    for rank, layout in enumerate(layouts):  # each rank's piece is its torch.chunk of rows, padding zeroed
        shard = rank_major[rank * layout.shard_numel : (rank + 1) * layout.shard_numel]
        assert not shard.isnan().any()
        for got, want, place in zip(layout.local_views(shard), values, layout.places):
            chunk = math.ceil(want.shape[0] / shards)
            torch.testing.assert_close(got, want[rank * chunk : (rank + 1) * chunk])
            assert got.shape == place.local_shape
        for got, want in zip(layout.local_rows_in_full(full), layout.local_views(shard)):
            torch.testing.assert_close(got, want)


def test_bfloat16_moments_train_on_two_processes(tmp_path):
    got = fit(tmp_path, *common(2, 1, clip=False), *SLIDE, *knobs(optimizer_state_dtype="bfloat16"), steps=STEPS)
    losses = got["train/loss"]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.1, losses


def test_a_delayed_update_overlaps_the_backward_with_clipping_and_resumes_on_three_processes_as_on_one(tmp_path,
                                                                                                   monkeypatch):
    """``delayed_update`` (DPU) with clipping: each update runs during the next step's backward (hidden share > 0,
    where undelayed clipping hides none). Three processes writing their uneven rows into one shared staging copy,
    copies asynchronous, take the same steps as one process, across a checkpoint at step 4 (which applies the
    waiting update) and a resume from it."""
    monkeypatch.setenv(EMULATED_DELAY_VARIABLE, "3")
    settings = [*common(3, 1, clip=True), *SLIDE, *knobs(update="delayed", param_transfer="full", window=1)]
    stats = {"class_path": "callbacks.OffloadStats"}
    one = fit(tmp_path / "one", *settings, devices=1, batch_size=6, steps=STEPS,
              callbacks=[stats, checkpoint_every(4, tmp_path / "one.ckpt")])
    part, ckpts = tmp_path / "three", tmp_path / "three.ckpt"
    first = fit(part, *settings, devices=3, batch_size=2, steps=STEPS,
                callbacks=[stats, checkpoint_every(4, ckpts),
                           {"class_path": "tests.probes.StopAtStep", "init_args": {"step": 4}}])
    second = fit(part, *settings, "--ckpt_path", "last", devices=3, batch_size=2, steps=STEPS,
                 callbacks=[stats, checkpoint_every(4, ckpts)])
    for key in ("train/loss", "train/grad_norm"):
        assert first[key] + second[key] == pytest.approx(one[key], rel=1e-5), key
    assert one["train/loss"][-1] < one["train/loss"][0] - 0.1
    # step 0 and the first step after the resume have no update waiting; every other step hides its delayed one
    hidden = first["offload/cpu_update_hidden_share"][1:] + second["offload/cpu_update_hidden_share"][1:]
    assert len(hidden) == STEPS - 2 and all(share > 0 for share in hidden), hidden
    # beside it, per step: the device's idle time inside the backward and the share the backward alone could hide
    for key, low, high in (("offload/device_idle_ms", 0.0, float("inf")), ("offload/cpu_update_hideable_share", 0.0, 1.0),
                           ("offload/update_wait_ms", 0.0, float("inf"))):
        values = first[key] + second[key]
        assert len(values) == STEPS and all(low <= value <= high for value in values), (key, values)


def test_a_delayed_update_warmed_up_for_every_step_takes_the_synchronous_steps_and_one_not_warmed_up_does_not(tmp_path):
    """``delayed_update_warmup``: the first steps' updates are applied before the next step (ZeRO-Offload's DPU
    warm-up), so a run warmed up for all its steps takes the synchronous update's steps, clipping included (the
    coefficient multiplies inside the update instead of the kept gradient: float32 rounding apart); without warm-up
    the second step still computes with the initial weights. One process, the three runs in one spawn."""

    settings = [*common(1, 1, clip=True), *SLIDE]
    runs = {"synchronous": knobs(update="synchronous"), "warmed": knobs(update="delayed", delayed_update_warmup=STEPS),
            "delayed": knobs(update="delayed")}
    run(fit_in_process, tmp_path, [fit_arguments(tmp_path / name, *settings, *extra, devices=1, batch_size=4, steps=STEPS)
                                   for name, extra in runs.items()], world=1)
    losses = {name: read_metrics(max((tmp_path / name).glob("lightning_logs/version_*/metrics.csv")))["train/loss"]
              for name in runs}
    assert losses["warmed"] == pytest.approx(losses["synchronous"], rel=1e-5)
    assert losses["delayed"][0] == losses["synchronous"][0]
    # from the second step on, the delayed run computes with weights one update old
    assert all(d != pytest.approx(s, rel=1e-5) for d, s in zip(losses["delayed"][1:], losses["synchronous"][1:]))
