"""SlideFSDP against torch's CPU offload (FSDP2 + CPUOffloadPolicy) and plain FSDP2, side by side in one run.

Every run is a real ``python -m lit_fsdp fit`` with the same model, global batch, sequence length,
precision and activation checkpointing, on synthetic data whose vocabulary is the preset's; each
records tokens/s, TFLOPS and MFU per device (warm-up steps dropped), the device's peak memory, the
peak host RSS of rank 0, and for SlideFSDP the host-device rates, the CPU AdamW time per step and
the share of it hidden behind the backward. The strategies run in turns ``--repeats`` times (default 3):
every (model, strategy) row once, then every row again, so that a drift in the machine's load hits every
row alike. A row gives each figure's median over its runs and their range (min-max) in brackets, and how
many runs succeeded; a run that fails (out of memory, say) is counted with its error: that is how "where
the model fits" is found. Table: ``OUT/table.md``, rewritten after every run; records: ``OUT/bench.jsonl``,
one line per run appended as it ends; run folders: ``OUT/<model>-<strategy>-<repeat>``.

    python scripts/bench_offload.py                                   # CPU, 2 processes, a small GPT-2
    python scripts/bench_offload.py --accelerator gpu --devices 1 --param-dtype bfloat16 \\
        --presets llama-1b llama-8b --seq-len 2048 --batch-size 8 --steps 12
    python scripts/bench_offload.py --strategies slide_fsdp slide_fsdp_delayed --trainer.gradient_clip_val 1.0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lit_fsdp.commands.launch import launch
from lit_fsdp.presets import PRESETS
from repeats import Spread, in_turns  # scripts/repeats.py: this script's folder is first on sys.path

REPO = Path(__file__).resolve().parents[1]

STRATEGIES = {
    "slide_fsdp": {"class_path": "offload.SlideFSDPStrategy"},
    # the one-step delayed update (DPU): with --trainer.gradient_clip_val set, the row to put beside slide_fsdp's
    "slide_fsdp_delayed": {"class_path": "offload.SlideFSDPStrategy", "init_args": {"update": "delayed"}},
    "fsdp2_cpu_offload": {"class_path": "lit_fsdp.strategy.FSDP2Strategy", "init_args": {"cpu_offload": True}},
    "fsdp2": {"class_path": "lit_fsdp.strategy.FSDP2Strategy"},
}
COLUMNS = [
    ("status", "status"), ("tokens/s", "tokens_per_s"), ("step ms p50", "step_time_ms_p50"), ("TFLOPS/device", "tflops"),
    ("MFU", "mfu"), ("GPU peak GiB", "peak_allocated_gb"), ("host RSS GiB", "peak_rss_gb"),
    ("H2D GB/s", "offload_h2d_gbps"), ("D2H GB/s", "offload_d2h_gbps"), ("CPU update ms", "offload_cpu_update_ms"),
    ("update hidden", "offload_cpu_update_hidden_share"), ("host GB/B params", "host_gb_per_billion_params"),
]


def strategy_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    config = json.loads(json.dumps(STRATEGIES[name]))
    init = config.setdefault("init_args", {})
    init.update(param_dtype=args.param_dtype, activation_checkpointing=args.activation_checkpointing)
    if name.startswith("slide_fsdp"):
        init.update(window=args.window, activation_offload=args.activation_offload,
                    param_transfer=args.param_transfer, grad_sync=args.grad_sync)
    return config


def run(preset: str, strategy: str, repeat: int, args: argparse.Namespace, passthrough: list[str]) -> dict[str, Any]:
    """One ``fit`` of ``strategy`` on ``preset``: its outcome and results record, TFLOPS per device added."""
    out = args.out / f"{preset}-{strategy}-{repeat}"
    callbacks = [
        {"class_path": "callbacks.Throughput", "init_args": {"warmup_steps": args.warmup, "peak_tflops": args.peak_tflops}},
        {"class_path": "callbacks.Memory", "init_args": {"every_n_steps": 1}},
        {"class_path": "callbacks.OffloadStats", "init_args": {"warmup_steps": args.warmup}},
        {"class_path": "callbacks.Results", "init_args": {"run_name": f"{preset}-{strategy}"}},
    ]
    fit_args = [
        "--trainer.strategy", json.dumps(strategy_config(strategy, args)), "--trainer.callbacks", json.dumps(callbacks),
        "--trainer.accelerator", args.accelerator, "--trainer.devices", str(args.devices),
        "--trainer.max_steps", str(args.steps), "--trainer.limit_val_batches", "0", "--trainer.gradient_clip_val", "0",
        "--model.preset", preset, "--data.vocab_size", str(PRESETS[preset]["vocab_size"]),
        "--data.seq_len", str(args.seq_len), "--data.batch_size", str(args.batch_size),
        "--data.num_train_blocks", str(max(64, (args.steps + 2) * args.batch_size * args.devices)),
        "--data.num_val_blocks", "4", *passthrough,
    ]
    outcome = launch([REPO / "configs" / "quickstart.yaml"], fit_args, out, timeout_s=args.timeout)
    row: dict[str, Any] = dict(outcome)
    results = out / "results.jsonl"
    if outcome["status"] == "ok" and results.is_file():
        row.update(json.loads(results.read_text().splitlines()[-1]))
        if row.get("flops_per_token") and row.get("tokens_per_s"):
            row["tflops"] = row["flops_per_token"] * row["tokens_per_s"] / args.devices / 1e12
    # The benchmark's names last: the record's own `strategy` is fsdp2 with and without CPU offload.
    return {**row, "preset": preset, "strategy": strategy, "repeat": repeat}


def cell(spread: Spread | None) -> str:
    if spread is None:
        return ""
    return spread.format(".3g" if max(abs(spread.low), abs(spread.high)) < 1000 else ".0f")


def table(runs: list[dict[str, Any]]) -> str:
    """A row per (model, strategy): how many runs succeeded, then each figure's median (min-max) over them."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for result in runs:
        groups.setdefault((result["preset"], result["strategy"]), []).append(result)
    lines = ["| model | strategy | " + " | ".join(title for title, _ in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for (preset, strategy), group in groups.items():
        ok = [r for r in group if r["status"] == "ok"]
        errors = [str(r.get("error"))[:80] for r in group if r["status"] != "ok"]
        status = f"{len(ok)} of {len(group)} ok" + (f"; failed: {errors[-1]}" if errors else "")
        values = [status] + [cell(Spread.of(r.get(key) for r in ok)) for _, key in COLUMNS[1:]]
        lines.append(f"| {preset} | {strategy} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2-small"], choices=sorted(PRESETS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per process")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="optimizer steps left out of the figures")
    parser.add_argument("--activation-checkpointing", type=int, default=1)
    parser.add_argument("--window", type=int, default=2)
    parser.add_argument("--activation-offload", default="cpu", choices=["cpu", "none"])
    parser.add_argument("--param-transfer", default="full", choices=["full", "shard"])
    parser.add_argument("--grad-sync", default="gpu_reduce", choices=["gpu_reduce", "cpu_reduce"])
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak of one device for MFU (default: the GPU table)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every (model, strategy) row, in turns")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_offload")
    args, passthrough = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats} must be >= 1")
    results = []
    with open(args.out / "bench.jsonl", "a") as records:
        for repeat, (preset, strategy) in in_turns([(p, s) for p in args.presets for s in args.strategies], args.repeats):
            result = run(preset, strategy, repeat, args, passthrough)
            records.write(json.dumps(result, default=str) + "\n")
            records.flush()
            results.append(result)
            print(f"repeat {repeat}: " + table([result]).splitlines()[-1], flush=True)
            (args.out / "table.md").write_text(table(results) + "\n")
    text = table(results)
    print(text)
    return 0 if all(result["status"] == "ok" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
