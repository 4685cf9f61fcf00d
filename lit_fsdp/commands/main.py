"""Entry point: ``python -m lit_fsdp COMMAND`` (or ``lit-fsdp``); ``python -m lit_fsdp --help`` lists the commands."""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

from lit_fsdp.errors import RunError, error_line

#: Every command and what it does: the top-level help, and the answer to an unknown command.
COMMANDS = {
    "fit": "train a model: --config FILE and --model.*, --data.*, --trainer.* options (LightningCLI)",
    "validate": "the validation loss of a model, or of a checkpoint with --ckpt_path, as fit logs it",
    "export": "write a checkpoint as a Hugging Face folder (config.json, model.safetensors, tokenizer)",
    "generate": "continue a prompt with a trained model, printing the text as it comes",
    "evaluate": "loss and perplexity of a trained model on a Wikipedia-format file; answer loss and exact match on chat",
    "tune": "find the fastest strategy setting that fits, by running short real trials",
    "estimate": "memory, traffic and a step-time bound of a run's configs, before it runs (no device needed)",
    "hardware": "print this machine's hardware as JSON, the format --tune.hardware reads",
    "compressors": "list the gradient compression methods, their parameters and defaults",
    "compare_runs": "a table (Markdown, CSV) and loss-curve PNGs comparing the runs in run folders' results.jsonl",
}

#: Commands that run in this one process, each a function whose signature is its command line.
SINGLE_PROCESS_COMMANDS = {
    "export": "lit_fsdp.commands.export:export_hf",
    "generate": "lit_fsdp.commands.generate:generate",
    "evaluate": "lit_fsdp.commands.evaluate:evaluate",
    "hardware": "lit_fsdp.commands.tune.hardware:hardware",
}

#: LightningCLI's commands that lit_fsdp does not offer: the data has no test split, and predictions would have
#: nowhere to go (LightningCLI writes none).
NOT_OFFERED = ("test", "predict")
INSTEAD = ("use validate for the validation loss, evaluate CHECKPOINT --data.path FILE for the loss on a file, "
           "or generate CHECKPOINT for text")


def usage() -> str:
    """The top-level help: every command with what it does."""
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m lit_fsdp COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    lines += ["", "python -m lit_fsdp COMMAND --help shows a command's options; "
              "LIT_FSDP_TRACEBACK=1 shows the traceback behind a one-line error."]
    return "\n".join(lines)


def compressors(args: list[str]) -> None:
    """List the gradient compression methods (``--trainer.strategy.init_args.compression``'s ``method``)."""
    if args in (["-h"], ["--help"]):
        print(f"usage: lit_fsdp compressors\n\n{COMMANDS['compressors']}: the values of "
              "--trainer.strategy.init_args.compression's method and the parameters each takes.")
    elif args:
        raise ValueError(f"compressors takes no arguments, got {' '.join(args)}; run python -m lit_fsdp compressors")
    else:
        from compress.config import describe_methods

        print(describe_methods())


def bare_flags(args: list[str], function: Any) -> list[str]:
    """``--adapter-only`` (or ``--adapter_only``) alone, for a boolean parameter of ``function``, as the
    ``--adapter_only true`` its command line (jsonargparse) reads."""
    flags = {name for name, parameter in inspect.signature(function).parameters.items() if parameter.annotation in
             (bool, "bool")}
    given = []
    for index, arg in enumerate(args):
        name = arg[2:].replace("-", "_") if arg.startswith("--") else None
        following = args[index + 1] if index + 1 < len(args) else ""
        if name in flags and following.lower() not in ("true", "false"):
            given += [f"--{name}", "true"]
        else:
            given.append(arg)
    return given


def is_user_error(error: Exception) -> bool:
    """A mistake the user can fix, shown in one line: ours are ValueErrors; Lightning's MisconfigurationException is a
    setting it refuses before anything runs (looked up only where Lightning is loaded: this module loads no Lightning)."""
    lightning_errors = sys.modules.get("lightning.fabric.utilities.exceptions")
    refused = (lightning_errors.MisconfigurationException,) if lightning_errors else ()
    return isinstance(error, (ValueError, FileNotFoundError, *refused))


def rank() -> int:
    """This process's global rank: Lightning's ``rank_zero_only.rank`` where Lightning is loaded (a strategy sets it),
    otherwise the launcher's environment, read in Lightning's order."""
    rank_zero = sys.modules.get("lightning.fabric.utilities.rank_zero")
    if rank_zero is not None:
        return rank_zero.rank_zero_only.rank
    return int(next((os.environ[key] for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID") if key in os.environ), 0))


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else None
    try:
        if command in (None, "-h", "--help"):
            print(usage(), file=sys.stdout if command else sys.stderr)
            sys.exit(0 if command else 2)
        elif command in NOT_OFFERED:
            raise ValueError(f"'{command}' is not offered: lit_fsdp's data has no test split and LightningCLI writes no "
                             f"predictions; {INSTEAD}")
        elif not command.startswith("-") and command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}; choose from {', '.join(COMMANDS)} "
                             "(python -m lit_fsdp --help says what each does)")
        elif command == "compressors":
            compressors(args[1:])
        elif command == "tune":
            from lit_fsdp.commands.tune.command import main as tune

            tune(args[1:])
        elif command == "compare_runs":
            from lit_fsdp.commands.compare_runs import main as compare_runs

            compare_runs(args[1:])
        elif command == "estimate":
            from lit_fsdp.commands.estimate import main as estimate

            estimate(args[1:])
        elif command in SINGLE_PROCESS_COMMANDS:
            from importlib import import_module

            from jsonargparse import auto_cli

            from lit_fsdp.commands.help import PlainHelpFormatter

            module, function = SINGLE_PROCESS_COMMANDS[command].split(":")
            target = getattr(import_module(module), function)
            auto_cli(target, args=bare_flags(args[1:], target), prog=f"lit_fsdp {command}",
                     formatter_class=PlainHelpFormatter)
        else:
            from lit_fsdp.commands.cli import run

            run(argv)
    except Exception as error:
        if not is_user_error(error) or os.environ.get("LIT_FSDP_TRACEBACK"):
            raise
        # Every rank raises an error the ranks agreed on (a non-finite step, a checkpoint that could not be
        # written): one of them says it.
        if not isinstance(error, RunError) or rank() == 0:
            line = error_line(error)
            tip = "" if "\n" in line else " (LIT_FSDP_TRACEBACK=1 shows the traceback)"  # not after a block's last item
            print(f"lit_fsdp: error: {line}{tip}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
