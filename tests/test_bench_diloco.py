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


def tuning_args(tmp_path, **overrides):
    values = {"lr": 2e-3, "lr_points": 3, "lr_extend": 1, "outer_search": "after-inner",
              "outer": [(1.0, 0.0), (0.7, 0.9)], "out": tmp_path, "sync_every": 0, "steps": 8}
    return argparse.Namespace(**{**values, **overrides})


def fake_runs(args, loss):
    """A stand-in for one training run: records the call and a validation loss given by ``loss(inner_lr, outer)``;
    a setting already recorded is not run again, as the script's ``once`` does."""
    calls = []

    def once(protocol, arm, seed, inner_lr, outer):
        if (protocol, arm, seed, inner_lr, *outer) in {bench.key(r) for r in bench.read(args.out / "results.jsonl")}:
            return
        calls.append((inner_lr, outer))
        record = {"protocol": protocol, "arm": arm, "seed": seed, "inner_lr": inner_lr, "outer_lr": outer[0],
                  "outer_momentum": outer[1], "sync_every": 32, "val_loss": loss(inner_lr, outer)}
        with open(args.out / "results.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return calls, once


def test_the_inner_lr_is_tuned_first_then_the_outer_step_at_the_best_and_a_winning_edge_is_extended_once(tmp_path):
    args = tuning_args(tmp_path)
    # the loss falls with the lr past the grid's top edge (2e-3 * 2) and prefers Nesterov 0.9 outside
    calls, once = fake_runs(args, lambda lr, outer: abs(math.log(lr / 5e-3)) + (0 if outer[1] else 0.1))
    chosen = bench.tune("scratch", "h32_int4", 1, args, once)
    grid = [bench.lr_point(args, i) for i in (-1, 0, 1, 2)]
    assert calls == [(lr, (1.0, 0.0)) for lr in grid] + [(grid[-1], (0.7, 0.9))]
    assert (chosen["inner_lr"], chosen["outer_lr"], chosen["outer_momentum"]) == (grid[-1], 0.7, 0.9)


def test_an_inner_best_is_not_extended_and_grid_search_tries_every_pair(tmp_path):
    args = tuning_args(tmp_path, outer_search="grid")
    calls, once = fake_runs(args, lambda lr, outer: abs(math.log(lr / 2e-3)) + outer[0])
    chosen = bench.tune("scratch", "h32_int4", 1, args, once)
    assert len(calls) == 6 and chosen["inner_lr"] == 2e-3 and chosen["outer_lr"] == 0.7
    # the synchronous arm has no outer step: the lr grid alone, extended downwards once where its low edge wins
    calls, once = fake_runs(args, lambda lr, outer: lr)
    chosen = bench.tune("scratch", "synchronous", 1, args, once)
    assert [lr for lr, _ in calls] == [bench.lr_point(args, i) for i in (-1, 0, 1, -2)]
    assert chosen["inner_lr"] == bench.lr_point(args, -2)


def test_an_out_folder_of_other_settings_is_refused_in_one_line(tmp_path):
    bench.main(["--arms", "synchronous", *TINY, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as caught:
        bench.main(["--arms", "synchronous", *TINY, "--batch-size", "3", "--out", str(tmp_path)])
    message = str(caught.value)
    assert f"{tmp_path} holds runs of other settings" in message and "another --out" in message and "\n" not in message
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 1


def test_a_call_with_a_larger_lr_extend_goes_on_past_the_points_an_earlier_call_added(tmp_path):
    args = tuning_args(tmp_path)
    calls, once = fake_runs(args, lambda lr, outer: -lr)  # the larger the better, without end
    bench.tune("scratch", "synchronous", 1, args, once)
    assert [lr for lr, _ in calls] == [bench.lr_point(args, i) for i in (-1, 0, 1, 2)]
    calls.clear()
    bench.tune("scratch", "synchronous", 1, tuning_args(tmp_path, lr_extend=3), once)
    assert [lr for lr, _ in calls] == [bench.lr_point(args, i) for i in (3, 4)]
