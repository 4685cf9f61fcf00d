"""Entry point: ``python -m lit_fsdp`` (or ``lit-fsdp``) with fit/validate/test/predict, tune, estimate, export, generate,
evaluate, hardware or compressors."""

from __future__ import annotations

import os
import sys

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_fsdp.errors import RunError, error_line

#: Commands that run in this one process, each a function whose signature is its command line.
SINGLE_PROCESS_COMMANDS = {
    "export": "lit_fsdp.export:export_hf",
    "generate": "lit_fsdp.generate:generate",
    "evaluate": "lit_fsdp.evaluate:evaluate",
    "hardware": "lit_fsdp.tune.hardware:hardware",
}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["compressors"]:
            from compress.config import describe_methods

            print(describe_methods())
        elif args[:1] == ["tune"]:
            from lit_fsdp.tune.command import main as tune

            tune(args[1:])
        elif args[:1] == ["estimate"]:
            from lit_fsdp.estimate import main as estimate

            estimate(args[1:])
        elif args[:1] and args[0] in SINGLE_PROCESS_COMMANDS:
            from importlib import import_module

            from jsonargparse import auto_cli

            module, function = SINGLE_PROCESS_COMMANDS[args[0]].split(":")
            auto_cli(getattr(import_module(module), function), args=args[1:], prog=f"lit_fsdp {args[0]}")
        else:
            from lit_fsdp.cli import run

            run(argv)
    except (ValueError, FileNotFoundError) as error:
        if os.environ.get("LIT_FSDP_TRACEBACK"):
            raise
        # Every rank raises an error the ranks agreed on (a non-finite step, a checkpoint that could not be
        # written): one of them says it.
        if not isinstance(error, RunError) or rank_zero_only.rank == 0:
            print(f"lit_fsdp: error: {error_line(error)} (LIT_FSDP_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
