"""Entry point: ``python -m lit_fsdp`` (or ``lit-fsdp``) with fit/validate/test/predict, tune, export, generate, evaluate,
hardware or compressors."""

from __future__ import annotations

import os
import sys

#: Commands that run in this one process, each a function whose signature is its command line.
SINGLE_PROCESS_COMMANDS = {
    "export": "lit_fsdp.export:export_hf",
    "generate": "lit_fsdp.generate:generate",
    "evaluate": "lit_fsdp.evaluate:evaluate",
    "hardware": "lit_fsdp.tune.hardware:hardware",
}


def root_cause(error: BaseException) -> BaseException:
    """The first error raised: jsonargparse wraps errors from constructors in its own."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def error_line(error: BaseException) -> str:
    """The one line that says what was wrong.

    A constructor's error (``SlideFSDPStrategy(window=0)``) can reach us only as one entry of
    jsonargparse's list of failed Union alternatives ("Errors: - Expected a <class 'str'> - ..."):
    the entry that is not a type mismatch is the one to show.
    """
    text = str(error)
    if "\nErrors:\n" in text:
        entries = [line.strip()[2:] for line in text.split("\nErrors:\n", 1)[1].splitlines() if line.strip().startswith("- ")]
        specific = [entry for entry in entries if not entry.startswith("Expected a ")]
        if specific:
            return specific[0]
    lines = str(root_cause(error)).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["compressors"]:
            from compress.config import describe_methods

            print(describe_methods())
        elif args[:1] == ["tune"]:
            from lit_fsdp.tune.command import main as tune

            tune(args[1:])
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
        print(f"lit_fsdp: error: {error_line(error)} (LIT_FSDP_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
