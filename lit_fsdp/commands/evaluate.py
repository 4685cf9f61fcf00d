"""``python -m lit_fsdp evaluate``: loss and perplexity of a trained model on a Wikipedia-format file; on a chat file,
the loss on the assistant's answers and the share of answers greedy generation gets exactly right."""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ijson
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm import tqdm

from lit_fsdp.data.blocks import TokenBlocks
from lit_fsdp.data.chat import ChatRenderer, Sample
from lit_fsdp.data.sft import read_samples_of
from lit_fsdp.data.corpus import Corpus, file_records, open_corpus
from lit_fsdp.data.token_cache import cache_dir_or_default, cached_tokens
from lit_fsdp.commands.trained import DType, Trained, load_trained

#: The file in a run folder that collects one line per evaluation.
EVALUATIONS = "evaluations.jsonl"
#: Samples whose prompt, reference and generation a chat evaluation prints.
EXAMPLES = 3
#: New tokens a generation may take beyond the reference's length, so a longer answer shows as one.
EXTRA_TOKENS = 8
IGNORE_INDEX = -100

DataFormat = Literal["auto", "text", "chat"]
#: what --data.path holds, for its errors
RECORDS = "articles or chat samples"


@dataclass
class EvaluationData:
    """The corpus to evaluate on.

    Args:
        path: Articles ({"title", "text"}, the format fit reads) or chat samples ({"messages": [{"role", "content"},
            ...]} or {"prompt", "completion"}, SFTDataModule's format): a JSON array or JSON Lines file (also .jsonl.gz,
            .jsonl.zst), a Parquet file, or a folder or glob of such files, read in name order.
        cache_dir: Folder of the token caches, shared with fit; default $LIT_FSDP_CACHE, else ~/.cache/lit_fsdp/tokens.
            Chat samples are rendered in memory, without a cache.
        format: text (articles), chat (samples), or auto: told by the keys of the first file's first record.
        text_field: The field (JSON) or column (Parquet) holding each article's text, as fit's --data.text_field.
    """

    path: str
    cache_dir: str | None = None
    format: DataFormat = "auto"
    text_field: str = "text"


def detect_format(source: Corpus | Path, text_field: str = "text") -> Literal["text", "chat"]:
    """``chat`` when the first record of ``source`` has ``messages`` or ``prompt``, ``text`` when it has
    ``text_field``.

    A first record that cannot be read is left to the text reader, whose error names the record.
    """
    corpus = source if isinstance(source, Corpus) else open_corpus(source, "--data.path", None, RECORDS)
    record = _first_record(corpus.files[0])
    if record is _NOT_JSON:
        return "text"
    if isinstance(record, dict):
        if "messages" in record or "prompt" in record:
            return "chat"
        if text_field in record:
            return "text"
        found = f"keys {', '.join(map(str, record))}" if record else "no keys"
    elif record is None:
        raise ValueError(f"--data.path {corpus}: it holds no records; give Wikipedia articles or chat samples")
    else:
        found = f"no keys (it is a {type(record).__name__})"
    raise ValueError(
        f"--data.path {corpus}: its first record has {found}; expected {text_field!r} (Wikipedia articles) or "
        "'messages' or 'prompt' and 'completion' (chat samples)"
    )


_NOT_JSON = object()


def _first_record(path: Path) -> Any:
    """The first record of one corpus file, any format (a JSON array is read lazily: a dump may be gigabytes); None
    if it has none."""
    try:
        return next((record for _, record, _ in file_records(path)), None)
    except (ValueError, ijson.JSONError):
        return _NOT_JSON


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


def masked_loss(trained: Trained, rendered: list[tuple[list[int], list[bool]]], batch_size: int) -> tuple[float, int]:
    """Mean cross-entropy over the target tokens of ``(ids, target mask)`` samples, and how many there are.

    A sample is one row, its labels as SFTDataModule makes them: ``labels[t]`` is ``ids[t + 1]`` where that token is a
    target, else ignored. Rows are padded at the end; attention is causal, so padding changes no real position.
    """
    pad = _pad_id(trained)
    order = sorted(range(len(rendered)), key=lambda i: len(rendered[i][0]))  # similar lengths together: less padding
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in _progress(range(0, len(order), batch_size), "loss"):
            chunk = [rendered[i] for i in order[start : start + batch_size]]
            width = max(len(ids) for ids, _ in chunk) - 1
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.long)
            for row, (ids, mask) in enumerate(chunk):
                tokens = torch.tensor(ids)
                input_ids[row, : len(ids) - 1] = tokens[:-1]
                labels[row, : len(ids) - 1] = torch.where(torch.tensor(mask[1:]), tokens[1:], IGNORE_INDEX)
            device = trained.model.device
            logits = trained.model(input_ids=input_ids.to(device), use_cache=False).logits
            total += F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten(), reduction="sum",
                                     ignore_index=IGNORE_INDEX).item()
            count += int((labels != IGNORE_INDEX).sum())
    return total / max(count, 1), count


def greedy_answers(
    trained: Trained, prompts: list[list[int]], budgets: list[int], stop_ids: set[int], batch_size: int
) -> list[list[int]]:
    """The greedy continuation of each prompt: at most its budget of new tokens, cut before the first stop token.

    Prompts are batched left-padded with an attention mask (the model's positions follow the mask); a budget of 0
    gives no tokens.
    """
    model, pad = trained.model, _pad_id(trained)
    answers: list[list[int]] = [[] for _ in prompts]
    order = sorted((i for i in range(len(prompts)) if budgets[i] > 0), key=lambda i: len(prompts[i]))
    with torch.inference_mode():
        for start in _progress(range(0, len(order), batch_size), "generating"):
            chunk = order[start : start + batch_size]
            width = max(len(prompts[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                input_ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                attention[row, width - len(prompts[i]) :] = 1
            new = max(budgets[i] for i in chunk)
            if trained.positions is not None:  # the padded batch must fit too; only a prompt near the limit loses
                new = min(new, trained.positions - width)
            if new < 1:
                continue
            output = model.generate(
                input_ids.to(model.device), attention_mask=attention.to(model.device), max_new_tokens=new,
                do_sample=False, eos_token_id=sorted(stop_ids), pad_token_id=pad, use_cache=True,
            )
            for row, i in enumerate(chunk):
                ids = output[row, width : width + budgets[i]].tolist()
                answers[i] = list(itertools.takewhile(lambda token: token not in stop_ids, ids))
    return answers


def end_of_turn(renderer: ChatRenderer, sample: Sample) -> str:
    """The text the chat template writes after an answer's content to close the turn ('' for the plain template,
    whose answers end with the eos id)."""
    target = [text for text, is_target, _ in renderer.pieces(sample) if is_target][-1]
    content = sample.reference.strip()  # a template may trim the content
    at = target.find(content) if content else -1
    return target[at + len(content) :].strip() if at >= 0 else ""


def stop_tokens(trained: Trained, closing: str) -> set[int]:
    """Token ids that end a generated answer: eos, the model's own eos ids, and the end-of-turn when it is one token."""
    stops = {trained.tokenizer.eos_token_id}
    configured = getattr(trained.model.generation_config, "eos_token_id", None)
    stops |= set(configured if isinstance(configured, list) else [] if configured is None else [configured])
    closing_ids = trained.tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    if len(closing_ids) == 1:
        stops.add(closing_ids[0])
    return stops


def evaluate_chat(
    trained: Trained, source: Corpus, seq_len: int | None, batch_size: int, max_samples: int | None
) -> tuple[dict[str, Any], list[tuple[str, str, str]]]:
    """The masked loss and exact match on the first ``max_samples`` samples of ``source`` (those with an answer), and
    the first examples as (prompt, reference, generated) texts."""
    read = [sample for sample, _ in itertools.islice(read_samples_of(source), max_samples)]
    samples = [sample for sample in read if sample.has_answer]
    if not samples:
        raise ValueError(f"--data.path {source}: none of the {len(read)} samples read has an assistant turn")
    renderer, tokenizer = ChatRenderer(trained.tokenizer), trained.tokenizer
    rendered = []
    for ids, mask in renderer.encode(samples):
        if seq_len is not None:  # as fit's SFT data does (too_long: truncate): a row holds seq_len + 1 tokens
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
        if any(mask[1:]):
            rendered.append((ids, mask))
    loss, targets = masked_loss(trained, rendered, batch_size)
    if not targets:
        raise ValueError(f"--data.path {source}: no answer token is left within --seq_len {seq_len}; raise it")

    prompts = [renderer.prompt_ids(sample) for sample in samples]
    references = [sample.reference.strip() for sample in samples]
    lengths = [len(ids) for ids in tokenizer(references, add_special_tokens=False)["input_ids"]]
    budgets = [length + EXTRA_TOKENS for length in lengths]
    if trained.positions is not None:
        budgets = [max(0, min(budget, trained.positions - len(prompt))) for budget, prompt in zip(budgets, prompts)]
    if not all(budgets):
        print(f"{budgets.count(0)} samples' prompts fill the model's {trained.positions} positions: counted as wrong",
              file=sys.stderr)
    closing = end_of_turn(renderer, samples[0])
    answers = greedy_answers(trained, prompts, budgets, stop_tokens(trained, closing), batch_size)
    generated = [tokenizer.decode(ids) for ids in answers]
    if closing:  # an end-of-turn of several tokens does not stop generation: the answer ends where it begins
        generated = [text.split(closing, 1)[0] for text in generated]
    matched = sum(text.strip() == reference for text, reference in zip(generated, references))
    result = {"format": "chat", "loss": loss, "perplexity": math.exp(loss), "target_tokens": targets,
              "exact_match": matched / len(samples), "samples": len(samples), "seq_len": seq_len}
    examples = [(tokenizer.decode(prompt), reference, text)
                for prompt, reference, text in zip(prompts[:EXAMPLES], references, generated)]
    return result, examples


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
    """Print a trained model's loss and perplexity on articles, or on chat samples its answer loss and exact match.

    Articles: the loss, perplexity and tokens evaluated. The file is tokenised with the run's tokenizer (once, into
    the token cache fit uses) and cut into blocks of seq_len + 1 tokens, as fit's validation does; a tail shorter
    than a block is left out.

    Chat samples (rendered as fit's SFT data renders them, with the tokenizer's chat template if it has one): the
    loss and perplexity on the assistant's answer tokens only (target_tokens of them), and exact_match, the share
    of samples whose greedy answer (up to the reference's tokens + 8, ending at eos or the end of the turn) equals
    the reference once whitespace at both ends is stripped. A few examples are printed.

    Given a run folder, or a checkpoint in one, the result is appended to <run folder>/evaluations.jsonl.

    Args:
        checkpoint: A run folder (its checkpoints/last.ckpt), a checkpoint written by fit (a sharded folder is
            consolidated on load) or a Hugging Face folder with its tokenizer.
        data: The file to evaluate on.
        seq_len: Tokens of context per prediction block; default the run's training seq_len (needed for a
            Hugging Face folder with articles). A chat sample longer than seq_len + 1 tokens is cut, as fit does;
            default there the run's seq_len, else the model's positions.
        batch_size: Blocks, or chat samples, per forward pass or generation.
        max_documents: Read only the first this many articles, or chat samples.
        device: auto (the GPU if there is one, else the CPU), cpu, cuda or cuda:N.
        dtype: Dtype of the weights on the device; the loss is computed in float32.
        tokenizer_path: Tokenizer folder to use instead of the one the run trained with.
    """
    for flag, value in (("--seq_len", seq_len), ("--batch_size", batch_size), ("--max_documents", max_documents)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} must be at least 1")
    if data.format not in ("auto", "text", "chat"):
        raise ValueError(f"--data.format {data.format!r}; give auto, text or chat")
    if not data.text_field:
        raise ValueError("--data.text_field is empty; give the name of the field or column holding the text")
    form = data.format
    # records for auto-detection and chat samples; detection's open is what a chat corpus is read from
    source = open_corpus(data.path, "--data.path", text_field=None, records=RECORDS) if form != "text" else None
    if form == "auto":
        form = detect_format(source, data.text_field)
    if form == "text":  # the text column of every Parquet file checked before the model is loaded
        source = open_corpus(data.path, "--data.path", text_field=data.text_field)
    trained = load_trained(checkpoint, device, dtype, tokenizer_path)
    seq_len = seq_len or trained.seq_len
    if form == "chat":
        seq_len = seq_len or trained.positions
    if seq_len is None:
        raise ValueError(f"--seq_len is needed: {trained.source} does not record the sequence length it was trained with")
    if trained.positions is not None and seq_len > trained.positions:
        raise ValueError(f"--seq_len {seq_len} is longer than the model's {trained.positions} positions")

    if form == "chat":
        started = time.perf_counter()
        result, examples = evaluate_chat(trained, source, seq_len, batch_size, max_documents)
    else:
        tokens = cached_tokens(source, trained.tokenizer, cache_dir_or_default(data.cache_dir), max_documents)
        if len(tokens) <= seq_len:
            raise ValueError(f"--data.path {source}: its {len(tokens)} tokens do not fill one block of --seq_len {seq_len}")
        blocks = TokenBlocks(tokens, seq_len)
        started = time.perf_counter()
        loss = mean_loss(trained, blocks, batch_size)
        result = {"loss": loss, "perplexity": math.exp(loss), "tokens": len(blocks) * seq_len, "seq_len": seq_len}
    result |= {
        "data": str(source),
        "max_documents": max_documents,
        "checkpoint": str(trained.source.absolute()),
        "step": trained.step,
        "device": str(trained.model.device),
        "dtype": dtype,
        "seconds": time.perf_counter() - started,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(f"loss        {result['loss']:.4f}")
    print(f"perplexity  {result['perplexity']:.2f}")
    if form == "chat":
        matched = round(result["exact_match"] * result["samples"])
        samples = result["samples"]
        print(f"targets     {result['target_tokens']:,} answer tokens of {samples:,} samples from {source.name}")
        print(f"exact match {result['exact_match']:.4f} ({matched:,} of {samples:,} greedy answers)")
        for number, (prompt, reference, text) in enumerate(examples, start=1):
            print(f"example {number}\n  prompt     {_one_line(prompt)}\n  reference  {_one_line(reference)}\n"
                  f"  generated  {_one_line(text)}")
    else:
        print(f"tokens      {result['tokens']:,} ({len(blocks):,} blocks of {seq_len}) from {source.name}")
    if trained.run_folder is not None:
        record = trained.run_folder / EVALUATIONS
        with open(record, "a") as file:
            file.write(json.dumps(result) + "\n")
        print(f"recorded in {record}")
    return result


def _pad_id(trained: Trained) -> int:
    pad = trained.tokenizer.pad_token_id
    return trained.tokenizer.eos_token_id if pad is None else pad


def _progress(steps: range, what: str) -> Any:
    return tqdm(steps, desc=what, unit="batch", disable=not sys.stderr.isatty(), leave=False)


def _one_line(text: str, width: int = 160) -> str:
    """``text`` with its line breaks shown as \\n, its start cut to ``width`` characters (a prompt's end matters)."""
    shown = text.replace("\n", "\\n")
    return shown if len(shown) <= width else "…" + shown[-width + 1 :]
