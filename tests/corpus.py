"""Small deterministic Wikipedia-format corpora (JSON array, JSON Lines, Parquet files and shards) and a
WikipediaDataModule over them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lit_fsdp.data.wikipedia import WikipediaDataModule

WORDS = "the cat sat on a mat while dogs ran past old red barns near quiet rivers under grey skies".split()


def articles(count: int = 12) -> list[dict[str, str]]:
    """Small deterministic articles of different lengths."""
    rng = np.random.default_rng(0)
    return [
        {"id": str(i), "title": f"Article {i}", "text": " ".join(rng.choice(WORDS, size=40 + 10 * i)) + " ."}
        for i in range(count)
    ]


def write_array(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records, indent=1))
    return path


def write_lines(path: Path, records: list) -> Path:
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    return path


def wikimedia_rows(records: list[dict]) -> list[dict]:
    """The columns of the ``wikimedia/wikipedia`` shards: id, url, title, text."""
    return [{"id": r["id"], "url": f"https://en.wikipedia.org/wiki?curid={r['id']}", "title": r["title"],
             "text": r["text"]} for r in records]


def write_parquet(path: Path, records: list[dict], row_group_size: int = 2) -> Path:
    """A column for every key of any record, null where a record lacks it."""
    keys = list(dict.fromkeys(key for record in records for key in record))
    pq.write_table(pa.table({key: [record.get(key) for record in records] for key in keys}), path,
                   row_group_size=row_group_size)
    return path


def write_shards(folder: Path, records: list[dict], shards: int = 3) -> Path:
    """``records`` split over ``train-0000N-of-0000M.parquet`` files, as the wikimedia/wikipedia dataset names them."""
    folder.mkdir(parents=True, exist_ok=True)
    for n, part in enumerate(np.array_split(np.arange(len(records)), shards)):
        write_parquet(folder / f"train-{n:05d}-of-{shards:05d}.parquet", wikimedia_rows([records[i] for i in part]))
    (folder / "README.md").write_text("not a shard: a folder's other files are left alone\n")
    return folder


def datamodule(path: Path, cache: Path, **overrides) -> WikipediaDataModule:
    kwargs = dict(vocab_size=300, seq_len=16, batch_size=2, cache_dir=str(cache))
    return WikipediaDataModule(train_path=str(path), **{**kwargs, **overrides})
