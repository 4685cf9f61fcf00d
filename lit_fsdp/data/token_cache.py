"""Tokenise a corpus's documents (``lit_fsdp.data.corpus``) once into a memory-mapped cache.

A cache is a folder holding ``tokens.bin`` (every document's token ids, with the eos id between documents),
``progress.json`` (how many documents and tokens of ``tokens.bin`` are durable) and ``meta.json`` (written
last; ``finalized: true``). A killed build resumes from ``progress.json``; readers open finalized caches only.
In a multi-process run local rank 0 builds while the other ranks wait on the filesystem (``wait_or_build``).
"""

from __future__ import annotations

import builtins
import fcntl
import hashlib
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from transformers import PreTrainedTokenizerBase

from lit_fsdp.data.corpus import Corpus
from lit_fsdp.data.progress import CorpusProgress
from lit_fsdp.data.tokenizer import encode_documents, tokenizer_fingerprint

#: Characters of documents committed together (written, synced, recorded in progress.json): the most work a killed
#: build redoes. A chunk's texts and tokens are held until then, a few bytes a character.
CHARACTERS_PER_CHUNK = 4_000_000
#: Characters of documents encoded in one batch: bounds the memory the tokenizer's output takes (about 50 bytes a
#: character, as Rust encodings and then Python lists) while leaving each batch enough documents for every core.
CHARACTERS_PER_BATCH = 500_000

_TOKENS, _PROGRESS, _META, _FAILED, _LOCK, _HEARTBEAT = "tokens.bin", "progress.json", "meta.json", "failed", "lock", "heartbeat"


# ---------------------------------------------------------------------------------------------------- building


def build_token_cache(
    directory: Path, source: Corpus | Path, tokenizer: PreTrainedTokenizerBase, max_documents: int | None = None
) -> dict[str, Any]:
    """Tokenise the first ``max_documents`` documents of ``source`` into ``directory``, resuming a killed build.

    Documents are encoded ``CHARACTERS_PER_BATCH`` at a time by the fast tokenizer's batch encoding (Rust threads on
    every core), and committed to ``progress.json`` ``CHARACTERS_PER_CHUNK`` at a time once their tokens are on disk,
    so a resumed build skips the committed documents (whole Parquet row groups unread) and ends with the same tokens
    as an uninterrupted one. Memory depends on those two sizes, not on the corpus's. Rank 0 shows its progress
    (``CorpusProgress``). Returns the cache's description for ``meta.json``; finalizing is ``wait_or_build``'s job.
    """
    corpus = Corpus.of(source)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if len(tokenizer) <= 2**16 else np.uint32)
    progress = _read_json(directory / _PROGRESS) or {"documents": 0, "tokens": 0}
    done, committed = progress["documents"], progress["tokens"]
    documents = corpus.documents(max_documents, skip=done)
    rank_zero_info(f"Tokenizing {corpus} into {directory}" + (f", resuming after {done} documents" if done else ""))

    (directory / _TOKENS).touch()
    with (
        open(directory / _TOKENS, "r+b") as file,
        CorpusProgress(f"Tokenizing {corpus.name}", corpus.files, max_documents, documents=done, tokens=committed) as shown,
    ):
        # Bytes past the last commit belong to a chunk whose documents will be tokenised again.
        file.truncate(committed * dtype.itemsize)
        file.seek(0, os.SEEK_END)
        for chunk, bytes_read in _chunks(documents, CHARACTERS_PER_CHUNK):
            tokens = _chunk_tokens(tokenizer, chunk, done, dtype)
            file.write(tokens.tobytes())
            file.flush()
            os.fsync(file.fileno())
            done, committed = done + len(chunk), committed + len(tokens)
            _write_json(directory / _PROGRESS, {"documents": done, "tokens": committed})
            shown.update(done, bytes_read, committed)
        if committed == 0:
            raise ValueError(f"{corpus}: the corpus is empty ({done} documents, no tokens); give a file with article text")
    return {"source": corpus.identity(), "documents": done, "tokens": committed, "dtype": dtype.name}


def _chunk_tokens(tokenizer: PreTrainedTokenizerBase, chunk: list[str], first: int, dtype: np.dtype) -> np.ndarray:
    """The tokens of documents ``first, first + 1, ...`` of the corpus, encoded ``CHARACTERS_PER_BATCH`` at a time.

    The eos id goes before every document but the corpus's first, so a chunk's tokens depend only on its own
    documents and their position in the corpus.
    """
    eos, pieces = np.array([tokenizer.eos_token_id], dtype=dtype), []
    for batch, _ in _chunks(zip(chunk, itertools.repeat(0)), CHARACTERS_PER_BATCH):
        for ids in encode_documents(tokenizer, batch):
            if pieces or first:
                pieces.append(eos)
            pieces.append(np.array(ids, dtype=dtype))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype)


def _chunks(documents: Iterable[tuple[str, int]], characters: int) -> Iterator[tuple[list[str], int]]:
    """Consecutive texts grouped until each group holds at least ``characters`` characters (the last may hold fewer).

    ``documents`` are ``(text, bytes read)`` pairs; each group comes with the bytes read after its last text.
    """
    chunk, size, bytes_read = [], 0, 0
    for text, bytes_read in documents:
        chunk.append(text)
        size += len(text)
        if size >= characters:
            yield chunk, bytes_read
            chunk, size = [], 0
    if chunk:
        yield chunk, bytes_read


#: How long ranks wait for local rank 0's build by default: generous, a multi-GB corpus takes a while.
WAIT_TIMEOUT_S = 6 * 3600.0
#: Local rank 0 touches its heartbeat this often while it builds; a heartbeat this old means it is gone.
HEARTBEAT_S, STALE_AFTER_S = 5.0, 60.0


class BuilderLostError(ValueError):
    """Local rank 0 stopped building a cache the other ranks wait for, or took longer than the deadline."""


def wait_or_build(
    directory: Path, build: Callable[[Path], dict[str, Any]], local_rank: int, poll_seconds: float = 1.0,
    timeout_s: float = WAIT_TIMEOUT_S, stale_after_s: float = STALE_AFTER_S,
) -> dict[str, Any]:
    """The ``meta.json`` of the finalized ``directory``, built by local rank 0 while the other ranks wait.

    Rank 0 runs ``build(directory)`` (unless a finalized build is there) and writes ``meta.json`` from what it
    returns; if the build raises, it writes the one-line error to a ``failed`` marker. Other ranks poll the
    filesystem rather than block in a collective, so a long build never trips the process-group timeout,
    and they raise rank 0's error if it fails. Rank 0 keeps a heartbeat file fresh while it works: a waiting
    rank that finds rank 0's process gone, or its heartbeat older than ``stale_after_s``, or that has waited
    ``timeout_s``, stops with a one-line error instead of waiting forever.
    """
    if local_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        with Heartbeat(directory / _HEARTBEAT), open(directory / _LOCK, "w") as lock:
            # Another job building the same cache holds the lock; wait for it rather than interleave writes.
            fcntl.flock(lock, fcntl.LOCK_EX)
            meta = _finalized_meta(directory)
            if meta is None:
                (directory / _FAILED).unlink(missing_ok=True)
                try:
                    meta = {**build(directory), "finalized": True}
                except Exception as error:
                    _write_atomic(directory / _FAILED, f"{type(error).__name__}: {' '.join(str(error).split())}\n")
                    raise
                _write_json(directory / _META, meta)
        return meta

    started, began = time.monotonic(), time.time()
    while (meta := _finalized_meta(directory)) is None:
        # A marker left by an earlier failed run can be read before rank 0 clears it; the same inputs would
        # fail the same way, and a rerun after rank 0 succeeds finds the finalized build.
        if (directory / _FAILED).exists():
            _raise_failure((directory / _FAILED).read_text().strip())
        waited = time.monotonic() - started
        gone = _builder_gone(directory / _HEARTBEAT, began, waited, stale_after_s)
        if gone is not None or waited > timeout_s:
            what = gone or f"has not finished after {waited:.0f} s (--data.wait_timeout_s {timeout_s:g})"
            raise BuilderLostError(
                f"local rank 0, building {directory}, {what}; rerun the same command (the build resumes where it "
                "stopped) and read rank 0's log for why it stopped"
            )
        time.sleep(poll_seconds)
    return meta


class Heartbeat:
    """While open, a thread rewrites ``path`` (pid, host, time) every ``HEARTBEAT_S`` seconds."""

    def __init__(self, path: Path):
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="lit-fsdp-heartbeat", daemon=True)

    def _beat(self) -> None:
        while True:
            _write_json(self.path, {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()})
            if self._stop.wait(HEARTBEAT_S):
                return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _builder_gone(heartbeat: Path, began: float, waited: float, stale_after_s: float) -> str | None:
    """Why the builder is gone (its process ended, its heartbeat stopped), or None while it seems alive."""
    try:
        beat = json.loads(heartbeat.read_text())
    except (FileNotFoundError, ValueError):
        beat = None
    if beat is not None and beat["time"] >= began - 2 * HEARTBEAT_S and beat["host"] == socket.gethostname():
        try:  # written by this run's builder on this machine: is the process still there?
            os.kill(beat["pid"], 0)
        except ProcessLookupError:
            return f"(pid {beat['pid']}) has exited"
        except PermissionError:
            pass
    if waited > stale_after_s:
        if beat is None:
            return f"never started (no heartbeat after {waited:.0f} s)"
        age = time.time() - beat["time"]
        if age > stale_after_s:
            return f"(pid {beat['pid']} on {beat['host']}) stopped its heartbeat {age:.0f} s ago"
    return None


def _raise_failure(line: str) -> None:
    kind, _, message = line.partition(": ")
    error_type = getattr(builtins, kind, None)
    if not (isinstance(error_type, type) and issubclass(error_type, Exception)):
        error_type, message = RuntimeError, line
    raise error_type(message)


def _finalized_meta(directory: Path) -> dict[str, Any] | None:
    meta = _read_json(directory / _META)
    return meta if meta is not None and meta.get("finalized") else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _write_json(path: Path, content: dict[str, Any]) -> None:
    _write_atomic(path, json.dumps(content, indent=2))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a reader (or a resumed build) sees either the old or the new content, never a mix."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


# ---------------------------------------------------------------------------------------------------- serving


class MappedTokens:
    """Read-only memory map of a finalized cache's tokens that pickles as its path.

    DataLoader workers started by spawn or forkserver re-map the file instead of receiving a copy of it.
    """

    def __init__(self, path: Path, dtype: str, length: int):
        self.path, self.dtype, self.length = path, dtype, length
        self._array: np.memmap | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: Any) -> np.ndarray:
        if self._array is None:
            self._array = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.length,))
        return self._array[index]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None}


def open_tokens(directory: Path) -> MappedTokens:
    """The tokens of the cache in ``directory``, which must be finalized."""
    meta = _finalized_meta(directory)
    if meta is None:
        raise FileNotFoundError(f"{directory} holds no finalized token cache; build it with wait_or_build first")
    path, dtype = directory / _TOKENS, np.dtype(meta["dtype"])
    if path.stat().st_size != meta["tokens"] * dtype.itemsize:
        raise ValueError(f"{path} does not hold the {meta['tokens']} tokens its meta.json records; delete {directory}")
    return MappedTokens(path, dtype.name, meta["tokens"])


# ---------------------------------------------------------------------------------------------------- a file's cache


def cache_dir_or_default(cache_dir: str | Path | None) -> Path:
    """``cache_dir``, else ``$LIT_FSDP_CACHE``, else ``~/.cache/lit_fsdp/tokens``."""
    return Path(cache_dir or os.environ.get("LIT_FSDP_CACHE") or "~/.cache/lit_fsdp/tokens").expanduser()


def cache_key(**parts: Any) -> str:
    """A short stable hash of what a cached artifact was built from."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def cached_tokens(
    source: Corpus | Path, tokenizer: PreTrainedTokenizerBase, cache_dir: Path, max_documents: int | None = None,
    local_rank: int = 0, wait_timeout_s: float = WAIT_TIMEOUT_S,
) -> MappedTokens:
    """The token stream of ``source``, built once into ``cache_dir`` (keyed by the files, tokenizer and ``max_documents``).

    The stream does not depend on the sequence length, so ``fit`` and ``evaluate`` with any ``seq_len`` share it.
    """
    corpus = Corpus.of(source)
    key = cache_key(source=corpus.identity(), tokenizer=tokenizer_fingerprint(tokenizer), max_documents=max_documents)
    directory = cache_dir / f"tokens-{corpus.stem}-{key}"
    build = partial(build_token_cache, source=corpus, tokenizer=tokenizer, max_documents=max_documents)
    wait_or_build(directory, build, local_rank, timeout_s=wait_timeout_s)
    return open_tokens(directory)
