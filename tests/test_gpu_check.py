"""``scripts/gpu_check.py`` in its CPU mode: every step's code path at tiny sizes, so the GPU check cannot rot between
the windows in which a GPU machine is lent; and its table of steps (``scripts/gpu_steps.py``) as the one place a step
is declared."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_fsdp.commands.tune.hardware import load
from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402
import gpu_fit  # noqa: E402
import gpu_overlays  # noqa: E402
import gpu_report  # noqa: E402
import gpu_steps  # noqa: E402


def test_every_step_runs_in_cpu_mode_and_leaves_its_records(tmp_path):
    out = tmp_path / "out"
    steps = ",".join(gpu_steps.STEPS)
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--steps", steps,
                           "--budget", "1500"], cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    records = json.loads((out / "summary.json").read_text())
    failed = {r["step"]: r.get("error") for r in records if r["status"] != "ok"}
    assert done.returncode == 0 and not failed, (failed, (out / "check.log").read_text()[-3000:])
    assert [r["step"] for r in records] == list(gpu_steps.STEPS)
    by_step = {r["step"]: r for r in records}
    assert by_step["parity"]["passed"] and by_step["resume_export"]["exact"]
    assert any("fp16" in line for line in by_step["codecs"]["table"])
    hardware = load(out / "hardware.json")  # the probe's rates in the --tune.hardware format
    assert hardware.accelerator == "cpu" and hardware.host_memory_gbps > 0
    # every training run has estimate's JSON beside its record, with the probe's hardware file, and out/ has them all
    runs = dict(gpu_report.runs(records))
    estimates = json.loads((out / "estimate.json").read_text())
    assert sorted(estimates) == sorted(runs) and len(runs) >= 15
    for name, run in runs.items():
        assert run["estimate"]["file"] == f"{name}.estimate.json" and run["estimate"]["hardware"] == "hardware.json"
        assert json.loads((out / "work" / run["estimate"]["file"]).read_text()) == estimates[name]
        assert estimates[name]["hardware"]["accelerator"] == "cpu" and estimates[name]["tokens_per_step"] > 0
    # every measured run leaves out the first --warmup-steps of its rates, and says so
    measured = {name: run for name, run in runs.items() if "figures" in run}
    assert {"eight_b", "eight_b_control", "fsdp2_1b", "slide_fsdp", "onebit", "sft_full"} <= set(measured)
    for name, run in measured.items():
        assert run["figures"]["warmup_steps_left_out"] == gpu_fit.WARMUP_STEPS == 2, name
        assert run["result"]["steps_measured"] == run["steps_done"] - 2 and not run["result"]["warmup_steps_included"]
    eight_b = measured["eight_b"]["figures"]  # the 8B as shipped (llama-tiny here): every figure its table shows
    assert measured["eight_b"]["steps_done"] == 5 and eight_b["tokens_per_s"] > 0 and eight_b["offload_cpu_update_ms"] > 0
    assert len(eight_b["step_times_ms"]) == 3 and eight_b["step_time_ms_p10"] <= eight_b["step_time_ms_p90"]
    assert eight_b["offload_cpu_update_gbps"] > 0 and eight_b["min_mem_available_gib"] > 0
    assert {"offload_device_idle_ms", "offload_cpu_update_hidden_share", "offload_cpu_update_hideable_share"} <= set(eight_b)
    # every measured run: the host's lowest MemAvailable during its steps beside estimate's host figure
    for name, run in measured.items():
        assert run["figures"]["host_available_min_gb"] > 0 and run["figures"]["min_mem_available_gib"] > 0, name
        assert run["figures"]["estimate_host_gib"] == run["estimate"]["host_gib"] > 0, name
    # the first window's steps: each new path ran, the rollback's forced and the plan auto took recorded
    assert set(gpu_steps.PLANS["first_window"][1:]) <= set(measured)
    rolled = runs["first_split_rollback"]  # every step's rollback, counted with the next step's figures
    assert rolled["result"]["offload_rollbacks"] == rolled["steps_done"] - 1 and rolled["result"]["offload_update"].startswith("split")
    # the shipped 8B's exact update: auto, chosen after step 4 by the step model with the run's rates, and why
    assert runs["eight_b"]["result"]["offload_update"].startswith(("split", "forward order"))
    assert runs["eight_b"]["result"]["offload_update_reason"].startswith("by the step model with this run's rates")
    taken = runs["first_auto_plan"]["result"]["offload_activation_plan"]  # in words: "2 kept on the device"
    assert re.fullmatch(r"\d+ (on the host|recomputed|kept on the device)(, \d+ (recomputed|kept on the device))*", taken)
    assert runs["eight_b_float8"]["same_run_as"] == "eight_b" or "torchao" in sys.modules  # one CPU run, two records
    lines = done.stdout.splitlines()
    runs_table = lines.index("Training runs; every rate leaves out the first 2 optimizer steps of its run:")
    assert "left out" in lines[runs_table + 1] and lines[runs_table + 2].split()[:2] == ["eight_b", "2"]
    assert lines[-len(records) - 1].startswith("step")  # the steps' table comes last
    assert done.stdout.startswith("versions: torch ")  # every version first: the GPU machine's differ from CI's


#: A step of the default plan whose time the records in docs/gpu_runs/ hold under an earlier name: the 8B as shipped
#: now (compiled blocks) ran as eight_b_compiled before its config took them.
RECORDED_AS = {"eight_b": "eight_b_compiled"}


def test_the_default_plan_fits_one_device_call_and_gives_each_step_more_than_its_recorded_time():
    recorded: dict[str, float] = {}
    for summary in sorted((REPO / "docs" / "gpu_runs").glob("*/*summary*.json")):
        for step in json.loads(summary.read_text()):
            if step["status"] == "ok":
                recorded[step["step"]] = max(recorded.get(step["step"], 0.0), step["seconds"])
    assert gpu_steps.PLAN[0] == "probe" and {"eight_b", "fsdp2_1b"} <= set(gpu_steps.PLAN)
    assert gpu_steps.PLAN_BUDGET == sum(gpu_steps.STEPS[name].deadline for name in gpu_steps.PLAN) <= gpu_steps.PLAN_SECONDS
    assert gpu_steps.PLAN_SECONDS <= 540  # nine minutes of a device call's ten
    # the first window after untried code: the probe, then every first_ step, within one device call too
    first = gpu_steps.PLANS["first_window"]
    assert first[0] == "probe" and len(first) >= 8 and all(name.startswith("first_") for name in first[1:])
    assert sum(gpu_steps.STEPS[name].deadline for name in first) <= gpu_steps.PLAN_SECONDS
    timed = {name: recorded[RECORDED_AS.get(name, name)] for name in gpu_steps.PLAN if RECORDED_AS.get(name, name) in recorded}
    assert set(gpu_steps.PLAN) <= set(timed)
    short = {name: (gpu_steps.STEPS[name].deadline, seconds) for name, seconds in timed.items()
             if gpu_steps.STEPS[name].deadline < 1.2 * seconds}
    assert not short, f"deadlines under 1.2x the recorded time (deadline, recorded s): {short}"


def test_a_step_is_one_row_of_the_table_and_a_fit_row_runs_its_configs_with_its_overlay(tmp_path, monkeypatch):
    steps = gpu_steps.STEPS
    assert all(name == step.name and step.deadline > 0 and step.records for name, step in steps.items())
    assert all(step.requires is None or step.requires in steps for step in steps.values())
    assert gpu_steps.PLAN == tuple(name for name in steps if steps[name].default) == tuple(steps)[:len(gpu_steps.PLAN)]
    assert gpu_steps.PLAN_BUDGET == sum(steps[name].deadline for name in gpu_steps.PLAN)
    assert f"(default: {', '.join(gpu_steps.PLAN)})" in " ".join(subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout.split())
    # a new fit step is a row: its configs, then its overlay for the device, its CPU steps, its summary
    calls = []

    def fit(name, work, configs, record, steps, measure):
        calls.append((name, configs, steps, measure))
        return {"figures": {"tokens_per_s": 1.0}, "result": {"host_syncs_per_step": 0, "other": 1}}

    monkeypatch.setattr(gpu_steps, "fit", fit)
    row = gpu_steps.Step("new_fit", gpu_steps.Fit((gpu_steps.QUICKSTART,), gpu_overlays.accelerator, steps=9,
                                                  result_keys=("host_syncs",)), 60, records="a new run")
    record = gpu_fit.Record(tmp_path / "new_fit.json")
    row.run(record, "cpu", tmp_path)
    [(name, configs, cpu_steps, measure)] = calls
    assert (name, configs, cpu_steps) == ("new_fit", [gpu_steps.QUICKSTART, str(tmp_path / "new_fit_shape.yaml")], 1)
    assert (tmp_path / "new_fit_shape.yaml").read_text() == "accelerator: cpu\ndevices: 1\n"
    assert measure[-1] == {"class_path": "callbacks.Results"}
    assert json.loads(record.path.read_text()) == {"summary": {"tokens_per_s": 1.0, "host_syncs_per_step": 0}}


STRATEGY_KNOBS = ("window", "param_transfer", "grad_sync", "activation_offload", "param_dtype", "reduce_dtype",
                  "activation_checkpointing", "optimizer_state_dtype", "update", "gradient_slots", "host_memory_gb")


def test_the_control_lays_the_old_8b_settings_over_the_shipped_config_and_as_shipped_changes_nothing_else(
        tmp_path, monkeypatch):
    from lit_fsdp.commands.estimate import parse

    monkeypatch.setenv(gpu_fit.HOST_MEMORY_VARIABLE, "120")
    hardware = load(REPO / "configs" / "hardware" / "h100_128g.json")

    def settings(name: str, overrides: dict | None) -> dict:
        configs = [REPO / "configs" / "quickstart.yaml", REPO / "configs" / "llama_8b_offload.yaml"]
        configs += [gpu_fit.write_yaml(tmp_path / f"{name}.yaml", overrides)] if overrides else []
        trainer, _, data = parse([a for c in configs for a in ("--config", str(c))], hardware)
        knobs = {knob: str(getattr(trainer.strategy, knob)).removeprefix("torch.") for knob in STRATEGY_KNOBS}
        return {"batch_size": data.batch_size, "gradient_clip_val": trainer.gradient_clip_val, **knobs}

    shipped = settings("shipped", None)
    as_shipped = settings("as_shipped", gpu_overlays.as_shipped("cuda"))
    control = settings("control", gpu_overlays.merge(gpu_overlays.as_shipped("cuda"),
                                                     gpu_overlays.nest(gpu_overlays.EIGHT_B_BEFORE)))
    assert as_shipped == {**shipped, "host_memory_gb": "120.0"}
    assert control == {**as_shipped, "batch_size": 8, "gradient_clip_val": None, "optimizer_state_dtype": "float32",
                       "update": "synchronous", "gradient_slots": "2", "activation_offload": "cpu"}


def test_the_update_rate_is_estimates_bytes_over_the_measured_time_and_a_figure_a_record_lacks_prints_n_a():
    result = {"tokens_per_s": 3254.0, "mfu": 0.159, "steps_measured": 3, "offload_cpu_update_ms": 4300.0}
    run = {"rc": 0, "losses": [], "warmup_steps_left_out": 2, "result": result,
           "estimate": {"cpu_update_bytes": 225e9, "step_time_s": None}}
    figures = gpu_fit.figures(run)
    assert figures["offload_cpu_update_gbps"] == pytest.approx(225 / 4.3)
    assert "estimate_step_time_s" not in figures and "offload_device_idle_ms" not in figures
    assert "offload_cpu_update_gbps" not in gpu_fit.figures({**run, "estimate": {"error": "ValueError: bad config"}})
    header, row = gpu_report.runs_table([{"step": "eight_b", "eight_b": {**run, "figures": figures}}]).splitlines()
    assert header.split()[:4] == ["run", "left", "out", "measured"]
    assert row.split() == ["eight_b", "2", "3", "3,254", "15.9%", "4,300", "52.3"] + ["n/a"] * 6


def test_a_command_run_in_the_cpu_modes_process_fails_as_its_process_would_and_leaves_the_process_as_it_was(
        tmp_path, monkeypatch):
    """The CPU mode runs a script or ``-m lit_fsdp`` in the runner's process (``gpu_fit.run_here``): its exit status
    and output are a process's, the step fails on a non-zero one, and the folder, arguments and environment are put
    back."""
    monkeypatch.setattr(gpu_fit, "IN_PROCESS", True)
    record, before = gpu_fit.Record(tmp_path / "step.json"), (Path.cwd(), list(sys.argv), dict(os.environ))
    assert gpu_fit.command("listing", [sys.executable, "-m", "lit_fsdp", "compressors"], tmp_path, record)[0].startswith("method")
    with pytest.raises(RuntimeError, match=r"^refused: lit_fsdp exited 2$"):
        gpu_fit.command("refused", [sys.executable, "-m", "lit_fsdp", "nope"], tmp_path, record)
    assert record["rc"] == 2 and "unknown command 'nope'" in (tmp_path / "refused.txt").read_text()
    with pytest.raises(RuntimeError, match=r"^script: bench_codecs.py exited 2$"):
        gpu_fit.command("script", [sys.executable, "scripts/bench_codecs.py", "--bogus"], tmp_path, record)
    assert (Path.cwd(), sys.argv, dict(os.environ)) == before


def test_a_step_past_its_deadline_is_reported_with_what_it_recorded_and_the_next_one_runs(tmp_path):
    with open(tmp_path / "check.log", "w") as log:
        late = gpu_check.run_step("parity", 3.0, "cpu", tmp_path, log)
        after = gpu_check.run_step("probe", 120.0, "cpu", tmp_path, log)
    assert late["status"] == "timeout" and late["rc"] is None and late["seconds"] < 10
    assert after["status"] == "ok"


@pytest.mark.parametrize(("arguments", "message"), [
    (["--steps", "probe,warp"], "unknown step 'warp'; steps are probe, eight_b, fsdp2_1b, first_host_blocks_compiled"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--warmup-steps", "-1"], "--warmup-steps -1: must be 0 or more (optimizer steps left out of every rate)"),
    pytest.param(["--device", "cuda"], "--device cuda but torch sees no CUDA device; use --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")),
])
def test_bad_arguments_are_one_line_before_any_step_runs(tmp_path, arguments, message):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *arguments],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and not (tmp_path / "out").exists()
