"""Supervised fine-tuning data: chat samples rendered once into a cache of packed rows, and the batches a model
trains on with loss on the assistant's answers only.

Every batch is a dict of int64 tensors (``b`` rows of ``seq_len`` positions):

- ``input_ids`` (b, seq_len): a row's samples one after the other, then padding (the eos id);
- ``labels`` (b, seq_len), already shifted: ``labels[t]`` is the target for position ``t`` (a sample of ``n`` tokens
  takes ``n - 1`` positions, its last token only a label), -100 where there is no loss (prompt tokens unless
  ``train_on_prompt``, and padding);
- ``position_ids`` (b, seq_len): 0, 1, ... restarting at each packed sample (0 for padding);
- ``segment_ids`` (b, seq_len): 1, 2, ... for the samples of a row, 0 for padding; attention stays inside a segment;
- ``step_targets`` (b,): every entry the number of targets (labels != -100) in the whole optimizer step, all
  micro-batches of the accumulation on all ranks, so a loss summed over a micro-batch's targets and divided by it
  adds up, over the step, to the mean over the step's targets on any number of processes.

``step_targets`` is known in advance because the order is: the sampler yields ``(row, step targets)`` pairs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from lit_fsdp.data.blocks import BlockDataModule, ResumableSampler, blocks_per_split
from lit_fsdp.data.chat import ChatRenderer, Sample, parse_sample, read_samples
from lit_fsdp.data.corpus import Corpus, file_records, is_plain_json, open_corpus
from lit_fsdp.data.progress import CorpusProgress
from lit_fsdp.data.token_cache import WAIT_TIMEOUT_S, cache_dir_or_default, cache_key, wait_or_build
from lit_fsdp.data.tokenizer import holds_tokenizer, load_tokenizer, tokenizer_fingerprint
from lit_fsdp.hub import tokenizer_folder

#: Samples rendered and tokenised in one batch while a cache is built.
SAMPLES_PER_CHUNK = 1024
#: Bumped when the cache's layout or the rendering changes, so older caches are not reused.
CACHE_VERSION = 1
_ARRAYS = ("tokens", "targets", "sample_starts", "row_starts", "row_samples", "row_targets")


# ---------------------------------------------------------------------------------------------------- building


def build_sft_cache(
    directory: Path, source: Corpus, renderer: ChatRenderer, seq_len: int, packing: bool, too_long: str,
    train_on_prompt: bool,
) -> dict[str, Any]:
    """Render, tokenise and pack the samples of ``source`` into ``directory``; returns the description for meta.json.

    A sample of ``n`` tokens takes ``n - 1`` positions of a row (its last token is only a label). One longer than
    ``seq_len`` is cut to its first ``seq_len + 1`` tokens or dropped (``too_long``), and dropped anyway when the cut
    leaves no target.
    """
    directory.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if len(renderer.tokenizer) <= 2**16 else np.uint32)
    tokens, targets, lengths, total = [], [], [], 0
    counts = {"read": 0, "without_answer": 0, "truncated": 0, "dropped": 0}
    rank_zero_info(f"Rendering {source} into {directory}")
    with CorpusProgress(f"Rendering {source.name}", source.files, tokens=0) as shown:
        for chunk, bytes_read in _chunks(read_samples_of(source), SAMPLES_PER_CHUNK):
            answered = [sample for sample in chunk if sample.has_answer]
            counts["read"] += len(chunk)
            counts["without_answer"] += len(chunk) - len(answered)
            for ids, mask in renderer.encode(answered):
                if train_on_prompt:
                    mask = [True] * len(ids)
                cut = len(ids) - 1 > seq_len
                if cut and too_long == "drop":
                    counts["dropped"] += 1
                    continue
                ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
                if not any(mask[1:]):  # the cut kept no answer token
                    counts["dropped"] += 1
                    continue
                counts["truncated"] += cut
                tokens.append(np.asarray(ids, dtype=dtype))
                targets.append(np.asarray(mask, dtype=bool))
                lengths.append(len(ids))
                total += len(ids)
            shown.update(counts["read"], bytes_read, total)
    if not lengths:
        raise ValueError(
            f"{source}: no sample has a target token ({counts['read']} read, {counts['without_answer']} without an "
            f"assistant turn, {counts['dropped']} longer than --data.seq_len {seq_len} dropped); give samples with "
            "assistant turns"
        )
    rows = first_fit([length - 1 for length in lengths], seq_len) if packing else [[i] for i in range(len(lengths))]
    per_sample_targets = np.array([mask[1:].sum() for mask in targets], dtype=np.int64)
    arrays = {
        "tokens": np.concatenate(tokens),
        "targets": np.concatenate(targets),
        "sample_starts": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        "row_starts": np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int64),
        "row_samples": np.fromiter((sample for row in rows for sample in row), dtype=np.int64, count=len(lengths)),
        "row_targets": np.array([per_sample_targets[row].sum() for row in rows], dtype=np.int64),
    }
    for name in _ARRAYS:
        np.save(directory / f"{name}.npy", arrays[name])
    return {
        "source": str(source), "samples": len(lengths), "rows": len(rows), "tokens": int(arrays["tokens"].size),
        "targets": int(per_sample_targets.sum()), "positions": total - len(lengths), **counts,
    }


def read_samples_of(corpus: Corpus) -> Iterator[tuple[Sample, int]]:
    """Each sample of the corpus's files in turn, with the bytes of the corpus read so far.

    A plain JSON file is read as ``chat.read_samples`` reads it (its errors name the line); compressed JSON Lines
    and Parquet rows (a ``messages`` column of ``{role, content}`` lists, or ``prompt`` and ``completion``) through
    ``corpus.file_records``.
    """
    def samples(file: Path) -> Iterator[tuple[Sample, int]]:
        if is_plain_json(file):
            return read_samples(file)
        return ((parse_sample(record, f"{file}: {where}"), read) for where, record, read in file_records(file))

    return corpus.each_file(samples)


def _chunks(samples: Iterator[tuple[Any, int]], size: int) -> Iterator[tuple[list[Any], int]]:
    chunk, bytes_read = [], 0
    for sample, bytes_read in samples:
        chunk.append(sample)
        if len(chunk) == size:
            yield chunk, bytes_read
            chunk = []
    if chunk:
        yield chunk, bytes_read


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices: each sample in turn goes into the first row with room for it, a new row when none has.

    A max-tree over the rows' free space finds that row in O(log rows), so a million samples pack in seconds.
    """
    leaves = 1
    while leaves < len(lengths):
        leaves *= 2
    free = [capacity] * (2 * leaves)  # every row not yet opened is empty; rows open left to right
    rows: list[list[int]] = []
    for sample, length in enumerate(lengths):
        if not 0 < length <= capacity:
            raise ValueError(f"sample {sample} takes {length} positions, which a row of {capacity} cannot hold")
        node = 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= length else 2 * node + 1
        row = node - leaves
        if row == len(rows):
            rows.append([])
        rows[row].append(sample)
        free[node] -= length
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def corpus_sha256(corpus: Corpus) -> str | list[str]:
    """The SHA-256 of the corpus's one file, or of each of its files."""
    hashes = [file_sha256(file) for file in corpus.files]
    return hashes[0] if len(hashes) == 1 else hashes


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------- serving


class PackedRows(Dataset):
    """Rows ``[first, first + count)`` of a finalized SFT cache, read through memory maps that pickle as paths."""

    def __init__(self, directory: Path, rows: int, seq_len: int, pad_id: int, first: int = 0, count: int | None = None):
        self.directory, self.seq_len, self.pad_id, self.first = directory, seq_len, pad_id, first
        self.count = rows - first if count is None else count
        self._arrays: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.count

    def arrays(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {name: np.load(self.directory / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
        return self._arrays

    @property
    def row_targets(self) -> np.ndarray:
        """Targets (labels != -100) of each row."""
        return np.asarray(self.arrays()["row_targets"][self.first : self.first + self.count])

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, torch.Tensor]:
        index, step_targets = item if isinstance(item, tuple) else (item, None)
        a, row = self.arrays(), self.first + index
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        labels = torch.full((self.seq_len,), -100, dtype=torch.int64)
        position_ids = torch.zeros(self.seq_len, dtype=torch.int64)
        segment_ids = torch.zeros(self.seq_len, dtype=torch.int64)
        at = 0
        for segment, sample in enumerate(a["row_samples"][a["row_starts"][row] : a["row_starts"][row + 1]], start=1):
            begin, end = int(a["sample_starts"][sample]), int(a["sample_starts"][sample + 1])
            tokens = torch.from_numpy(a["tokens"][begin:end].astype(np.int64))
            is_target = torch.from_numpy(a["targets"][begin + 1 : end].copy())
            span = slice(at, at + end - begin - 1)
            input_ids[span] = tokens[:-1]
            labels[span] = torch.where(is_target, tokens[1:], -100)
            position_ids[span] = torch.arange(end - begin - 1)
            segment_ids[span] = segment
            at = span.stop
        batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "segment_ids": segment_ids}
        if step_targets is not None:
            batch["step_targets"] = torch.tensor(step_targets, dtype=torch.int64)
        return batch

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}


class StepTargetSampler(ResumableSampler):
    """A ``ResumableSampler`` that yields ``(row, targets in the row's optimizer step)`` pairs.

    Global position ``g`` of the epoch's order is local sample ``g // world`` of rank ``g % world``, so micro-batch
    ``k`` of all ranks together is positions ``[k * b * world, (k + 1) * b * world)`` and optimizer step ``s`` is
    micro-batches ``[s * A, (s + 1) * A)``; the last step of an epoch may hold fewer. ``micro_batches`` is how many
    micro-batches of the epoch the trainer runs (``limit_train_batches``), when that is fewer than the loader has.
    """

    def __init__(self, dataset: PackedRows, num_replicas: int, rank: int, seed: int, shuffle: bool, batch_size: int,
                 accumulate: int, micro_batches: int | None = None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, seed=seed, shuffle=shuffle)
        self.batch_size, self.accumulate, self.micro_batches = batch_size, accumulate, micro_batches
        self.row_targets = dataset.row_targets

    def global_order(self) -> list[int]:
        """The epoch's rows in global order; rank ``r`` takes ``[r::world]`` (as ``DistributedSampler`` does)."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            order = list(range(len(self.dataset)))
        return order[: self.total_size]

    def step_targets(self, order: list[int]) -> np.ndarray:
        """For each global position of ``order``, the targets of its optimizer step."""
        per_micro = self.batch_size * self.num_replicas
        micro = len(order) // per_micro
        if self.micro_batches is not None:
            micro = min(micro, self.micro_batches)
        used, per_step = micro * per_micro, per_micro * self.accumulate
        # positions past the last micro-batch run are never trained on; they form one more group of their own
        starts = list(range(0, used, per_step)) + ([used] if used < len(order) else [])
        sums = np.add.reduceat(self.row_targets[order], starts) if order else np.zeros(0, dtype=np.int64)
        return np.repeat(sums, np.diff(starts + [len(order)]))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = self.global_order()
        steps = self.step_targets(order)
        positions = range(self.rank + self.start * self.num_replicas, len(order), self.num_replicas)
        return iter([(order[position], int(steps[position])) for position in positions])


def micro_batches_run(available: int, limit: int | float | None) -> int:
    """How many of ``available`` micro-batches an epoch runs under ``--trainer.limit_train_batches`` (as Lightning
    counts them)."""
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(available, limit)
    if isinstance(limit, float):
        return int(available * limit)
    return available


# ---------------------------------------------------------------------------------------------------- data module


class SFTDataModule(BlockDataModule):
    """Chat samples rendered once into a cache of rows of ``seq_len`` positions, with loss on the answers only.

    See the module's docstring for the batches. ``vocab_size`` is the tokenizer's length (known at construction
    with ``tokenizer_path``, else once ``setup`` has read the model's).
    """

    def __init__(
        self,
        train_path: str,
        val_path: str | None = None,
        tokenizer_path: str | None = None,
        seq_len: int = 1024,
        batch_size: int = 8,
        packing: bool = True,
        too_long: Literal["truncate", "drop"] = "truncate",
        train_on_prompt: bool = False,
        val_fraction: float = 0.05,
        cache_dir: str | None = None,
        wait_timeout_s: float = WAIT_TIMEOUT_S,
        seed: int = 1234,
        num_workers: int = 0,
    ):
        """
        Args:
            train_path: JSON Lines or JSON array of samples: {"messages": [{"role", "content"}, ...]} with roles
                system, user and assistant, or {"prompt", "completion"}; also .jsonl.gz, .jsonl.zst, Parquet with
                those columns, a folder or glob of such files, or a Hub data set's subfolder
                owner/name[@revision]:subfolder, read from the Hub cache (downloaded when online).
            val_path: Validation samples in the same format; by default the last val_fraction of the training rows.
            tokenizer_path: Hugging Face tokenizer: a local folder or a Hub name owner/name[@revision] (from the Hub
                cache); by default the tokenizer in --model.pretrained_path (one of the two is required). Its chat
                template renders the samples, else a plain template.
            seq_len: Positions per row.
            batch_size: Rows per process per micro-batch.
            packing: Pack several samples into a row (first fit, in file order); otherwise one padded sample per row.
            too_long: What to do with a sample longer than seq_len: truncate (keep its start) or drop it.
            train_on_prompt: Learn every token, not only the assistant's answers.
            val_fraction: Share of the training rows held out for validation when val_path is not given.
            cache_dir: Folder for the rendered rows; default $LIT_FSDP_CACHE, else ~/.cache/lit_fsdp/tokens.
            wait_timeout_s: Seconds the other ranks wait for local rank 0 to build the cache.
            seed: Seed of the sampling order.
            num_workers: DataLoader worker processes.
        """
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        self.train_path = _check_samples_file(train_path, "--data.train_path")
        self.val_path = None if val_path is None else _check_samples_file(val_path, "--data.val_path")
        if too_long not in ("truncate", "drop"):
            raise ValueError(f"--data.too_long is {too_long!r}; give truncate or drop")
        self.packing, self.too_long, self.train_on_prompt = packing, too_long, train_on_prompt
        self.val_fraction = val_fraction
        self.cache_dir = cache_dir_or_default(cache_dir)
        self.wait_timeout_s = wait_timeout_s
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.vocab_size = None  # type: ignore[assignment]
        if tokenizer_path is not None:
            folder = tokenizer_folder(tokenizer_path, "--data.tokenizer_path")
            if not Path(folder).expanduser().is_dir():
                raise FileNotFoundError(f"--data.tokenizer_path {tokenizer_path}: no such folder; give a local Hugging "
                                        "Face tokenizer folder or a Hub name owner/name, or leave it unset to use "
                                        "--model.pretrained_path's")
            self._tokenizer = load_tokenizer(Path(folder).expanduser())
            self.vocab_size = len(self._tokenizer)
        #: per file, what building its cache counted (samples, rows, without_answer, truncated, dropped, ...)
        self.stats: dict[str, dict[str, Any]] = {}

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        return self._tokenizer

    @property
    def dataset_name(self) -> str:
        return self.train_path.stem

    @property
    def chat_template(self) -> str | None:
        """The template the samples are rendered with (``ChatRenderer.template_identity``); checkpoints record it."""
        return None if self._tokenizer is None else ChatRenderer(self._tokenizer).template_identity

    def setup(self, stage: str) -> None:
        trainer = self.trainer
        self._read(None if trainer is None else trainer.lightning_module, 0 if trainer is None else trainer.local_rank)

    def read_before_launch(self, module: Any, local_rank: int) -> None:
        """The caches built (or found) before the other processes start: a malformed sample, a base folder without a
        tokenizer or samples without a target are said once, and the ranks find the caches built."""
        self._read(module, local_rank)

    def _read(self, module: Any, local_rank: int) -> None:
        """The tokenizer (``module``'s pretrained folder's, unless given) and the training and validation rows, from
        the caches local rank 0 builds."""
        if hasattr(self, "train_set"):
            return
        if self._tokenizer is None:
            self._tokenizer = self._model_tokenizer(module)
            self.vocab_size = len(self._tokenizer)
        renderer = ChatRenderer(self._tokenizer)
        train_dir, train_meta = self._cache(self.train_path, renderer, local_rank)
        rows_of = self._rows_of
        if self.val_path is not None:
            self.train_set = rows_of(train_dir, train_meta)
            self.val_set = rows_of(*self._cache(self.val_path, renderer, local_rank))
            return
        if train_meta["rows"] < 2:
            raise ValueError(f"{self.train_path}: its samples fill {train_meta['rows']} row of --data.seq_len "
                             f"{self.seq_len}, too few to hold out validation rows; give --data.val_path or more samples")
        num_train, num_val = blocks_per_split(train_meta["rows"], self.val_fraction)
        self.train_set = rows_of(train_dir, train_meta, 0, num_train)
        self.val_set = rows_of(train_dir, train_meta, num_train, num_val)

    def _rows_of(self, directory: Path, meta: dict[str, Any], first: int = 0, count: int | None = None) -> PackedRows:
        pad_id = self._tokenizer.pad_token_id
        pad_id = self._tokenizer.eos_token_id if pad_id is None else pad_id
        return PackedRows(directory, meta["rows"], self.seq_len, pad_id, first, count)

    def _model_tokenizer(self, module: Any) -> PreTrainedTokenizerBase:
        """The tokenizer saved in ``module``'s ``--model.pretrained_path``."""
        given = (getattr(module, "hparams", None) or {}).get("pretrained_path")
        # CausalLM resolved a Hub name to its snapshot folder when it was built; another module's name is resolved here
        pretrained = getattr(module, "pretrained_folder", None) or given
        if pretrained is None:
            raise ValueError("--data.tokenizer_path is not set and there is no --model.pretrained_path to take the "
                             "tokenizer from; give --data.tokenizer_path (a Hugging Face tokenizer folder)")
        folder = tokenizer_folder(pretrained, "--model.pretrained_path")
        if Path(folder).is_dir() and not holds_tokenizer(folder):  # else AutoTokenizer makes one of no tokens
            raise ValueError(
                f"--model.pretrained_path {given or pretrained}: the base folder has no tokenizer (a run trained on "
                "token ids, as the quickstart's is, exports none), and fine-tuning renders its samples with the "
                "base's; fine-tune a run that trained on text, such as configs/wikipedia.yaml's, exported (configs/"
                "sft_full.yaml's header says how), or give --data.tokenizer_path the tokenizer the base was trained "
                "with")
        return load_tokenizer(folder)

    def _cache(self, source: Corpus, renderer: ChatRenderer, local_rank: int) -> tuple[Path, dict[str, Any]]:
        settings = {"seq_len": self.seq_len, "packing": self.packing, "too_long": self.too_long,
                    "train_on_prompt": self.train_on_prompt}
        key = cache_key(source=corpus_sha256(source), tokenizer=tokenizer_fingerprint(renderer.tokenizer),
                        template=renderer.template_identity, version=CACHE_VERSION, **settings)
        directory = self.cache_dir / f"sft-{source.stem}-{key}"
        meta = wait_or_build(directory, lambda folder: build_sft_cache(folder, source, renderer, **settings), local_rank,
                             timeout_s=self.wait_timeout_s)
        self.stats[str(source)] = meta
        filled = meta["positions"] / (meta["rows"] * self.seq_len)
        rank_zero_info(
            f"{source.name}: {meta['samples']} samples in {meta['rows']} rows of {self.seq_len} ({filled:.0%} filled, "
            f"{meta['targets']} targets); {meta['without_answer']} without an assistant turn skipped, "
            f"{meta['truncated']} longer than --data.seq_len truncated, {meta['dropped']} dropped"
        )
        return directory, meta

    def _sampler(self, dataset: Dataset, world: int, rank: int, shuffle: bool) -> StepTargetSampler:
        training = dataset is getattr(self, "train_set", None)
        accumulate = self._accumulation() if training else 1
        micro_batches = None
        if training and self.trainer is not None:
            available = len(dataset) // world // self.batch_size
            micro_batches = micro_batches_run(available, getattr(self.trainer, "limit_train_batches", None))
        return StepTargetSampler(dataset, world, rank, self.seed, shuffle, self.batch_size, accumulate, micro_batches)


def _check_samples_file(path: str, flag: str) -> Corpus:
    return open_corpus(path, flag, text_field=None, records="samples", listed="a JSON Lines file or JSON array",
                       objects="samples")
