"""The tokenizer of a text corpus: a local Hugging Face tokenizer folder, or a byte-level BPE trained on the corpus.

Either way the result is a Hugging Face tokenizer with an eos token, so it can be saved next to the model
and the token caches can join documents with it.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
#: The files a saved tokenizer's vocabulary is read from, one of which every tokenizer folder holds (save_pretrained's
#: tokenizer.json, a GPT-2 vocab.json and merges.txt, a sentencepiece model).
VOCABULARY_FILES = ("tokenizer*", "vocab.*", "merges.txt", "spiece.model")


def holds_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a saved tokenizer: a model folder exported without one has only a config and
    weights, from which ``AutoTokenizer`` still builds a tokenizer, of no tokens."""
    return any(next(Path(folder).glob(pattern), None) is not None for pattern in VOCABULARY_FILES)


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer saved in the folder ``path``, read without touching the network or running code the
    folder ships (trust_remote_code stays off; transformers would otherwise ask for it on a terminal)."""
    if Path(path).is_dir() and not holds_tokenizer(path):
        raise ValueError(f"{path} holds no tokenizer (none of {', '.join(VOCABULARY_FILES)}); give a folder a "
                         "Hugging Face tokenizer was saved in")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as error:
        message = " ".join(str(error).split())
        if "trust_remote_code" in message:
            raise ValueError(f"the tokenizer in {path} needs its repository's own code, which lit_fsdp does not run "
                             "(trust_remote_code stays off); give a tokenizer transformers loads by itself") from None
        raise ValueError(f"cannot load a Hugging Face tokenizer from {path}: {message}") from None
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"the tokenizer in {path} has no eos token; documents are separated by it, "
            "so use a tokenizer that defines one"
        )
    return tokenizer


def tokenizer_files(tokenizer: PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes for ``tokenizer``, by name: a checkpoint carries them, as a path to them
    would not survive a move to another machine."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {file.name: file.read_bytes() for file in sorted(Path(folder).iterdir()) if file.is_file()}


def tokenizer_from_files(files: dict[str, bytes], source: Path) -> PreTrainedTokenizerBase:
    """The tokenizer whose ``tokenizer_files`` the checkpoint ``source`` holds."""
    with tempfile.TemporaryDirectory() as folder:
        for name, content in files.items():
            # a name read from a file must not lead out of the folder
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise ValueError(f"{source} holds a tokenizer file named {name!r}, not a plain file name; "
                                 "it was not written by lit_fsdp: pass --tokenizer_path")
            (Path(folder) / name).write_bytes(content)
        return load_tokenizer(folder)


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` included) trained on ``texts``."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        # All 256 bytes are in the vocabulary, so any text (including text unseen in training) can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash that changes whenever the tokenizer would produce different ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # A fast tokenizer is fully described by its tokenizer.json; a slow one by its vocabulary and class.
    content = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    described = json.dumps([type(tokenizer).__name__, content, tokenizer.eos_token_id])
    return hashlib.sha256(described.encode()).hexdigest()[:16]


def encode_documents(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (a fast tokenizer encodes the batch in parallel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        # The Rust batch encoding without character offsets: the ids of the call below, without its per-text
        # Python work (about 1.3x faster on a byte-level BPE).
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]
    # verbose=False: documents are meant to be longer than the model's context, so the length warning is noise.
    encoded = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return encoded["input_ids"]
