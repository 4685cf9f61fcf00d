"""Progress of a pass over a corpus file (tokenising it, training a BPE on it), shown by rank 0.

On a terminal it is a tqdm bar redrawn a few times a second; in a log (a file, a job's output) it is one
plain line every ``LINE_INTERVAL_S`` seconds. Either way it tells documents and tokens done, megabytes read,
the read rate and an estimate of the time left.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

from lightning.pytorch.utilities import rank_zero_only

_MB = 1e6
_TERMINAL_REDRAW_S = 0.2
#: Seconds between two progress lines when the output is not a terminal.
LINE_INTERVAL_S = 5.0


def duration(seconds: float) -> str:
    """``seconds`` as ``1h02m``, ``4m10s`` or ``12s``."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class CorpusProgress:
    """Documents, tokens and bytes of ``source`` done so far, reported on global rank 0 only.

    The fraction done is the share of the file's bytes read, or of ``max_documents`` when that is reached
    first; the time left assumes the rate so far holds.
    """

    def __init__(
        self,
        action: str,
        source: Path | Sequence[Path],
        max_documents: int | None = None,
        documents: int = 0,
        tokens: int | None = None,
        stream: TextIO | None = None,
    ):
        """
        Args:
            action: What is being done, e.g. ``Tokenizing train.json``; starts every line.
            source: The file (or files, read one after the other) being read; their size is the total.
            max_documents: Documents the pass stops after, if it is limited.
            documents: Documents already done when the pass starts (a resumed build).
            tokens: Tokens already done, or None when the pass makes no tokens (BPE training).
            stream: Where to write; default standard error.
        """
        self.action = action
        files = [source] if isinstance(source, Path) else source
        self.total_bytes = sum(file.stat().st_size for file in files)
        self.max_documents = max_documents
        self.documents, self.tokens, self.bytes_read = documents, tokens, 0
        self.stream = stream or sys.stderr
        self.enabled = rank_zero_only.rank == 0
        terminal = self.enabled and self.stream.isatty()
        self.interval_s = _TERMINAL_REDRAW_S if terminal else LINE_INTERVAL_S
        self._started = self._shown = time.monotonic()
        self._bar = None
        if terminal:
            from tqdm import tqdm

            self._bar = tqdm(total=1000, desc=action, file=self.stream, bar_format="{desc} |{bar}|")

    def fraction(self) -> float:
        """Share of the pass done, in [0, 1]."""
        done = self.bytes_read / self.total_bytes if self.total_bytes else 1.0
        if self.max_documents:
            done = max(done, self.documents / self.max_documents)
        return min(done, 1.0)

    def status(self) -> str:
        """``1,204 documents, 3,145,728 tokens, 12.6/1129.2 MB (1%), 4.2 MB/s, 4m22s left``."""
        elapsed = max(time.monotonic() - self._started, 1e-9)
        done = self.fraction()
        parts = [f"{self.documents:,} documents"]
        if self.tokens is not None:
            parts.append(f"{self.tokens:,} tokens")
        parts.append(f"{self.bytes_read / _MB:.1f}/{self.total_bytes / _MB:.1f} MB ({done:.0%})")
        parts.append(f"{self.bytes_read / _MB / elapsed:.1f} MB/s")
        parts.append(f"{duration(elapsed * (1 - done) / done)} left" if done > 0 else "time left unknown")
        return ", ".join(parts)

    def update(self, documents: int, bytes_read: int, tokens: int | None = None) -> None:
        """Record the totals so far (not increments); draws or writes when enough time has passed since the last time."""
        self.documents, self.bytes_read = documents, bytes_read
        if tokens is not None:
            self.tokens = tokens
        if not self.enabled or time.monotonic() - self._shown < self.interval_s:
            return
        self._shown = time.monotonic()
        if self._bar is not None:
            self._bar.n = round(self.fraction() * 1000)
            self._bar.set_description_str(f"{self.action}: {self.status()}", refresh=False)
            self._bar.refresh()
        else:
            print(f"{self.action}: {self.status()}", file=self.stream, flush=True)

    def track(self, documents: Iterable[tuple[str, int]]) -> Iterator[str]:
        """The texts of ``(text, bytes read)`` pairs, counting each as done once it is handed on."""
        for text, bytes_read in documents:
            yield text
            self.update(self.documents + 1, bytes_read)

    def close(self) -> None:
        """Remove the bar and write the final line: what was done and in how long."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elapsed = time.monotonic() - self._started
        tokens = "" if self.tokens is None else f", {self.tokens:,} tokens"
        print(
            f"{self.action}: done, {self.documents:,} documents{tokens}, {self.bytes_read / _MB:.1f} MB in {duration(elapsed)}",
            file=self.stream,
            flush=True,
        )

    def __enter__(self) -> CorpusProgress:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: object) -> None:
        if error_type is None:
            self.close()
        elif self._bar is not None:  # failed or killed: no "done" line, but leave the terminal clean
            self._bar.close()
