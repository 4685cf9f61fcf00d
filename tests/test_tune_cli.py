"""``python -m lit_fsdp tune`` end to end on gpt2-tiny (2 CPU processes, 4 short trials), its one-line errors, and
``python -m lit_fsdp hardware``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from lit_fsdp.commands.main import main
from lit_fsdp.commands.tune.hardware import Hardware, load
from tests.helpers import REPO, cli_in_process, run_cli
from tests.llm_stub import StubLLM

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
# Micro-batch 1 x 2 accumulation per process: the default is its own micro-batch-1 calibration trial.
FIT_ARGS = ["--config", QUICKSTART, "--data.batch_size", "1", "--trainer.accumulate_grad_batches", "2"]
# The stub LLM's answer: a value outside the space, SlideFSDP (whose ~20 bytes per parameter on the host do not fit
# in the 2 MB the hardware file gives offloaded state), NO_SHARD (runs), SHARD_GRAD_OP (the test kills its trial).
LLM_ANSWER = json.dumps({"candidates": [{"sharding": "QUARTER_SHARD"}, {"strategy": "slide_fsdp", "activation_checkpointing": 1},
                                        {"sharding": "NO_SHARD"}, {"sharding": "SHARD_GRAD_OP"}]})
HARDWARE = {"accelerator": "cpu", "nodes": 1, "devices_per_node": 1, "device_memory_gb": 16.0, "host_memory_gb": 0.002}


def processes_with(argument: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if argument in cmdline.read_bytes().decode(errors="replace").split("\0"):
                pids.append(int(cmdline.parent.name))
        except OSError:  # the process ended while we looked
            continue
    return pids


def kill_trial_of(out: Path, knob: str, done: threading.Event, killed: list[int]) -> None:
    """SIGKILL every process of the trial whose candidate.yaml has ``knob`` (what the OOM killer would do)."""
    while not done.is_set():
        for overlay in out.glob("trials/*/candidate.yaml"):
            if knob in overlay.read_text():
                for pid in processes_with(str(overlay.parent)):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        if killed and not processes_with(str(out / "trials")):
            return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    (tmp / "hardware.json").write_text(json.dumps(HARDWARE))
    out = tmp / "out"
    done, killed = threading.Event(), []
    watcher = threading.Thread(target=kill_trial_of, args=(out, "sharding: SHARD_GRAD_OP", done, killed), daemon=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with StubLLM(LLM_ANSWER) as stub:
        watcher.start()
        result = subprocess.run(
            [sys.executable, "-m", "lit_fsdp", "tune", *FIT_ARGS, "--tune.trials", "4", "--tune.out", str(out),
             "--tune.hardware", str(tmp / "hardware.json"), "--tune.trial.steps", "2", "--tune.trial.warmup_steps", "2",
             "--tune.trial.check_batches", "1", "--tune.patience", "10", "--tune.llm.base_url", stub.base_url,
             "--tune.llm.model", "stub", "--tune.llm.max_candidates", "4"],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=900,
        )
        done.set()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    return {"out": out, "tmp": tmp, "trials": trials, "stub": stub, "killed": killed, "stdout": result.stdout}


def test_tune_runs_four_trials_rejects_what_cannot_run_and_goes_on_after_a_crash(tuned):
    ran = [t for t in tuned["trials"] if t["index"] is not None]
    assert [t["index"] for t in ran] == [1, 2, 3, 4] and ran[0]["source"] == "default"
    by_knob = {t["knobs"].get("sharding"): t for t in ran[1:3]}
    assert by_knob["NO_SHARD"]["source"] == "llm" and by_knob["NO_SHARD"]["status"] == "ok"  # validated and run
    crashed = by_knob["SHARD_GRAD_OP"]
    assert tuned["killed"] and crashed["status"] == "failed" and "SIGKILL" in crashed["error"]
    assert crashed["findings"][0]["kind"] == "failure" and ran[3]["source"].startswith(("rules:", "llm"))  # it went on
    rejected = {t["knobs"]["strategy"] + ":" + str(t["knobs"].get("sharding")): t["error"]
                for t in tuned["trials"] if t["status"] == "rejected"}
    assert "outside the search space" in rejected["fsdp2:QUARTER_SHARD"]
    assert "memory filter: needs ~0.003 GB of host memory per node" in rejected["slide_fsdp:None"]  # 20 B/param + ring
    for trial in (t for t in ran if t["status"] == "ok"):
        assert trial["tokens_per_s"] > 0 and trial["peak_gb"] > 0 and len(trial["losses"]) == 4
        assert trial["check_loss"] is not None and trial["estimate"]["device_total"] > 0 and trial["findings"]
        assert list((Path(trial["folder"]) / "profiler").glob("*/rank0.*.pt.trace.json"))  # traces kept
    request = tuned["stub"].requests[0]["body"]["messages"][1]["content"]
    assert '"diagnosis"' in request and '"history"' in request and '"search_space"' in request


def test_tune_writes_a_report_with_a_table_and_a_plot(tuned):
    report = (tuned["out"] / "report.md").read_text()
    assert "4 trials run (3 ok, 1 failed)" in report and "2 candidates rejected without running (1 by the memory filter)" in report
    assert "Memory filter: calibrated by trial 1" in report and "| trial | source | changes | status | tokens/s |" in report
    assert "## Rejected without running" in report and "![tokens/s per trial](tokens_per_s.png)" in report
    assert (tuned["out"] / "tokens_per_s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best: trial" in tuned["stdout"]


def test_the_calibrated_memory_estimate_is_within_3_percent_of_the_peaks_the_trials_measured(tuned):
    """Trial 1 calibrates the per-process overhead; the two other finished trials measured 0.4% to 0.8% off their
    estimates (two runs). On a CPU the peak (RSS, ~0.52 GB) is mostly that overhead: the analytic terms are ~1% of it."""
    memory = json.loads((tuned["out"] / "summary.json").read_text())["memory"]
    measured = [t for t in tuned["trials"] if t["status"] == "ok" and t["index"] != memory["calibrated_by"]]
    errors = [(t["estimate"]["device_total"] - t["peak_gb"]) / t["peak_gb"] for t in measured]
    assert len(errors) == 2 and memory["estimate_errors"] == pytest.approx(errors, abs=1e-3)  # the summary's, recomputed
    assert max(map(abs, errors)) < 0.03


def test_best_yaml_is_an_overlay_fit_accepts(tuned):
    best = yaml.safe_load((tuned["out"] / "best.yaml").read_text())
    assert best["trainer"]["strategy"]["class_path"] == "lit_fsdp.strategy.FSDP2Strategy"
    micro_batch = best["data"]["init_args"]["batch_size"]
    assert micro_batch * best["trainer"]["accumulate_grad_batches"] == 2  # the configs' batch per process
    run = tuned["tmp"] / "fit_best"
    run_cli("fit", *FIT_ARGS, "--config", str(tuned["out"] / "best.yaml"), "--trainer.max_steps", "2",
            "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run), cwd=tuned["tmp"])


@pytest.mark.parametrize("args, message", [
    (["--tune.trials", "0"], "--tune.trials 0: at least 1 trial is needed"),
    (["--tune.space.sharding", "[QUARTER_SHARD]"], 'Parser key "tune.space.sharding": Expected a typing.Literal'),
    (["--tune.hardware", "{hardware}"], "is not JSON"),
    (["--tune.llm.base_url", "http://localhost:1/v1"], "--tune.llm.base_url and --tune.llm.model go together"),
    (["--tune.space.replicate_size", "[3]"], "replicate_size 3 does not divide the world size 2"),
], ids=["trials", "knob-value", "malformed-hardware", "llm-half", "impossible-mesh"])
def test_bad_input_is_one_line_and_exit_2_before_any_trial(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)  # parsing the configs seeds this process: undone after
    (tmp_path / "bad.json").write_text('{"device_memory_gb": 8,')
    args = [arg.replace("{hardware}", str(tmp_path / "bad.json")) for arg in args]
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--config", QUICKSTART, "--tune.out", str(tmp_path / "out"), *args])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lit_fsdp: error:")]
    assert exit_info.value.code == 2 and len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "out" / "trials").exists()


def test_hardware_prints_json_that_tune_reads_back(tmp_path):
    printed = cli_in_process("hardware", cwd=tmp_path).stdout
    (tmp_path / "hardware.json").write_text(printed)
    detected = load(tmp_path / "hardware.json")
    assert isinstance(detected, Hardware) and detected.device_memory_gb > 0 and detected.host_cores >= 1
    (tmp_path / "wrong.json").write_text(json.dumps({"device_memory_gb": -1}))
    with pytest.raises(ValueError, match="device_memory_gb must be a number > 0"):
        load(tmp_path / "wrong.json")
    (tmp_path / "unknown.json").write_text(json.dumps({"gpus": 8}))
    with pytest.raises(ValueError, match="unknown field 'gpus'"):
        load(tmp_path / "unknown.json")
