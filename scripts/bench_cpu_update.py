"""How fast one rank's CPU AdamW update runs: ns and bytes per parameter, float32 moments against bfloat16 moments.

Each row times ``offload.cpu_adam.CpuAdam.update`` (what SlideFSDP's worker thread runs per unit) on one
unit of ``--numel`` parameters: torch's fused AdamW with float32 moments and gradient, and the chunked update
(the same kernel per cache-sized chunk) with float32 moments and a bfloat16 gradient (SlideFSDP's default on
GPUs) or bfloat16 moments fed a float32 or a bfloat16 gradient. The median of ``--repeats`` updates after one
warm-up is reported, with the host bytes the pass reads and writes by construction: the gradient read,
the float32 master read and written, each moment read and written (the chunked update's float32
temporaries stay in cache and are not counted). One JSON line per row and thread count goes to ``--out``.

    python scripts/bench_cpu_update.py --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from compress.layout import UnitLayout
from offload.cpu_adam import CHUNK, CpuAdam

ROWS = [  # (row, moments dtype, gradient dtype)
    ("fp32 moments, fused AdamW, fp32 grad", torch.float32, torch.float32),
    ("fp32 moments, chunked, bf16 grad", torch.float32, torch.bfloat16),
    ("bf16 moments, chunked, fp32 grad", torch.bfloat16, torch.float32),
    ("bf16 moments, chunked, bf16 grad", torch.bfloat16, torch.bfloat16),
]


def bytes_per_param(state_dtype: torch.dtype, gradient_dtype: torch.dtype) -> int:
    """Host bytes one update reads and writes per parameter: gradient read, master read + written, two moments read + written."""
    return gradient_dtype.itemsize + 4 + 4 + 2 * 2 * state_dtype.itemsize


def time_update(numel: int, state_dtype: torch.dtype, gradient_dtype: torch.dtype, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` updates of one ``numel``-parameter unit, after one warm-up update."""
    held_param = torch.nn.Parameter(torch.empty(numel, device="meta"))  # the held optimizer's: no values
    layout = UnitLayout.build("unit", [(("weight",), held_param)], shards=1, shard_rank=0)
    master = torch.randn(numel)
    gradient = (torch.randn(numel) * 1e-3).to(gradient_dtype)
    adam = CpuAdam([layout], [master], torch.optim.AdamW([held_param], weight_decay=0.1), state_dtype=state_dtype)
    try:
        times = []
        for _ in range(1 + repeats):
            start = time.perf_counter()
            adam.update(0, layout.local_views(gradient))
            times.append(time.perf_counter() - start)
        return times[1:]
    finally:
        adam.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="parameters in the unit (one rank's rows)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch CPU thread counts to run, in turn")
    parser.add_argument("--repeats", type=int, default=5, help="timed updates per row (median reported)")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_cpu_update/results.jsonl"))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"{args.numel:,} parameters; median of {args.repeats} updates; chunk {CHUNK:,} elements; "
          f"1-minute load average {load:.2f} on {os.cpu_count()} CPUs\n")
    print("| row | threads | ns/param | B/param read+written | GB/s |")
    print("|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, state_dtype, gradient_dtype in ROWS:
            times = time_update(args.numel, state_dtype, gradient_dtype, args.repeats)
            seconds, nbytes = statistics.median(times), bytes_per_param(state_dtype, gradient_dtype)
            record = {
                "row": name, "optimizer_state_dtype": str(state_dtype).removeprefix("torch."),
                "gradient_dtype": str(gradient_dtype).removeprefix("torch."), "numel": args.numel, "threads": threads,
                "repeats": args.repeats, "chunk": CHUNK, "median_s": seconds, "min_s": min(times), "max_s": max(times),
                "ns_per_param": seconds / args.numel * 1e9, "bytes_per_param": nbytes,
                "gbps": nbytes * args.numel / seconds / 1e9, "load_average_1min": load, "torch": torch.__version__,
            }
            print(f"| {name} | {threads} | {record['ns_per_param']:.2f} | {nbytes} | {record['gbps']:.1f} |", flush=True)
            with args.out.open("a") as out:
                out.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
