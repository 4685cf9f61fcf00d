"""Corpora as distributed: Parquet files, folders and globs of shards, compressed JSON Lines, ``text_field``, a resumed
build of shards, the one-line errors for bad shards, and a cache build whose memory does not grow with the corpus."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lit_fsdp.data import corpus as corpus_module
from lit_fsdp.data import token_cache
from lit_fsdp.data.corpus import open_corpus, read_documents
from lit_fsdp.data.sft import SFTDataModule
from lit_fsdp.data.token_cache import build_token_cache, open_tokens, wait_or_build
from lit_fsdp.data.tokenizer import encode_documents, train_bpe
from tests.corpus import articles, datamodule, wikimedia_rows, write_array, write_lines, write_parquet, write_shards
from tests.helpers import REPO


def write_compressed_lines(path: Path, records: list[dict]) -> Path:
    text = "".join(json.dumps(record) + "\n" for record in records).encode()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text))
    else:
        with pa.output_stream(str(path), compression="zstd") as stream:
            stream.write(text)
    return path


def tokens_of(path: Path | str, cache: Path, **overrides) -> tuple[np.ndarray, str]:
    dm = datamodule(Path(path), cache, **overrides)
    dm.setup("fit")
    return np.asarray(dm.train_set.tokens[:]), dm.dataset_name


FORMATS = {
    "jsonl": lambda root, records: write_lines(root / "wiki.jsonl", records),
    "jsonl.gz": lambda root, records: write_compressed_lines(root / "wiki.jsonl.gz", records),
    "jsonl.zst": lambda root, records: write_compressed_lines(root / "wiki.jsonl.zst", records),
    "parquet": lambda root, records: write_parquet(root / "wiki.parquet", wikimedia_rows(records)),
    "folder": lambda root, records: write_shards(root / "20231101.en", records),
    "glob": lambda root, records: write_shards(root / "20231101.en", records) / "train-*-of-*.parquet",
}
NAMES = {"jsonl": "wiki", "jsonl.gz": "wiki", "jsonl.zst": "wiki", "parquet": "wiki", "folder": "20231101.en",
         "glob": "20231101.en"}


@pytest.mark.parametrize("form", FORMATS)
def test_each_format_gives_the_tokens_of_the_json_it_was_converted_from(tmp_path, form):
    expected, _ = tokens_of(write_array(tmp_path / "wiki.json", articles()), tmp_path / "cache")
    (tmp_path / "converted").mkdir()
    source = FORMATS[form](tmp_path / "converted", articles())
    # The BPE is trained on each corpus too: the same documents in the same order give the same tokenizer.
    tokens, name = tokens_of(source, tmp_path / "cache")
    np.testing.assert_array_equal(tokens, expected)
    assert name == NAMES[form]


def test_text_field_names_the_column_or_field_and_the_title_still_leads(tmp_path):
    expected, _ = tokens_of(write_array(tmp_path / "wiki.json", articles()), tmp_path / "cache")
    renamed = [{"title": r["title"], "body": r["text"], "text": 0} for r in articles()]  # "text" is something else
    parquet = write_parquet(tmp_path / "body.parquet", renamed)
    lines = write_lines(tmp_path / "body.jsonl", renamed)
    for source in (parquet, lines):
        tokens, _ = tokens_of(source, tmp_path / "cache", text_field="body")
        np.testing.assert_array_equal(tokens, expected)
    assert next(read_documents(open_corpus(parquet, "--data.train_path", "body"))).startswith("Article 0\n")


def test_interrupted_build_of_shards_resumes_to_the_identical_cache_without_reading_committed_shards(tmp_path, monkeypatch):
    shards = open_corpus(write_shards(tmp_path / "shards", articles()), "--data.train_path")  # 4 articles a shard
    build = partial(build_token_cache, source=shards, tokenizer=train_bpe(read_documents(shards), 300))
    expected = tmp_path / "clean"
    wait_or_build(expected, build, local_rank=0)

    monkeypatch.setattr(token_cache, "CHARACTERS_PER_CHUNK", 1)  # one document per chunk
    encoded, kill_at = [], 7  # killed in the second shard's second row group
    real_encode, real_batches = token_cache.encode_documents, corpus_module._parquet_batches
    real_iter_batches = pq.ParquetFile.iter_batches
    started, groups_read = [], []

    def encode(tokenizer, texts):
        if len(encoded) == kill_at:
            raise KeyboardInterrupt  # what a kill looks like to the process
        encoded.extend(texts)
        return real_encode(tokenizer, texts)

    def parquet_batches(path, parquet, columns, skip=0):
        started.append((path.name, skip))
        return real_batches(path, parquet, columns, skip)

    def iter_batches(self, *args, row_groups=None, **kwargs):
        groups_read.append(list(row_groups))
        return real_iter_batches(self, *args, row_groups=row_groups, **kwargs)

    monkeypatch.setattr(token_cache, "encode_documents", encode)
    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        wait_or_build(resumed, build, local_rank=0)
    assert json.loads((resumed / "progress.json").read_text())["documents"] == kill_at

    monkeypatch.setattr(corpus_module, "_parquet_batches", parquet_batches)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    kill_at = None
    wait_or_build(resumed, build, local_rank=0)
    assert len(encoded) == len(articles())  # the 7 committed documents were not tokenised again
    # shard 0 (documents 0-3) is not read at all; shard 1 from its second row group (documents 6 and 7) on
    assert started == [("train-00001-of-00003.parquet", 3), ("train-00002-of-00003.parquet", 0)]
    assert groups_read == [[1], [0, 1]]
    np.testing.assert_array_equal(open_tokens(resumed)[:], open_tokens(expected)[:])


def test_encoding_a_chunk_in_batches_gives_the_tokens_of_one_batch(tmp_path, monkeypatch):
    shards = open_corpus(write_shards(tmp_path / "shards", articles()), "--data.train_path")
    build = partial(build_token_cache, source=shards, tokenizer=train_bpe(read_documents(shards), 300))
    wait_or_build(tmp_path / "whole", build, local_rank=0)
    monkeypatch.setattr(token_cache, "CHARACTERS_PER_BATCH", 1)  # a batch per document
    wait_or_build(tmp_path / "batched", build, local_rank=0)
    np.testing.assert_array_equal(open_tokens(tmp_path / "batched")[:], open_tokens(tmp_path / "whole")[:])


def test_sft_reads_parquet_and_compressed_samples_as_their_json_lines(tmp_path):
    records = [{"prompt": f"reverse: a{i} b", "completion": f"b a{i}"} if i % 2 else
               {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}
               for i in range(16)]
    train_bpe([json.dumps(r) for r in records] + ["<|user|> <|assistant|>"], 300).save_pretrained(tmp_path / "tok")
    sources = {
        "jsonl": write_lines(tmp_path / "chat.jsonl", records),
        "zst": write_compressed_lines(tmp_path / "chat.jsonl.zst", records),
        "parquet": write_parquet(tmp_path / "chat.parquet", records, row_group_size=5),  # nulls where a key is absent
    }
    caches = {}
    for form, path in sources.items():
        dm = SFTDataModule(str(path), tokenizer_path=str(tmp_path / "tok"), seq_len=32, batch_size=2,
                           cache_dir=str(tmp_path / "cache"))
        dm.setup("fit")
        caches[form] = {name: np.asarray(array) for name, array in dm.train_set.arrays().items()}
    for form in ("zst", "parquet"):
        assert caches[form].keys() == caches["jsonl"].keys()
        for name, array in caches["jsonl"].items():
            np.testing.assert_array_equal(caches[form][name], array, err_msg=f"{form}: {name}")


def test_batch_encoding_gives_the_ids_of_the_tokenizer_call_even_with_truncation_set(tmp_path):
    texts = [f"{a['title']}\n{a['text']}" for a in articles()]
    tokenizer = train_bpe(texts, 300)
    expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert encode_documents(tokenizer, texts) == expected
    tokenizer.backend_tokenizer.enable_truncation(8)  # a tokenizer.json may ship with it; documents must not be cut
    assert encode_documents(tokenizer, texts) == expected


# ---------------------------------------------------------------------------------------------------- bad input


def corrupt_row_group(path: Path, group: int, column: int) -> Path:
    """Overwrite one column chunk of one row group: the footer still reads, that batch does not."""
    chunk = pq.read_metadata(path).row_group(group).column(column)
    data = bytearray(path.read_bytes())
    start, size = chunk.data_page_offset, chunk.total_compressed_size
    data[start : start + size] = b"\xff" * size
    path.write_bytes(data)
    return path


def truncated(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def not_zstd(path: Path) -> Path:
    path.write_bytes(b'{"text": "plain JSON Lines named .zst"}\n')
    return path


def empty_folder(path: Path) -> Path:
    path.mkdir()
    return path


def big_gzip(path: Path) -> Path:
    """A gzip file cut short after its first lines: it opens, and fails part-way."""
    records = [{"title": "t", "text": f"{i} " * 200} for i in range(400)]
    return truncated(write_compressed_lines(path, records))


GOOD = articles(6)
AT_CONSTRUCTION = {
    "missing-column": (lambda d: write_parquet(d / "bad.parquet", [{"id": "0", "body": "x"}]),
                       r"bad\.parquet: no column 'text' \(columns: id, body\); name the text column with --data\.text_field"),
    "non-string-column": (lambda d: write_parquet(d / "bad.parquet", [{"text": 5}]),
                          r"bad\.parquet: column 'text' holds int64, not strings"),
    "truncated-shard": (lambda d: truncated(write_parquet(d / "bad.parquet", wikimedia_rows(GOOD))),
                        r"bad\.parquet: not a readable Parquet file \(Parquet magic bytes not found"),
    "not-zstd": (lambda d: not_zstd(d / "bad.jsonl.zst"), r"bad\.jsonl\.zst: cannot read it as zstd"),
    "bad-shard-in-folder": (lambda d: write_parquet(write_shards(d / "bad", GOOD) / "x.parquet", [{"body": "x"}]),
                            r"bad/x\.parquet: no column 'text'"),
    "no-match": (lambda d: d / "none-*.parquet", r"none-\*\.parquet: no file matches the pattern"),
    "empty-folder": (lambda d: empty_folder(d / "bad"), r"bad: the folder holds no \.parquet"),
}
IN_SETUP = {
    "null-text": (lambda d: write_parquet(d / "bad.parquet", [*GOOD[:5], {"title": "t", "text": None}]),
                  r"bad\.parquet: row 5 has a null 'text', not a string"),
    "corrupt-batch": (lambda d: corrupt_row_group(write_parquet(d / "bad.parquet", wikimedia_rows(GOOD)), 1, 3),
                      r"bad\.parquet: batch 1 \(rows 2 to 3\) is unreadable \(.*\); the shard is damaged"),
    "non-string-json-text": (lambda d: write_compressed_lines(d / "bad.jsonl.gz", [*GOOD[:2], {"text": 5}]),
                             r"bad\.jsonl\.gz: line 3 has no string 'text' field"),
    "cut-gzip": (lambda d: big_gzip(d / "bad.jsonl.gz"),
                 r"bad\.jsonl\.gz: cannot read it to the end \(.*\); the file is damaged or cut short"),
}


@pytest.mark.parametrize("case", AT_CONSTRUCTION)
def test_bad_corpus_fails_at_construction_in_one_line_naming_the_file(tmp_path, case):
    make, match = AT_CONSTRUCTION[case]
    with pytest.raises((ValueError, FileNotFoundError), match=r"^--data\.train_path .*" + match) as error:
        datamodule(make(tmp_path), tmp_path / "cache")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", IN_SETUP)
def test_bad_corpus_fails_in_setup_in_one_line_naming_the_file_and_row_or_batch(tmp_path, monkeypatch, case):
    monkeypatch.setattr(corpus_module, "ROWS_PER_BATCH", 2)  # the shard's row groups hold 2 rows
    make, match = IN_SETUP[case]
    dm = datamodule(make(tmp_path), tmp_path / "cache")
    with pytest.raises(ValueError, match=match) as error:
        dm.setup("fit")
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------------- memory

# Builds the token cache of three corpora in turn, in a fresh process, and prints how far each build raised the
# process's RSS above where it started (the peak is reset before each: writing 5 to /proc/self/clear_refs). A warm-up
# first, so the tokenizer's threads and the allocators have their working size; then 1 shard, and 2 shards twice as long.
_MEASURE = """
import json, resource, sys
from pathlib import Path
from lit_fsdp.data import corpus, token_cache
from lit_fsdp.data.tokenizer import load_tokenizer
root = Path(sys.argv[1])
token_cache.CHARACTERS_PER_CHUNK, corpus.ROWS_PER_BATCH = 100_000, 64
tokenizer, grown = load_tokenizer(root / "tokenizer"), {}
for name in ("warm", "small", "large"):
    source = corpus.open_corpus(str(root / name / "*.parquet"), "--data.train_path")
    Path("/proc/self/clear_refs").write_text("5")
    start = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    meta = token_cache.build_token_cache(root / ("cache-" + name), source, tokenizer)
    grown[name] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
    grown[name + "_tokens"] = meta["tokens"]
print(json.dumps(grown))
"""


def word_level_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whole-word tokenizer: fast, so the corpora can be tens of MB and still build in about a second."""
    vocab = {word: i for i, word in enumerate(["<|endoftext|>", "<unk>", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", unk_token="<unk>")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak RSS through Linux's /proc")
def test_cache_build_memory_does_not_grow_with_the_corpus(tmp_path):
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(10, 20))) for _ in range(1000)]
    word_level_tokenizer(words).save_pretrained(tmp_path / "tokenizer")
    articles_pool = [" ".join(rng.choice(words, size=200)) for _ in range(50)]  # about 3 kB each
    rows = 1000  # about 3 MB of text: 30 chunks of the build, 15 of its record batches
    text_bytes = {}
    for name, shards in (("warm", [rows // 4]), ("small", [rows]), ("large", [2 * rows, 2 * rows])):
        (tmp_path / name).mkdir()
        for n, count in enumerate(shards):
            texts = [articles_pool[i % len(articles_pool)] for i in range(count)]
            write_parquet(tmp_path / name / f"train-{n:05d}.parquet", [{"title": f"T{i}", "text": t} for i, t in
                                                                         enumerate(texts)], row_group_size=500)
            text_bytes[name] = text_bytes.get(name, 0) + sum(map(len, texts))
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    grown = json.loads(result.stdout.strip().splitlines()[-1])
    assert grown["large_tokens"] == 4 * grown["small_tokens"] + 3  # 3 more eos between documents
    extra_text = text_bytes["large"] - text_bytes["small"]
    assert extra_text > 9e6  # 4 times the text (and tokens), in shards twice as long
    shown = ", ".join(f"{name} +{grown[name] / 2**20:.1f} MB" for name in ("warm", "small", "large"))
    # Holding a large shard whole would add its 6 MB of text at least; holding the tokens, about 40 bytes a token.
    # What a build holds whatever the corpus (the tokenizer's threads and buffers, a chunk's tokens, a batch's rows)
    # depends on the machine and its load (60 to 280 MB seen): only its growth with the corpus is pinned.
    assert grown["large"] - grown["small"] < 3 * 2**20, f"{shown} for {extra_text / 1e6:.0f} MB more text"
