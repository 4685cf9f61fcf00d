"""Faults injected into real 2-process runs: killed saves, broken checkpoints, NaN, dead ranks, full and read-only disks."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from lit_fsdp import checkpoints
from lit_fsdp.data import token_cache
from lit_fsdp.data.token_cache import BuilderLostError, Heartbeat, wait_or_build
from tests.helpers import cli_in_process, fit, fit_arguments, read_metrics, run_cli

STEPS = 8


def every(step: int, dirpath: Path, **extra) -> dict:
    init = {"dirpath": str(dirpath), "every_n_train_steps": step, "save_top_k": -1, "save_last": True, **extra}
    return {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": init}


def probe(name: str, **init_args) -> dict:
    return {"class_path": f"tests.probes.{name}", "init_args": init_args}


def samples_by_step(path: Path) -> dict[int, list[str]]:
    """Every sequence trained at each optimizer step, over all ranks (sorted: ranks split a step differently)."""
    by_step: dict[int, list[str]] = {}
    for file in path.parent.glob(f"{path.name}.rank*.jsonl"):
        for line in file.read_text().splitlines():
            entry = json.loads(line)
            by_step.setdefault(entry["step"], []).extend(entry["samples"])
    return {step: sorted(samples) for step, samples in by_step.items()}


def errors(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]


def finite_weights(checkpoint: Path) -> bool:
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_fsdp.commands.export import load_weights, read_metadata

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**read_metadata(checkpoint)["hf_config"]))
    load_weights(checkpoint, model)
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """8 steps on 2 processes, a checkpoint every 2 steps, every sequence recorded."""
    folder = tmp_path_factory.mktemp("whole")
    fit(folder, steps=STEPS, callbacks=[every(2, folder / "ckpt"), probe("RecordSamples", path=str(folder / "samples"))])
    return folder


def test_kill_between_shards_and_manifest_resumes_from_the_previous_checkpoint(uninterrupted, tmp_path):
    ckpts = tmp_path / "ckpt"
    killed = run_cli(*fit_arguments(tmp_path, steps=STEPS, callbacks=[
        every(2, ckpts), probe("RecordSamples", path=str(tmp_path / "samples")), probe("KillDuringSave", step=6),
    ]), cwd=tmp_path, check=False)
    assert killed.returncode != 0
    unfinished = list(ckpts.glob(".epoch=0-step=6.ckpt.partial-*"))
    assert unfinished and not (unfinished[0] / checkpoints.MANIFEST).exists()  # shards written, no manifest
    assert checkpoints.inspect(ckpts / "last.ckpt").manifest["step"] == 4

    for file in tmp_path.glob("samples.rank*.jsonl"):  # what the resumed run trains is recorded afresh
        file.unlink()
    shutil.rmtree(tmp_path / "lightning_logs")
    resumed = fit(tmp_path, "--ckpt_path", "last", steps=STEPS,
                  callbacks=[every(2, ckpts), probe("RecordSamples", path=str(tmp_path / "samples"))])
    whole = read_metrics(max(uninterrupted.glob("lightning_logs/version_*/metrics.csv")))
    assert resumed["train/loss"] == pytest.approx(whole["train/loss"][4:], rel=1e-5, abs=1e-6)
    expected = samples_by_step(uninterrupted / "samples")
    assert samples_by_step(tmp_path / "samples") == {step: expected[step] for step in range(4, STEPS)}


def test_last_falls_back_past_missing_and_truncated_checkpoints(uninterrupted, tmp_path):
    ckpts = tmp_path / "ckpt"
    shutil.copytree(uninterrupted / "ckpt", ckpts)
    shutil.rmtree(ckpts / "last.ckpt")
    path, manifest, notes = checkpoints.resolve("last", ckpts)
    assert Path(path).name == "epoch=0-step=8.ckpt" and manifest["step"] == 8 and notes[-1].startswith("lit_fsdp: resuming")

    shard = next((ckpts / "epoch=0-step=8.ckpt").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    path, manifest, notes = checkpoints.resolve("last", ckpts)
    assert Path(path).name == "epoch=0-step=6.ckpt"
    assert any("skipping" in note and shard.name in note for note in notes)

    # refused before any worker started: cli_in_process fails where a process group starts or training is reached
    named = cli_in_process(*fit_arguments(tmp_path, "--ckpt_path", str(ckpts / "epoch=0-step=8.ckpt")), cwd=tmp_path)
    assert named.returncode == 2 and len(errors(named)) == 1
    assert "epoch=0-step=8.ckpt cannot be resumed" in errors(named)[0] and shard.name in errors(named)[0]

    assert checkpoints.resolve("last", tmp_path / "empty")[0] is None


def test_last_is_the_checkpoint_written_last_and_a_fresh_run_beside_another_runs_says_so(tmp_path):
    """A run of 8 steps, then a fresh one of 3 in the same folder (its ``last`` is ``last-v1.ckpt``): the second says
    at its start that the folder holds the first's checkpoints, and ``--ckpt_path last`` resumes the second's step 3,
    not the first's step 8 (the higher step, written earlier)."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()

    def save(name: str, step: int, written: float) -> None:
        torch.save({checkpoints.MANIFEST_KEY: {"format": checkpoints.FORMAT, "step": step}}, folder / name)
        os.utime(folder / name, (written, written))

    save("epoch=0-step=8.ckpt", 8, 1_000)
    save("last.ckpt", 8, 1_000)
    assert checkpoints.earlier_run(tmp_path / "empty") == []
    (line,) = checkpoints.earlier_run(folder)
    assert line.startswith(f"lit_fsdp: {folder} holds an earlier run's checkpoints") and "at step 8" in line
    save("last-v1.ckpt", 3, 2_000)
    path, manifest, notes = checkpoints.resolve("last", folder)
    assert Path(path).name == "last-v1.ckpt" and manifest["step"] == 3 and "step 3" in notes[-1]


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_resume_on_another_world_size_continues_at_the_next_sample(uninterrupted, tmp_path, direction):
    if direction == "2->1":
        reference, saved_devices = uninterrupted, 2
    else:
        reference, saved_devices = tmp_path / "whole1", 1
        fit(reference, devices=1, batch_size=4, steps=STEPS,
            callbacks=[every(2, reference / "ckpt"), probe("RecordSamples", path=str(reference / "samples"))])
    devices = 3 - saved_devices
    ckpts = tmp_path / "ckpt"
    ckpts.mkdir()
    shutil.copytree(reference / "ckpt" / "epoch=0-step=4.ckpt", ckpts / "epoch=0-step=4.ckpt")
    resumed = fit(tmp_path / "resumed", "--ckpt_path", "last", devices=devices, batch_size=4 // devices, steps=STEPS,
                  callbacks=[every(2, ckpts), probe("RecordSamples", path=str(tmp_path / "samples"))])
    whole = read_metrics(max(reference.glob("lightning_logs/version_*/metrics.csv")))
    assert resumed["train/loss"] == pytest.approx(whole["train/loss"][4:], rel=1e-4, abs=1e-5)  # 1 vs 2 processes
    expected = samples_by_step(reference / "samples")
    assert samples_by_step(tmp_path / "samples") == {step: expected[step] for step in range(4, STEPS)}

    other_batch = cli_in_process(*fit_arguments(tmp_path / "other", "--ckpt_path", str(ckpts / "epoch=0-step=4.ckpt"),
                                                devices=devices, batch_size=8), cwd=tmp_path)
    assert other_batch.returncode == 2 and "was trained with a global batch of 4" in errors(other_batch)[0]


@pytest.mark.parametrize("strategy", [[], ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy",
                                            "--trainer.gradient_clip_val", "0"]], ids=["fsdp2", "slide_fsdp-overlapped"])
def test_nonfinite_loss_stops_before_any_update_and_no_checkpoint_holds_it(tmp_path, strategy):
    ckpts = tmp_path / "ckpt"
    arguments = fit_arguments(tmp_path, "--model.learning_rate", "1e30", "--model.warmup_steps", "1", *strategy, steps=STEPS,
                              callbacks=[every(1, ckpts), probe("RecordSamples", path=str(tmp_path / "samples")),
                                         {"class_path": "callbacks.Results"}])
    result = run_cli(*arguments, cwd=tmp_path, check=False)
    assert result.returncode == 2 and len(errors(result)) == 1, result.stderr[-3000:]
    assert "non-finite loss or gradient at optimizer step" in errors(result)[0]
    saved = [p for p in checkpoints.candidates(ckpts) if checkpoints.inspect(p).manifest]
    assert saved and all(finite_weights(p) for p in saved)
    record = json.loads((tmp_path / "results.jsonl").read_text().splitlines()[-1])
    assert record["status"] == "failed" and "non-finite" in record["error"]


def test_skip_step_skips_nonfinite_steps_on_every_rank(tmp_path):
    got = fit(tmp_path, "--model.learning_rate", "1e30", "--model.warmup_steps", "1",
              "--trainer.strategy.init_args.on_nonfinite", "skip_step", steps=5, callbacks=[every(5, tmp_path / "ckpt")])
    assert got["train/nonfinite_steps"][-1] >= 1
    assert len(got["train/loss"]) == 5
    assert finite_weights(tmp_path / "ckpt" / "last.ckpt")  # no rank applied a non-finite step


def test_warn_applies_nonfinite_steps_and_says_so_at_each(tmp_path):
    result = run_cli(*fit_arguments(tmp_path, "--model.learning_rate", "1e30", "--model.warmup_steps", "1",
                                    "--trainer.strategy.init_args.on_nonfinite", "warn", steps=5,
                                    callbacks=[every(5, tmp_path / "ckpt")]), cwd=tmp_path)
    got = read_metrics(max(tmp_path.glob("lightning_logs/version_*/metrics.csv")))
    # Step 1 is finite and its update (learning rate 1e30) makes every later step non-finite: the run goes on.
    assert len(got["train/loss"]) == 5 and got["train/loss"][0] < 7 and all(map(math.isnan, got["train/loss"][1:]))
    assert got["train/nonfinite_steps"] == [0, 1, 2, 3, 4]
    warned = re.findall(r"non-finite loss or gradient at optimizer step (\d) \(gradient norm nan\): "
                        r"applied anyway \(on_nonfinite: warn; (\d) so far\)", result.stderr)
    assert warned == [("2", "1"), ("3", "2"), ("4", "3"), ("5", "4")]  # once per step, by rank 0 only
    assert not finite_weights(tmp_path / "ckpt" / "last.ckpt")  # applied, unlike skip_step


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def test_a_waiting_rank_waits_while_the_heartbeat_is_fresh_and_stops_when_it_goes_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "HEARTBEAT_S", 0.1)
    cache = tmp_path / "cache"
    cache.mkdir()

    # stale_after_s is 20 beats: each beat is an fsync'ed write from a thread, which a loaded machine (2 shared cores,
    # checkpoints being written beside) can hold up for most of a second; 5 beats (0.5 s) failed there 1 run in 20.
    def build_for_4_s():  # local rank 0, beating every 0.1 s: a build twice as long as stale_after_s
        with Heartbeat(cache / "heartbeat"):
            time.sleep(4)
            _write_atomic(cache / "meta.json", json.dumps({"finalized": True, "tokens": 7}))

    builder = threading.Thread(target=build_for_4_s)
    builder.start()
    meta = wait_or_build(cache, lambda _: {}, local_rank=1, poll_seconds=0.1, timeout_s=60, stale_after_s=2)
    builder.join()
    assert meta == {"finalized": True, "tokens": 7}

    # The builder's process (this one) lives on but its heartbeat stopped: hung, not exited.
    (cache / "meta.json").unlink()
    started = time.monotonic()
    with pytest.raises(BuilderLostError, match=rf"\(pid {os.getpid()} on .+\) stopped its heartbeat \d+ s ago; rerun"):
        wait_or_build(cache, lambda _: {}, local_rank=1, poll_seconds=0.1, timeout_s=60, stale_after_s=2)
    assert time.monotonic() - started < 5  # soon after stale_after_s, not at the timeout


def _build_forever(directory: Path) -> None:
    wait_or_build(directory, lambda _: time.sleep(600) or {}, local_rank=0)


def test_a_waiting_rank_stops_when_the_cache_builder_dies(tmp_path):
    builder = multiprocessing.get_context("spawn").Process(target=_build_forever, args=(tmp_path / "cache",))
    builder.start()
    while not (tmp_path / "cache" / "heartbeat").exists():
        time.sleep(0.1)
    builder.kill()
    builder.join()  # as rank 0's parent would: a process that is not reaped still exists
    started = time.monotonic()
    with pytest.raises(BuilderLostError, match="has exited; rerun the same command"):
        wait_or_build(tmp_path / "cache", lambda _: {}, local_rank=1, poll_seconds=0.2)
    assert time.monotonic() - started < 5

    with pytest.raises(BuilderLostError, match="has not finished after"):  # alive but past the deadline
        wait_or_build(tmp_path / "slow", lambda _: {}, local_rank=1, poll_seconds=0.2, timeout_s=0.5, stale_after_s=60)


def test_a_surviving_rank_names_the_collective_and_the_rank_that_died(tmp_path):
    result = run_cli(*fit_arguments(tmp_path, steps=STEPS, callbacks=[probe("DieAtStep", rank=1, step=3)]),
                     cwd=tmp_path, check=False)
    assert result.returncode != 0
    lines = errors(result)
    assert len(lines) == 1, result.stderr[-3000:]
    assert "rank 0 of 2 failed in" in lines[0] and "local rank 1" in lines[0] and "SIGKILL" in lines[0]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs (and a read-only one): mounting needs root, so the test is skipped elsewhere."""
    disks = []
    for name, options in (("full", "size=4m"), ("filling", "size=16m"), ("readonly", "size=1m,ro")):
        folder = tmp_path / name
        folder.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True).returncode:
            for mounted in disks:
                subprocess.run(["umount", str(mounted)])
            pytest.skip("mounting a tmpfs is not allowed here (needs root)")
        disks.append(folder)
    yield disks
    for folder in disks:
        subprocess.run(["umount", "-l", str(folder)])


def test_full_and_read_only_disks_fail_in_one_line_and_keep_the_last_checkpoint(tmp_path, small_disk):
    full, filling, readonly = small_disk
    # Too small for the checkpoints at launch: refused before any worker starts
    # (in this process: cli_in_process fails the test where a process group starts or training is reached)
    result = cli_in_process(*fit_arguments(tmp_path / "run", steps=STEPS, callbacks=[every(2, full, save_last=False)]),
                            cwd=tmp_path)
    assert result.returncode == 2 and len(errors(result)) == 1, result.stderr[-3000:]
    assert f"in {full}" in errors(result)[0] and "are free" in errors(result)[0]
    # Room at launch, full by step 4's checkpoint: that write fails in one line and step 2's is kept
    callbacks = [every(2, filling, save_last=False), probe("FillDisk", path=str(filling / "filler"), step=3)]
    result = run_cli(*fit_arguments(tmp_path / "run", steps=STEPS, callbacks=callbacks), cwd=tmp_path, check=False)
    assert result.returncode == 2 and len(errors(result)) == 1, result.stderr[-3000:]
    assert f"cannot write checkpoint to {filling}" in errors(result)[0] and "no space left on device" in errors(result)[0]
    kept = [checkpoints.inspect(p) for p in checkpoints.candidates(filling)]
    assert [found.manifest["step"] for found in kept] == [2]  # the earlier checkpoint, complete; no partial left
    assert not list(filling.glob(".*partial*"))

    arguments = fit_arguments(tmp_path / "ro")
    arguments[-1] = str(readonly / "run")  # the run folder (the logger's and the config's files stay writable)
    result = cli_in_process(*arguments, cwd=tmp_path)  # refused before any worker starts, as above
    assert result.returncode == 2 and "read-only file system" in errors(result)[0]
