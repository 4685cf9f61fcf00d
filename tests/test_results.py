"""The measuring callbacks on a real 2-process int8 run: one plausible results.jsonl record."""

from __future__ import annotations

import json

from lit_fsdp.commands.cli import CALLBACKS
from tests.helpers import REPO, fit

REQUIRED = (
    "run_name world_size model dataset max_length batch_size compress_method compress_config seed "
    "step_time_ms_mean step_time_ms_p50 step_time_ms_p90 tokens_per_s comm_time_ms_total comm_ratio "
    "comm_time_ms_by_op bytes_raw_total bytes_compressed_total compression_ratio train_loss val_loss val_ppl"
).split()


def test_an_int8_run_appends_one_record_with_plausible_figures(tmp_path):
    # int8.yaml's callbacks: the standard list (which fit() would replace) and its comm_profiler
    fit(tmp_path, "--config", str(REPO / "configs" / "int8.yaml"), "--trainer.limit_val_batches", "2",
        "--trainer.val_check_interval", "10", steps=10, callbacks=CALLBACKS)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(records) == 1
    record = records[0]
    assert set(REQUIRED) <= set(record)
    assert (record["world_size"], record["compress_method"], record["model"]) == (2, "int8", "gpt2-tiny")
    assert record["seed"] == 1234  # the quickstart's seed_everything
    assert record["step_time_ms_p90"] >= record["step_time_ms_p50"] > 0 and record["tokens_per_s"] > 0
    assert 3.5 < record["compression_ratio"] < 4.0  # int8 + per-chunk scales + headers, against fp32
    assert record["bytes_compressed_total"] < record["bytes_raw_total"]
    assert record["val_ppl"] > 1 and record["peak_rss_gb"] > 0
    # The config's CommProfiler records steps 8-10 on both ranks; its Quality has no target or budget.
    assert record["profiled_steps"] == 2 * 3 and record["comm_time_ms_total"] > 0 and 0 < record["comm_ratio"] < 1
    assert record["comm_time_ms_by_op"]["all_to_all"] > 0  # int8 payloads cross by all-to-all
    assert record["samples_per_s"] > 0 and record["mfu"] is None  # no peak known for a CPU
    assert record["density"] == 1.0 and record["grad_cosine"] > 0.999  # int8 is dense and close
    assert record["train_wall_s"] > 0 and record["time_to_target_s"] is None
    environment = json.loads((tmp_path / "environment.json").read_text())
    assert environment["world_size"] == 2 and environment["packages"]["torch"]
