"""Errors that end a run with one line: what went wrong, where, and what to do."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any


class OneLineError(ValueError):
    """An error whose message is already the one line to show (not a wrapper to look through)."""


class ErrorBlock(ValueError):
    """An error whose message is a short block, shown whole: a heading line, then one line per item (every unknown key
    of a config at once)."""


class RunError(OneLineError):
    """An error that every rank raises together (a decision they agreed on): printed once, by rank 0."""


def root_cause(error: BaseException) -> BaseException:
    """The first error raised: jsonargparse wraps errors from constructors in its own."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def error_line(error: BaseException) -> str:
    """The one line that says what was wrong.

    A constructor's error (``SlideFSDPStrategy(window=0)``) can reach us only as one entry of
    jsonargparse's list of failed Union alternatives ("Errors: - Expected a <class 'str'> - ..."), nested
    once per Union it sits in (a dataclass inside a strategy's arguments): the first entry, at any depth, that
    is neither a type mismatch nor another Union's failure is the one to show.
    """
    text = str(error)
    if isinstance(error, ErrorBlock):
        return text.strip()
    if isinstance(error, OneLineError):
        return text.strip().splitlines()[0] if text.strip() else type(error).__name__
    if "\nErrors:\n" in text:
        entries = [line.strip()[2:] for line in text.split("\nErrors:\n", 1)[1].splitlines() if line.strip().startswith("- ")]
        specific = [entry for entry in entries
                    if not entry.startswith(("Expected a ", "Does not validate against any of the Union subtypes"))]
        if specific:
            return specific[0]
    lines = str(root_cause(error)).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class PeerLostError(OneLineError):
    """A collective failed because another rank is gone; the message says which collective and which rank."""


_PEER_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
               "nccl", "gloo", "timed out", "watchdog")


def collective_of(error: BaseException) -> tuple[str | None, str | None]:
    """The torch.distributed call that failed, and the code that called it (``file:line``), from the traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    for index, frame in enumerate(frames):
        if frame.filename.endswith("distributed_c10d.py"):
            callers = [f for f in frames[:index] if not f.filename.endswith("c10d_logger.py")]
            where = f"{Path(callers[-1].filename).name}:{callers[-1].lineno}" if callers else None
            return frame.name, where
    return None, None


def lost_peer(error: BaseException, launched: list[Any], rank: int, world: int,
              grace_s: float = 15.0) -> str | None:
    """One line for a collective that failed because a peer died, or None if ``error`` is something else.

    ``launched`` are the processes this rank started (Lightning's launcher on local rank 0): their exit
    codes say which one died. A dying peer's sockets close before its exit status can be read, so each
    is given up to ``grace_s`` (in all) to be reaped: a peer that died is reaped at once, but on a loaded
    machine its teardown has taken more than 3 s (CI); only a peer that is still alive costs the whole grace.
    A rank started by another finds its parent gone instead.
    """
    collective, where = collective_of(error)
    text = re.sub(r"^\[[^\]]*\]\s*", "", " ".join(str(error).split()))  # gloo prefixes its source location
    if collective is None or not any(sign in text.lower() for sign in _PEER_SIGNS):
        return None
    gone = []
    deadline = time.monotonic() + grace_s
    for local_rank, process in enumerate(launched, start=1):
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            gone.append(f"local rank {local_rank} (pid {process.pid}) ended with {how}")
    if not launched and os.getppid() == 1:
        gone.append("local rank 0, which started this process, is gone")
    who = "; ".join(gone) or "another rank stopped answering"
    place = f" called from {where}" if where else ""
    return (f"rank {rank} of {world} failed in {collective}{place} ({text[:160]}): {who}; "
            "see that rank's log for why it stopped")
