"""Wikipedia-style articles as training data: records with a ``text`` (and optionally a ``title``) in JSON, JSON Lines
(plain, ``.gz``, ``.zst``) or Parquet files, a folder or glob of them, or a Hub data set's subfolder of Parquet shards
(``lit_fsdp.data.corpus``).

The tokenizer (a Hugging Face folder or Hub name, or a byte-level BPE trained on the training corpus) and each
corpus's token stream are built once into ``cache_dir`` and reused by every later run with the same inputs.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from transformers import PreTrainedTokenizerBase

from lit_fsdp.data.blocks import BlockDataModule, TokenBlocks, blocks_per_split
from lit_fsdp.data.corpus import Corpus, open_corpus
from lit_fsdp.data.progress import CorpusProgress
from lit_fsdp.data.token_cache import WAIT_TIMEOUT_S, MappedTokens, cache_dir_or_default, cache_key, cached_tokens, wait_or_build
from lit_fsdp.data.tokenizer import load_tokenizer, train_bpe
from lit_fsdp.hub import tokenizer_folder


class WikipediaDataModule(BlockDataModule):
    """Articles tokenised once into a memory-mapped cache and packed into blocks of ``seq_len + 1`` tokens.

    Articles are joined with the tokenizer's eos token between them. ``vocab_size`` is the tokenizer's
    length once ``setup`` has run (before that, the requested BPE size).
    """

    def __init__(
        self,
        train_path: str,
        val_path: str | None = None,
        text_field: str = "text",
        tokenizer_path: str | None = None,
        vocab_size: int = 8192,
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_documents: int | None = None,
        cache_dir: str | None = None,
        wait_timeout_s: float = WAIT_TIMEOUT_S,
        seed: int = 1234,
        num_workers: int = 0,
    ):
        """
        Args:
            train_path: Articles to train on: a JSON array or JSON Lines file of {"title", "text"} records (also
                .jsonl.gz, .jsonl.zst), a Parquet file, a folder or glob of such files (Parquet shards as downloaded),
                or a Hub data set's subfolder, owner/name[@revision]:subfolder (wikimedia/wikipedia:20231101.en), read
                from the Hub cache (downloaded when online, HF_HUB_OFFLINE unset).
            val_path: Validation articles in the same formats; by default the last val_fraction of the training blocks.
            text_field: The field (JSON) or column (Parquet) holding each article's text; a "title" is put before it.
            tokenizer_path: Hugging Face tokenizer: a local folder or a Hub name owner/name[@revision] (from the Hub
                cache, as train_path); by default a byte-level BPE is trained on train_path.
            vocab_size: Vocabulary size of the trained BPE, eos included (ignored with tokenizer_path).
            seq_len: Tokens per training sequence.
            batch_size: Sequences per process per micro-batch.
            val_fraction: Share of the training blocks held out for validation when val_path is not given.
            max_documents: Read only the first this many articles of each file (for quick runs).
            cache_dir: Folder for tokenizers and token caches; default $LIT_FSDP_CACHE, else ~/.cache/lit_fsdp/tokens.
            wait_timeout_s: Seconds the other ranks wait for local rank 0 to build the tokenizer and token caches
                before giving up (they also stop as soon as rank 0's process is gone or its heartbeat stops).
            seed: Seed of the sampling order.
            num_workers: DataLoader worker processes.
        """
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        if not text_field:
            raise ValueError("--data.text_field is empty; give the name of the field or column holding the text")
        self.train_path = open_corpus(train_path, "--data.train_path", text_field)
        self.val_path = None if val_path is None else open_corpus(val_path, "--data.val_path", text_field)
        folder = None if tokenizer_path is None else tokenizer_folder(tokenizer_path, "--data.tokenizer_path")
        if folder is not None and not Path(folder).expanduser().is_dir():
            raise FileNotFoundError(
                f"--data.tokenizer_path {tokenizer_path}: no such folder; give a local Hugging Face tokenizer folder or a Hub "
                "name owner/name, or leave it unset to train a BPE on --data.train_path"
            )
        if tokenizer_path is None and vocab_size <= 256:
            raise ValueError(f"--data.vocab_size must exceed the 256 byte tokens of a byte-level BPE, got {vocab_size}")
        if max_documents is not None and max_documents < 1:
            raise ValueError(f"--data.max_documents must be positive or unset, got {max_documents}")
        self.tokenizer_path = None if folder is None else Path(folder).expanduser()
        self.bpe_vocab_size = vocab_size
        self.vocab_size = vocab_size
        self.val_fraction = val_fraction
        self.max_documents = max_documents
        self.cache_dir = cache_dir_or_default(cache_dir)
        self.wait_timeout_s = wait_timeout_s
        self._tokenizer: PreTrainedTokenizerBase | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer

    @property
    def dataset_name(self) -> str:
        return self.train_path.stem

    def setup(self, stage: str) -> None:
        self._read(0 if self.trainer is None else self.trainer.local_rank)

    def read_before_launch(self, module: Any, local_rank: int) -> None:
        """The tokenizer and token caches built (or found) before the other processes start: a malformed article is
        said once, and the ranks find the caches built."""
        self._read(local_rank)

    def _read(self, local_rank: int) -> None:
        """The tokenizer and the training and validation blocks, from the caches local rank 0 builds."""
        if hasattr(self, "train_set"):
            return
        self._tokenizer = self._setup_tokenizer(local_rank)
        self.vocab_size = len(self._tokenizer)
        tokens_of = partial(
            cached_tokens, tokenizer=self._tokenizer, cache_dir=self.cache_dir, max_documents=self.max_documents,
            local_rank=local_rank, wait_timeout_s=self.wait_timeout_s,
        )
        train_tokens = tokens_of(self.train_path)
        if self.val_path is not None:
            self.train_set = _blocks(self.train_path, train_tokens, self.seq_len)
            self.val_set = _blocks(self.val_path, tokens_of(self.val_path), self.seq_len)
            return
        total = (len(train_tokens) - 1) // self.seq_len
        if total < 2:
            raise ValueError(
                f"{self.train_path}: {len(train_tokens)} tokens make {total} blocks of --data.seq_len {self.seq_len}, "
                "too few to hold out validation blocks; use a shorter --data.seq_len, more data or --data.val_path"
            )
        num_train, num_val = blocks_per_split(total, self.val_fraction)
        self.train_set = _blocks(self.train_path, train_tokens, self.seq_len, 0, num_train)
        self.val_set = _blocks(self.train_path, train_tokens, self.seq_len, num_train, num_val)

    def _setup_tokenizer(self, local_rank: int) -> PreTrainedTokenizerBase:
        if self.tokenizer_path is not None:
            return load_tokenizer(self.tokenizer_path)
        key = cache_key(
            source=self.train_path.identity(), vocab_size=self.bpe_vocab_size, max_documents=self.max_documents
        )
        directory = self.cache_dir / f"tokenizer-{self.train_path.stem}-{key}"
        wait_or_build(directory, self._train_tokenizer, local_rank, timeout_s=self.wait_timeout_s)
        return load_tokenizer(directory)

    def _train_tokenizer(self, directory: Path) -> dict[str, Any]:
        rank_zero_info(f"Training a byte-level BPE of {self.bpe_vocab_size} tokens on {self.train_path}")
        documents = self.train_path.documents(self.max_documents)
        with CorpusProgress(f"Training the BPE on {self.train_path.name}", self.train_path.files, self.max_documents) as shown:
            tokenizer = train_bpe(shown.track(documents), self.bpe_vocab_size)
        tokenizer.save_pretrained(directory)
        return {"source": self.train_path.identity(), "vocab_size": len(tokenizer)}


def _blocks(source: Corpus, tokens: MappedTokens, seq_len: int, first: int = 0, count: int | None = None) -> TokenBlocks:
    try:
        return TokenBlocks(tokens, seq_len, first, count)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
