"""WikipediaDataModule: streaming JSON / JSON Lines, the resumable token cache, waiting ranks, and bad inputs."""

from __future__ import annotations

import json
import pickle
import threading
from functools import partial
from pathlib import Path

import ijson
import numpy as np
import pytest
import torch

from lit_fsdp.data import corpus as corpus_module
from lit_fsdp.data import token_cache, wikipedia
from lit_fsdp.data.corpus import read_documents
from lit_fsdp.data.token_cache import build_token_cache, open_tokens, wait_or_build
from lit_fsdp.data.tokenizer import train_bpe
from lit_fsdp.data.wikipedia import WikipediaDataModule
from tests.corpus import articles, datamodule, write_array, write_lines


def all_tokens(dm: WikipediaDataModule) -> np.ndarray:
    return np.asarray(dm.train_set.tokens[:])


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_array(tmp_path / "wiki.json", articles())


def test_json_array_and_json_lines_give_the_same_tokens(tmp_path, monkeypatch):
    prefixes = []
    real_items = ijson.items

    def items(file, prefix, **kwargs):
        prefixes.append(prefix)
        return real_items(file, prefix, **kwargs)

    monkeypatch.setattr(corpus_module.ijson, "items", items)
    array = datamodule(write_array(tmp_path / "a.json", articles()), tmp_path / "cache")
    lines = datamodule(write_lines(tmp_path / "b.jsonl", articles()), tmp_path / "cache")
    array.setup("fit")
    lines.setup("fit")
    assert prefixes and set(prefixes) == {"item"}  # arrays are streamed record by record
    assert list(read_documents(array.train_path)) == list(read_documents(lines.train_path))
    np.testing.assert_array_equal(all_tokens(array), all_tokens(lines))


def test_documents_are_title_and_text_joined_by_eos(corpus, tmp_path):
    dm = datamodule(corpus, tmp_path / "cache")
    dm.setup("fit")
    tokens = all_tokens(dm)
    eos = dm.tokenizer.eos_token_id
    assert (tokens == eos).sum() == len(articles()) - 1
    first = dm.tokenizer.decode(tokens[: np.argmax(tokens == eos)])
    assert first == f"Article 0\n{articles()[0]['text']}"


def test_second_setup_reuses_the_cache_without_rebuilding(corpus, tmp_path, monkeypatch):
    first = datamodule(corpus, tmp_path / "cache")
    first.setup("fit")

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a cached artifact")

    monkeypatch.setattr(wikipedia, "train_bpe", no_rebuild)
    monkeypatch.setattr(token_cache, "build_token_cache", no_rebuild)
    second = datamodule(corpus, tmp_path / "cache")
    second.setup("fit")
    np.testing.assert_array_equal(all_tokens(first), all_tokens(second))
    assert second.vocab_size == len(second.tokenizer) == first.vocab_size


def test_tokenizer_and_source_key_the_cache_and_any_seq_len_shares_it(corpus, tmp_path):
    cache = tmp_path / "cache"
    datamodule(corpus, cache).setup("fit")
    datamodule(corpus, cache, seq_len=8).setup("fit")  # the token stream does not depend on seq_len
    datamodule(corpus, cache, vocab_size=280).setup("fit")
    write_array(corpus, articles(11))  # new size and mtime
    datamodule(corpus, cache).setup("fit")
    assert len(list(cache.glob("tokens-*"))) == 3
    assert len(list(cache.glob("tokenizer-*"))) == 3


def test_local_tokenizer_folder_is_used_as_is(corpus, tmp_path):
    folder = tmp_path / "tok"
    train_bpe(read_documents(corpus), 290).save_pretrained(folder)
    dm = datamodule(corpus, tmp_path / "cache", tokenizer_path=str(folder))
    dm.setup("fit")
    assert dm.vocab_size == len(dm.tokenizer) == 290
    assert not list((tmp_path / "cache").glob("tokenizer-*"))


def test_killed_build_resumes_and_matches_an_uninterrupted_build(corpus, tmp_path, monkeypatch):
    build = partial(build_token_cache, source=corpus, tokenizer=train_bpe(read_documents(corpus), 300))
    expected = tmp_path / "clean"
    wait_or_build(expected, build, local_rank=0)

    monkeypatch.setattr(token_cache, "CHARACTERS_PER_CHUNK", 1)  # one document per chunk
    encoded = []
    kill_at = 4
    real_encode = token_cache.encode_documents

    def encode(tokenizer, texts):
        if len(encoded) == kill_at:
            raise KeyboardInterrupt  # what a kill looks like to the process
        encoded.extend(texts)
        return real_encode(tokenizer, texts)

    monkeypatch.setattr(token_cache, "encode_documents", encode)
    resumed = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        wait_or_build(resumed, build, local_rank=0)
    with pytest.raises(FileNotFoundError, match="no finalized token cache"):
        open_tokens(resumed)
    assert not (resumed / "failed").exists()  # a kill is not a failure: waiting ranks keep waiting
    assert json.loads((resumed / "progress.json").read_text())["documents"] == 4
    with open(resumed / "tokens.bin", "ab") as file:
        file.write(b"\x07" * 10)  # a chunk written but not committed when the process died

    kill_at = None
    wait_or_build(resumed, build, local_rank=0)
    assert len(encoded) == len(articles())  # the 4 committed documents were not tokenised again
    np.testing.assert_array_equal(open_tokens(resumed)[:], open_tokens(expected)[:])


def test_waiting_rank_raises_the_builders_error(tmp_path):
    def failing_build(directory):
        raise ValueError("wiki.json: malformed JSON in record 3\n(parser stopped at byte 99)")

    with pytest.raises(ValueError, match="record 3"):
        wait_or_build(tmp_path / "cache", failing_build, local_rank=0)
    with pytest.raises(ValueError, match=r"^wiki\.json: malformed JSON in record 3 \(parser stopped at byte 99\)$"):
        wait_or_build(tmp_path / "cache", failing_build, local_rank=1, poll_seconds=0.01)


def test_waiting_rank_returns_once_rank_zero_finalizes(tmp_path):
    waited = {}
    waiter = threading.Thread(
        target=lambda: waited.update(wait_or_build(tmp_path / "cache", None, local_rank=1, poll_seconds=0.01))
    )
    waiter.start()
    built = wait_or_build(tmp_path / "cache", lambda d: {"tokens": 5}, local_rank=0)
    waiter.join(timeout=5)
    assert not waiter.is_alive()
    assert waited == built == {"tokens": 5, "finalized": True}


def test_loader_yields_shifted_int64_blocks(corpus, tmp_path):
    valid = write_lines(tmp_path / "valid.jsonl", articles(4))
    dm = datamodule(corpus, tmp_path / "cache", val_path=str(valid))
    dm.setup("fit")
    assert dm.dataset_name == "wiki"
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        batch = next(iter(loader))
        assert set(batch) == {"input_ids", "labels"}
        for tensor in batch.values():
            assert tensor.dtype == torch.int64 and tensor.shape == (2, 16)
        torch.testing.assert_close(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


def test_mapped_tokens_pickle_as_a_path_not_a_copy(corpus, tmp_path):
    dm = datamodule(corpus, tmp_path / "cache")
    dm.setup("fit")
    tokens = dm.train_set.tokens
    tokens[:1]  # map the file
    payload = pickle.dumps(tokens)
    assert len(payload) < 500 < len(tokens) * 2
    np.testing.assert_array_equal(pickle.loads(payload)[:], tokens[:])


def test_split_holds_out_the_tail_blocks(corpus, tmp_path):
    dm = datamodule(corpus, tmp_path / "cache", val_fraction=0.25)
    dm.setup("fit")
    assert dm.val_set.first_block == len(dm.train_set)
    assert len(dm.val_set) == -(-(len(dm.train_set) + len(dm.val_set)) // 4)


GOOD = '{"id": "0", "title": "Fine", "text": "fine text"}'


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (f'[{GOOD}, {{"id": "1", "text": "a" "b"}}]', r"malformed JSON in record 1 \(parser stopped at byte \d+\)"),
        (f'[{GOOD}, {{"id": "1", "text": "cut', r"malformed JSON in record 1 .*premature EOF"),
        (f'{GOOD}\n\n{{"id": "1", "text": }}\n', r"malformed JSON on line 3"),
        (f'[{GOOD}, {{"id": "1", "title": "no text"}}]', r"record 1 has no string 'text'"),
        (f'{GOOD}\n{{"id": "1", "body": "x"}}\n', r"line 2 has no string 'text'"),
        ("[]", r"the corpus is empty"),
        ('[{"id": "0", "text": ""}]', r"the corpus is empty"),
    ],
)
def test_bad_corpus_fails_in_setup_naming_file_and_position(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    dm = datamodule(path, tmp_path / "cache")
    with pytest.raises(ValueError, match=r"bad\.json: " + match):
        dm.setup("fit")


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"train_path": "missing.json"}, FileNotFoundError, r"--data\.train_path .*missing\.json: no such file"),
        ({"val_path": "missing.json"}, FileNotFoundError, r"--data\.val_path .*missing\.json: no such file"),
        ({"tokenizer_path": "no_tokenizer"}, FileNotFoundError, r"--data\.tokenizer_path no_tokenizer: no such folder"),
        ({"vocab_size": 100}, ValueError, r"--data\.vocab_size must exceed"),
    ],
)
def test_bad_arguments_fail_at_construction(corpus, tmp_path, monkeypatch, overrides, error, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=match):
        datamodule(Path(overrides.pop("train_path", corpus)), tmp_path / "cache", **overrides)


@pytest.mark.parametrize("content", ["", "   \n", "id,title,text\n"])
def test_file_that_is_not_json_fails_at_construction(tmp_path, content):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"--data\.train_path .*bad\.csv: it (is empty|starts with 'i')"):
        datamodule(path, tmp_path / "cache")


def test_sequence_longer_than_the_data_names_the_file_and_flag(corpus, tmp_path):
    with pytest.raises(ValueError, match=r"wiki\.json: \d+ tokens make [01] blocks of --data\.seq_len 4096"):
        datamodule(corpus, tmp_path / "cache", seq_len=4096).setup("fit")
    valid = write_array(tmp_path / "valid.json", articles(1))
    with pytest.raises(ValueError, match=r"valid\.json: \d+ tokens hold 0 blocks of seq_len=1024.*--data\.seq_len"):
        datamodule(corpus, tmp_path / "cache", seq_len=1024, val_path=str(valid)).setup("fit")
