"""Does float8 compute (``--model.float8``, torchao's Float8Linear on the blocks' linear layers) train as the unconverted
model does? WikiText-2 loss curves on the CPU, where torchao emulates float8: numerics only, never speed.

Each seed trains llama-tiny (torchtitan's float8 converts nn.Linear; GPT-2's blocks are Conv1D) on WikiText-2
(configs/wikipedia.yaml's data and byte-level BPE, 128 tokens x 8 sequences a step) once per arm, the same data in the
same order: unconverted, float8 tensorwise and float8 rowwise. The compute is float32 by default: a CPU without
bfloat16 matmuls emulates them 20x slower, and on a GPU the unconverted arm would be bf16 (``--param-dtype
bfloat16`` there). A JSON line per run goes to ``--out`` as it ends; the table gives each arm's mean train loss over
the last ``--tail`` steps, its last validation loss, and its largest and final-window gaps to the unconverted arm.
Needs torchao in the running interpreter (``pip install -e ".[float8]"``).

    python scripts/bench_float8.py --steps 300 --out runs/bench_float8.jsonl
    python scripts/bench_float8.py --table --out runs/bench_float8.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import paired_runs  # noqa: E402
from tests.helpers import read_metrics  # noqa: E402  (the CSV reader the tests use)

REFERENCE = "unconverted"
ARMS = {REFERENCE: "off", "float8 tensorwise (emulated)": "tensorwise", "float8 rowwise (emulated)": "rowwise"}
WIKITEXT = ["--config", "configs/quickstart.yaml", "--config", "configs/wikipedia.yaml", "--model.preset", "llama-tiny",
            "--data.seq_len", "128", "--data.batch_size", "8",  # the local copy the recorded table used, not the Hub's
            "--data.train_path", str(ROOT.parent / "shared" / "data" / "wikitext2" / "train.json"),
            "--data.val_path", str(ROOT.parent / "shared" / "data" / "wikitext2" / "valid.json")]


def run(seed: int, arm: str, steps: int, folder: Path, learning_rate: float, param_dtype: str) -> dict:
    """One single-process fit of ``arm`` under FSDP2; its per-step train losses and its validation losses."""
    folder.mkdir(parents=True, exist_ok=True)
    callbacks = folder / "callbacks.yaml"
    callbacks.write_text(json.dumps({"trainer": {"callbacks": []}}))  # no checkpoints: the losses are the product
    command = [sys.executable, "-m", "lit_fsdp", "fit", *WIKITEXT, "--config", str(callbacks),
               "--seed_everything", str(seed), "--model.float8", ARMS[arm], "--model.learning_rate", str(learning_rate),
               "--trainer.max_steps", str(steps), "--trainer.devices", "1", "--trainer.log_every_n_steps", "1",
               "--trainer.val_check_interval", str(min(100, steps)), "--trainer.enable_progress_bar", "false",
               "--trainer.enable_checkpointing", "false", "--comm_profiler", "false",
               "--trainer.strategy.init_args.param_dtype", param_dtype,
               "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(folder),
               "--trainer.default_root_dir", str(folder)]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    metrics = read_metrics(max(folder.glob("lightning_logs/version_*/metrics.csv")))
    return {"seed": seed, "arm": arm, "recipe": ARMS[arm], "preset": "llama-tiny", "data": "wikitext2", "steps": steps,
            "learning_rate": learning_rate, "param_dtype": param_dtype, "seconds": time.perf_counter() - start,
            "train_loss": metrics["train/loss"], "val_loss": metrics.get("val/loss", [])}


def table(rows: list[dict], tail: int) -> str:
    """Markdown: per arm and seed the mean train loss over the last ``tail`` steps, the last validation loss, and the
    gaps to the seed's unconverted run (largest per step, and of the ``tail``-step means)."""
    reference = {row["seed"]: row for row in rows if row["arm"] == REFERENCE}
    lines = [f"| arm | seed | steps | train loss, last {tail} steps | last validation loss | largest per-step gap | "
             f"gap of the last-{tail} means | wall s |", "|---|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (r["seed"], list(ARMS).index(r["arm"]))):
        mean = statistics.fmean(row["train_loss"][-tail:])
        val = f"{row['val_loss'][-1]:.4f}" if row["val_loss"] else "n/a"
        base = reference.get(row["seed"])
        if base is None or row is base:
            gaps = ("", "")
        else:
            steps = list(zip(row["train_loss"], base["train_loss"]))
            gaps = (f"{max(abs(a - b) for a, b in steps):.4f}",
                    f"{mean - statistics.fmean(base['train_loss'][-tail:]):+.4f}")
        lines.append(f"| {row['arm']} | {row['seed']} | {len(row['train_loss'])} | {mean:.4f} | {val} | {gaps[0]} | "
                     f"{gaps[1]} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    paired_runs.arguments(parser, [1], 300, 1e-3, "configs/wikipedia.yaml", list(ARMS), ROOT / "runs" / "bench_float8.jsonl")
    parser.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the strategy's param_dtype in every arm (bfloat16: on hardware with bf16 matmuls)")
    args = parser.parse_args()
    rows = paired_runs.run_all(args, lambda seed, arm, folder: run(seed, arm, args.steps, folder, args.lr,
                                                                   args.param_dtype))
    print(table(rows, args.tail))


if __name__ == "__main__":
    main()
