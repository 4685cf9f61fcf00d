"""``python -m lit_fsdp fit|validate``: LightningCLI over CausalLM, our DataModules and our strategies."""

from __future__ import annotations

import copy
import inspect
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from jsonargparse import ArgumentError
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks.comm_profiler import CommProfiler
from callbacks.interrupt import InterruptCheckpoint, interrupted
from callbacks.model_summary import ModelSummary
from callbacks.offload import OffloadStats
from callbacks.results import Results
from callbacks.throughput import Throughput
from callbacks.progress_bar import progress_bar
from callbacks.progress_lines import ProgressLines
from callbacks.run_folder import compression_method, run_name
from offload import SlideFSDPStrategy  # importing offload registers the slide_fsdp strategy name
from lit_fsdp import checkpoints
from lit_fsdp.data.blocks import BlockDataModule, check_same_global_batch
from lit_fsdp.ddp import DDPStrategy
from lit_fsdp.data.synthetic import SyntheticDataModule
from lit_fsdp.errors import OneLineError, PeerLostError, lost_peer
from lit_fsdp.commands import config_keys
from lit_fsdp.commands.help import PlainHelpFormatter
from lit_fsdp.model import CausalLM
from lit_fsdp.lifecycle import CausalLMStrategy
from lit_fsdp.wandb_logger import CSVFallbackLogger, SaveConfig, WandbLogger, default_logger, without_broken_wandb

TRAINER_DEFAULTS = {
    "strategy": {"class_path": "lit_fsdp.strategy.FSDP2Strategy"},
    # "logger": W&B, or CSV in the run folder without the wandb package (wandb_logger.default_logger, decided per run)
    "max_steps": 200,
    "default_root_dir": "runs/default",  # the run folder: results, traces, checkpoints, W&B files
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "limit_val_batches": 8,
    "log_every_n_steps": 10,
}

#: Every run's callbacks: the default of ``trainer.callbacks``. A config or ``--trainer.callbacks`` that lists
#: callbacks replaces them (``[]``: none); ``--trainer.callbacks+=CLASS``, or ``callbacks+:`` in a config, adds one.
#: A parser default, not Lightning's ``trainer_defaults``: those are appended after parsing, where no config can take
#: them out. ``--trainer.enable_checkpointing false`` leaves this list's ModelCheckpoint out (``_no_checkpoints``);
#: under SlideFSDP the trainer gets an OffloadStats too (``instantiate_trainer``), so no config repeats this list.
CALLBACKS: list[dict[str, Any]] = [
    # to <default_root_dir>/checkpoints (_preflight); resume with --ckpt_path last; read by generate and evaluate.
    # Lightning's, with last also saved at the final step when max_steps is not a multiple of 100
    {"class_path": "callbacks.ModelCheckpoint",
     "init_args": {"save_last": True, "every_n_train_steps": 100}},
    {"class_path": "callbacks.Throughput"},  # tokens/s in the progress bar; throughput.json
    {"class_path": "callbacks.Memory"},
    {"class_path": "callbacks.CompressionStats"},  # compress/*, compression.json; does nothing without compression
    {"class_path": "callbacks.Quality"},  # history.jsonl: the loss curve compare_runs draws
    {"class_path": "callbacks.Results"},  # results.jsonl: the run's record, with the others' summaries
]
COMM_PROFILER = (
    "add callbacks.CommProfiler (torch.profiler on optimizer steps 8-10: time per collective, compute, overlap; "
    "traces in <run folder>/profiler) unless trainer.callbacks has one. The method configs (baseline.yaml too) and "
    "offload.yaml turn it on; off by default, as its profiled steps run slower, inside those Throughput measures, "
    "and every rank writes a trace (2.6 MB each for the quickstart on 2 CPU processes; more with GPU kernels)"
)

PEAK_TFLOPS = (
    "peak TFLOPS of one device, for the MFU of callbacks.Throughput where its built-in GPU table has none (a CPU, an "
    "unlisted GPU); a Throughput whose init_args give peak_tflops keeps its own"
)

# Deprecations inside Lightning that a user cannot act on, silenced by message and by the module they arise in
# (every rank imports this module). Lightning's flattening of the dataloaders builds a LeafSpec, which torch's
# pytree deprecates: Lightning-AI/pytorch-lightning#21326.
warnings.filterwarnings(
    "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning,
    module=r"lightning\.pytorch\.utilities\._pytree",
)
# LightningCLI calls jsonargparse APIs deprecated in jsonargparse 4.49 (shown with -W default or PYTHONWARNINGS).
warnings.filterwarnings(
    "ignore", message=r"\s*(By default only one JsonargparseDeprecationWarning|\S.* was deprecated in v4\.)",
    category=DeprecationWarning, module=r"lightning\.pytorch\.cli",
)
# Lightning 2.6 advertises litlogger and litmodels ("💡 Tip: ...") at every Trainer, with no setting to turn it off:
# dropped where its info lines are made (Lightning's or Fabric's logger, whichever imported last).
for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(_name).addFilter(lambda record: not str(record.msg).startswith("💡 Tip:"))


#: LightningCLI's optimizer options: CausalLM.configure_optimizers decides what they would replace.
REFUSED_OPTIMIZATION = ("optimizer", "lr_scheduler")
OWN_OPTIMIZATION = (
    "CausalLM builds AdamW (no weight decay on biases and norms) with a warm-up + cosine schedule, the strategy "
    "replaces it where a compression method needs its own (1-bit Adam, 0/1 Adam) and SlideFSDP runs it on the CPU; set "
    "--model.learning_rate, --model.weight_decay, --model.betas, --model.warmup_steps and --model.min_lr_ratio instead"
)


class PlainParser(LightningArgumentParser):
    """LightningCLI's parser, its help in plain text: ``--trainer.strategy.help CLASS`` builds a parser of this class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", PlainHelpFormatter)
        kwargs.setdefault("exit_on_error", False)  # LitFsdpCLI.parse_arguments says the error in a line, no usage
        super().__init__(*args, **kwargs)


class LitFsdpCLI(LightningCLI):
    """LightningCLI with our defaults and checks that run before any worker process starts."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit and validate: test and predict are not offered (``lit_fsdp.commands.main.NOT_OFFERED`` says why)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in ("fit", "validate")}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data": {"class_path": "lit_fsdp.data.synthetic.SyntheticDataModule"}})
        parser.set_defaults({"trainer.callbacks": copy.deepcopy(CALLBACKS)})
        parser.add_argument("--comm_profiler", type=bool, default=False, help=COMM_PROFILER)
        parser.add_argument("--peak_tflops", type=Optional[float], default=None, help=PEAK_TFLOPS)
        # Taken (and refused in one line) rather than left out, so that a config naming them is told why.
        for name in REFUSED_OPTIMIZATION:
            parser.add_argument(f"--{name}", type=Optional[Union[str, dict]], default=None,
                                help=f"not supported: {OWN_OPTIMIZATION}")

    def before_instantiate_classes(self) -> None:
        """Refuse --optimizer and --lr_scheduler, from the command line or a config, before anything is built."""
        for name in REFUSED_OPTIMIZATION:
            given = self._get(self.config, name)
            if given is not None:
                shown = given.get("class_path", given) if isinstance(given, dict) else given
                raise ValueError(f"--{name} {shown} is not supported: {OWN_OPTIMIZATION}")
        self._no_checkpoints()

    def _no_checkpoints(self) -> None:
        """``--trainer.enable_checkpointing false`` takes the standard list's ModelCheckpoint out as it turns off
        Lightning's own (Lightning refuses a ModelCheckpoint with it); one a config lists stays, and is refused."""
        trainer = self._get(self.config, "trainer")
        if trainer.get("enable_checkpointing") is not False:
            return
        standard = self._parser(self.subcommand).get_defaults()["trainer.callbacks"][0]
        callbacks = trainer.get("callbacks") or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        trainer["callbacks"] = [callback for callback in callbacks if callback != standard]

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        given = sys.argv[1:] if args is None else args
        subcommands = getattr(self, "_subcommand_parsers", {})
        command = next((arg for arg in given if arg in subcommands), None) if isinstance(given, list) else None
        if isinstance(given, list):  # unknown keys, all of them, named before jsonargparse stops at the first
            checked = given[given.index(command) + 1:] if command else given
            config_keys.check(subcommands[command] if command else parser, checked, command or "fit")
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:  # its message alone: the usage before it is the length of a screen
            raise OneLineError(config_keys.parse_error_line(error, command or "fit")) from error
        # LightningCLI reads a --ckpt_path file's hyperparameters next, before our preflight: a file that is not a
        # complete checkpoint of ours (empty, truncated, or holding what we never write) is refused first, in our one
        # line (checkpoints.resumable, checkpoints.load).
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path and Path(ckpt_path).is_file():
            checkpoints.resumable(ckpt_path)

    def _preflight(self) -> None:
        strategy = self.trainer.strategy
        if not isinstance(strategy, (CausalLMStrategy, DDPStrategy)):
            raise ValueError(
                f"--trainer.strategy is {type(strategy).__name__}; lit_fsdp models are built on the meta device "
                "and need lit_fsdp.strategy.FSDP2Strategy (the default), offload.SlideFSDPStrategy or "
                "lit_fsdp.ddp.DDPStrategy (whole model on each rank): remove the --trainer.strategy override"
            )
        strategy.preflight(self.trainer, self.model, self.datamodule)
        self._warn_cores_shared()
        positions = getattr(self.model.hf_config(), "max_position_embeddings", None)
        seq_len = getattr(self.datamodule, "seq_len", 0)
        if positions is not None and seq_len > positions:
            raise ValueError(
                f"--data.seq_len {seq_len} is longer than the model's {positions} positions; lower it or raise "
                "max_position_embeddings (n_positions for GPT-2) with --model.config_overrides"
            )
        embedded, data_vocab = getattr(self.model.hf_config(self.datamodule), "vocab_size", None), getattr(
            self.datamodule, "vocab_size", None)
        # Token ids without a tokenizer (synthetic data) past a pretrained model's vocabulary, which it keeps
        if isinstance(self.datamodule, SyntheticDataModule) and embedded and data_vocab and data_vocab > embedded:
            raise ValueError(
                f"the data's token ids run to {data_vocab - 1}, past the model's vocabulary of {embedded} "
                f"(--model.pretrained_path {self.model.hparams.get('pretrained_path')}); give data tokenized with the "
                "model's own tokenizer, or --data.vocab_size at most its vocabulary"
            )
        # A fixed checkpoint folder (not one per logger version) is what makes `--ckpt_path last` find it.
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
                callback.dirpath = os.path.realpath(os.path.join(self.trainer.default_root_dir, "checkpoints"))
        saving = [callback.dirpath for callback in self.trainer.checkpoint_callbacks if isinstance(callback, ModelCheckpoint)]
        for callback in self.trainer.checkpoint_callbacks:  # an interrupt's checkpoint goes beside the others
            if isinstance(callback, InterruptCheckpoint) and not callback.dirpath:
                callback.dirpath = saving[0] if saving else os.path.join(self.trainer.default_root_dir, "checkpoints")
        checkpoints.check_writable(Path(self.trainer.default_root_dir), "--trainer.default_root_dir")
        for callback in self.trainer.checkpoint_callbacks:
            checkpoints.check_writable(Path(callback.dirpath), "the ModelCheckpoint's dirpath")
        if self.subcommand == "fit" and not self.trainer.fast_dev_run:  # only fit saves checkpoints, not a dev run
            checkpoints.check_space(self.trainer, self.model.hf_config(self.datamodule), self.model.hparams.get("lora"))
        self._resolve_checkpoint()
        # Last, as the slowest check (a first run tokenises the data): in the launching process, a bad data file is
        # said once, before the other processes start or a W&B run is made.
        self.datamodule.read_before_launch(self.model, self.trainer.local_rank)
        # W&B's name is the results.jsonl record's; a tag per method makes runs easy to filter.
        self.trainer.loggers = without_broken_wandb(self.trainer.loggers)
        for logger in self.trainer.loggers:
            if isinstance(logger, WandbLogger):
                tags = [compression_method(self.trainer)]
                logger.use_run(self.trainer.default_root_dir, run_name(self.trainer), tags=tags)
            elif isinstance(logger, CSVFallbackLogger):
                logger.use_folder(self.trainer.default_root_dir)

    def _warn_cores_shared(self) -> None:
        """One line where CPU processes outnumber the cores this process may run on: they share them, and each step
        waits for the slowest, so the run is slower than with one process per core."""
        trainer = self.trainer
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if isinstance(trainer.accelerator, CPUAccelerator) and trainer.num_devices > cores:
            rank_zero_info(f"lit_fsdp: warning: --trainer.devices {trainer.num_devices} starts {trainer.num_devices} "
                           f"CPU processes on {cores} core{'s' if cores > 1 else ''}: they take turns on the cores and "
                           "every step waits for the slowest, so the run is slower than with --trainer.devices "
                           f"{cores}")

    def _resolve_checkpoint(self) -> None:
        """``--ckpt_path last``: the newest complete checkpoint; a named one must be complete and of the same global batch."""
        arguments = self.config_init[self.subcommand]
        folders = [Path(cb.dirpath) for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        folder = folders[0] if folders else Path(self.trainer.default_root_dir) / "checkpoints"
        path, manifest, notes = checkpoints.resolve(arguments.get("ckpt_path"), folder)
        if folders and arguments.get("ckpt_path") is None and self.subcommand == "fit":  # a fresh run that saves
            notes = checkpoints.earlier_run(folder)
        for line in notes:
            rank_zero_info(line)
        arguments["ckpt_path"] = path
        if manifest is not None and self.subcommand == "fit":
            trainer = self.trainer
            world = trainer.num_nodes * trainer.num_devices
            check_same_global_batch(manifest, self.datamodule.batch_size, world, trainer.accumulate_grad_batches,
                                    f"the checkpoint {path}")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with a CommProfiler if ``comm_profiler`` asks for one and none is listed, an OffloadStats under
        SlideFSDP unless one is listed, an InterruptCheckpoint where a ModelCheckpoint saves, and our model summary and
        progress bar (short names, no ``Epoch 2/-2``; plain lines where stdout is no terminal) unless each is off or
        one is configured."""
        config = self._get(self.config_init, "trainer", default={})
        accelerator = config.get("accelerator")
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():  # Lightning's own answer is a traceback
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
            raise ValueError(f"--trainer.accelerator {accelerator} but torch sees no CUDA device (torch "
                             f"{torch.__version__}, built with {build}); use --trainer.accelerator cpu, or run on a "
                             "machine with an NVIDIA GPU and a CUDA build of torch")
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if self._get(self.config_init, "comm_profiler") and not any(isinstance(c, CommProfiler) for c in callbacks):
            callbacks.append(CommProfiler())
        strategy = config.get("strategy")
        slide = isinstance(strategy, SlideFSDPStrategy) or strategy == SlideFSDPStrategy.strategy_name
        if slide and not any(isinstance(c, OffloadStats) for c in callbacks):
            # before Results, which comes last to record the others' summaries
            results = next((index for index, c in enumerate(callbacks) if isinstance(c, Results)), len(callbacks))
            callbacks.insert(results, OffloadStats())
        if any(isinstance(c, ModelCheckpoint) for c in callbacks) and not any(isinstance(c, InterruptCheckpoint)
                                                                              for c in callbacks):
            callbacks.append(InterruptCheckpoint())  # Ctrl-C and preemption save the step reached
        peak = self._get(self.config_init, "peak_tflops")
        if peak is not None:
            if peak <= 0:
                raise ValueError(f"--peak_tflops {peak} must be > 0 (TFLOPS of one device), or left unset")
            for callback in callbacks:
                if isinstance(callback, Throughput) and callback.peak_tflops is None:
                    callback.peak_tflops = peak
        if config.get("enable_model_summary") is not False and not any(isinstance(c, LightningModelSummary)
                                                                       for c in callbacks):
            callbacks.append(ModelSummary())  # counts under every strategy; Lightning then adds none (and says nothing)
            kwargs["enable_model_summary"] = False
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(progress_bar() if sys.stdout.isatty() else ProgressLines())  # a log: lines, not a bar
        kwargs.setdefault("callbacks", callbacks)
        return super().instantiate_trainer(**kwargs)

    before_fit = before_validate = _preflight

    def _run_subcommand(self, subcommand: str) -> None:
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:  # Ctrl-C or a preemption signal, after InterruptCheckpoint saved the step reached
            sys.exit(interrupted(self.trainer))
        except Exception as error:
            strategy = self.trainer.strategy
            launched = getattr(getattr(strategy, "launcher", None), "procs", None) or []
            line = lost_peer(error, launched, strategy.global_rank, strategy.world_size)
            if line is None:
                raise
            raise PeerLostError(line) from error


def run(args: list[str] | None = None, cli_class: type[LitFsdpCLI] = LitFsdpCLI, **cli_options: Any) -> LitFsdpCLI:
    """The CLI on ``args``; ``run=False`` parses them into a trainer, model and data without a subcommand (``tune`` does);
    ``cli_class`` a subclass that instantiates less (``estimate``'s, without a Trainer)."""
    return cli_class(
        CausalLM,
        BlockDataModule,
        subclass_mode_data=True,
        trainer_defaults={**TRAINER_DEFAULTS, "logger": default_logger()},
        seed_everything_default=1234,
        save_config_callback=SaveConfig,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        # Lightning 2.5.0 takes no parser_class (Lightning-AI/pytorch-lightning#20596): its help keeps the backticks.
        **({"parser_class": PlainParser} if "parser_class" in inspect.signature(LightningCLI).parameters else {}),
        args=args,
        **{"parser_kwargs": {"prog": "python -m lit_fsdp"}, **cli_options},
    )
