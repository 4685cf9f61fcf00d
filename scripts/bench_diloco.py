"""DiLoCo against synchronous training, measured fairly: every arm tuned, best against best, paired seeds.

Every arm sees the same tokens in the same steps (2 processes of BATCH sequences: the synchronous run's global batch is
2 x BATCH, each DiLoCo replica's BATCH), and ``--steps`` is a multiple of every H, so each run ends on a
synchronisation and validation scores the replicas' average on the whole validation set. Per arm, on the first seed,
the inner learning rate is swept on a sqrt(2) grid around ``--lr`` (and, for DiLoCo, the outer lr and momentum over
``--outer``); the best by validation loss then runs on every seed. Gaps are paired by seed against the synchronous
arm's best. Brackets: ``one_worker`` (one process at a replica's batch: half the tokens; DiLoCo with one replica at
outer lr 1 without momentum is the same run, since the average of one replica is itself).

Protocols: ``scratch`` (every arm from the same initialisation) and ``continue`` (DiLoCo's own: a synchronous run of
``--warm-steps`` steps per seed at ``--lr``, the first part of a ``--steps`` schedule, then every arm continues from
its checkpoint to ``--steps`` along that schedule at its own inner lr; bytes are counted on the continuation).

Every finished run is appended to ``OUT/results.jsonl`` at once, and runs already there are not run again, so a
partial sweep is usable and an interrupted one resumes. ``--table`` prints the markdown tables from that file.

    python scripts/bench_diloco.py --out runs/bench_diloco_fair                 # everything (hours: see docs/diloco.md)
    python scripts/bench_diloco.py --arms synchronous h32_int4 --seeds 1 --lr-points 1 --steps 64
    python scripts/bench_diloco.py --table --out runs/bench_diloco_fair
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from lit_fsdp.commands.sweep import REPO, last_values, launch

DATA = REPO.parent / "shared" / "data" / "wikitext2"
INT4 = {"method": "int8", "num_bits": 4}
#: name: (sync_every, the outer codec, streaming settings, outer (lr, momentum) candidates; None: --outer's)
DILOCO_ARMS: dict[str, tuple[int, dict, dict, list[tuple[float, float]] | None]] = {
    "h32_int4": (32, INT4, {}, None),
    "h128_int4": (128, INT4, {}, None),
    "h32_int3_ef": (32, {"method": "int8", "num_bits": 3, "error_feedback": True}, {}, None),
    # SparseLoCo's outer step is lr 1 without momentum: its decayed error feedback stands in for the momentum
    "h32_sparseloco": (32, {"method": "sparseloco"}, {}, [(1.0, 0.0)]),
    "h32_streaming": (32, INT4, {"fragments": 3, "delay": 2, "mix": 0.5}, None),
}
BRACKETS = ("one_worker",)
ARMS = ("synchronous", *BRACKETS, *DILOCO_ARMS)
PROTOCOLS = ("scratch", "continue")


def sync_every(arm: str, args: argparse.Namespace) -> int:
    """The arm's H (0: synchronous); ``--sync-every`` overrides every DiLoCo arm's (for short runs)."""
    if arm not in DILOCO_ARMS:
        return 0
    return args.sync_every or DILOCO_ARMS[arm][0]


def lr_point(args: argparse.Namespace, index: int) -> float:
    """The inner learning rate ``index`` sqrt(2) steps from ``--lr`` (rounded as the records name it)."""
    return round(args.lr * math.sqrt(2) ** index, 8)


def lr_grid(args: argparse.Namespace) -> list[float]:
    """``--lr-points`` inner learning rates on a sqrt(2) grid centred on ``--lr``."""
    half = args.lr_points // 2
    return [lr_point(args, i - half) for i in range(args.lr_points)]


def outer_grid(arm: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    if arm not in DILOCO_ARMS:
        return [(0.0, 0.0)]
    return DILOCO_ARMS[arm][3] or args.outer


def key(record: dict) -> tuple:
    return (record["protocol"], record["arm"], record["seed"], record["inner_lr"], record["outer_lr"],
            record["outer_momentum"])


def arm_arguments(arm: str, inner_lr: float, outer: tuple[float, float], args: argparse.Namespace) -> list[str]:
    """The command line of one arm beyond the shared settings."""
    strategy = "--trainer.strategy.init_args."
    arguments = ["--model.learning_rate", str(inner_lr)]
    if arm == "synchronous":
        return arguments
    if arm == "one_worker":
        return [*arguments, "--trainer.devices", "1"]
    _, codec, streaming, _ = DILOCO_ARMS[arm]
    settings = {"lr": outer[0], "momentum": outer[1], "codec": codec, **streaming}
    return [*arguments, "--config", str(REPO / "configs" / "diloco.yaml"), f"{strategy}sync_every",
            str(sync_every(arm, args)), f"{strategy}outer", json.dumps(settings)]


def shared_arguments(seed: int, args: argparse.Namespace) -> tuple[list[Path], list[str]]:
    configs = [REPO / "configs" / "quickstart.yaml"]
    data = []
    if args.data != "synthetic":
        configs.append(REPO / "configs" / "wikipedia.yaml")
        data = ["--data.train_path", str(Path(args.data) / "train.json"), "--data.val_path",
                str(Path(args.data) / "valid.json")]
    return configs, [
        *data, "--data.seq_len", str(args.seq_len), "--data.batch_size", str(args.batch_size),
        "--data.seed", str(seed), "--seed_everything", str(seed),
        "--model.config_overrides", json.dumps({"n_layer": args.layers, "n_embd": args.width, "n_head": 4}),
        "--model.warmup_steps", str(max(1, args.steps // 10)), "--trainer.max_steps", str(args.steps),
        "--trainer.val_check_interval", str(args.steps), "--trainer.check_val_every_n_epoch", "null",
        "--trainer.limit_val_batches", str(args.val_batches), "--trainer.num_sanity_val_steps", "0",
        "--trainer.devices", "2", "--trainer.accelerator", "cpu",
    ]


def warm_checkpoint(seed: int, args: argparse.Namespace) -> Path:
    """The ``continue`` protocol's synchronous start for ``seed``: ``--warm-steps`` steps, its last checkpoint."""
    out = args.out / "warm" / f"seed{seed}"
    checkpoint = out / "checkpoints" / "last.ckpt"
    if not checkpoint.exists():
        configs, shared = shared_arguments(seed, args)
        # the first warm_steps of the whole run's schedule: the arms go on along it, each at its own peak
        outcome = launch(configs, [*shared, "--model.learning_rate", str(args.lr), "--trainer.max_steps",
                                   str(args.warm_steps), "--model.schedule_steps", str(args.steps)], out)
        if outcome["status"] != "ok" or not checkpoint.exists():
            sys.exit(f"bench_diloco: the synchronous start of seed {seed} failed ({outcome['error']}); see {out}")
    return checkpoint


def run_one(protocol: str, arm: str, seed: int, inner_lr: float, outer: tuple[float, float],
            args: argparse.Namespace) -> dict[str, Any]:
    """One training run through ``python -m lit_fsdp fit``; its record (``failed`` on error)."""
    record = {"protocol": protocol, "arm": arm, "seed": seed, "inner_lr": inner_lr, "outer_lr": outer[0],
              "outer_momentum": outer[1], "sync_every": sync_every(arm, args), "steps": args.steps}
    name = f"{protocol}-{arm}-seed{seed}-lr{inner_lr:g}" + (f"-outer{outer[0]:g}-{outer[1]:g}" if arm in DILOCO_ARMS else "")
    out = args.out / "runs" / name
    configs, shared = shared_arguments(seed, args)
    resume = ["--ckpt_path", str(warm_checkpoint(seed, args))] if protocol == "continue" else []
    outcome = launch(configs, [*shared, *arm_arguments(arm, inner_lr, outer, args), *resume], out)
    if outcome["status"] != "ok":
        return {**record, "failed": outcome["error"]}
    metrics = last_values(max(out.glob("lightning_logs/version_*/metrics.csv")))
    if "val/loss" not in metrics:
        return {**record, "failed": "the run ended before its validation"}
    results = out / "results.jsonl"
    summary = json.loads(results.read_text().splitlines()[-1]) if results.exists() else {}
    return {**record, "wall_s": outcome["wall_s"], "val_loss": metrics["val/loss"], "val_ppl": metrics["val/ppl"],
            "val_loss_replica": metrics.get("val/loss_replica"), "train_loss": metrics.get("train/loss"),
            "compression_ratio": summary.get("compression_ratio") or 1.0, "outer_syncs": summary.get("outer_syncs"),
            "outer_bytes_per_value": summary.get("outer_bytes_per_value")}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def best(records: list[dict], protocol: str, arm: str, seed: int) -> dict | None:
    """The arm's tuning run with the lowest validation loss on ``seed`` (the first seed)."""
    tuned = [r for r in records if r["protocol"] == protocol and r["arm"] == arm and r["seed"] == seed and "failed" not in r]
    return min(tuned, key=lambda r: r["val_loss"], default=None)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every run of an OUT folder shares: records of other settings are not comparable with them."""
    return {name: getattr(args, name) for name in ("steps", "warm_steps", "sync_every", "layers", "width", "seq_len",
                                                     "batch_size", "val_batches", "data")}


def tune(protocol: str, arm: str, seed: int, args: argparse.Namespace, once: Callable[..., None]) -> dict | None:
    """The arm's best setting on ``seed``: the inner lr over the grid, extended by ``--lr-extend`` points past an edge
    that wins, then (``--outer-search after-inner``) the other outer candidates at that lr; ``grid``: every pair."""
    outers = outer_grid(arm, args)
    first = outers if args.outer_search == "grid" else outers[:1]
    half = args.lr_points // 2
    low, high = -half, args.lr_points - 1 - half
    for index in range(low, high + 1):
        for outer in first:
            once(protocol, arm, seed, lr_point(args, index), outer)
    # the points an earlier call added past the grid count against --lr-extend
    tried = [round(math.log(r["inner_lr"] / args.lr, math.sqrt(2))) for r in read(args.out / "results.jsonl")
             if (r["protocol"], r["arm"], r["seed"]) == (protocol, arm, seed)]
    extended = max(0, low - min(tried)) + max(0, max(tried) - high)
    low, high = min(low, *tried), max(high, *tried)
    for _ in range(max(0, args.lr_extend - extended) if args.lr_points >= 3 else 0):  # 1 or 2 points: no inside
        chosen = best(read(args.out / "results.jsonl"), protocol, arm, seed)
        if chosen is None or chosen["inner_lr"] not in (lr_point(args, low), lr_point(args, high)):
            break
        at_low = chosen["inner_lr"] == lr_point(args, low)
        low, high = (low - 1, high) if at_low else (low, high + 1)
        for outer in first:
            once(protocol, arm, seed, lr_point(args, low if at_low else high), outer)
    chosen = best(read(args.out / "results.jsonl"), protocol, arm, seed)
    if chosen is not None and args.outer_search == "after-inner":
        for outer in outers[1:]:
            once(protocol, arm, seed, chosen["inner_lr"], outer)
        chosen = best(read(args.out / "results.jsonl"), protocol, arm, seed)
    return chosen


def sweep(args: argparse.Namespace) -> None:
    results = args.out / "results.jsonl"
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [args.first_seed + i for i in range(args.seeds)]

    def once(protocol: str, arm: str, seed: int, inner_lr: float, outer: tuple[float, float]) -> None:
        probe = {"protocol": protocol, "arm": arm, "seed": seed, "inner_lr": inner_lr, "outer_lr": outer[0],
                 "outer_momentum": outer[1]}
        if key(probe) in {key(r) for r in read(results)}:
            return
        record = run_one(protocol, arm, seed, inner_lr, outer, args)
        print(json.dumps(record), flush=True)
        with open(results, "a") as f:
            f.write(json.dumps(record) + "\n")

    for protocol in args.protocols:
        for arm in args.arms:
            if protocol == "continue" and arm in BRACKETS:
                continue  # one process cannot continue a 2-process run's data stream at the same global batch
            chosen = tune(protocol, arm, seeds[0], args, once)
            if chosen is None:
                continue
            for seed in seeds[1:]:
                once(protocol, arm, seed, chosen["inner_lr"], (chosen["outer_lr"], chosen["outer_momentum"]))


def spread(values: list[float], signed: bool = True) -> str:
    """Mean ± sd over seeds: a signed gap to 2 decimals, or an unsigned share in whole percent."""
    sign, digits = ("+", 2) if signed else ("", 0)
    mean = f"{statistics.fmean(values):{sign}.{digits}f}%"
    return f"{mean} ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else f"{mean} (one seed)"


def table(records: list[dict]) -> str:
    """Per protocol, one row per arm at its best setting: loss and perplexity gaps paired by seed, with spreads."""
    out = []
    for protocol in PROTOCOLS:
        mine = [r for r in records if r["protocol"] == protocol and "failed" not in r]
        if not mine:
            continue
        first = min(r["seed"] for r in mine)
        chosen = {arm: best(mine, protocol, arm, first) for arm in ARMS}
        runs = {arm: [r for r in mine if r["arm"] == arm and c is not None and
                      (r["inner_lr"], r["outer_lr"], r["outer_momentum"]) == (c["inner_lr"], c["outer_lr"], c["outer_momentum"])]
                for arm, c in chosen.items()}
        base = {r["seed"]: r for r in runs["synchronous"]}
        single = {r["seed"]: r for r in runs["one_worker"]}
        out += [f"**{protocol}**", "",
                "| arm | H | best inner lr | outer lr, momentum | seeds | val loss | loss gap vs synchronous | "
                "ppl gap vs synchronous | the second worker's gain kept | bytes vs per-step fp32 | tuning runs | "
                "inner lrs tried |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm in ARMS:
            if not runs[arm]:
                continue
            c, paired = chosen[arm], [r for r in runs[arm] if r["seed"] in base]
            loss_gap = [100 * (r["val_loss"] / base[r["seed"]]["val_loss"] - 1) for r in paired]
            ppl_gap = [100 * (r["val_ppl"] / base[r["seed"]]["val_ppl"] - 1) for r in paired]
            # one worker's loss less the arm's, over one worker's less the synchronous pair's: 100% is synchronous
            kept = [100 * (single[r["seed"]]["val_loss"] - r["val_loss"])
                    / (single[r["seed"]]["val_loss"] - base[r["seed"]]["val_loss"]) for r in paired if r["seed"] in single]
            outer = f"{c['outer_lr']:g}, {c['outer_momentum']:g}" if arm in DILOCO_ARMS else "-"
            tried = sum(r["arm"] == arm and r["seed"] == first for r in mine)
            lrs = sorted({r["inner_lr"] for r in mine if r["arm"] == arm and r["seed"] == first})
            out.append(
                f"| {arm} | {c['sync_every'] or '-'} | {c['inner_lr']:.3g} | {outer} | {len(runs[arm])} "
                f"| {statistics.fmean(r['val_loss'] for r in runs[arm]):.4f} "
                f"| {spread(loss_gap) if arm != 'synchronous' and loss_gap else '-'} "
                f"| {spread(ppl_gap) if arm != 'synchronous' and ppl_gap else '-'} "
                f"| {spread(kept, signed=False) if arm in DILOCO_ARMS and kept else '-'} "
                f"| {statistics.fmean(r['compression_ratio'] for r in runs[arm]):.0f}x | {tried} "
                f"| {len(lrs)}: {lrs[0]:.3g} to {lrs[-1]:.3g} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    parser.add_argument("--seeds", type=int, default=3, help="paired seeds; tuning runs on the first")
    parser.add_argument("--first-seed", type=int, default=1234)
    parser.add_argument("--steps", type=int, default=1024, help="optimizer steps; a multiple of every H")
    parser.add_argument("--warm-steps", type=int, default=512, help="continue: the synchronous start's steps")
    parser.add_argument("--sync-every", type=int, default=0, help="every DiLoCo arm's H instead of its own (short runs)")
    parser.add_argument("--lr", type=float, default=2e-3, help="the centre of the inner learning-rate grid")
    parser.add_argument("--lr-points", type=int, default=5, help="points of the sqrt(2) grid")
    parser.add_argument("--lr-extend", type=int, default=2,
                        help="points added past the grid's edge while the best inner lr lies on it")
    parser.add_argument("--outer-search", choices=["after-inner", "grid"], default="after-inner",
                        help="DiLoCo: the outer candidates at the best inner lr of the first (after-inner), or every pair")
    parser.add_argument("--outer", type=lambda text: tuple(float(v) for v in text.split(",")), nargs="+",
                        default=[(1.0, 0.0), (0.7, 0.9), (0.7, 0.5), (1.0, 0.5)], metavar="LR,MOMENTUM",
                        help="outer (lr, momentum) candidates for the DiLoCo arms (Nesterov)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="per process: a replica's batch")
    parser.add_argument("--val-batches", type=int, default=40, help="per process")
    parser.add_argument("--data", default=str(DATA), help="folder with train.json and valid.json, or 'synthetic'")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_diloco_fair")
    parser.add_argument("--table", action="store_true", help="print the tables from OUT/results.jsonl and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table(read(args.out / "results.jsonl")))
        return
    for protocol in args.protocols:
        length = args.steps - (args.warm_steps if protocol == "continue" else 0)
        odd = [arm for arm in args.arms if sync_every(arm, args) and length % sync_every(arm, args)]
        if odd or length <= 0:
            sys.exit(f"bench_diloco: {protocol} trains {length} steps, not a positive multiple of H "
                     f"{sync_every(odd[0], args) if odd else ''} ({odd[0] if odd else 'warm-steps >= steps'}); "
                     "give --steps (and --warm-steps) so every arm ends on a synchronisation")
    if args.data != "synthetic" and not (Path(args.data) / "train.json").is_file():
        sys.exit(f"bench_diloco: {Path(args.data) / 'train.json'} not found; pass --data FOLDER or --data synthetic")
    marker = args.out / "settings.json"
    if marker.exists() and json.loads(marker.read_text()) != settings(args):
        sys.exit(f"bench_diloco: {args.out} holds runs of other settings ({marker.read_text().strip()}); "
                 "give the same settings or another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(settings(args)) + "\n")
    sweep(args)
    print(table(read(args.out / "results.jsonl")))


if __name__ == "__main__":
    main()
