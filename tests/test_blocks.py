"""Token blocks, the resumable sampler and the Markov source, without a trainer."""

from __future__ import annotations

import numpy as np
import pytest

from lit_fsdp.data.blocks import ResumableSampler, TokenBlocks
from lit_fsdp.data.synthetic import MarkovSource


def global_batches(num_blocks: int, world: int, local_batch: int, epoch: int = 0) -> list[set[int]]:
    per_rank = []
    for rank in range(world):
        sampler = ResumableSampler(range(num_blocks), num_replicas=world, rank=rank, seed=7)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        per_rank.append([indices[i : i + local_batch] for i in range(0, len(indices) - local_batch + 1, local_batch)])
    return [set().union(*batches) for batches in zip(*per_rank)]


def test_a_global_batch_holds_the_same_blocks_on_one_and_on_two_ranks():
    one, two = global_batches(103, 1, 8), global_batches(103, 2, 4)
    assert one == two and len(one) == 103 // 8
    assert global_batches(103, 1, 8, epoch=1) != one  # reshuffled per epoch


def test_resume_skips_exactly_the_consumed_samples_of_that_epoch_only():
    full = ResumableSampler(range(50), num_replicas=2, rank=1, seed=3)
    full.set_epoch(2)
    resumed = ResumableSampler(range(50), num_replicas=2, rank=1, seed=3)
    resumed.resume(epoch=2, start=6)
    resumed.set_epoch(2)  # Lightning calls this at the start of the epoch it resumes into
    assert list(resumed) == list(full)[6:]
    resumed.set_epoch(3)
    assert len(list(resumed)) == 25


def test_blocks_overlap_by_one_token_and_labels_are_shifted():
    blocks = TokenBlocks(np.arange(21), seq_len=5)
    assert len(blocks) == 4
    item = blocks[1]
    assert item["input_ids"].tolist() == [5, 6, 7, 8, 9] and item["labels"].tolist() == [6, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="shorter --data.seq_len"):
        TokenBlocks(np.arange(10), seq_len=16)


def test_markov_entropy_rate_equals_the_mean_loss_of_the_true_model():
    source = MarkovSource(vocab_size=64, branching=4, concentration=1.0, seed=0)
    tokens = source.sample(200_000)
    probability = {(a, b): p for a in range(64) for b, p in zip(source.successors[a], source.probs[a])}
    nll = -np.mean([np.log(probability[pair]) for pair in zip(tokens[:-1].tolist(), tokens[1:].tolist())])
    assert nll == pytest.approx(source.entropy_rate, abs=0.01)
    assert source.stationary.sum() == pytest.approx(1.0)
