"""Step time of every compression method across a slow link: two network namespaces, one rank in each.

Emulates two nodes on one machine: two Linux network namespaces joined by a veth pair (addresses
10.210.0.1/30 and 10.210.0.2/30, which exist only inside the namespaces), both veth ends shaped by a
``tc`` token-bucket filter (tbf) to the given rate, gloo over that link. The link is checked first
with a timed TCP transfer and its measured rate is printed. Then ``python -m lit_fsdp fit`` runs
once per method and rate with one rank in each namespace (Lightning's multi-node environment: 2 nodes
x 1 device), each rank pinned to its own core(s) with as many threads (``--threads``, default 1), so
its compute does not depend on the other rank's. The rows (rate, method) run in turns ``--repeats``
times (default 3): every row once, then every row again, so that a drift in the machine's load hits
every row alike; each rate has its own link, set up once for the whole sweep.

The configuration is communication-bound on purpose: ``sharding: NO_SHARD`` (the default) replicates
the model on both ranks (data parallelism across two nodes, as DDP), so the only traffic per step is
the gradient all-reduce across the link, which the compression hook compresses. ``--sharding
FULL_SHARD`` also all-gathers the parameters every step (twice: forward and backward); without
``--param-all-gather int8`` that traffic is uncompressed and caps the gain. PowerSGD's ``start_step`` and DGC's
``warmup_steps`` are set to 0, so the timed steps are compressed ones. The default model is GPT-2-shaped,
4 layers x 640 wide (about 20M parameters, 80 MB of fp32 gradients per step, about 0.65 s on
1 Gbit/s), trained on one sequence of 16 tokens per rank, so that most of a ``none`` step is the
fp32 exchange. The compressors run on the rank's own core(s) too: where their time per value
exceeds what the smaller payload saves on the wire, a method is slower than ``none`` (the codec
time is in the raw records, ``compress_time_ms`` and ``decompress_time_ms``). On a busy or small
CPU the veth pair itself may carry less than a high nominal rate: the table heading gives the
measured one.

Figures are read from each run's ``results.jsonl`` (``callbacks.Results``): a run's step time is the
p50 of its steps after warm-up; a row gives the median of its runs' p50s and their range (min-max).
Speed-up = median of ``none`` / median of the method at the same rate, with the range of the
per-repeat ratios (``none`` and the method of the same repeat). Communication time and share come
from ``callbacks.CommProfiler`` (when it exists) recording the same steps whose time is reported, so
those step times include the profiler's own per-op recording. Failed runs are counted in the row and
the sweep goes on. The table goes to ``OUT/table.md`` (rewritten after every run), every run's record
to ``OUT/results.jsonl`` (appended after every run), each run's folder to ``OUT/<rate>/<method>/<repeat>``
(rank logs included).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN, for ``ip netns`` and ``tc``); it removes the namespaces
it created (and with them the veth pair) on exit, on an error, on Ctrl-C and on SIGTERM. The link and its check
are in ``slow_link.py``, one run in ``slow_link_runs.py``, the table in ``slow_link_table.py``.

    sudo python scripts/bench_slow_link.py                               # every method, 1 and 10 Gbit/s, 3 repeats
    sudo python scripts/bench_slow_link.py --rates 1gbit --methods none int8 --steps 8 --warmup 3 --repeats 5
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from pathlib import Path

from repeats import in_turns  # scripts/: this script's folder is first on sys.path
from slow_link import LinkError, SlowLink, measure_rate, tc_rate
from slow_link_runs import METHODS, REPO, model_overrides, run_method, write_callbacks
from slow_link_table import report

VOCAB = 512  # the synthetic data's default vocabulary; the model's embedding follows it


def parameter_count(args: argparse.Namespace) -> int:
    """Parameters of the benchmark model (built on the meta device: nothing is allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_fsdp.presets import build_config

    with torch.device("meta"):
        config = build_config("gpt2-tiny", {**model_overrides(args), "vocab_size": VOCAB})
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def comm_profiler_available() -> bool:
    """Whether ``callbacks.CommProfiler`` exists (it gives the communication share)."""
    try:
        return hasattr(importlib.import_module("callbacks"), "CommProfiler")
    except Exception as error:  # a broken callbacks package is reported by the runs themselves
        print(f"bench_slow_link: callbacks not importable ({error}); running without CommProfiler", file=sys.stderr)
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=list(METHODS), metavar="METHOD",
        help=f"methods to run (default: all): {', '.join(METHODS)}",
    )
    parser.add_argument("--rates", nargs="+", type=tc_rate, default=["1gbit", "10gbit"], help="tc rates, e.g. 1gbit 500mbit")
    parser.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    parser.add_argument("--sharding", choices=["NO_SHARD", "FULL_SHARD"], default="NO_SHARD",
                        help="NO_SHARD: the gradient all-reduce is the only traffic; FULL_SHARD: parameter all-gathers "
                             "and gradient reduce-scatters cross the link")
    parser.add_argument("--param-all-gather", choices=["int8", "fp8", "bf16", "fp16"],
                        help="FULL_SHARD: quantise the parameter all-gather too (compression.param_all_gather)")
    parser.add_argument(
        "--warmup", type=int, default=5, help="first steps left out of the step times and the profile"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of every (rate, method) row, in turns")
    parser.add_argument("--sync-every", type=int, help="the semi-synchronous methods' sync_every (default: their config's)")
    parser.add_argument("--statistic", choices=["p50", "mean"], default="p50",
                        help="each run's step time: p50, or mean (which counts a semi-synchronous method's exchange "
                             "steps; time a whole number of its periods after --warmup)")
    parser.add_argument("--layers", type=int, default=4, help="GPT-2 n_layer")
    parser.add_argument("--width", type=int, default=640, help="GPT-2 n_embd")
    parser.add_argument("--heads", type=int, default=8, help="GPT-2 n_head")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1, help="per rank")
    parser.add_argument("--threads", type=int, default=1, help="cores (and threads) per rank, each rank on its own")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take before both ranks are killed")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_slow_link", help="table, records and run folders")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.param_all_gather and args.sharding == "NO_SHARD":
        parser.error("--param-all-gather needs --sharding FULL_SHARD (NO_SHARD gathers no parameters)")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no measured step of --steps {args.steps}; lower it")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    rates = list(dict.fromkeys(args.rates))
    records: list[dict] = []
    port = 29500
    try:
        with contextlib.ExitStack() as stack:
            # Every link first: a missing root fails before anything slow.
            links = {rate: stack.enter_context(SlowLink(rate, tag=f"{os.getpid()}{i}")) for i, rate in enumerate(rates)}
            params = parameter_count(args)
            callbacks = write_callbacks(args.out / "callbacks.json", args.warmup, args.steps, comm_profiler_available())
            setup = (
                f"{args.sharding}{' with a ' + args.param_all_gather + ' parameter all-gather' if args.param_all_gather else ''} across 2 namespaces (1 rank each, gloo, {args.threads} pinned core(s) and "
                f"thread(s) per rank); GPT-2 "
                f"n_layer={args.layers} n_embd={args.width} ({params / 1e6:.1f}M parameters, "
                f"{4 * params / 1e6:.0f} MB of fp32 gradients per step), batch {args.batch_size} x seq "
                f"{args.seq_len} per rank, synthetic data; {args.steps} steps, first {args.warmup} left out; "
                f"{args.repeats} repeat(s), every row once per repeat"
            )
            print(setup, flush=True)
            checks, headings = {}, {}
            for rate in rates:
                check = checks[rate] = measure_rate(links[rate])
                fp32_ms = 4 * params * 8 / (check["measured_gbit_s"] * 1e9) * 1000
                headings[rate] = (
                    f"## {rate}: measured {check['measured_gbit_s']:.2f} Gbit/s "
                    f"(tbf on both veth ends); the fp32 all-reduce alone takes about {fp32_ms:.0f} ms per step"
                )
                print(headings[rate], flush=True)
            for repeat, (rate, method) in in_turns([(r, m) for r in rates for m in args.methods], args.repeats):
                port += 1  # a fresh port: the last run's may still be in TIME_WAIT
                record = {**run_method(links[rate], method, repeat, args, callbacks, port), "link": checks[rate],
                          "setup": setup, "sharding": args.sharding, "param_all_gather": args.param_all_gather}
                records.append(record)
                print(json.dumps({k: record.get(k) for k in (
                    "rate", "method", "repeat", "wall_s", "failed", "step_time_ms_p50", "comm_ratio",
                    "compression_ratio")}), flush=True)
                with open(args.out / "results.jsonl", "a") as f:
                    f.write(json.dumps(record, default=str) + "\n")
                # Rewritten after every run, so an interrupted sweep keeps the table of the runs done so far.
                markdown = report(setup, headings, records, args.statistic)
                (args.out / "table.md").write_text(markdown + "\n")
    except LinkError as error:
        sys.exit(f"bench_slow_link: {error}")
    print(markdown)



if __name__ == "__main__":
    main()
