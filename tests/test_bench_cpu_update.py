"""scripts/bench_cpu_update.py's default run on a tiny unit and one thread: every row it times has a cost per
parameter, the ratios it prints are those rows' medians over each other, and DeepSpeed's rows are timed where deepspeed
is installed and left out with one line where it is not."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import sys

import pytest
import torch

from offload import adamw_kernel
from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("bench_cpu_update", REPO / "scripts" / "bench_cpu_update.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = ["--numel", "4096", "--threads", "1", "--repeats", "1", "--max-seconds", "0.05"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def run(argv: list[str]) -> tuple[str, list[dict]]:
    """The script's stdout and JSON lines for ``argv`` (with ``--out``), torch's threads and the environment as they
    were afterwards."""
    out = argv[argv.index("--out") + 1]
    threads, stdout = torch.get_num_threads(), io.StringIO()
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
            patch.setenv("DS_ACCELERATOR", os.environ.get("DS_ACCELERATOR", "cpu"))  # the script sets it; undone after
            assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    with open(out) as lines:
        return stdout.getvalue(), [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[str, list[dict]]:
    if adamw_kernel.compiler() is None:
        pytest.skip("no C compiler to build the native kernel with: the native rows cannot run")
    return run([*TINY, "--out", str(tmp_path_factory.mktemp("bench") / "rows.jsonl")])


def test_every_default_row_is_timed_with_a_positive_cost_per_parameter(default_run):
    _, records = default_run
    expected = [row.name for row in bench.ROWS if HAS_DEEPSPEED or row.path != "deepspeed"]
    assert [r["row"] for r in records] == expected
    for record in records:
        assert record["ns_per_param"] > 0 and record["bytes_per_param"] > 0, record
    nbytes = {r["row"]: r["bytes_per_param"] for r in records}
    assert nbytes["native, bf16 moments, bf16 grad"] == 20  # 2 grad + 8 master + 8 moments + 2 staging
    assert nbytes["torch, fused AdamW over whole tensors, no staging, fp32 moments, fp32 grad"] == 28


def test_the_printed_ratios_are_the_rows_medians_over_each_other(default_run):
    stdout, records = default_run
    ns = {r["row"]: r["ns_per_param"] for r in records}
    printed = re.findall(r"^\| ([^|]+) \| ([^|]+) \| 1 \| ([0-9.]+)x \|$", stdout, re.MULTILINE)
    assert [(row, against) for row, against, _ in printed] == [
        (row, against) for row, against in bench.RATIOS if row in ns and against in ns]
    assert ("native, bf16 moments, bf16 grad", "native, fp32 moments, bf16 grad") in [p[:2] for p in printed]
    for row, against, value in printed:
        assert float(value) == pytest.approx(ns[against] / ns[row], abs=0.006), (row, against)


def test_deepspeed_rows_and_their_ratio_where_it_is_installed(default_run):
    pytest.importorskip("deepspeed")
    stdout, records = default_run
    deepspeed = [r for r in records if r["path"] == "deepspeed"]
    assert [(r["param_dtype"], r["optimizer_state_dtype"], r["gradient_dtype"], r["bytes_per_param"])
            for r in deepspeed] == [("float32", "float32", "float32", 28), ("bfloat16", "float32", "bfloat16", 22),
                                    ("bfloat16", "bfloat16", "bfloat16", 14)]
    assert f"| native, bf16 moments, bf16 grad | {bench.DEEPSPEED_FP32} | 1 |" in stdout


def test_without_deepspeed_its_rows_are_left_out_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # an import of it fails, as where it is not installed
    stdout, records = run([*TINY, "--paths", "deepspeed", "torch-fused", "--out", str(tmp_path / "rows.jsonl")])
    [line] = [line for line in stdout.splitlines() if "DeepSpeed" in line]
    assert line.startswith("DeepSpeedCPUAdam rows left out: ") and ".[peers]" in line, line
    assert [r["path"] for r in records] == ["torch-fused"]
