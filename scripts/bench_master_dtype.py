"""How well does a bfloat16 master train against a float32 one? WikiText-2 loss on the CPU, paired seeds.

Each seed trains gpt2-tiny on WikiText-2 at the quickstart's shape (``bench_delayed_update``'s ``--wikitext`` run:
clipping 1.0, the quickstart's learning-rate schedule) under SlideFSDP three times, the same data in the same order,
the compute in float32 so that the arms differ in the master's precision alone (bfloat16 matmuls on a CPU without
them are emulated, 20x slower): a float32 master (``master_dtype: float32``, what the 8B ships), a bfloat16 master rounded
stochastically by the update (``master_dtype: bfloat16``), and a bfloat16 master rounded to nearest (the control:
what stochastic rounding buys). A JSON line per run goes to ``--out`` as it ends; ``--table`` prints each arm's mean
and spread over seeds and the paired differences against the float32 master.

    python scripts/bench_master_dtype.py --seeds 1 2 3 --steps 1000
    python scripts/bench_master_dtype.py --table
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paired_runs  # noqa: E402
from bench_delayed_update import run, table  # noqa: E402  (the WikiText-2 fit and the paired table)
from offload.rounding import ROUNDING_VARIABLE  # noqa: E402

REFERENCE = "float32 master"
#: arm: (SlideFSDP knobs, environment)
ARMS = {
    REFERENCE: ({"master_dtype": "float32"}, {}),
    "bfloat16 master, stochastic rounding": ({"master_dtype": "bfloat16"}, {}),
    "bfloat16 master, rounded to nearest": ({"master_dtype": "bfloat16"}, {ROUNDING_VARIABLE: "nearest"}),
}
COMMON = {"param_dtype": "float32", "update": "synchronous"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    paired_runs.arguments(parser, [1, 2, 3], 1000, 3e-3, "the quickstart", list(ARMS),
                          ROOT / "runs" / "bench_master_dtype.jsonl")
    args = parser.parse_args()

    def run_arm(seed: int, arm: str, folder: Path) -> dict:
        knobs, environment = ARMS[arm]
        return run(seed, arm, args.steps, 1, folder, args.lr, True, {**COMMON, **knobs}, environment)

    print(table(paired_runs.run_all(args, run_arm), args.tail, REFERENCE))


if __name__ == "__main__":
    main()
