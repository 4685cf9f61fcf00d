"""Small deterministic Wikipedia-format corpora (JSON array or JSON Lines) and a WikipediaDataModule over them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

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


def datamodule(path: Path, cache: Path, **overrides) -> WikipediaDataModule:
    kwargs = dict(vocab_size=300, seq_len=16, batch_size=2, cache_dir=str(cache))
    return WikipediaDataModule(train_path=str(path), **{**kwargs, **overrides})
