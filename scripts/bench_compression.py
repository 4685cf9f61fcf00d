"""Quality and bytes of every compression method on real text (WikiText-2), 2 processes, fixed steps.

For each method config in ``configs/`` (and several seeds for the main ones) this trains the same
small GPT-2-shaped model with ``python -m lit_fsdp fit`` and reports: final validation perplexity,
its change against ``none`` (mean and spread over seeds), the measured compression ratio against
float32 and bfloat16 gradients (from the communicator's byte counters), and compress + decompress
time per step. Runs that fail are recorded as failed and the sweep goes on.

    python scripts/bench_compression.py                      # all methods, as in the issue note
    python scripts/bench_compression.py --methods baseline int8 --seeds 1 --steps 50
    python scripts/bench_compression.py --methods thresholdv --set threshold=7e-4   # a row "thresholdv threshold=7e-4"
    python scripts/bench_compression.py --methods offload offload_bf16_moments   # SlideFSDP's host AdamW moments
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import yaml
from lit_fsdp.commands.sweep import METHODS, REPO, last_values, launch

DATA = REPO.parent / "shared" / "data" / "wikitext2"
#: torch's own PowerSGD DDP hook at configs/powersgd.yaml's rank and start step: the reference for ``powersgd``
TORCH_POWERSGD = "torch_powersgd"
#: SlideFSDP's host AdamW with float32 and with bfloat16 moments, no compression: the cost of optimizer_state_dtype
OFFLOAD = {"offload": "float32", "offload_bf16_moments": "bfloat16"}
CHOICES = [*METHODS, TORCH_POWERSGD, *OFFLOAD]
SEMI_SYNCHRONOUS = ("diloco", "diloco_streaming", "diloco_sparseloco")  # --set keys are the strategy's: sync_every=8, outer.codec.method=none
MULTI_SEED = ("baseline", "int8", "topk", "dgc", "powersgd", TORCH_POWERSGD)


def powersgd_settings() -> dict:
    """configs/powersgd.yaml's compression block."""
    config = yaml.safe_load((REPO / "configs" / "powersgd.yaml").read_text())
    return config["trainer"]["strategy"]["init_args"]["compression"]


def torch_powersgd_strategy() -> list[str]:
    """Arguments that run DDP with torch's PowerSGD hook at our config's rank and start step."""
    settings = powersgd_settings()
    strategy = {"class_path": "lit_fsdp.ddp.DDPStrategy",
                "init_args": {"torch_powersgd_rank": settings["rank"], "torch_powersgd_start_step": settings["start_step"]}}
    return ["--trainer.strategy", json.dumps(strategy)]


def offload_strategy(method: str) -> list[str]:
    """Arguments that run SlideFSDP (host AdamW, moments in the method's dtype) in place of FSDP2."""
    strategy = {"class_path": "offload.SlideFSDPStrategy", "init_args": {"optimizer_state_dtype": OFFLOAD[method]}}
    return ["--trainer.strategy", json.dumps(strategy)]


def torch_powersgd_ratio(args: argparse.Namespace, steps: int) -> float:
    """Values of DDP's fp32 all-reduce over the values torch's hook all-reduces, over the run (dense steps included).

    torch compresses a parameter viewed as ``shape[0] x rest`` at rank ``r = min(r, rows, cols)`` when
    ``(rows + cols) r x 2 < rows cols`` (its ``min_compression_rate``), and sends the rest uncompressed.
    """
    from lit_fsdp.presets import build_config
    from transformers import AutoModelForCausalLM

    settings = powersgd_settings()
    vocab = yaml.safe_load((REPO / "configs" / "wikipedia.yaml").read_text())["data"]["init_args"]["vocab_size"]
    config = build_config("gpt2-small", {"n_layer": args.layers, "n_embd": args.width, "n_head": 4, "vocab_size": vocab})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    dense = sent = 0
    for parameter in model.parameters():
        dense += parameter.numel()
        rows = parameter.shape[0]
        cols = parameter.numel() // rows
        rank = min(settings["rank"], rows, cols)
        compressed = parameter.dim() > 1 and (rows + cols) * rank * 2 < rows * cols
        sent += (rows + cols) * rank if compressed else parameter.numel()
    start = min(settings["start_step"], steps)
    return steps * dense / (start * dense + (steps - start) * sent)


def row_name(method: str, settings: list[str]) -> str:
    """The table's name for ``method`` run with ``--set`` overrides: ``thresholdv threshold=7e-4``."""
    return " ".join([method, *settings])


def method_of(name: str) -> str:
    """The method a row name (``row_name``) was run with."""
    return name.split(" ")[0]


def run_one(method: str, seed: int, args: argparse.Namespace, root: Path) -> dict:
    """One training run; its final metrics, or ``{"failed": reason}``."""
    name = row_name(method, args.set)
    out = root / f"{name.replace(' ', '-')}-seed{seed}"
    overrides = []
    # compression parameters; for the semi-synchronous configs, the strategy's (sync_every=8, outer.codec.method=none)
    prefix = "--trainer.strategy.init_args." + ("" if method in SEMI_SYNCHRONOUS else "compression.")
    for setting in args.set:
        key, _, value = setting.partition("=")
        overrides += [f"{prefix}{key}", value]
    # torch's PowerSGD and SlideFSDP: the baseline's callbacks, its strategy replaced
    uncompressed = method == TORCH_POWERSGD or method in OFFLOAD
    names = ["quickstart.yaml", "wikipedia.yaml", "baseline.yaml" if uncompressed else f"{method}.yaml"]
    configs = [REPO / "configs" / name for name in names]
    outcome = launch(configs, [
        *(torch_powersgd_strategy() if method == TORCH_POWERSGD else []),
        *(offload_strategy(method) if method in OFFLOAD else []),
        *overrides,
        "--data.train_path", str(args.data / "train.json"),
        "--data.val_path", str(args.data / "valid.json"),
        "--data.seq_len", str(args.seq_len), "--data.batch_size", str(args.batch_size),
        "--data.seed", str(seed), "--seed_everything", str(seed),
        "--model.config_overrides", json.dumps({"n_layer": args.layers, "n_embd": args.width, "n_head": 4}),
        "--model.learning_rate", str(args.lr), "--model.warmup_steps", str(args.steps // 10),
        "--trainer.max_steps", str(args.steps),
        "--trainer.val_check_interval", str(args.steps), "--trainer.limit_val_batches", str(args.val_batches),
        "--trainer.enable_checkpointing", "false",
        # Named explicitly: a logger class switched on the command line keeps the default logger's name (null).
    ], out)
    if outcome["status"] == "failed":
        return {"method": name, "seed": seed, "failed": outcome["error"]}
    metrics = last_values(next(out.glob("lightning_logs/version_*/metrics.csv")))
    if "val/loss" not in metrics:  # Lightning ends a run it got SIGTERM in with exit code 0, before the validation
        return {"method": name, "seed": seed, "failed": "the run ended before its validation (stopped from outside?)"}
    record = {
        "method": name, "seed": seed, "wall_s": outcome["wall_s"],
        "val_loss": metrics["val/loss"], "val_ppl": metrics["val/ppl"], "train_loss": metrics["train/loss"],
        "tokens_per_s": json.loads((out / "throughput.json").read_text())["tokens_per_s"],
    }
    compression = out / "compression.json"
    if compression.exists():
        report = json.loads(compression.read_text())
        record.update(
            ratio_vs_fp32=report["compress/ratio_vs_fp32"], ratio_vs_bf16=report["compress/ratio_vs_bf16"],
            ratio_after_warmup=report.get("ratio_after_warmup"), warmup_steps=report.get("warmup_steps", 0),
            codec_ms_per_step=1000 * (report["compress_s"] + report["decompress_s"]) / args.steps,
            config=report["config"],
        )
    elif method == TORCH_POWERSGD:  # against DDP's fp32 all-reduce (the others: against FSDP2's fp32 reduce-scatter)
        ratio = torch_powersgd_ratio(args, args.steps)
        record.update(ratio_vs_fp32=ratio, ratio_vs_bf16=ratio / 2, codec_ms_per_step=float("nan"))
    else:  # no hook: FSDP2's own float32 reduce-scatter (SlideFSDP's on CPU)
        record.update(ratio_vs_fp32=1.0, ratio_vs_bf16=0.5, codec_ms_per_step=0.0)
    return record


def table(records: list[dict]) -> str:
    """Markdown: one row per method, perplexity change against the baseline's mean."""
    ok = [r for r in records if "failed" not in r]
    # Changes are paired by seed (same init and data order), which removes most seed-to-seed spread.
    base = {r["seed"]: r["val_ppl"] for r in ok if r["method"] == "baseline"}
    base_mean = statistics.fmean(base.values()) if base else float("nan")
    lines = [
        "| method | seeds | val ppl | change vs none, paired by seed (mean ± sd) | ratio vs fp32 | after warm-up "
        "| ratio vs bf16 | codec ms/step | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    # each method, then its runs with --set overrides
    for method in sorted({r["method"] for r in records}, key=lambda name: (CHOICES.index(method_of(name)), name)):
        runs = [r for r in ok if r["method"] == method]
        failed = [r for r in records if r["method"] == method and "failed" in r]
        if failed and not runs:
            lines.append(f"| {method} | failed: {failed[0]['failed'][:80]} | | | | | | | |")
            continue
        if not runs:
            continue
        ppl = [r["val_ppl"] for r in runs]
        if base:
            change = [100 * (r["val_ppl"] / base.get(r["seed"], base_mean) - 1) for r in runs]
            spread = f"{statistics.stdev(change):.2f}" if len(change) > 1 else "n/a (one seed)"
            change_text = f"{statistics.fmean(change):+.2f}% ± {spread}"
            unpaired = sum(r["seed"] not in base for r in runs)
            if unpaired:  # no baseline run of that seed: compared with the baseline's mean instead, and said so
                change_text += f" ({unpaired} of {len(runs)} against the baseline mean: no baseline run of that seed)"
        else:
            change_text = "no baseline run"
        lines.append(
            f"| {method} | {len(runs)} | {statistics.fmean(ppl):.2f} | {change_text} "
            f"| {statistics.fmean(r['ratio_vs_fp32'] for r in runs):.2f}x "
            f"| {after_warmup(runs)} "
            f"| {statistics.fmean(r['ratio_vs_bf16'] for r in runs):.2f}x "
            f"| {statistics.fmean(r['codec_ms_per_step'] for r in runs):.1f} "
            f"| {statistics.fmean(r['tokens_per_s'] for r in runs):.0f} |"
        )
    return "\n".join(lines)


def after_warmup(runs: list[dict]) -> str:
    """The ratio vs fp32 over the steps after the method's warm-up, and the warm-up's length; '-' without one."""
    warmup = runs[0].get("warmup_steps") or 0
    ratios = [r.get("ratio_after_warmup") for r in runs]
    if not warmup or None in ratios:
        return "-"
    return f"{statistics.fmean(ratios):.2f}x (from step {warmup})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=CHOICES, choices=CHOICES)
    parser.add_argument("--seeds", type=int, default=3, help=f"seeds for {', '.join(MULTI_SEED)}; others run once")
    parser.add_argument("--first-seed", type=int, default=1234, help="seeds are FIRST_SEED, FIRST_SEED + 1, ...")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--val-batches", type=int, default=40)
    parser.add_argument("--data", type=Path, default=DATA, help="folder with train.json and valid.json")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_compression")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="override the methods' compression settings (e.g. threshold=7e-4); the row is named after them")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from OUT/results.jsonl")
    args = parser.parse_args()
    if args.report_only:
        records = [json.loads(line) for line in open(args.out / "results.jsonl")]
        print(table(records))
        return
    if malformed := [setting for setting in args.set if "=" not in setting]:
        sys.exit(f"bench_compression: --set {malformed[0]} is not KEY=VALUE; e.g. --set threshold=7e-4")
    if args.set and {"baseline", TORCH_POWERSGD, *OFFLOAD} & set(args.methods):
        sys.exit("bench_compression: --set applies to compression methods; run baseline, torch_powersgd and offload "
                 "without it")
    if not (args.data / "train.json").is_file():
        sys.exit(f"bench_compression: {args.data / 'train.json'} not found; pass --data FOLDER with train.json and valid.json")
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for method in args.methods:
        for seed in range(args.seeds if method in MULTI_SEED else 1):
            record = run_one(method, args.first_seed + seed, args, args.out)
            records.append(record)
            print(json.dumps(record, default=str), flush=True)
            with open(args.out / "results.jsonl", "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
    markdown = table(records)
    (args.out / "table.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
