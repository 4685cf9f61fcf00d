"""Does SlideFSDP's delayed update (DPU) train as well as the synchronous one, and how often does clipping fire (what
the speculative update's rollbacks cost)? Loss curves on the CPU, paired seeds.

Each seed trains the quickstart (gpt2-tiny on the embedded Markov data, clipping 1.0, its learning-rate schedule;
``--wikitext``: on WikiText-2 at the same shape) under SlideFSDP twice: the CPU update applied in the step
(``update: synchronous``) and one step late (``delayed``), the same data in the same order; ``--warmups`` adds delayed
arms whose first steps are updated synchronously (``delayed_update_warmup``), ``--speculative`` the speculative arm
(``update: speculative``: the synchronous steps, each rolled back and redone where clipping fires), ``--ordered`` the
ordered arms (``forward`` and ``split``: the synchronous steps, the updates after the norm in forward order). A JSON line per run
goes to ``--out`` as it ends (so a partial run is usable): the train loss and gradient norm per step, the steps the
speculative update rolled back, the validation losses. ``--table`` prints, from that file, each arm's mean and spread
over seeds, the paired difference (delayed - synchronous) against the spread between seeds of the synchronous arm
(seed noise), and the share of steps whose norm the clipping cut.

    python scripts/bench_delayed_update.py --seeds 1 2 3 --steps 300 --warmups 0 30 100
    python scripts/bench_delayed_update.py --seeds 1 --steps 500 --wikitext --speculative --out runs/clipping.jsonl
    python scripts/bench_delayed_update.py --seeds 1 --steps 500 --wikitext --ordered --out runs/ordered.jsonl
    python scripts/bench_delayed_update.py --seeds 1 2 3 --steps 300 --plain-torch
    python scripts/bench_delayed_update.py --table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import read_metrics  # noqa: E402  (the CSV reader the tests use)

MAX_NORM = 1.0  # the quickstart's gradient_clip_val
#: WikiText-2 at the quickstart's shape: configs/wikipedia.yaml's data (its byte-level BPE) with gpt2-tiny
WIKITEXT = ["--config", "configs/wikipedia.yaml", "--model.preset", "gpt2-tiny", "--data.seq_len", "128",
            "--data.batch_size", "8",  # the local copy the recorded tables used, not the config's Hub name
            "--data.train_path", str(ROOT.parent / "shared" / "data" / "wikitext2" / "train.json"),
            "--data.val_path", str(ROOT.parent / "shared" / "data" / "wikitext2" / "valid.json")]


def arm_name(warmup: int | None) -> str:
    """``synchronous`` (None), ``delayed``, or ``delayed, warm-up N``."""
    return "synchronous" if warmup is None else "delayed" + (f", warm-up {warmup}" if warmup else "")


#: The exact arms beside ``synchronous``: each takes the synchronous steps
EXACT_ARMS = ("speculative", "forward", "split")


def arm_knobs(arm: str) -> dict[str, str]:
    """The SlideFSDP knobs of an arm named by ``arm_name`` or in ``EXACT_ARMS``."""
    if arm in ("synchronous", *EXACT_ARMS):
        return {"update": arm}
    return {"update": "delayed", "delayed_update_warmup": arm.partition("warm-up ")[2] or "0"}


def run(seed: int, arm: str, steps: int, devices: int, folder: Path, learning_rate: float, wikitext: bool,
        knobs: dict[str, str] | None = None, environment: dict[str, str] | None = None) -> dict:
    """One fit of ``arm`` (its SlideFSDP ``knobs``, default ``arm_knobs(arm)``; ``environment`` added to the fit's);
    its losses, gradient norms and the steps its speculative update rolled back."""
    folder.mkdir(parents=True, exist_ok=True)
    callbacks = folder / "callbacks.yaml"
    # no checkpoints (they would apply a delayed update); OffloadStats logs each step's rollback
    callbacks.write_text(json.dumps({"trainer": {"callbacks": [{"class_path": "callbacks.OffloadStats"}]}}))
    knobs = [a for name, value in (knobs or arm_knobs(arm)).items() for a in (f"--trainer.strategy.init_args.{name}", value)]
    command = [sys.executable, "-m", "lit_fsdp", "fit", "--config", "configs/quickstart.yaml",
               *(WIKITEXT if wikitext else []),
               "--config", "configs/offload.yaml", "--config", str(callbacks), "--seed_everything", str(seed),
               "--trainer.max_steps", str(steps), "--model.learning_rate", str(learning_rate),
               "--trainer.devices", str(devices), "--trainer.log_every_n_steps", "1",
               "--trainer.gradient_clip_val", str(MAX_NORM),
               "--trainer.enable_checkpointing", "false", "--comm_profiler", "false",
               "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(folder),
               *knobs, "--trainer.default_root_dir", str(folder)]
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **(environment or {})})
    metrics = read_metrics(max(folder.glob("lightning_logs/version_*/metrics.csv")))
    return {"seed": seed, "arm": arm, "family": "lit_fsdp", "data": "wikitext2" if wikitext else "markov",
            "steps": steps, "learning_rate": learning_rate, "devices": devices, "train_loss": metrics["train/loss"],
            "grad_norm": metrics.get("train/grad_norm", []), "rollbacks": metrics.get("offload/rollbacks", []),
            "val_loss": metrics.get("val/loss", [])}


def clipping(rows: list[dict], early: int = 100) -> str:
    """Markdown: per run, the share of steps whose gradient norm the clipping cut (all, the first ``early``, the
    rest) and, for the speculative arm, the share of steps it rolled back (the same steps, counted by OffloadStats)."""
    lines = [f"| arm | seed | steps | clipping fired: all | first {early} | after | rolled back |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        norms = row.get("grad_norm") or []
        if not norms:
            continue
        fired = [norm + 1e-6 > MAX_NORM for norm in norms]
        share = (lambda xs: f"{sum(xs) / len(xs):.1%}" if xs else "n/a")
        rolled = f"{sum(row['rollbacks']) / len(row['rollbacks']):.1%}" if row.get("rollbacks") and row["arm"] in ("speculative", "split") else ""
        lines.append(f"| {row['arm']} | {row['seed']} | {len(norms)} | {share(fired)} | {share(fired[:early])} | "
                     f"{share(fired[early:])} | {rolled} |")
    return "\n".join(lines)


def plain_torch(seed: int, warmup: int | None, steps: int, learning_rate: float) -> dict:
    """The reference: the same model shape and data in plain torch (one process, AdamW as the quickstart configures it,
    clipping 1.0, linear warm-up and cosine decay), the gradient taken at the current weights or, delayed, at the
    weights one update old."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_fsdp.data.synthetic import SyntheticDataModule
    from lit_fsdp.presets import build_config

    torch.manual_seed(seed)
    data = SyntheticDataModule(vocab_size=512, seq_len=128, batch_size=8, seed=seed)
    data.setup("fit")
    model = AutoModelForCausalLM.from_config(build_config("gpt2-tiny", {"vocab_size": 512, "n_positions": 128}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30)
                                                 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    older = [p.detach().clone() for p in model.parameters()]
    losses, batches = [], iter(())
    for step in range(steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(data.train_dataloader())
            batch = next(batches)
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        late = warmup is not None and step >= warmup
        if late:  # the gradient at the weights one update old
            current = [p.detach().clone() for p in model.parameters()]
            with torch.no_grad():
                for p, old in zip(model.parameters(), older):
                    p.copy_(old)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if late:
            with torch.no_grad():
                for p, now in zip(model.parameters(), current):
                    p.copy_(now)
        older = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return {"seed": seed, "arm": arm_name(warmup), "family": "plain torch", "steps": steps,
            "learning_rate": learning_rate, "train_loss": losses, "val_loss": []}


def steps_behind(synchronous: list[list[float]], other: list[list[float]], window: int) -> int:
    """How many steps earlier the synchronous arm's loss reached the other arm's at its end, both averaged over their
    seeds and over ``window`` steps (a running mean): what the other arm's steps cost in progress."""
    def curve(runs):
        mean = [statistics.fmean(step) for step in zip(*runs)]
        return [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(len(mean))]

    reference, other = curve(synchronous), curve(other)
    target = other[-1]
    reached = next((i for i, value in enumerate(reference) if value <= target), len(reference) - 1)
    return len(other) - 1 - reached


def table(rows: list[dict], tail: int, reference: str = "synchronous") -> str:
    """Markdown: per arm the mean over seeds of the last ``tail`` steps' train loss and of the last validation loss,
    with their spreads, and the paired differences against the ``reference`` arm."""
    by = {(row["arm"], row["seed"]): row for row in rows}
    arms = [reference, *sorted({row["arm"] for row in rows} - {reference})]
    seeds = sorted({seed for arm, seed in by if all((a, seed) in by for a in arms)})
    if not seeds:
        return "no seed has every arm yet"

    def tail_loss(row):
        return statistics.fmean(row["train_loss"][-tail:])

    def last_val(row):  # nan where the run ended before its first validation
        return row["val_loss"][-1] if row["val_loss"] else float("nan")

    lines = [f"| arm | train loss, last {tail} steps | last validation loss | steps behind at the end (seed mean, "
             f"{tail}-step mean; the {reference} arm against itself: noise) |", "|---|---|---|---|"]
    for arm in arms:
        train = [tail_loss(by[arm, s]) for s in seeds]
        val = [last_val(by[arm, s]) for s in seeds]
        spread = (lambda xs: float("nan") if any(math.isnan(x) for x in xs)
                  else statistics.stdev(xs) if len(xs) > 1 else 0.0)
        behind = steps_behind([by[reference, s]["train_loss"] for s in seeds],
                              [by[arm, s]["train_loss"] for s in seeds], tail)
        lines.append(f"| {arm} | {statistics.fmean(train):.4f} ± {spread(train):.4f} | "
                     f"{statistics.fmean(val):.4f} ± {spread(val):.4f} | {behind} |")
    for arm in arms[1:]:
        diffs = [tail_loss(by[arm, s]) - tail_loss(by[reference, s]) for s in seeds]
        val_diffs = [last_val(by[arm, s]) - last_val(by[reference, s]) for s in seeds]
        lines.append(f"| {arm} - {reference}, paired | {statistics.fmean(diffs):+.4f} "
                     f"({', '.join(f'{d:+.4f}' for d in diffs)}) | {statistics.fmean(val_diffs):+.4f} "
                     f"({', '.join(f'{d:+.4f}' for d in val_diffs)}) | |")
    return "\n".join(lines) + f"\n\n{len(seeds)} seeds ({', '.join(map(str, seeds))}), {rows[0]['steps']} steps each."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--devices", type=int, default=1, help="CPU processes per run")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (the quickstart's: 3e-3)")
    parser.add_argument("--warmups", type=int, nargs="+", default=[0],
                        help="delayed arms: optimizer steps updated synchronously first (delayed_update_warmup)")
    parser.add_argument("--synchronous", action=argparse.BooleanOptionalAction, default=True,
                        help="run the synchronous arm too (off: add delayed arms to a file that has it)")
    parser.add_argument("--speculative", action="store_true", help="run the speculative arm too (update: speculative)")
    parser.add_argument("--ordered", action="store_true",
                        help="run the ordered arms too (update: forward and split: after the norm, in forward order)")
    parser.add_argument("--wikitext", action="store_true",
                        help="train on WikiText-2 (configs/wikipedia.yaml's data) at the quickstart's shape")
    parser.add_argument("--tail", type=int, default=50, help="steps the final train loss is averaged over")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_delayed_update.jsonl")
    parser.add_argument("--table", action="store_true", help="print the table from --out and stop")
    parser.add_argument("--plain-torch", action="store_true",
                        help="the reference instead: the same shape in plain torch, the gradient current or one step old")
    args = parser.parse_args()
    if args.plain_torch and (args.speculative or args.ordered):
        parser.error("--speculative and --ordered are SlideFSDP's modes: the plain-torch reference has only synchronous "
                     "and delayed arms")
    if not args.table:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as work:
            arms = ([None] if args.synchronous else []) + list(args.warmups)
            named = ([arm_name(warmup) for warmup in arms] + (["speculative"] if args.speculative else [])
                     + (["forward", "split"] if args.ordered else []))
            for seed in args.seeds:
                for arm, warmup in zip(named, arms + [None] * len(named)):
                    row = (plain_torch(seed, warmup, args.steps, args.lr) if args.plain_torch else
                           run(seed, arm, args.steps, args.devices, Path(work) / f"{arm}-{seed}", args.lr, args.wikitext))
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    print(f"seed {seed} {row['arm']}: last {args.tail} steps {statistics.fmean(row['train_loss'][-args.tail:]):.4f}",
                          flush=True)
    rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    for family in sorted({row.get("family", "lit_fsdp") for row in rows}):
        for data in sorted({row.get("data", "markov") for row in rows}):
            for rate in sorted({row["learning_rate"] for row in rows}, reverse=True):
                chosen = [row for row in rows if row.get("family", "lit_fsdp") == family
                          and row.get("data", "markov") == data and row["learning_rate"] == rate]
                if chosen:
                    print(f"\n{family}, {data}, learning rate {rate:g}\n")
                    print(table(chosen, args.tail))
                    print(f"\nclipping at {MAX_NORM:g}\n")
                    print(clipping(chosen))


if __name__ == "__main__":
    main()
