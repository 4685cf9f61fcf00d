"""The lines a run ends with: its final losses, speed and where its results went (from its results.jsonl record)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The files a run folder may hold, in the order they are worth reading.
RESULT_FILES = ("results.jsonl", "history.jsonl", "throughput.json", "compression.json", "comm_profile.json",
                "host_syncs.json", "environment.json", "config.yaml")
#: How a run goes on from its newest checkpoint: a run's last line says it, at its end or after an interrupt.
RESUME = "resume with --ckpt_path last"


def summary_lines(record: dict[str, Any], folder: Path, checkpoints: Path | None = None) -> list[str]:
    """Two or three lines: ``done: 300 steps; train loss 1.234, val loss 1.456 (ppl 4.29); 812 tokens/s, MFU
    41.2%``, the run folder and its result files, and ``checkpoints``, the folder a ModelCheckpoint saves to (its
    last save comes after this summary)."""
    figures = [f"{record.get('steps')} steps"]
    losses = [f"{name} {record[key]:.4f}" for key, name in (("train_loss", "train loss"), ("val_loss", "val loss"))
              if isinstance(record.get(key), (int, float))]
    if isinstance(record.get("val_ppl"), (int, float)):
        losses[-1] += f" (ppl {record['val_ppl']:.2f})"
    figures.append(", ".join(losses) or "no loss logged")
    speed = [f"{record['tokens_per_s']:,.0f} tokens/s"] if isinstance(record.get("tokens_per_s"), (int, float)) else []
    if isinstance(record.get("mfu"), (int, float)):
        speed.append(f"MFU {record['mfu']:.1%}")
    elif speed:
        speed.append("MFU unknown (no peak TFLOPS for this device)")
    figures += [", ".join(speed)] if speed else []
    status = "done" if record.get("status", "ok") == "ok" else f"failed ({record.get('error')})"
    files = [name for name in RESULT_FILES if (folder / name).is_file()]
    lines = [f"run {record.get('run_name')} {status}: {'; '.join(figures)}",
             f"run folder {folder.resolve()}: {', '.join(files) or 'no result files'}"]
    if checkpoints is not None:
        lines.append(f"checkpoints in {checkpoints.resolve()} ({RESUME})")
    return lines
