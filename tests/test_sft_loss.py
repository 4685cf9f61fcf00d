"""Fine-tuning's loss: every target token weighs the same in a step, however the samples are packed, padded, split into
micro-batches or spread over ranks; packed samples never attend to each other."""

from __future__ import annotations

import pytest
import torch

from lit_fsdp.loss import IGNORE_INDEX, step_normalised, target_count
from lit_fsdp.model import CausalLM

SEQ_LEN, VOCAB = 24, 512


def tiny_model(chunk: int, preset: str = "gpt2-tiny") -> CausalLM:
    module = CausalLM(preset=preset, loss_chunk_tokens=chunk)
    module.configure_model()
    module.model.to_empty(device="cpu")
    module.model.tie_weights()
    torch.manual_seed(0)
    module.model.apply(module.model._init_weights)
    return module


def samples(count: int = 7, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) of samples of 4-12 tokens whose first half is prompt: few or many targets each."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(count):
        length = int(torch.randint(4, 13, (1,), generator=generator))
        tokens = torch.randint(0, VOCAB, (length + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[: int(torch.randint(1, length, (1,), generator=generator))] = IGNORE_INDEX  # the prompt
        made.append((tokens[:-1], labels))
    return made


def rows(parts: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """A batch of rows, each the given samples back to back, padded; position ids restart per sample and padding."""
    batch = {key: torch.zeros(len(parts), SEQ_LEN, dtype=torch.long) for key in ("input_ids", "labels", "position_ids")}
    batch["labels"].fill_(IGNORE_INDEX)
    for row, members in enumerate(parts):
        at = 0
        for tokens, labels in members:
            end = at + len(tokens)
            batch["input_ids"][row, at:end], batch["labels"][row, at:end] = tokens, labels
            batch["position_ids"][row, at:end] = torch.arange(len(tokens))
            at = end
        batch["position_ids"][row, at:] = torch.arange(SEQ_LEN - at)  # padding: a segment of its own
    return batch


def packed(members: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """First fit of the samples into rows of SEQ_LEN tokens."""
    made: list[list] = []
    for sample in members:
        for row in made:
            if sum(len(t) for t, _ in row) + len(sample[0]) <= SEQ_LEN:
                row.append(sample)
                break
        else:
            made.append([sample])
    return made


def step_gradients(module: CausalLM, micro_batches_per_rank: list[list[dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The gradients one optimizer step applies: each rank's micro-batches through ``step_normalised`` and Lightning's
    division by the accumulation, then the strategy's average over ranks."""
    world, accumulation = len(micro_batches_per_rank), len(micro_batches_per_rank[0])
    step_targets = sum(int(target_count(b["labels"])) for ranks in micro_batches_per_rank for b in ranks)
    summed: dict[str, torch.Tensor] = {}
    for rank_batches in micro_batches_per_rank:
        module.model.zero_grad()
        for batch in rank_batches:
            mean = module._loss(batch)[0]
            loss = step_normalised(mean, batch["labels"], torch.tensor([step_targets]), world, accumulation)
            (loss / accumulation).backward()
        for name, param in module.model.named_parameters():
            summed[name] = summed.get(name, 0) + param.grad / world
    return summed


def reference_gradients(module: CausalLM, members: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each sample alone, the sum of all target tokens' losses divided by their number."""
    module.model.zero_grad()
    total = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in members)
    for tokens, labels in members:
        logits = module.model(input_ids=tokens[None]).logits[0].float()
        (torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / total).backward()
    return {name: param.grad.clone() for name, param in module.model.named_parameters()}


@pytest.mark.parametrize("chunk", [0, 16], ids=["plain_loss", "chunked_loss"])
def test_packed_padded_accumulated_and_two_ranks_give_the_gradients_of_the_token_mean(chunk):
    module = tiny_model(chunk)
    members = samples()
    want = reference_gradients(module, members)
    ways = {
        "padded, one micro-batch": [[rows([[s] for s in members])]],
        "padded, accumulation 4 (the last micro-batch one sample)": [
            [rows([[s] for s in members[i: i + 2]]) for i in range(0, 8, 2)]],
        "packed, accumulation 1": [[rows(packed(members))]],
        "packed, 2 ranks x accumulation 2": [[rows(packed(members[:2])), rows(packed(members[2:4]))],
                                             [rows(packed(members[4:6])), rows(packed(members[6:]))]],
        "padded, 2 ranks, unequal targets": [[rows([[s] for s in members[:1]])], [rows([[s] for s in members[1:]])]],
    }
    for way, batches in ways.items():
        got = step_gradients(module, batches)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=f"{way}: {name}")


def test_a_mean_of_micro_batch_means_would_weigh_tokens_unequally():
    """The check above can fail: with unequal target counts, averaging the micro-batches' means is another gradient."""
    module = tiny_model(0)
    members = samples()
    want = reference_gradients(module, members)
    module.model.zero_grad()
    for sample in members:  # accumulation 7, one sample each, Lightning's division of each mean by 7
        (module._loss(rows([[sample]]))[0] / len(members)).backward()
    differs = any(not torch.allclose(p.grad, want[n], rtol=1e-3, atol=1e-6) for n, p in module.model.named_parameters())
    assert differs


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_a_packed_sample_sees_only_itself(preset):
    """Logits of a packed row equal each sample's logits computed alone: no token attends to another sample."""
    module = tiny_model(0, preset)
    members = samples(4, seed=1)
    batch = rows(packed(members))
    assert batch["input_ids"].shape[0] < len(members)  # several samples share a row
    with torch.no_grad():
        logits = module(batch["input_ids"], batch["position_ids"])
        for row, row_members in enumerate(packed(members)):
            at = 0
            for tokens, _ in row_members:
                alone = module(tokens[None])[0]
                torch.testing.assert_close(logits[row, at: at + len(tokens)], alone, rtol=1e-4, atol=1e-5)
                at += len(tokens)
