"""Methods x strategies x seeds x world sizes, one ``python -m lit_fsdp fit`` subprocess each; every run recorded, failures too.

Each run trains in ``OUT/<method>-w<world>-s<seed>/``, its ``default_root_dir``: ``results.jsonl``,
``history.jsonl``, ``throughput.json``, ``compression.json``, ``stdout.log`` and ``stderr.log`` land
there. Its configs are the ``--config`` files (default ``configs/quickstart.yaml``), then
``configs/<method>.yaml`` (or METHOD itself when it is a YAML path), then every argument this script
does not know, passed to ``lit_fsdp fit`` as it is (``--trainer.max_steps 100``, ``--trainer.accelerator
gpu``). The world size is ``--trainer.devices`` on one node, the seed ``--seed_everything``. The run's
callbacks are its configs' list with ``Results`` (named ``<method>-w<world>-s<seed>-<time>``),
``Quality``, ``Throughput`` and ``CompressionStats`` added where missing; it logs to CSV in its folder
unless ``--trainer.logger`` says otherwise. Each run appends a line to
``OUT/sweep.jsonl``: status ok or failed, return code, last error line, wall time, command. A failed run
does not stop the sweep. Compare the runs with ``python scripts/compare_runs.py OUT``.

``--strategies`` runs the same model and data under several strategies (``ddp``: the whole model on each
rank, each FSDP2 sharding mode, ``slide_fsdp``); without ``--methods`` they run on the base configs alone,
in ``OUT/<strategy>-w<world>-s<seed>/``. Compare them with ``compare_runs.py OUT --baseline ddp``.

    python scripts/sweep.py --methods baseline int8 topk --seeds 1234 1235 --world-sizes 2 --trainer.max_steps 200
    python scripts/sweep.py --strategies ddp fsdp2 fsdp2_shard_grad_op fsdp2_no_shard slide_fsdp --trainer.max_steps 50
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence, get_args

import yaml

from lit_fsdp.commands.cli import CALLBACKS
from lit_fsdp.commands.launch import launch  # bench scripts import it from here too
from lit_fsdp.strategy import FSDP2Strategy, Sharding

REPO = Path(__file__).resolve().parents[2]

# the configs that set a gradient compression, or semi-synchronous training's outer exchange
METHODS = [p.stem for p in sorted(REPO.glob("configs/*.yaml"))
           if "compression:" in p.read_text() or "sync_every:" in p.read_text()]
# --strategies: named as the results records name them (the strategy's ``label``).
STRATEGIES = {
    "ddp": {"class_path": "lit_fsdp.ddp.DDPStrategy"},
    **{FSDP2Strategy(sharding=mode).label: {"class_path": "lit_fsdp.strategy.FSDP2Strategy", "init_args": {"sharding": mode}}
       for mode in get_args(Sharding)},
    "slide_fsdp": {"class_path": "offload.SlideFSDPStrategy"},
}


def last_values(path: Path) -> dict[str, float]:
    """Each metric's last value in a CSVLogger ``metrics.csv`` (the benchmarks' runs)."""
    values: dict[str, float] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            values.update({k: float(v) for k, v in row.items() if v and k not in ("epoch", "step")})
    return values


def _last(configs: Sequence[Path], *keys: str) -> Any:
    """The value at ``keys`` in the last config that sets it (later configs win, lists are replaced whole)."""
    found = None
    for config in configs:
        node: Any = yaml.safe_load(config.read_text()) or {}
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        found = node if node is not None else found
    return found


def configured_callbacks(configs: Sequence[Path]) -> list[Any]:
    """The callbacks the configs give, read as the CLI reads them in order: ``trainer.callbacks`` replaces the list,
    ``trainer.callbacks+`` appends to it (to the CLI's standard list where no config gave one)."""
    listed: list[Any] | None = None
    for config in configs:
        trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
        if trainer.get("callbacks") is not None:
            listed = list(trainer["callbacks"])
        appended = trainer.get("callbacks+")
        if appended is not None:
            listed = [*(CALLBACKS if listed is None else listed), *(appended if isinstance(appended, list) else [appended])]
    return list(CALLBACKS) if listed is None else listed


def run_callbacks(configs: Sequence[Path], run_name: str, quality: dict[str, float]) -> list[dict[str, Any]]:
    """The configs' callbacks (``configured_callbacks``) plus what compare_runs reads: Results (with ``run_name``),
    Quality, Throughput, CompressionStats."""
    entries = [{"class_path": c} if isinstance(c, str) else dict(c) for c in configured_callbacks(configs)]
    for class_path, init_args in (
        ("callbacks.Results", {"run_name": run_name}), ("callbacks.Quality", quality),
        ("callbacks.Throughput", {}), ("callbacks.CompressionStats", {}),
    ):
        name = class_path.rsplit(".", 1)[-1]
        entry = next((e for e in entries if e["class_path"].rsplit(".", 1)[-1] == name), None)
        if entry is None:
            entries.append({"class_path": class_path, "init_args": init_args})
        else:
            entry["init_args"] = {**(entry.get("init_args") or {}), **init_args}
    return entries


def method_config(method: str) -> Path:
    """``configs/<method>.yaml``, or ``method`` itself when it names a YAML file."""
    return Path(method) if method.endswith((".yaml", ".yml")) else REPO / "configs" / f"{method}.yaml"


def run_one(method: str | None, world: int, seed: int, base: Sequence[Path], passthrough: Sequence[str],
            quality: dict[str, float], out: Path, timeout_s: float | None, strategy: str | None = None) -> dict[str, Any]:
    """One run of the sweep in ``out/<method>[-<strategy>]-w<world>-s<seed>``; its ``sweep.jsonl`` record.

    Without ``method`` the run has the base configs only; ``strategy`` (a key of ``STRATEGIES``) replaces theirs.
    """
    folder = "-".join([*([Path(method).stem] if method else []), *([strategy] if strategy else []), f"w{world}", f"s{seed}"])
    name = f"{folder}-{time.strftime('%Y%m%d-%H%M%S')}"  # the form of run_folder.run_name's default
    record: dict[str, Any] = {"method": Path(method).stem if method else strategy, "strategy": strategy, "world_size": world,
                              "seed": seed, "run_name": name, "folder": folder, "compress_method": None}
    configs = [*base, *([method_config(method).resolve()] if method else [])]
    failed = {"status": "failed", "returncode": None, "wall_s": 0.0, "command": None}
    if not configs[-1].is_file():
        return {**record, **failed, "error": f"{configs[-1]} not found; methods: {' '.join(METHODS)} or a YAML path"}
    try:
        compression = _last(configs, "trainer", "strategy", "init_args", "compression") or {}
        callbacks = run_callbacks(configs, name, quality)
    except (yaml.YAMLError, AttributeError, TypeError) as error:
        return {**record, **failed, "error": f"{configs[-1]}: not a lit_fsdp config ({error}); fix the YAML"}
    record["compress_method"] = compression.get("method", "none")
    args = ["--seed_everything", str(seed), "--trainer.devices", str(world), "--trainer.callbacks", json.dumps(callbacks)]
    if strategy:
        args += ["--trainer.strategy", json.dumps(STRATEGIES[strategy])]
    return {**record, **launch(configs, [*args, *passthrough], out / folder, timeout_s)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Unknown arguments go to every `lit_fsdp fit`, e.g. --trainer.max_steps 100 --data.batch_size 4.",
    )
    parser.add_argument("--methods", nargs="+", help=f"config names in configs/ or YAML paths (default: all: {' '.join(METHODS)}; "
                        "none with --strategies)")
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), help="run each under these strategies "
                        "(the model materialised whole on each rank for ddp)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234], help="--seed_everything values")
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[2], help="--trainer.devices values (one node)")
    parser.add_argument("--config", type=Path, action="append", help="base config before the method's, repeatable (default: configs/quickstart.yaml)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "sweep", help="sweep folder (default: runs/sweep)")
    parser.add_argument("--target-val-loss", type=float, help="Quality: report time and step to this validation loss")
    parser.add_argument("--time-budget-s", type=float, help="Quality: report the validation loss at this many seconds of training")
    parser.add_argument("--timeout-s", type=float, help="kill a run and record it failed after this many seconds")
    args, passthrough = parser.parse_known_args(argv)
    passthrough = [a for a in passthrough if a != "--"]
    base = [path.resolve() for path in args.config or [REPO / "configs" / "quickstart.yaml"]]
    for path in base:
        if not path.is_file():
            parser.error(f"--config {path} not found; pass an existing YAML file")
    quality = {k: v for k, v in (("target_val_loss", args.target_val_loss), ("time_budget_s", args.time_budget_s)) if v is not None}
    args.out.mkdir(parents=True, exist_ok=True)
    methods = args.methods or ([None] if args.strategies else METHODS)
    strategies = args.strategies or [None]
    failed = 0
    for method in methods:
        for strategy in strategies:
            for world in args.world_sizes:
                for seed in args.seeds:
                    record = run_one(method, world, seed, base, passthrough, quality, args.out, args.timeout_s, strategy)
                    failed += record["status"] == "failed"
                    with open(args.out / "sweep.jsonl", "a") as f:
                        f.write(json.dumps(record) + "\n")
                    status = record["status"] if record["status"] == "ok" else f"failed: {record['error']}"
                    print(f"{record['folder']}: {status} ({record['wall_s']:.0f} s)", flush=True)
    print(f"{failed} of {len(methods) * len(strategies) * len(args.seeds) * len(args.world_sizes)} runs failed; "
          f"records in {args.out / 'sweep.jsonl'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
