"""DDP as the baseline: ``sweep.py --strategies ddp fsdp2`` trains the same model and data under both, from the same
weights, and ``compare_runs.py --baseline ddp`` makes the table with the change against DDP."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from lit_fsdp.commands import compare_runs
from tests.helpers import REPO

# 4 steps of gpt2-tiny on 2 processes, one validation at the end.
RUN_ARGS = [
    "--trainer.max_steps", "4", "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
    "--trainer.log_every_n_steps", "1", "--data.batch_size", "2", "--model.warmup_steps", "2",
    "--trainer.enable_model_summary", "false",
]


@pytest.fixture(scope="module")
def strategies_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategies")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sweep.py"), "--strategies", "ddp", "fsdp2", "--out", str(out), *RUN_ARGS],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return out


def test_ddp_and_fsdp2_train_the_same_model_on_the_same_data(strategies_sweep):
    records = [json.loads(line) for line in (strategies_sweep / "sweep.jsonl").read_text().splitlines()]
    assert [(r["folder"], r["strategy"], r["status"]) for r in records] == [
        ("ddp-w2-s1234", "ddp", "ok"), ("fsdp2-w2-s1234", "fsdp2", "ok")]
    results = {name: json.loads((strategies_sweep / f"{name}-w2-s1234" / "results.jsonl").read_text()) for name in ("ddp", "fsdp2")}
    assert results["ddp"]["strategy"] == "ddp" and results["fsdp2"]["strategy"] == "fsdp2"
    losses = {name: [h["train_loss"] for h in map(json.loads, (strategies_sweep / f"{name}-w2-s1234" / "history.jsonl")
                                                  .read_text().splitlines()) if h["train_loss"] is not None]
              for name in ("ddp", "fsdp2")}
    # The whole model materialised on each rank gets FSDP2's per-block seeded init (the tied head included).
    assert len(losses["ddp"]) == 4 and losses["ddp"] == pytest.approx(losses["fsdp2"], rel=1e-4)


def test_compare_runs_with_baseline_ddp_gives_the_change_against_ddp(strategies_sweep, capsys):
    out = strategies_sweep / "comparison"
    compare_runs.main([str(strategies_sweep), "--baseline", "ddp", "--out", str(out)])
    rows = {row["method"]: row for row in csv.DictReader(open(out / "comparison.csv"))}
    assert set(rows) == {"ddp", "fsdp2"}
    fsdp2 = rows["fsdp2"]
    for key in ("tokens_per_s", "step_time_ms_p50", "peak_rss_gb", "val_loss"):
        assert fsdp2[f"{key}_change_pct"] != "", key
    assert abs(float(fsdp2["val_loss_change_pct"])) < 0.1  # the same numerics
    table = (out / "comparison.md").read_text()
    assert "against `ddp`" in table and table.index("| ddp |") < table.index("| fsdp2 |")
