"""``python -m lit_fsdp tune``: find the fastest strategy setting that fits, by running short real trials.

    python -m lit_fsdp tune --config configs/quickstart.yaml --config configs/wikipedia.yaml --tune.trials 12 --tune.out runs/tune
    python -m lit_fsdp fit --config configs/quickstart.yaml --config configs/wikipedia.yaml --config runs/tune/best.yaml

``tune`` takes ``fit``'s configs and arguments (they fix the model, the data, the devices and the batch
per process) and its own ``--tune.*`` options; it searches the strategy knobs and the micro-batch.
"""

from __future__ import annotations

import shutil
import time
import warnings
from argparse import ArgumentError
from dataclasses import asdict, dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any, Sequence

import lightning.pytorch as pl
from jsonargparse import ArgumentParser, set_parsing_settings

from compress.config import CompressionConfig
from lit_fsdp.commands.tune.coder import Coder
from lit_fsdp.commands.tune.controller import Budget, Controller, Search
from lit_fsdp.commands.help import PlainHelpFormatter
from lit_fsdp.commands.tune.hardware import Hardware, detect, load
from lit_fsdp.commands.tune.llm import LLMAdviser, LLMOptions
from lit_fsdp.commands.tune.memory import MemoryFilter, ModelShape
from lit_fsdp.commands.tune.report import PLOT, append_trial, write_best, write_report
from lit_fsdp.commands.tune.space import COMMON_KNOBS, STRATEGY_CLASSES, STRATEGY_KNOBS, Candidate, RunShape, SearchSpace
from lit_fsdp.commands.tune.trials import TrialRunner, TrialSchedule
from offload.strategy import SlideFSDPStrategy

OUTPUTS = ("trials.jsonl", "best.yaml", "report.md", "summary.json", PLOT, "trials")  # what a new search in OUT replaces


@dataclass
class TuneOptions:
    """The search: its budget, where it writes, the hardware, the space, the trials and the optional LLM adviser."""

    trials: int = 12
    """trials to run at most (candidates rejected without running do not count)"""
    out: str = "runs/tune"
    """folder for trials.jsonl, best.yaml, report.md, summary.json, tokens_per_s.png and the trials' run folders
    (trials/NN); a previous search's files there are replaced"""
    time_budget: float | None = None
    """seconds for the whole search (null: no limit); a trial's deadline is at most the time left"""
    hardware: str | None = None
    """JSON file describing the hardware, the format `python -m lit_fsdp hardware` prints; default: detected"""
    patience: int = 4
    """stop after this many trials in a row without a gain of min_gain over the best"""
    min_gain: float = 0.02
    """relative tokens/s gain that counts as an improvement"""
    memory_margin: float = 0.1
    """share of a device's memory the memory filter keeps free"""
    loss_tolerance: float = 0.02
    """relative change of the validation loss after a trial, against the default's, beyond which the trial is flagged"""
    trial: TrialSchedule = field(default_factory=TrialSchedule)
    space: SearchSpace = field(default_factory=SearchSpace)
    llm: LLMOptions = field(default_factory=LLMOptions)

    def check(self) -> None:
        if self.trials < 1:
            raise ValueError(f"--tune.trials {self.trials}: at least 1 trial is needed")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"--tune.time_budget {self.time_budget} must be > 0 seconds, or null")
        if self.patience < 1 or self.min_gain < 0 or not 0 <= self.memory_margin < 1 or self.loss_tolerance <= 0:
            raise ValueError("--tune.patience >= 1, --tune.min_gain >= 0, 0 <= --tune.memory_margin < 1 and "
                             "--tune.loss_tolerance > 0 are needed")
        self.trial.check()
        self.llm.check()


def split_arguments(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(``--tune.*`` arguments, everything else: ``fit``'s)."""
    tune, fit = [], []
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--tune" or arg.startswith(("--tune.", "--tune=")):
            tune.append(arg)
            if "=" not in arg and args:
                tune.append(args.pop(0))
        else:
            fit.append(arg)
    return tune, fit


def parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="lit_fsdp tune", description=__doc__.split("\n\n")[0], exit_on_error=False, formatter_class=PlainHelpFormatter,
        epilog="Every argument that is not --tune.* is fit's (--config FILE, --trainer.devices 2, ...).",
    )
    # The options' help is their attribute docstrings; the setting is global and slows other parsers: only here.
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    try:
        parser.add_argument("--tune", type=TuneOptions, default=TuneOptions())
    finally:
        set_parsing_settings(docstring_parse_attribute_docstrings=False)
    return parser


def parse_options(args: Sequence[str]) -> TuneOptions:
    """The ``--tune.*`` options, checked; a bad one is a one-line ValueError."""
    tune_parser = parser()
    try:
        options = tune_parser.instantiate(tune_parser.parse_args(list(args))).tune
    except ArgumentError as error:
        raise ValueError(" ".join(str(error).split())) from None
    options.check()
    return options


def default_candidate(trainer: pl.Trainer, data: Any, searched: bool = True) -> Candidate:
    """The configs' own setting of the knobs: the first trial and the reference. An activation plan of counts
    (``{host: 2}``) is a candidate's only where nothing is ``searched`` (``estimate``, which plans the counts itself):
    tune searches null and auto."""
    strategy = trainer.strategy
    by_class = {path.rsplit(".", 1)[1]: name for name, path in STRATEGY_CLASSES.items()}
    name = by_class.get(type(strategy).__name__)
    if name is None:
        raise ValueError(f"the configs' strategy is {type(strategy).__name__}; tune searches the knobs of "
                         f"{' and '.join(STRATEGY_CLASSES.values())}: start from a config with one of them")
    knobs = {knob: getattr(strategy, knob) for knob in COMMON_KNOBS[1:] + STRATEGY_KNOBS[name] if hasattr(strategy, knob)}
    if isinstance(knobs.get("activation_plan"), dict):
        if not searched:  # estimate counts the plan from the strategy's own setting (planned_activations)
            knobs["activation_plan"] = None
        else:
            raise ValueError(f"the configs' activation_plan is {knobs['activation_plan']}; tune searches null and "
                             "auto (the plan chosen on the machine): set activation_plan: auto, or remove it")
    if name == "fsdp2":
        knobs["compression"] = "none" if strategy.compression is None else strategy.compression.method
        if strategy.sharding == "HYBRID_SHARD" and strategy.replicate_size is None:
            knobs["replicate_size"] = trainer.num_nodes  # the strategy's own default
    return Candidate(strategy=name, micro_batch=data.batch_size).with_knobs(knobs)


def run_shape(trainer: pl.Trainer, module: Any, data: Any, hardware: Hardware) -> RunShape:
    """What the configs fix, checked against the hardware."""
    accelerator = trainer.strategy.root_device.type
    run = RunShape(world_size=trainer.num_nodes * trainer.num_devices, nodes=trainer.num_nodes, accelerator=accelerator,
                   seq_len=data.seq_len, batch_per_process=data.batch_size * trainer.accumulate_grad_batches,
                   clipping=bool(trainer.gradient_clip_val),
                   loss_chunk_tokens=getattr(module.hparams, "loss_chunk_tokens", 0),
                   optimizer_state_dtype=getattr(trainer.strategy, "optimizer_state_dtype", "float32"),
                   master_dtype=getattr(trainer.strategy, "master_dtype", "float32"),
                   # SlideFSDP's; a SlideFSDP candidate from FSDP2 configs gets the strategy's default
                   reduce_dtype=trainer.strategy.reduce_dtype if isinstance(trainer.strategy, SlideFSDPStrategy) else "auto",
                   outer=semi.config.outer if (semi := getattr(trainer.strategy, "semi_sync", None)) else None,
                   on_nonfinite=trainer.strategy.on_nonfinite,
                   accumulate_on=getattr(trainer.strategy, "accumulate_on", "device"))
    if accelerator != hardware.accelerator:
        raise ValueError(f"the configs train on {accelerator} but the hardware is {hardware.accelerator}; "
                         "fix --trainer.accelerator or the hardware file's accelerator")
    if trainer.num_nodes > hardware.nodes or (accelerator == "cuda" and trainer.num_devices > hardware.devices_per_node):
        raise ValueError(f"the configs ask for {trainer.num_nodes} node(s) x {trainer.num_devices} device(s) but the hardware "
                         f"has {hardware.nodes} x {hardware.devices_per_node}")
    return run


def strategy_validator(trainer: pl.Trainer, module: pl.LightningModule, base: dict[str, Any], run: RunShape):
    """A function that builds a candidate's strategy and runs its preflight (constructor checks, mesh, host memory)
    with the candidate's gradient accumulation (what a delayed update refuses, and what keeps gradients on the host)."""
    base_class, base_args = base.get("class_path"), {k: v for k, v in (base.get("init_args") or {}).items() if k != "comm_hook"}

    def validate(candidate: Candidate) -> str | None:
        class_path = STRATEGY_CLASSES[candidate.strategy]
        init = {**(base_args if class_path == base_class else {}), **candidate.strategy_init_args(base_args.get("compression"))}
        if isinstance(init.get("compression"), dict):
            init["compression"] = CompressionConfig(**init["compression"])
        module_name, class_name = class_path.rsplit(".", 1)
        try:
            strategy = getattr(import_module(module_name), class_name)(**init)
            # What the trainer's accelerator connector gives a strategy: its devices (resolve_dtype reads them).
            strategy.parallel_devices = trainer.strategy.parallel_devices
            strategy.cluster_environment = trainer.strategy.cluster_environment
            configs_accumulation = trainer.accumulate_grad_batches
            trainer.accumulate_grad_batches = run.batch_per_process // candidate.micro_batch
            try:
                strategy.preflight(trainer, module)
            finally:
                trainer.accumulate_grad_batches = configs_accumulation
        except (ValueError, TypeError) as error:
            return f"invalid: {str(error).splitlines()[0]}"
        return None

    return validate


def strategy_config(config: Any) -> dict[str, Any]:
    """The configs' ``trainer.strategy`` as a dict (empty when it is given as a registered name)."""
    strategy = config["trainer"]["strategy"]
    return strategy.as_dict() if hasattr(strategy, "as_dict") else {}


def clear(out: Path) -> None:
    for name in OUTPUTS:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def main(argv: Sequence[str]) -> None:
    tune_args, fit_args = split_arguments(argv)
    if {"-h", "--help"} & set(fit_args):
        parser().print_help()
        return
    options = parse_options(tune_args)
    hardware = load(options.hardware) if options.hardware else detect()
    from lit_fsdp.commands.cli import run as parse_fit  # after the options: a bad tune option fails before the run is built

    with warnings.catch_warnings():  # that args and sys.argv both exist is how tune calls it
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = parse_fit(fit_args, run=False)
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    base = strategy_config(cli.config)
    base_compression = (base.get("init_args") or {}).get("compression")
    run = run_shape(trainer, module, data, hardware)
    default = default_candidate(trainer, data)
    data.setup("fit")  # tokenizer and token cache built once, here: no trial's deadline pays for them
    allowed = options.space.resolve(run)
    validate = strategy_validator(trainer, module, base, run)
    if (reason := validate(default)) is not None:
        raise ValueError(f"the configs' own strategy setting cannot run: {reason}")
    model = ModelShape.of(module.hf_config(datamodule=data), getattr(trainer.strategy, "block_class", None),
                          module.hparams.get("lora"))
    # Units of more blocks than the model has are all the same unit: keep one such value at most.
    groups = allowed["blocks_per_group"]
    allowed["blocks_per_group"] = [b for b in groups if b < model.layers] + [b for b in groups if b >= model.layers][:1]
    out = Path(options.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    clear(out)
    memory = MemoryFilter(model, run, hardware, options.memory_margin, base_compression)
    runner = TrialRunner(fit_args, out, Path.cwd(), run, options.trial, hardware, base_compression)
    search = Search(default, allowed, run, memory, Coder(allowed, run), validate, runner, options.loss_tolerance,
                    options.trial.timeout_s, facts={"hardware": asdict(hardware), "model": asdict(model), "run": asdict(run)})
    budget = Budget(options.trials, options.time_budget, options.patience, options.min_gain)
    adviser = LLMAdviser(options.llm) if options.llm.base_url else None

    def on_trial(trial: Any) -> None:
        append_trial(out, trial)
        figure = f"{trial.tokens_per_s:,.0f} tokens/s" if trial.tokens_per_s else (trial.error or "")[:120]
        print(f"trial {trial.index if trial.index is not None else '-'} [{trial.source}] "
              f"{trial.candidate.changes(default)}: {trial.status} {figure}", flush=True)

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    result = Controller(search, budget, adviser, on_trial).run()
    header = [
        f"`python -m lit_fsdp tune {' '.join(argv)}`, started {started}.", "",
        f"Hardware: {hardware.nodes} node(s) x {hardware.devices_per_node} {hardware.device_name} "
        f"({hardware.device_memory_gb:.3g} GB each, host {hardware.host_memory_gb:.3g} GB); model: "
        f"{model.parameters / 1e6:.2f}M parameters in {model.layers} blocks; {run.world_size} processes, sequence "
        f"{run.seq_len}, {run.batch_per_process} sequences per process per step; default: `{default.key()}`.",
    ]
    if result.best is not None:
        write_best(out / "best.yaml", result, run, base_compression)
    write_report(out, result, memory, header)
    best = (f"best: trial {result.best.index}, {result.best.tokens_per_s:,.0f} tokens/s; overlay {out / 'best.yaml'}"
            if result.best is not None else "no trial ran to completion: no best.yaml")
    print(f"{result.stop_reason}; {best}; report {out / 'report.md'}")
