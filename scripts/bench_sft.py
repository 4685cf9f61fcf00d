"""Fine-tuning quality on CPU: full fine-tuning, LoRA, LoRA with packing, and LoRA with the embeddings and norms trained
beside the adapters, from one pretrained folder.

Each run trains with a shipped config (configs/sft_full.yaml, configs/sft_lora.yaml) on the reverse-words sample and
is then scored by ``evaluate`` on its validation file: the loss over the answer tokens and the exact match of greedy
answers, beside the base model's. The base is a folder ``export`` wrote from a pretraining run (docs/finetuning.md):

    python -m lit_fsdp fit --config configs/quickstart.yaml --config configs/wikipedia.yaml --trainer.default_root_dir runs/sft_base_run
    python -m lit_fsdp export runs/sft_base_run/checkpoints/last.ckpt runs/sft_base
    python scripts/bench_sft.py --base runs/sft_base --out runs/sft_bench

Each finished piece is appended to <out>/results.jsonl, so a stopped benchmark keeps what it measured and a rerun
skips it; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lit_fsdp from this checkout

REPO = Path(__file__).resolve().parents[1]
VAL = REPO / "lit_fsdp" / "data" / "samples" / "reverse_words" / "val.jsonl"
#: name -> (config, extra fit arguments)
RUNS = {
    "full": ("sft_full.yaml", []),
    "lora": ("sft_lora.yaml", ["--data.packing", "false"]),
    "lora_packed": ("sft_lora.yaml", []),
    # the embeddings (tied to the head) and norms trained beside the adapters: what closed the gap in compare_lora.py
    "lora_trained": ("sft_lora.yaml", ["--model.lora", "{rank: 16, alpha: 32, dropout: 0.0, train: [embeddings, norms]}"]),
}


def done(results: Path) -> dict[str, dict]:
    if not results.is_file():
        return {}
    return {record["name"]: record for record in map(json.loads, results.read_text().splitlines()) if record}


def evaluate(target: Path) -> dict:
    """``evaluate``'s result for ``target`` (a checkpoint or a Hugging Face folder) on the validation answers."""
    from lit_fsdp.commands.evaluate import EvaluationData, evaluate as evaluate_command

    return evaluate_command(str(target), EvaluationData(str(VAL)), batch_size=32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the pretrained Hugging Face folder to fine-tune")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "sft_bench", help="run folders and results.jsonl")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    if not (args.base / "config.json").is_file():
        raise SystemExit(f"--base {args.base} has no config.json: make it with the commands in this script's docstring")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    if "base" not in done(results):
        record = {"name": "base", **evaluate(args.base)}
        with results.open("a") as f:
            f.write(json.dumps(record) + "\n")
    for name in args.runs:
        if name in done(results):
            continue
        config, extra = RUNS[name]
        folder = args.out / name
        steps = ["--trainer.max_steps", str(args.steps)] if args.steps else []
        subprocess.run([sys.executable, "-m", "lit_fsdp", "fit", "--config", f"configs/{config}", "--model.pretrained_path",
                        str(args.base), *extra, *steps, "--trainer.enable_progress_bar", "false",
                        "--trainer.default_root_dir", str(folder)], cwd=REPO, check=True)
        run = json.loads((folder / "results.jsonl").read_text().splitlines()[-1])
        record = {"name": name, "config": config, "extra": extra, **evaluate(folder / "checkpoints" / "last.ckpt"),
                  "tokens_per_s": run.get("tokens_per_s"), "peak_rss_gb": run.get("peak_rss_gb"),
                  "train_s": run.get("train_time_s") or run.get("wall_s")}
        with results.open("a") as f:
            f.write(json.dumps(record) + "\n")
    table(done(results))


def table(records: dict[str, dict]) -> None:
    base = records.get("base")
    full_gain = base and "full" in records and base["loss"] - records["full"]["loss"]
    print("| run | answer loss | exact match | loss gain over the base | share of full fine-tuning's gain |")
    print("|---|---|---|---|---|")
    for name, record in records.items():
        gain = base["loss"] - record["loss"] if base else None
        share = f"{gain / full_gain:.0%}" if full_gain and name not in ("base", "full") else ""
        print(f"| {name} | {record['loss']:.3f} | {record['exact_match']:.1%} | "
              f"{'' if name == 'base' else f'{gain:.3f}'} | {share} |")


if __name__ == "__main__":
    main()
