"""How fast one rank's CPU AdamW update runs against the host's copy rate: ns and bytes per parameter, by path.

Each row times one update of one unit of ``--numel`` parameters, the staging copy (bfloat16, what the device
loads) included. *native* is ``offload.cpu_adam.CpuAdam.update`` as SlideFSDP runs it: the one-pass C kernel
(``offload/adamw_kernel.c``), with float32 moments and a float32 or bfloat16 gradient (SlideFSDP's default on GPUs),
or bfloat16 moments. *torch, one pass per chunk* is its fallback (no C compiler): torch's fused AdamW per cache-sized
chunk on float32 copies, each chunk's new weights written to the staging copy while in cache. *torch, two passes* is
what SlideFSDP ran first: the fused kernel over the whole tensors, then the staging copy rewritten from the master.
Beside them, without a staging copy: *torch, fused AdamW over whole tensors* (``torch.optim.AdamW(fused=True)`` on
float32 tensors) and *DeepSpeedCPUAdam* (its AVX-512/AVX2 C++ op, built at first use; rows only where deepspeed is
installed: ``pip install -e '.[peers]'``, else one line says why) with the dtypes its ``step`` takes that SlideFSDP
uses: float32 parameters, gradients and moments; bfloat16 parameters and gradients (it reads the gradient as the
parameters' dtype) with float32 or bfloat16 moments (its float16 ones are left out; on a host without AVX-512 its
bfloat16 runs a scalar loop). Its bfloat16 parameters are the only weights: there is no float32 master to compare.
After the rows, the ratios of the same run: per parameter, how many times faster one row is than another on the
same threads.
Each thread count first measures the host's copy rate (``copy_gb_per_s``: a float32 tensor of ``--numel`` elements
``copy_``'d, bytes read + written per second) on the same threads. Updates are timed by
``torch.utils.benchmark.Timer`` after warm-up updates, for at least ``--repeats`` updates' time, until their spread is
small; the median is reported, with the host bytes the pass reads and writes by construction (the chunked update's
float32 temporaries stay in cache and are not counted). One JSON line per row and thread count goes to ``--out``
(the ratios are printed only).

    python scripts/bench_cpu_update.py --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils import benchmark

from compress.layout import UnitLayout
from offload import adamw_kernel
from offload.cpu_adam import CHUNK, CpuAdam

PATHS = ["native", "torch", "torch-two-passes", "torch-fused", "deepspeed"]
STAGED = ("native", "torch", "torch-two-passes")  # the paths that write the staging copy


class Row(NamedTuple):
    name: str
    state_dtype: torch.dtype  # the moments'
    gradient_dtype: torch.dtype
    path: str  # one of PATHS; torch: one pass per chunk
    param_dtype: torch.dtype = torch.float32  # the weights the update reads and writes: the master, where there is one


F32, BF16 = torch.float32, torch.bfloat16
DEEPSPEED_FP32 = "DeepSpeedCPUAdam, fp32 params, fp32 moments, fp32 grad"
ROWS = [
    Row("torch, two passes: fused AdamW, then staging, fp32 grad", F32, F32, "torch-two-passes"),
    Row("torch, one pass per chunk, fp32 moments, fp32 grad", F32, F32, "torch"),
    Row("torch, one pass per chunk, fp32 moments, bf16 grad", F32, BF16, "torch"),
    Row("torch, one pass per chunk, bf16 moments, bf16 grad", BF16, BF16, "torch"),
    Row("torch, fused AdamW over whole tensors, no staging, fp32 moments, fp32 grad", F32, F32, "torch-fused"),
    Row(DEEPSPEED_FP32, F32, F32, "deepspeed"),
    Row("DeepSpeedCPUAdam, bf16 params, fp32 moments, bf16 grad", F32, BF16, "deepspeed", BF16),
    Row("DeepSpeedCPUAdam, bf16 params, bf16 moments, bf16 grad", BF16, BF16, "deepspeed", BF16),
    Row("native, fp32 moments, fp32 grad", F32, F32, "native"),
    Row("native, fp32 moments, bf16 grad", F32, BF16, "native"),
    Row("native, bf16 moments, bf16 grad", BF16, BF16, "native"),
]
#: (row, against): the first row is printed as so many times faster per parameter than the second, same threads.
RATIOS = [
    ("native, bf16 moments, bf16 grad", DEEPSPEED_FP32),
    ("native, fp32 moments, bf16 grad", DEEPSPEED_FP32),  # SlideFSDP's default dtypes on GPUs
    ("native, fp32 moments, fp32 grad", DEEPSPEED_FP32),
    ("native, bf16 moments, bf16 grad", "native, fp32 moments, bf16 grad"),
    ("native, fp32 moments, fp32 grad", "torch, fused AdamW over whole tensors, no staging, fp32 moments, fp32 grad"),
]
STAGING = BF16


def bytes_per_param(row: Row) -> int:
    """Host bytes one update reads and writes per parameter: gradient read, weight read + written, two moments read +
    written, and on SlideFSDP's paths the staging copy written (in two passes, the master read again for it)."""
    staging = STAGING.itemsize if row.path in STAGED else 0
    again = row.param_dtype.itemsize if row.path == "torch-two-passes" else 0
    weight, moments = 2 * row.param_dtype.itemsize, 2 * 2 * row.state_dtype.itemsize
    return row.gradient_dtype.itemsize + weight + moments + staging + again


def measure(task, repeats: int, threads: int, max_seconds: float = 10.0) -> benchmark.Measurement:
    """``task()`` timed by ``Timer.adaptive_autorange`` on ``threads`` threads after three warm-up calls (the Timer's
    two, and one whose time sizes the run): blocks of calls, at least four and ``repeats`` calls' time, until their
    spread (IQR) is within 10% of their median, or for ``max_seconds``. ``.times``: seconds per call of each block."""
    timer = benchmark.Timer("task()", globals={"task": task}, num_threads=threads)
    per_call = timer.timeit(1).mean
    return timer.adaptive_autorange(min_run_time=repeats * per_call, max_run_time=max_seconds)


def copy_rate(numel: int, repeats: int, threads: int, max_seconds: float = 10.0) -> float:
    """The host's copy rate on ``threads`` threads, GB/s: a ``numel``-element float32 tensor ``copy_``'d to another,
    the bytes read and written."""
    source, target = torch.randn(numel), torch.empty(numel)
    return 2 * source.nbytes / measure(lambda: target.copy_(source), repeats, threads, max_seconds).median / 1e9


def deepspeed_cpu_adam() -> tuple[type | None, str]:
    """DeepSpeed's ``DeepSpeedCPUAdam`` with its op loaded (built at the first use on a host: minutes) and its
    version, or None and why not."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # its CPU op builds on a host without a GPU; a CPU update is timed
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError as error:
        return None, f"{error}; `pip install -e '.[peers]'` adds them"
    try:
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(1))])
    except Exception as error:  # noqa: BLE001 - whatever the build raised, the rows are left out and the line says it
        return None, f"deepspeed {deepspeed.__version__}'s CPU Adam op did not build or load: {error}"
    return DeepSpeedCPUAdam, deepspeed.__version__


def time_update(numel: int, row: Row, repeats: int, chunk: int = CHUNK, threads: int = 1,
                max_seconds: float = 10.0, deepspeed_adam: type | None = None) -> benchmark.Measurement:
    """Updates of one ``numel``-parameter unit as ``row`` runs them (torch per chunk: ``chunk`` elements at a time;
    deepspeed: by ``deepspeed_adam``) on ``threads`` threads, timed by ``measure``."""
    held_param = torch.nn.Parameter(torch.empty(numel, device="meta"))  # the held optimizer's: no values
    layout = UnitLayout.build("unit", [(("weight",), held_param)], shards=1, shard_rank=0)
    master = torch.randn(numel).to(row.param_dtype)
    gradient = (torch.randn(numel) * 1e-3).to(row.gradient_dtype)
    staging = torch.empty(numel, dtype=STAGING)
    adam = None
    if row.path in ("native", "torch"):
        adam = CpuAdam([layout], [master], torch.optim.AdamW([held_param], weight_decay=0.1),
                       state_dtype=row.state_dtype, chunk=chunk)

        def update() -> None:
            adam.update(0, layout.local_views(gradient), layout.local_views(staging))
    else:
        weight = torch.nn.Parameter(master)
        weight.grad = gradient
        if row.path == "deepspeed":
            optimizer = deepspeed_adam([weight], weight_decay=0.1, fp32_optimizer_states=row.state_dtype == F32)
        else:
            optimizer = torch.optim.AdamW([weight], weight_decay=0.1, fused=True)
        staged = row.path == "torch-two-passes"

        def update() -> None:
            optimizer.step()
            if staged:
                staging.copy_(master)
    adamw_kernel.enabled = row.path == "native"
    try:
        if row.path == "native" and adamw_kernel.library() is None:
            raise SystemExit("the native kernel did not build (see the warning above): no native rows to time")
        return measure(update, repeats, threads, max_seconds)
    finally:
        adamw_kernel.enabled = True
        if adam is not None:
            adam.close()


def ratio_lines(records: list[dict]) -> list[str]:
    """The Markdown rows of ``RATIOS`` whose two rows ``records`` hold on the same threads: the second row's median
    ns/param over the first's."""
    ns = {(r["row"], r["threads"]): r["ns_per_param"] for r in records}
    return [f"| {row} | {against} | {threads} | {ns[against, threads] / ns[row, threads]:.2f}x |"
            for threads in dict.fromkeys(r["threads"] for r in records) for row, against in RATIOS
            if (row, threads) in ns and (against, threads) in ns]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="parameters in the unit (one rank's rows)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch CPU thread counts to run, in turn")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed for at least this many updates' time per row (median reported)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[CHUNK],
                        help="elements per chunk of torch's one-pass rows")
    parser.add_argument("--paths", nargs="+", default=PATHS, choices=PATHS, help="which paths' rows to run")
    parser.add_argument("--max-seconds", type=float, default=10.0,
                        help="stop timing a row after this long even if its spread is still wide")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_cpu_update.jsonl"))
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    print(f"{args.numel:,} parameters; median over at least {args.repeats} updates' time; "
          f"1-minute load average {load:.2f} on {os.cpu_count()} CPUs\n")
    deepspeed_adam, deepspeed_version = deepspeed_cpu_adam() if "deepspeed" in args.paths else (None, None)
    if "deepspeed" in args.paths and deepspeed_adam is None:
        print(f"DeepSpeedCPUAdam rows left out: {deepspeed_version}\n")
    elif deepspeed_adam is not None:
        print(f"DeepSpeedCPUAdam: deepspeed {deepspeed_version}\n")
    print("| row | chunk | threads | ns/param | B/param read+written | GB/s | of copy rate |")
    print("|---|---|---|---|---|---|---|")
    runnable = [row for row in ROWS if row.path in args.paths and (row.path != "deepspeed" or deepspeed_adam)]
    cases = [(row, chunk) for row in runnable for chunk in (args.chunks if row.path == "torch" else [None])]
    records = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        copy_gb_per_s = copy_rate(args.numel, args.repeats, threads, args.max_seconds)
        print(f"| host copy (float32 copy_) | | {threads} | | 8 | {copy_gb_per_s:.1f} | 100% |", flush=True)
        for row, chunk in cases:
            measured = time_update(args.numel, row, args.repeats, chunk or CHUNK, threads, args.max_seconds,
                                   deepspeed_adam)
            times, seconds = measured.times, measured.median
            nbytes = bytes_per_param(row)
            record = {
                "row": row.name, "path": row.path, "optimizer_state_dtype": str(row.state_dtype).removeprefix("torch."),
                "gradient_dtype": str(row.gradient_dtype).removeprefix("torch."),
                "param_dtype": str(row.param_dtype).removeprefix("torch."), "staging": row.path in STAGED,
                "one_pass": row.path != "torch-two-passes", "numel": args.numel, "threads": threads,
                "repeats": args.repeats, "chunk": chunk, "median_s": seconds, "min_s": min(times), "max_s": max(times),
                "ns_per_param": seconds / args.numel * 1e9, "bytes_per_param": nbytes,
                "gbps": nbytes * args.numel / seconds / 1e9, "copy_gb_per_s": copy_gb_per_s,
                "load_average_1min": load, "torch": torch.__version__,
                **({"deepspeed": deepspeed_version} if row.path == "deepspeed" else {}),
            }
            share = record["gbps"] / copy_gb_per_s
            print(f"| {row.name} | {chunk or 'whole'} | {threads} | {record['ns_per_param']:.2f} | {nbytes} | "
                  f"{record['gbps']:.1f} | {share:.0%} |", flush=True)
            with args.out.open("a") as out:
                out.write(json.dumps(record) + "\n")
            records.append(record)
    ratios = ratio_lines(records)
    if ratios:
        print("\n| row | against | threads | times faster per parameter |\n|---|---|---|---|", *ratios, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
