"""scripts/bench_diloco.py: a 2-arm, 1-seed, 4-step comparison through ``python -m lit_fsdp fit``, its records and
tables; the grids and the refusal of a length that is not a multiple of H."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import pytest

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("bench_diloco", REPO / "scripts" / "bench_diloco.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

TINY = ["--protocols", "scratch", "--seeds", "1", "--lr-points", "1", "--outer", "1,0", "--steps", "4",
        "--sync-every", "2", "--layers", "1", "--width", "32", "--seq-len", "32", "--batch-size", "2",
        "--val-batches", "2", "--data", "synthetic"]


def test_a_tiny_comparison_records_each_arm_as_it_ends_and_tables_the_gap(tmp_path, capsys):
    bench.main(["--arms", "synchronous", "h32_int4", *TINY, "--out", str(tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["arm"] for r in records] == ["synchronous", "h32_int4"] and not any("failed" in r for r in records)
    synchronous, diloco = records
    assert synchronous["compression_ratio"] == 1.0 and math.isfinite(synchronous["val_loss"])
    # 4 steps, a synchronisation at 2 and 4: 2 exchanges of 4-bit values instead of 4 fp32 all-reduces
    assert diloco["outer_syncs"] == 2 and diloco["compression_ratio"] > 2 * 7
    assert diloco["val_loss_replica"] == pytest.approx(diloco["val_loss"], rel=1e-5)  # validated at a synchronisation
    # a second call finds both runs recorded and runs nothing again
    bench.main(["--arms", "synchronous", "h32_int4", *TINY, "--out", str(tmp_path)])
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 2
    capsys.readouterr()
    bench.main(["--table", "--out", str(tmp_path)])
    table = capsys.readouterr().out
    gap = 100 * (diloco["val_loss"] / synchronous["val_loss"] - 1)
    assert "**scratch**" in table and f"| h32_int4 | 2 | 0.002 | 1, 0 | 1 | {diloco['val_loss']:.4f} | {gap:+.2f}% (one seed)" in table


def test_the_inner_learning_rates_are_a_sqrt2_grid_around_lr():
    grid = bench.lr_grid(argparse.Namespace(lr=2e-3, lr_points=3))  # rounded to 8 decimals, as the records name them
    assert grid == pytest.approx([2e-3 / math.sqrt(2), 2e-3, 2e-3 * math.sqrt(2)], rel=1e-5)


def test_a_length_that_is_not_a_multiple_of_h_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit) as caught:
        bench.main(["--arms", "h32_int4", *TINY, "--steps", "5", "--out", str(tmp_path)])
    message = str(caught.value)
    assert "scratch trains 5 steps, not a positive multiple of H 2 (h32_int4)" in message and "\n" not in message
    assert not (tmp_path / "results.jsonl").exists()
