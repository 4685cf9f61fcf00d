"""scripts/bench_compression.py's table: changes paired by seed, and it says when they are not or rest on one seed."""

from __future__ import annotations

import importlib.util

from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("bench_compression", REPO / "scripts" / "bench_compression.py")
bench_compression = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_compression)


def run(method: str, seed: int, ppl: float) -> dict:
    return {"method": method, "seed": seed, "val_ppl": ppl, "ratio_vs_fp32": 4.0, "ratio_vs_bf16": 2.0,
            "codec_ms_per_step": 1.0, "tokens_per_s": 10.0}


def test_one_seed_prints_no_spread_and_an_unpaired_seed_is_marked():
    rows = bench_compression.table([run("baseline", 1, 100), run("baseline", 2, 200), run("int8", 1, 101),
                                    run("topk", 1, 110), run("topk", 3, 165)]).splitlines()
    int8 = next(row for row in rows if row.startswith("| int8 "))
    topk = next(row for row in rows if row.startswith("| topk "))
    assert "+1.00% ± n/a (one seed)" in int8 and "against the baseline mean" not in int8
    # seed 3 has no baseline run: compared with the baseline mean (150), +10%, and said so
    assert "+10.00% ± 0.00 (1 of 2 against the baseline mean: no baseline run of that seed)" in topk
