"""``scripts/bench_delayed_update.py``: each arm's SlideFSDP knobs, and the clipping table counted from the norms."""

from __future__ import annotations

import sys

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import bench_delayed_update as bench  # noqa: E402


def test_every_arm_sets_the_update_mode_it_names():
    assert bench.arm_knobs("synchronous") == {"update": "synchronous"}
    assert bench.arm_knobs("delayed") == {"update": "delayed", "delayed_update_warmup": "0"}
    assert bench.arm_knobs(bench.arm_name(30)) == {"update": "delayed", "delayed_update_warmup": "30"}
    assert [bench.arm_knobs(arm) for arm in bench.EXACT_ARMS] == [{"update": arm} for arm in bench.EXACT_ARMS]


def test_the_clipping_table_counts_the_steps_whose_norm_the_clipping_cut_early_and_late():
    norms = [2.0, 0.5, 1.5, 0.9] + [0.5] * 5 + [1.2]  # cut at steps 1, 3 and 10 of 10
    rows = [{"arm": "synchronous", "seed": 1, "grad_norm": norms},
            {"arm": "speculative", "seed": 1, "grad_norm": norms, "rollbacks": [float(n > 1.0) for n in norms]}]
    lines = bench.clipping(rows, early=4).splitlines()
    assert lines[0].startswith("| arm | seed | steps | clipping fired: all | first 4 | after | rolled back |")
    assert lines[2] == "| synchronous | 1 | 10 | 30.0% | 50.0% | 16.7% |  |"
    assert lines[3] == "| speculative | 1 | 10 | 30.0% | 50.0% | 16.7% | 30.0% |"
