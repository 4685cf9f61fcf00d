"""scripts/sweep.py and lit_fsdp.commands.compare_runs (scripts/compare_runs.py): a real 2-process sweep with a failure, its
table and plots; the grouping and paired-change arithmetic on hand-made records; W&B input without a network."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_fsdp.commands import compare_runs
from lit_fsdp.commands import sweep as sweep_script
from tests.helpers import REPO

PNG = b"\x89PNG\r\n\x1a\n"
# 6 steps of gpt2-tiny on 2 processes, validating at steps 3 and 6; every target of 100 is reached at step 3.
RUN_ARGS = [
    "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2",
    "--trainer.log_every_n_steps", "1", "--data.batch_size", "2", "--model.warmup_steps", "2",
    "--trainer.enable_checkpointing", "false", "--trainer.enable_model_summary", "false",
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A sweep of a missing config, an int8 config that fails at start-up, none and int8 (seed 1234, world 2)."""
    out = tmp_path_factory.mktemp("sweep")
    bad = out / "badmethod.yaml"
    bad.write_text("trainer: {callbacks: [], strategy: {class_path: lit_fsdp.strategy.FSDP2Strategy, "
                   "init_args: {compression: {method: int8, num_bits: 12}}}}\n")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "sweep.py"), "--methods", "nosuch", str(bad), "baseline", "int8",
         "--seeds", "1234", "--world-sizes", "2", "--out", str(out), "--target-val-loss", "100", *RUN_ARGS],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 1, result.stdout + result.stderr  # some runs failed, the sweep finished
    return out


def test_sweep_records_failed_runs_and_goes_on(sweep):
    records = [json.loads(line) for line in (sweep / "sweep.jsonl").read_text().splitlines()]
    assert [(r["method"], r["status"]) for r in records] == [
        ("nosuch", "failed"), ("badmethod", "failed"), ("baseline", "ok"), ("int8", "ok")]
    missing, bad = records[0], records[1]
    assert "nosuch.yaml not found" in missing["error"] and missing["returncode"] is None
    assert bad["returncode"] == 2 and "num_bits" in bad["error"] and bad["wall_s"] > 0  # lit_fsdp's one-line error
    assert bad["compress_method"] == "int8"
    for record in records[2:]:
        run = sweep / record["folder"]
        results = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
        assert [r["run_name"] for r in results] == [record["run_name"]]  # the sweep named the run
        assert (results[0]["seed"], results[0]["world_size"]) == (1234, 2)


def test_quality_history_has_a_line_per_step_and_per_validation(sweep):
    history = [json.loads(line) for line in (sweep / "int8-w2-s1234" / "history.jsonl").read_text().splitlines()]
    train = [h for h in history if h["train_loss"] is not None]
    val = [h for h in history if h["val_loss"] is not None]
    assert [h["step"] for h in train] == [1, 2, 3, 4, 5, 6] and [h["step"] for h in val] == [3, 6]
    assert [h["tokens"] for h in train] == [step * 2 * 2 * 128 for step in range(1, 7)]  # batch x ranks x seq
    assert all(a["wall_s"] <= b["wall_s"] for a, b in zip(history, history[1:]))
    result = json.loads((sweep / "int8-w2-s1234" / "results.jsonl").read_text())
    assert result["step_to_target"] == 3 and result["time_to_target_s"] == pytest.approx(val[0]["wall_s"])
    assert result["best_val_loss"] == min(h["val_loss"] for h in val) and result["train_wall_s"] >= val[-1]["wall_s"]


def test_compare_runs_turns_a_sweep_into_tables_and_pngs(sweep, capsys):
    out = sweep / "comparison"
    compare_runs.main([str(sweep), "--out", str(out)])
    rows = {row["method"]: row for row in csv.DictReader(open(out / "comparison.csv"))}
    assert set(rows) == {"none", "int8", "nosuch"}  # the failed int8 config counts as a failed int8 run
    none, int8 = rows["none"], rows["int8"]
    assert (none["runs"], int8["runs"], int8["failed"], rows["nosuch"]["failed"]) == ("1", "1", "1", "1")
    assert float(none["compression_ratio_mean"]) == 1.0 and 3.5 < float(int8["compression_ratio_mean"]) < 4.0
    assert 250 < float(int8["compression_ratio_change_pct"]) < 300  # ~3.9x the baseline's bytes ratio
    assert abs(float(int8["val_ppl_change_pct"])) < 5  # same seed, 6 steps: int8 barely moves the loss
    assert float(int8["tokens_per_s_mean"]) > 0 and float(int8["time_to_target_s_mean"]) > 0
    table = (out / "comparison.md").read_text()
    assert sum(line.startswith(("| none |", "| int8 |")) for line in table.splitlines()) == 2
    assert "| int8 | 2 | 6 | 1 (1 failed: lit_fsdp: error:" in table and "| nosuch | 2 | — | 0 (1 failed:" in table
    has_comm = any(row["comm_ratio_mean"] for row in rows.values())
    for name in ("loss_vs_step", "loss_vs_wall", "tokens_per_s", "ratio_vs_ppl") + (("comm_share",) if has_comm else ()):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG, name
    assert has_comm or "comm_share.png not drawn" in table


def test_launch_kills_a_run_past_its_timeout_and_records_it_failed(tmp_path):
    start = time.perf_counter()
    outcome = sweep_script.launch([REPO / "configs" / "quickstart.yaml"], [], tmp_path / "run", timeout_s=1)
    assert outcome["status"] == "failed" and outcome["error"] == "timed out after 1 s" and outcome["returncode"] != 0
    assert time.perf_counter() - start < 30  # did not wait for the 300-step quickstart


def _run(method: str, seed: int, world: int = 2, **figures) -> dict:
    config = {"method": method, "ratio": figures.pop("ratio", None)}
    return {"compress_method": method, "compress_config": config, "seed": seed, "world_size": world, "status": "ok",
            "history": [], **figures}


def test_changes_are_paired_by_seed_and_groups_split_by_method_and_world_size():
    records = [
        _run("none", 1, val_ppl=10.0), _run("none", 2, val_ppl=12.0), _run("none", 3, val_ppl=11.0),
        _run("int8", 1, val_ppl=11.0), _run("int8", 2, val_ppl=12.6), _run("int8", 4, val_ppl=30.0),
        _run("int8", 1, world=4, val_ppl=20.0),  # no baseline at world 4
        {"compress_method": "int8", "seed": 5, "world_size": 2, "status": "failed", "error": "boom", "history": []},
    ]
    compare_runs.label_methods(records)
    rows = {(row["method"], row["world_size"]): row for row in compare_runs.compare(records, "none")}
    int8 = rows[("int8", 2)]
    assert (int8["runs"], int8["failed"], int8["error"]) == (3, 1, "boom")
    assert int8["val_ppl_mean"] == pytest.approx(statistics.fmean([11.0, 12.6, 30.0]))
    assert int8["val_ppl_sd"] == pytest.approx(statistics.stdev([11.0, 12.6, 30.0]))
    # seeds 1 and 2 pair up: +10% and +5%; seed 4 has no baseline run and stays out of the change
    assert int8["val_ppl_change_pct"] == pytest.approx(7.5) and int8["val_ppl_change_sd"] == pytest.approx(statistics.stdev([10, 5]))
    assert rows[("none", 2)]["val_ppl_change_pct"] == 0 and rows[("int8", 4)]["val_ppl_change_pct"] is None
    assert int8["tokens_per_s_mean"] is None and int8["tokens_per_s_n"] == 0


def test_without_common_seeds_the_change_is_between_the_means():
    records = [_run("none", 1, val_ppl=10.0), _run("none", 2, val_ppl=14.0), _run("int8", 7, val_ppl=13.2)]
    compare_runs.label_methods(records)
    int8 = next(row for row in compare_runs.compare(records, "none") if row["method"] == "int8")
    assert int8["val_ppl_change_pct"] == pytest.approx(10.0) and int8["val_ppl_change_sd"] is None


def test_configs_of_one_method_get_labels_by_the_parameters_that_differ():
    records = [_run("topk", 1, ratio=0.01), _run("topk", 1, ratio=0.1), _run("int8", 1)]
    compare_runs.label_methods(records)
    assert [r["method"] for r in records] == ["topk ratio=0.01", "topk ratio=0.1", "int8"]


def test_wandb_offline_is_a_one_line_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(SystemExit) as exit_info:
        compare_runs.main(["--wandb", "team/project"])
    message = str(exit_info.value)
    assert message.startswith("compare_runs: error:") and "wandb sync" in message and "\n" not in message


def test_a_wandb_run_becomes_a_results_record():
    history = {"train/loss": [{"trainer/global_step": 1, "_runtime": 2.0, "train/loss": 6.1}],
               "val/loss": [{"trainer/global_step": 3, "_runtime": 5.0, "val/loss": 5.9}]}
    run = SimpleNamespace(
        name="int8-w2-s1234-20260101-000000", state="finished", tags=["int8"],
        config={"seed_everything": 1234, "trainer": {"devices": 2, "num_nodes": 1}},
        summary_metrics={"val/ppl": 400.0, "perf/tokens_per_s": 700.0, "compression_ratio": 3.9, "_runtime": 9},
        history=lambda keys, **_: history[keys[0]],
    )
    record = compare_runs.wandb_record(run)
    assert (record["compress_method"], record["seed"], record["world_size"], record["status"]) == ("int8", 1234, 2, "ok")
    assert (record["val_ppl"], record["tokens_per_s"], record["compression_ratio"]) == (400.0, 700.0, 3.9)
    assert record["history"] == [{"step": 1, "wall_s": 2.0, "train_loss": 6.1}, {"step": 3, "wall_s": 5.0, "val_loss": 5.9}]
    crashed = compare_runs.wandb_record(SimpleNamespace(**{**vars(run), "state": "crashed"}))
    assert crashed["status"] == "failed" and "crashed" in crashed["error"]


def test_a_sweep_run_keeps_the_callbacks_its_configs_list_or_append(tmp_path):
    """As the CLI reads them: ``callbacks+`` appends to the standard list, or to the list an earlier config gave;
    ``callbacks`` replaces it. compare_runs' four are added where missing."""
    names = lambda configs: [e["class_path"] for e in sweep_script.run_callbacks(configs, "run", {})]  # noqa: E731
    plus = tmp_path / "plus.yaml"
    plus.write_text("trainer:\n  callbacks+:\n    - class_path: callbacks.OffloadStats\n")
    appended = names([REPO / "configs" / "quickstart.yaml", plus])
    assert appended[0] == "callbacks.ModelCheckpoint" and "callbacks.OffloadStats" in appended
    own = tmp_path / "own.yaml"
    own.write_text("trainer:\n  callbacks:\n    - class_path: callbacks.Memory\n")
    assert names([own, plus]) == [
        "callbacks.Memory", "callbacks.OffloadStats", "callbacks.Results", "callbacks.Quality", "callbacks.Throughput",
        "callbacks.CompressionStats"]


def test_compare_runs_is_a_command_and_keeps_two_runs_of_one_seed_apart(tmp_path, capsys):
    from lit_fsdp.commands.main import main

    folder = tmp_path / "runs" / "quickstart"
    folder.mkdir(parents=True)
    runs = [{"run_name": name, "compress_method": "none", "compress_config": None, "strategy": "fsdp2", "world_size": 2,
             "seed": 1234, "status": "ok", "val_loss": loss, "tokens_per_s": 1000.0}
            for name, loss in (("first", 5.0), ("second", 4.0))]
    (folder / "results.jsonl").write_text("".join(json.dumps(run) + "\n" for run in runs))
    main(["compare_runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "2 runs of none on 2 processes with seed 1234 (first, second), each counted as a run" in out, out
    with open(tmp_path / "out" / "comparison.csv") as file:
        row = next(csv.DictReader(file))
    assert row["runs"] == "2" and float(row["val_loss_mean"]) == 4.5, row


def _history(name: str, steps: range, loss: float) -> list[dict]:
    return [{"run_name": name, "step": step, "wall_s": float(step), "train_loss": loss - step / 100} for step in steps]


def test_a_run_and_its_resume_are_one_run_and_a_run_of_another_length_is_no_seed_of_it(tmp_path):
    """An interrupted run, its resume (``resumed_from``) and a stray 10-step run of the same seed, beside a run of
    another seed: two 300-step seeds, and the 10-step run in a row of its own."""
    interrupted = {**_run("none", 1234, steps=30, status="interrupted", error="stopped by a signal after step 30"),
                   "run_name": "a", "history": _history("a", range(1, 31), 6.0)}
    resumed = {**_run("none", 1234, steps=300, val_loss=4.0), "run_name": "b", "resumed_from": "a",
               "history": _history("b", range(31, 301), 6.0)}
    stray = {**_run("none", 1234, steps=10, val_loss=5.5), "run_name": "c", "history": _history("c", range(1, 11), 6.0)}
    other_seed = {**_run("none", 7, steps=300, val_loss=4.2), "run_name": "d", "history": _history("d", range(1, 301), 6.1)}
    rows = compare_runs.report([interrupted, resumed, stray, other_seed], "none", tmp_path)
    by_steps = {row["steps"]: row for row in rows}
    assert set(by_steps) == {10, 300}
    full, short = by_steps[300], by_steps[10]
    assert (full["runs"], full["failed"], short["runs"], short["failed"]) == (2, 0, 1, 0)
    assert full["val_loss_mean"] == pytest.approx(4.1) and short["val_loss_mean"] == 5.5
    joined = next(run for run in full["_runs"] if run["run_name"] == "b")
    assert [h["step"] for h in joined["history"]] == list(range(1, 301))  # the interrupted part, then the resume's
    assert all(a["wall_s"] < b["wall_s"] for a, b in zip(joined["history"], joined["history"][1:]))
    table = (tmp_path / "comparison.md").read_text()
    assert "a resumed as b: one run" in table and "| none | 2 | 300 | 2 |" in table and "| none | 2 | 10 | 1 |" in table


def test_coinciding_loss_curves_stay_apart_by_line_style_and_marker(tmp_path, monkeypatch):
    """Two groups whose curves are the same points (same seed, same steps): each drawn with its own line style and
    marker, the markers on alternate points, so the one drawn last does not hide the other."""
    records = [{**_run(method, 1, steps=20), "run_name": method, "history": _history(method, range(1, 21), 6.0)}
               for method in ("none", "int8")]
    compare_runs.label_methods(records)
    rows = compare_runs.compare(records, "none")
    drawn = []
    monkeypatch.setattr(compare_runs, "_save", lambda figure, path: drawn.append(figure))
    compare_runs.plot_losses(rows, "step", tmp_path / "loss_vs_step.png")
    lines = drawn[0].axes[0].lines
    assert len(lines) == 2 and lines[0].get_xydata().tolist() == lines[1].get_xydata().tolist()
    assert lines[0].get_linestyle() != lines[1].get_linestyle() and lines[0].get_marker() != lines[1].get_marker()
    assert lines[0].get_markevery() != lines[1].get_markevery()  # their markers on different points
