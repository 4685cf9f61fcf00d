"""``scripts/gpu_check.py`` in its CPU mode: every step's code path at tiny sizes, so the GPU check cannot rot between
the windows in which a GPU machine is lent (issue 26)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lit_fsdp.commands.tune.hardware import load
from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_check  # noqa: E402


def test_every_step_runs_in_cpu_mode_and_leaves_its_records(tmp_path):
    out = tmp_path / "out"
    steps = ",".join(gpu_check.STEPS)
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out), "--steps", steps,
                           "--budget", "1200"], cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    records = json.loads((out / "summary.json").read_text())
    failed = {r["step"]: r.get("error") for r in records if r["status"] != "ok"}
    assert done.returncode == 0 and not failed, (failed, (out / "check.log").read_text()[-3000:])
    assert [r["step"] for r in records] == list(gpu_check.STEPS)
    by_step = {r["step"]: r for r in records}
    assert by_step["parity"]["passed"] and by_step["resume_export"]["exact"]
    assert by_step["slide_fsdp"]["slide_fsdp"]["steps_done"] == 3 and by_step["slide_fsdp"]["summary"]["tokens_per_s"] > 0
    assert any("fp16" in line for line in by_step["codecs"]["table"])
    hardware = load(out / "hardware.json")  # the probe's rates in the --tune.hardware format
    assert hardware.accelerator == "cpu" and hardware.host_memory_gbps > 0
    assert done.stdout.splitlines()[-len(records) - 1].startswith("step")  # the table comes last
    assert done.stdout.startswith("versions: torch ")  # every version first (issue 26: the GPU machine's differ)


def test_a_step_past_its_deadline_is_reported_with_what_it_recorded_and_the_next_one_runs(tmp_path):
    with open(tmp_path / "check.log", "w") as log:
        late = gpu_check._run_step("parity", 3.0, "cpu", tmp_path, log)
        after = gpu_check._run_step("probe", 120.0, "cpu", tmp_path, log)
    assert late["status"] == "timeout" and late["rc"] is None and late["seconds"] < 10
    assert after["status"] == "ok"


@pytest.mark.parametrize(("arguments", "message"), [
    (["--steps", "probe,warp"], "unknown step 'warp'; steps are probe, cuda_tests"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    pytest.param(["--device", "cuda"], "--device cuda but torch sees no CUDA device; use --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")),
])
def test_bad_arguments_are_one_line_before_any_step_runs(tmp_path, arguments, message):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *arguments],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and not (tmp_path / "out").exists()
