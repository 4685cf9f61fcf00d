"""How fast one rank's CPU AdamW update runs against the host's copy rate: ns and bytes per parameter, by path.

Each row times one update of one unit of ``--numel`` parameters, the staging copy (bfloat16, what the device
loads) included. *native* is ``offload.cpu_adam.CpuAdam.update`` as SlideFSDP runs it: the one-pass C kernel
(``offload/adamw_kernel.c``), with float32 moments and a float32 or bfloat16 gradient (SlideFSDP's default on GPUs),
or bfloat16 moments. *torch, one pass per chunk* is its fallback (no C compiler): torch's fused AdamW per cache-sized
chunk on float32 copies, each chunk's new weights written to the staging copy while in cache. *torch, two passes* is
what SlideFSDP ran first: the fused kernel over the whole tensors, then the staging copy rewritten from the master.
Each thread count first measures the host's copy rate (``copy_gb_per_s``: a float32 tensor of ``--numel`` elements
``copy_``'d, bytes read + written per second) on the same threads. Updates are timed by
``torch.utils.benchmark.Timer`` after warm-up updates, for at least ``--repeats`` updates' time, until their spread is
small; the median is reported, with the host bytes the pass reads and writes by construction (the chunked update's
float32 temporaries stay in cache and are not counted). One JSON line per row and thread count goes to ``--out``.

    python scripts/bench_cpu_update.py --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils import benchmark

from compress.layout import UnitLayout
from offload import adamw_kernel
from offload.cpu_adam import CHUNK, CpuAdam

ROWS = [  # (row, moments dtype, gradient dtype, path: native, torch (one pass per chunk) or torch-two-passes)
    ("torch, two passes: fused AdamW, then staging, fp32 grad", torch.float32, torch.float32, "torch-two-passes"),
    ("torch, one pass per chunk, fp32 moments, fp32 grad", torch.float32, torch.float32, "torch"),
    ("torch, one pass per chunk, fp32 moments, bf16 grad", torch.float32, torch.bfloat16, "torch"),
    ("torch, one pass per chunk, bf16 moments, bf16 grad", torch.bfloat16, torch.bfloat16, "torch"),
    ("native, fp32 moments, fp32 grad", torch.float32, torch.float32, "native"),
    ("native, fp32 moments, bf16 grad", torch.float32, torch.bfloat16, "native"),
    ("native, bf16 moments, bf16 grad", torch.bfloat16, torch.bfloat16, "native"),
]
STAGING = torch.bfloat16


def bytes_per_param(state_dtype: torch.dtype, gradient_dtype: torch.dtype, one_pass: bool) -> int:
    """Host bytes one update reads and writes per parameter: gradient read, master read + written, two moments read +
    written, the staging copy written (and, in two passes, the master read again for it)."""
    return gradient_dtype.itemsize + 4 + 4 + 2 * 2 * state_dtype.itemsize + STAGING.itemsize + (0 if one_pass else 4)


def measure(task, repeats: int, threads: int) -> benchmark.Measurement:
    """``task()`` timed by ``Timer.adaptive_autorange`` on ``threads`` threads after three warm-up calls (the Timer's
    two, and one whose time sizes the run): blocks of calls, at least four and ``repeats`` calls' time, until their
    spread (IQR) is within 10% of their median, or for 10 s. ``.times``: seconds per call of each block."""
    timer = benchmark.Timer("task()", globals={"task": task}, num_threads=threads)
    per_call = timer.timeit(1).mean
    return timer.adaptive_autorange(min_run_time=repeats * per_call)


def copy_rate(numel: int, repeats: int, threads: int) -> float:
    """The host's copy rate on ``threads`` threads, GB/s: a ``numel``-element float32 tensor ``copy_``'d to another,
    the bytes read and written."""
    source, target = torch.randn(numel), torch.empty(numel)
    return 2 * source.nbytes / measure(lambda: target.copy_(source), repeats, threads).median / 1e9


def time_update(numel: int, state_dtype: torch.dtype, gradient_dtype: torch.dtype, path: str,
                repeats: int, chunk: int = CHUNK, threads: int = 1) -> benchmark.Measurement:
    """Updates of one ``numel``-parameter unit by ``path`` (torch: ``chunk`` elements at a time) on ``threads``
    threads, timed by ``measure``."""
    held_param = torch.nn.Parameter(torch.empty(numel, device="meta"))  # the held optimizer's: no values
    layout = UnitLayout.build("unit", [(("weight",), held_param)], shards=1, shard_rank=0)
    master = torch.randn(numel)
    gradient = (torch.randn(numel) * 1e-3).to(gradient_dtype)
    staging = torch.empty(numel, dtype=STAGING)
    one_pass = path != "torch-two-passes"
    if one_pass:
        adam = CpuAdam([layout], [master], torch.optim.AdamW([held_param], weight_decay=0.1), state_dtype=state_dtype,
                       chunk=chunk)

        def update() -> None:
            adam.update(0, layout.local_views(gradient), layout.local_views(staging))
    else:
        weight = torch.nn.Parameter(master)
        weight.grad = gradient
        fused = torch.optim.AdamW([weight], weight_decay=0.1, fused=True)

        def update() -> None:
            fused.step()
            staging.copy_(master)
    adamw_kernel.enabled = path == "native"
    try:
        if path == "native" and adamw_kernel.library() is None:
            raise SystemExit("the native kernel did not build (see the warning above): no native rows to time")
        return measure(update, repeats, threads)
    finally:
        adamw_kernel.enabled = True
        if one_pass:
            adam.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="parameters in the unit (one rank's rows)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch CPU thread counts to run, in turn")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed for at least this many updates' time per row (median reported)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[CHUNK],
                        help="elements per chunk of torch's one-pass rows")
    parser.add_argument("--paths", nargs="+", default=["native", "torch", "torch-two-passes"],
                        choices=["native", "torch", "torch-two-passes"], help="which paths' rows to run")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_cpu_update.jsonl"))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"{args.numel:,} parameters; median over at least {args.repeats} updates' time; "
          f"1-minute load average {load:.2f} on {os.cpu_count()} CPUs\n")
    print("| row | chunk | threads | ns/param | B/param read+written | GB/s | of copy rate |")
    print("|---|---|---|---|---|---|---|")
    cases = [(row, chunk) for row in ROWS if row[3] in args.paths for chunk in (args.chunks if row[3] == "torch" else [None])]
    for threads in args.threads:
        torch.set_num_threads(threads)
        copy_gb_per_s = copy_rate(args.numel, args.repeats, threads)
        print(f"| host copy (float32 copy_) | | {threads} | | 8 | {copy_gb_per_s:.1f} | 100% |", flush=True)
        for (name, state_dtype, gradient_dtype, path), chunk in cases:
            measured = time_update(args.numel, state_dtype, gradient_dtype, path, args.repeats, chunk or CHUNK,
                                   threads)
            times, seconds = measured.times, measured.median
            one_pass = path != "torch-two-passes"
            nbytes = bytes_per_param(state_dtype, gradient_dtype, one_pass)
            record = {
                "row": name, "path": path, "optimizer_state_dtype": str(state_dtype).removeprefix("torch."),
                "gradient_dtype": str(gradient_dtype).removeprefix("torch."), "one_pass": one_pass, "numel": args.numel,
                "threads": threads,
                "repeats": args.repeats, "chunk": chunk, "median_s": seconds, "min_s": min(times), "max_s": max(times),
                "ns_per_param": seconds / args.numel * 1e9, "bytes_per_param": nbytes,
                "gbps": nbytes * args.numel / seconds / 1e9, "copy_gb_per_s": copy_gb_per_s,
                "load_average_1min": load, "torch": torch.__version__,
            }
            share = record["gbps"] / copy_gb_per_s
            print(f"| {name} | {chunk or 'whole'} | {threads} | {record['ns_per_param']:.2f} | {nbytes} | "
                  f"{record['gbps']:.1f} | {share:.0%} |", flush=True)
            with args.out.open("a") as out:
                out.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
