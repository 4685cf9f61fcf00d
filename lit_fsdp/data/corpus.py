"""Corpus files as users have them: JSON arrays, JSON Lines (plain, ``.gz`` or ``.zst``), Parquet, and a folder or
glob of such files (the ``wikimedia/wikipedia`` shards as downloaded, ``20231101.en/train-000NN-of-000MM.parquet``),
also by a Hub data set's name and subfolder (``wikimedia/wikipedia:20231101.en``, ``lit_fsdp.hub.dataset_path``).

A ``Corpus`` is its files read one after the other as one stream of records. A record's document is its title and
text joined by a newline (the text alone without a title). JSON is streamed record by record and Parquet read in
record batches of ``ROWS_PER_BATCH`` rows of the needed columns only, so memory does not grow with the corpus. A bad
file fails in one line naming the file and the record, line, row or batch.
"""

from __future__ import annotations

import glob
import gzip
import io
import itertools
import json
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import ijson
import pyarrow as pa
import pyarrow.parquet as pq

from lit_fsdp.hub import dataset_path

#: Parquet rows converted to Python strings at a time: under 1 MB of Wikipedia articles (3 kB each on average).
ROWS_PER_BATCH = 256
#: Parquet is read through a buffer of this many bytes. pyarrow still decodes a row group of the columns read at a
#: time (a few MB in the wikimedia/wikipedia shards), so that, never the whole file, is what reading holds.
_PARQUET_BUFFER = 1 << 20
_COMPRESSED = {".gz": "gzip", ".zst": "zstd"}
#: What the corpus files of a folder end with (other files in it, a README or checksums, are left alone).
SUFFIXES = (".parquet", ".json", ".jsonl", ".json.gz", ".jsonl.gz", ".json.zst", ".jsonl.zst")
_READ_ERRORS = (OSError, EOFError, zlib.error, pa.ArrowException)

T = TypeVar("T")


@dataclass(frozen=True)
class Corpus:
    """Files read in order as one corpus; ``spec`` is what the user gave (a file, folder or glob), made absolute."""

    spec: str
    files: tuple[Path, ...]
    text_field: str = "text"

    @classmethod
    def of(cls, source: Corpus | str | Path) -> Corpus:
        """``source`` itself if it is a Corpus, else the corpus of the one file ``source``."""
        if isinstance(source, Corpus):
            return source
        path = Path(source).expanduser().absolute()
        return cls(str(path), (path,))

    def __str__(self) -> str:
        return self.spec

    @property
    def name(self) -> str:
        """For progress lines: the file's name, the folder's name or the glob's last part."""
        return Path(self.spec).name

    @property
    def stem(self) -> str:
        """For cache folders and run names: a file's name without its corpus suffixes, a folder's name, or a
        glob's last folder without wildcards (``20231101.en`` for ``.../20231101.en/train-*.parquet``)."""
        path = Path(self.spec)
        if glob.has_magic(self.spec):
            path = next(parent for parent in path.parents if not glob.has_magic(str(parent)))
            return path.name
        if len(self.files) == 1 and self.files[0] == path:
            for suffix in sorted(SUFFIXES, key=len, reverse=True):
                if path.name.endswith(suffix) and len(path.name) > len(suffix):
                    return path.name[: -len(suffix)]
        return path.name

    def identity(self) -> Any:
        """What identifies the corpus's content cheaply: every file's path, size and mtime, and the text field."""
        if len(self.files) == 1 and self.text_field == "text":
            return source_identity(self.files[0])  # as a single JSON file's caches have always been keyed
        return {"files": [source_identity(file) for file in self.files], "text_field": self.text_field}

    def each_file(self, read: Callable[[Path], Iterator[tuple[T, int]]]) -> Iterator[tuple[T, int]]:
        """``read(file)``'s ``(item, bytes of the file read)`` for every file in turn, bytes counted over the corpus."""
        before = 0
        for file in self.files:
            for item, bytes_read in read(file):
                yield item, before + bytes_read
            before += file.stat().st_size

    def documents(self, max_documents: int | None = None, skip: int = 0) -> Iterator[tuple[str, int]]:
        """``(document, bytes of the corpus read)`` of documents ``skip`` to ``max_documents`` (the first ``skip`` are
        passed over: whole Parquet files and row groups without reading them)."""
        limit = None if max_documents is None else max(max_documents - skip, 0)
        to_skip = skip

        def read(file: Path) -> Iterator[tuple[str, int]]:  # called as each file's turn comes
            nonlocal to_skip
            if is_parquet(file):
                parquet = _open_parquet(file, self.text_field)
                passed = min(to_skip, parquet.metadata.num_rows)
                to_skip -= passed
                if passed == parquet.metadata.num_rows:
                    return iter(())
                return _parquet_documents(file, parquet, self.text_field, passed)
            documents = _json_documents(file, self.text_field)
            to_skip -= sum(1 for _ in itertools.islice(documents, to_skip))
            return documents

        return itertools.islice(self.each_file(read), limit)


def is_parquet(path: Path) -> bool:
    return path.name.endswith(".parquet")


def is_plain_json(path: Path) -> bool:
    return not is_parquet(path) and path.suffix not in _COMPRESSED


# ---------------------------------------------------------------------------------------------------- opening


def open_corpus(
    spec: str | Path, flag: str, text_field: str | None = "text", records: str = "articles",
    listed: str = "a JSON array or JSON Lines file", objects: str = "objects",
) -> Corpus:
    """The corpus a path gives (a file, a folder of corpus files, a glob, or a Hub data set's subfolder
    ``owner/name[@revision]:subfolder``), after a cheap check of every file.

    Called when the DataModule is built, so a missing file, an unreadable or compressed-wrong file, or a Parquet
    shard without a string ``text_field`` column fails before any worker process starts (a Parquet check reads the
    footer only). ``text_field`` None skips the column check (chat samples say what they lack row by row);
    ``records``, ``listed`` and ``objects`` say in the messages what the files hold.
    """
    given = str(Path(dataset_path(str(spec), flag)).expanduser())
    path = Path(given).absolute()
    formats = (f"{listed}, .jsonl.gz, .jsonl.zst, Parquet, a folder or glob of them, or a Hub data set "
               "owner/name:subfolder")
    if glob.has_magic(given) and not path.exists():
        files = [Path(name) for name in sorted(glob.glob(str(path), recursive=True)) if Path(name).is_file()]
        if not files:
            raise FileNotFoundError(f"{flag} {path}: no file matches the pattern; give {formats} of {records}")
    elif path.is_dir():
        files = sorted(file for file in path.iterdir()
                       if file.is_file() and not file.name.startswith(".") and file.name.endswith(SUFFIXES))
        if not files:
            raise FileNotFoundError(f"{flag} {path}: the folder holds no {', '.join(SUFFIXES)} file; give {formats} "
                                    f"of {records}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"{flag} {path}: no such file; give {formats} of {records}")
    for file in files:
        _check_file(file, flag, text_field, objects)
    return Corpus(str(path), tuple(files), text_field or "text")


def _check_file(path: Path, flag: str, text_field: str | None, objects: str) -> None:
    if is_parquet(path):
        try:
            _open_parquet(path, text_field)
        except ValueError as error:
            raise ValueError(f"{flag} {error}") from None
        return
    try:
        first = first_char(path)
    except _READ_ERRORS as error:
        raise ValueError(f"{flag} {path}: cannot read it as {_COMPRESSED[path.suffix]} ({_first_line(error)}); "
                         "give the file as downloaded, or decompressed") from None
    if first not in ("[", "{"):
        found = "it is empty" if first is None else f"it starts with {first!r}"
        raise ValueError(
            f"{flag} {path}: {found}, but a JSON array ('[') or JSON Lines of {objects} ('{{') was expected"
        )


def first_char(path: Path) -> str | None:
    """The first non-blank character of a (decompressed) file: ``[`` for a JSON array, ``{`` for JSON Lines, None
    when blank."""
    with _binary(path) as (file, _):
        while chunk := file.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1].decode("latin-1")
    return None


@contextmanager
def _binary(path: Path) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """The file's decompressed bytes, and a function telling how many bytes of the file itself have been read."""
    with open(path, "rb") as raw:
        codec = _COMPRESSED.get(path.suffix)
        if codec == "gzip":
            stream: Any = gzip.GzipFile(fileobj=raw)
        elif codec == "zstd":  # pyarrow's zstd codec, so no other package is needed for it
            stream = io.BufferedReader(pa.CompressedInputStream(raw, "zstd"), _PARQUET_BUFFER)
        else:
            stream = raw
        yield stream, raw.tell


def source_identity(path: Path) -> dict[str, Any]:
    """What identifies a source file's content cheaply: its absolute path, size and modification time."""
    stat = path.stat()
    return {"path": str(path.absolute()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


# ---------------------------------------------------------------------------------------------------- reading


def read_documents(source: Corpus | Path, max_documents: int | None = None) -> Iterator[str]:
    """Each record's ``title + "\\n" + text`` (the first ``max_documents``), streamed from a corpus or one file."""
    return (text for text, _ in Corpus.of(source).documents(max_documents))


def read_documents_with_offsets(source: Corpus | Path, max_documents: int | None = None) -> Iterator[tuple[str, int]]:
    """``read_documents`` paired with how many bytes of the corpus have been read so far (for progress)."""
    return Corpus.of(source).documents(max_documents)


def _document(title: Any, text: str) -> str:
    return f"{title}\n{text}" if title else text


def _json_documents(path: Path, text_field: str) -> Iterator[tuple[str, int]]:
    for where, record, offset in file_records(path):
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{path}: {where} has no string {text_field!r} field; every article needs one "
                             "(--data.text_field names the field)")
        yield _document(record.get("title"), text), offset


def file_records(path: Path) -> Iterator[tuple[str, Any, int]]:
    """``(where, record, bytes of the file read)`` for every record of one file, any format; ``where`` is ``record 3``
    (a JSON array, counted from 0), ``line 4`` (JSON Lines) or ``row 5`` (Parquet, counted from 0)."""
    if is_parquet(path):
        yield from _parquet_rows(path)
        return
    with _binary(path) as (file, position):
        array = first_char(path) == "["
        try:
            yield from (_array_records if array else _line_records)(path, file, position)
        except _READ_ERRORS as error:
            raise ValueError(f"{path}: cannot read it to the end ({_first_line(error)}); the file is damaged or cut "
                             "short: give it again as downloaded") from None


def _array_records(path: Path, file: BinaryIO, position: Callable[[], int]) -> Iterator[tuple[str, Any, int]]:
    index = 0  # of the record being parsed; after the last one, an error is trailing garbage
    try:
        for record in ijson.items(file, "item"):
            yield f"record {index}", record, position()
            index += 1
    except ijson.JSONError as error:
        # ijson reads in 64 KiB buffers, so the byte offset is where the parser stopped, not the exact byte.
        raise ValueError(
            f"{path}: malformed JSON in record {index} (parser stopped at byte {position()}): {_first_line(error)}"
        ) from None


def _line_records(path: Path, file: BinaryIO, position: Callable[[], int]) -> Iterator[tuple[str, Any, int]]:
    for number, line in enumerate(file, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(
                f"{path}: malformed JSON on line {number} ({_first_line(error)}); JSON Lines needs one object per line"
            ) from None
        yield f"line {number}", record, position()


def _open_parquet(path: Path, text_field: str | None) -> pq.ParquetFile:
    """The Parquet file (its footer read), checked to have a string column ``text_field`` unless that is None."""
    try:
        parquet = pq.ParquetFile(path, buffer_size=_PARQUET_BUFFER, pre_buffer=False)
    except _READ_ERRORS as error:
        raise ValueError(f"{path}: not a readable Parquet file ({_first_line(error)}); give the shard as "
                         "downloaded") from None
    schema = parquet.schema_arrow
    if text_field is not None:
        if text_field not in schema.names:
            raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); name the text "
                             "column with --data.text_field")
        kind = schema.field(text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
            raise ValueError(f"{path}: column {text_field!r} holds {kind}, not strings; name the text column with "
                             "--data.text_field")
    return parquet


def _parquet_batches(path: Path, parquet: pq.ParquetFile, columns: list[str] | None,
                     skip: int = 0) -> Iterator[tuple[int, pa.RecordBatch]]:
    """``(first row, batch)`` of the rows from ``skip`` on, row groups before it not read at all."""
    meta, group, row = parquet.metadata, 0, 0
    while group < meta.num_row_groups and row + meta.row_group(group).num_rows <= skip:
        row += meta.row_group(group).num_rows
        group += 1
    batches = parquet.iter_batches(ROWS_PER_BATCH, row_groups=range(group, meta.num_row_groups), columns=columns)
    for number in itertools.count():
        try:
            batch = next(batches, None)
        except _READ_ERRORS as error:
            last = min(row + ROWS_PER_BATCH, meta.num_rows) - 1
            raise ValueError(f"{path}: batch {number} (rows {row} to {last}) is unreadable "
                             f"({_first_line(error)}); the shard is damaged: give it again as downloaded") from None
        if batch is None:
            return
        if row < skip:
            batch = batch.slice(skip - row)
            row = skip
        yield row, batch
        row += batch.num_rows


def _parquet_documents(path: Path, parquet: pq.ParquetFile, text_field: str, skip: int) -> Iterator[tuple[str, int]]:
    has_title = "title" in parquet.schema_arrow.names and text_field != "title"
    columns = [text_field, "title"] if has_title else [text_field]
    size, total = path.stat().st_size, max(parquet.metadata.num_rows, 1)
    for first, batch in _parquet_batches(path, parquet, columns, skip):
        texts = batch.column(text_field)
        if texts.null_count:
            row = first + texts.is_null().to_pylist().index(True)
            raise ValueError(f"{path}: row {row} has a null {text_field!r}, not a string; every article needs one")
        titles = batch.column("title").to_pylist() if has_title else itertools.repeat(None)
        for row, (title, text) in enumerate(zip(titles, texts.to_pylist()), start=first + 1):
            yield _document(title, text), size * row // total


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any, int]]:
    parquet = _open_parquet(path, None)
    size, total = path.stat().st_size, max(parquet.metadata.num_rows, 1)
    for first, batch in _parquet_batches(path, parquet, None):
        for row, record in enumerate(batch.to_pylist(), start=first):
            # Every row has every column; a null is a field the record does not have (JSON Lines would leave it out).
            record = {key: value for key, value in record.items() if value is not None}
            yield f"row {row}", record, size * (row + 1) // total


def _first_line(error: Exception) -> str:
    reason = error.args[0] if error.args else ""
    # The yajl backend reports some errors as bytes, and its messages go on to draw a multi-line caret.
    text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
    lines = text.strip().splitlines()
    return lines[0] if lines else type(error).__name__
