"""``python -m lit_fsdp evaluate``: loss and perplexity of a trained model on a Wikipedia-format file."""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from lit_fsdp.data.blocks import TokenBlocks
from lit_fsdp.data.token_cache import cache_dir_or_default, cached_tokens, check_corpus_file
from lit_fsdp.commands.trained import DType, Trained, load_trained

#: The file in a run folder that collects one line per evaluation.
EVALUATIONS = "evaluations.jsonl"


@dataclass
class EvaluationData:
    """The text to evaluate on.

    Args:
        path: JSON array or JSON Lines file of {"id", "title", "text"} articles (the format fit reads).
        cache_dir: Folder of the token caches, shared with fit; default $LIT_FSDP_CACHE, else ~/.cache/lit_fsdp/tokens.
    """

    path: str
    cache_dir: str | None = None


def mean_loss(trained: Trained, blocks: TokenBlocks, batch_size: int) -> float:
    """Mean next-token cross-entropy over every token of ``blocks`` (as fit's ``val/loss``, in float32)."""
    total, count = 0.0, 0
    loader = DataLoader(blocks, batch_size=batch_size)
    with torch.inference_mode():
        for batch in tqdm(loader, desc="evaluating", unit="batch", disable=not sys.stderr.isatty(), leave=False):
            logits = trained.model(input_ids=batch["input_ids"].to(trained.model.device)).logits
            labels = batch["labels"].to(logits.device)
            total += F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum").item()
            count += labels.numel()
    return total / count


def evaluate(
    checkpoint: str,
    data: EvaluationData,
    seq_len: int | None = None,
    batch_size: int = 8,
    max_documents: int | None = None,
    device: str = "auto",
    dtype: DType = "float32",
    tokenizer_path: str | None = None,
) -> dict[str, Any]:
    """Print the loss, perplexity and tokens evaluated of a trained model on a file; record them in its run folder.

    The file is tokenised with the run's tokenizer (once, into the token cache fit uses) and cut into
    blocks of seq_len + 1 tokens, as fit's validation does; a tail shorter than a block is left out. Given
    a run folder, or a checkpoint in one, the result is appended to <run folder>/evaluations.jsonl.

    Args:
        checkpoint: A run folder (its checkpoints/last.ckpt), a checkpoint written by fit (a sharded folder is
            consolidated on load) or a Hugging Face folder with its tokenizer.
        data: The file to evaluate on.
        seq_len: Tokens of context per prediction block; default the run's training seq_len (needed for a
            Hugging Face folder).
        batch_size: Blocks per forward pass.
        max_documents: Read only the first this many articles.
        device: auto (the GPU if there is one, else the CPU), cpu, cuda or cuda:N.
        dtype: Dtype of the weights on the device; the loss is computed in float32.
        tokenizer_path: Tokenizer folder to use instead of the one the run trained with.
    """
    for flag, value in (("--seq_len", seq_len), ("--batch_size", batch_size), ("--max_documents", max_documents)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be at least 1")
    source = check_corpus_file(data.path, "--data.path")
    trained = load_trained(checkpoint, device, dtype, tokenizer_path)
    seq_len = seq_len or trained.seq_len
    if seq_len is None:
        raise ValueError(f"--seq_len is needed: {trained.source} does not record the sequence length it was trained with")
    if trained.positions is not None and seq_len > trained.positions:
        raise ValueError(f"--seq_len {seq_len} is longer than the model's {trained.positions} positions")
    tokens = cached_tokens(source, trained.tokenizer, cache_dir_or_default(data.cache_dir), max_documents)
    if len(tokens) <= seq_len:
        raise ValueError(f"--data.path {source}: its {len(tokens)} tokens do not fill one block of --seq_len {seq_len}")
    blocks = TokenBlocks(tokens, seq_len)

    started = time.perf_counter()
    loss = mean_loss(trained, blocks, batch_size)
    result = {
        "loss": loss,
        "perplexity": math.exp(loss),
        "tokens": len(blocks) * seq_len,
        "seq_len": seq_len,
        "data": str(source),
        "max_documents": max_documents,
        "checkpoint": str(trained.source.absolute()),
        "step": trained.step,
        "device": str(trained.model.device),
        "dtype": dtype,
        "seconds": time.perf_counter() - started,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"loss        {loss:.4f}")
    print(f"perplexity  {result['perplexity']:.2f}")
    print(f"tokens      {result['tokens']:,} ({len(blocks):,} blocks of {seq_len}) from {source.name}")
    if trained.run_folder is not None:
        record = trained.run_folder / EVALUATIONS
        with open(record, "a") as file:
            file.write(json.dumps(result) + "\n")
        print(f"recorded in {record}")
    return result

