"""Next-token cross-entropy computed by the language-model head in chunks of tokens.

The plain loss turns the whole ``tokens x vocabulary`` logits tensor to float32 and keeps it, and its
gradient, for backward: at a 128k vocabulary and 16k tokens per step that is 8.4 GB of float32 logits
beside their bfloat16 copy and both gradients. Here the head computes, for ``chunk_tokens`` tokens at a
time, the logits, their loss and their gradient (``softmax - onehot``, Liger-Kernel's fused linear
cross-entropy), multiplies that gradient into the hidden states' and the head's gradients, and frees
the chunk. Only one chunk's logits exist at once; backward only scales the stored gradients, so nothing is
recomputed. The value and the gradients are those of ``F.cross_entropy(logits.float(), labels)``, up to
the order in which float32 sums are taken.

The loss is computed inside the model's forward, by its head, so that FSDP2's and SlideFSDP's hooks
see the head's weight used inside the root module's forward as before.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # F.cross_entropy's default: labels with this value add nothing to the loss


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """The tokens the loss covers (labels other than ``IGNORE_INDEX``), as a device tensor: no host sync."""
    return (labels != IGNORE_INDEX).sum()


def step_normalised(mean: torch.Tensor, labels: torch.Tensor, step_targets: torch.Tensor, data_parallel: int,
                    accumulation: int) -> torch.Tensor:
    """A micro-batch's loss scaled so that the optimizer step's gradient is that of the sum of the losses of all its
    target tokens (every micro-batch of the accumulation, every rank) divided by their number, ``step_targets``.

    The mean of per-micro-batch means weighs a token of a micro-batch with few targets more than one of a micro-batch
    with many (torchtune#1875); here every token weighs the same. Lightning divides each micro-batch's loss by
    ``accumulation`` and the strategy averages gradients over the ``data_parallel`` ranks: both are undone, so that
    ``mean x targets here x data_parallel x accumulation / step_targets`` summed over the step is the step's mean.
    """
    return mean * target_count(labels) * (data_parallel * accumulation) / step_targets[0]


def loss_bytes(tokens: int, vocab_size: int, hidden_size: int, itemsize: int, chunk_tokens: int,
               bias: bool = False) -> int:
    """Peak device bytes the loss holds beside its inputs, the model's activations and the gradients it hands back.

    Plain (``chunk_tokens`` 0): the logits in the compute dtype, their float32 copy and its gradient. Chunked,
    for ``C`` = min(tokens, chunk_tokens): one chunk's float32 logits beside their log-softmax (later the softmax),
    8 x C x V; the gradients made in forward and kept for backward, the hidden states' in the compute dtype and
    the head's (and its bias's) in float32. Nothing vocabulary x hidden is made per chunk beyond that room.
    """
    if not chunk_tokens:
        return tokens * vocab_size * (itemsize + 8)
    chunk = min(tokens, chunk_tokens)
    kept = tokens * hidden_size * itemsize + vocab_size * (hidden_size + (1 if bias else 0)) * 4
    return _chunk_room(chunk, vocab_size) + kept


def _chunk_room(chunk: int, vocab_size: int) -> int:
    """Bytes a chunk's float32 logits and their (log-)softmax take at once: the room every other temporary fits in."""
    return chunk * vocab_size * 8


def _row_slices(rows: int, row_bytes: int, room: int) -> Iterator[slice]:
    """Slices of ``rows`` rows, each small enough that ``row_bytes`` per row fit in ``room`` bytes."""
    step = max(1, room // row_bytes)
    return (slice(start, start + step) for start in range(0, rows, step))


# Per device type: whether torch.addmm(..., out_dtype=torch.float32, out=acc) adds a bfloat16/float16 product into
# a float32 buffer in place (CUDA kernels from torch 2.8 on; none on CPU in 2.13). Some builds refuse a float32
# addend (pytorch/pytorch#154086): the first refusal turns it off for the process, and the product is sliced instead.
_ADDMM_TO_FLOAT32 = {"cuda": True}


def _add_product(acc: torch.Tensor, grad_logits: torch.Tensor, part: torch.Tensor, room: int) -> None:
    """``acc += grad_logits.T @ part`` in float32 ``acc``, with no vocabulary x hidden temporary beyond ``room`` bytes.

    A fresh product and its float32 copy per chunk were 6 x V x H bytes more (1.6 GB at Llama-1B's shape), uncounted,
    and 20 bytes of memory traffic per element of ``acc``, where adding in the matmul's epilogue moves 8.
    """
    if grad_logits.dtype == acc.dtype:
        acc.addmm_(grad_logits.t(), part)
        return
    if _ADDMM_TO_FLOAT32.get(acc.device.type, False):
        try:
            torch.addmm(acc, grad_logits.t(), part, out_dtype=acc.dtype, out=acc)  # checks fail before any write
            return
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError):  # no kernel, a refused float32 addend, or no out_dtype argument
            _ADDMM_TO_FLOAT32[acc.device.type] = False
    # Elsewhere the product is made a slice of the vocabulary at a time, in the room the chunk's float32 logits left.
    for rows in _row_slices(acc.shape[0], part.shape[1] * (grad_logits.itemsize + 4), room):
        acc[rows] += grad_logits[:, rows].t().mm(part).float()


def _scaled(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, room: int) -> torch.Tensor:
    """``(grad * scale).to(dtype)`` rounded once, without a float32 copy of ``grad`` beyond ``room`` bytes.

    On CUDA the multiply casts as it stores, one pass instead of a float32 product and then a cast; on CPU ``out=``
    of another dtype goes through a float32 temporary, hence the slices.
    """
    out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
    for rows in _row_slices(grad.shape[0], grad[:1].numel() * 4, room):
        torch.mul(grad[rows], scale, out=out[rows])
    return out


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, with gradients made chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens):  # type: ignore[override]
        counted = (labels != IGNORE_INDEX).sum().clamp_min(1).float()  # a device tensor: no host sync
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        room = _chunk_room(min(hidden.shape[0], chunk_tokens), weight.shape[0])
        needs = ctx.needs_input_grad
        grad_hidden = torch.empty_like(hidden) if needs[0] else None
        # Accumulated in float32 across chunks, as the single matmul of the plain loss accumulates internally.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if (
            bias is not None and needs[2]) else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            part = hidden[start:start + chunk_tokens]
            target = labels[start:start + chunk_tokens]
            logits = F.linear(part, weight, bias).float()
            total += F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            # d(sum of losses)/d(logits) = softmax - onehot on counted rows, 0 on ignored ones.
            grad_logits = torch.softmax(logits, dim=-1)
            del logits
            grad_logits[torch.arange(target.shape[0], device=target.device), target.clamp_min(0)] -= 1
            grad_logits.mul_((target != IGNORE_INDEX).unsqueeze(1))
            grad_logits = grad_logits.to(part.dtype)  # as autograd casts it back through `.float()`
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:start + chunk_tokens])
            if grad_weight is not None:
                _add_product(grad_weight, grad_logits, part, room - grad_logits.numel() * grad_logits.itemsize)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0, dtype=torch.float32)
            del grad_logits  # before the next chunk's logits, not after them
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, counted)
        ctx.dtypes, ctx.room = (weight.dtype, None if bias is None else bias.dtype), room
        return total / counted

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias, counted = ctx.saved_tensors
        scale = grad_output / counted
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype),
            None if grad_weight is None else _scaled(grad_weight, scale, weight_dtype, ctx.room),
            None if grad_bias is None else _scaled(grad_bias, scale, bias_dtype, ctx.room),
            None,
            None,
        )


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Mean next-token loss of a linear head over ``hidden`` (..., H) against ``labels`` (...), ``chunk_tokens`` at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens is {chunk_tokens}; give a positive number of tokens per chunk")
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                            labels.reshape(-1), chunk_tokens)


class LossHead(nn.Linear):
    """A model's linear LM head that, inside ``targets(labels)``, returns the chunked mean loss instead of logits."""

    chunk_tokens: int
    _labels: torch.Tensor | None

    @classmethod
    def convert(cls, head: nn.Module, chunk_tokens: int) -> "LossHead":
        """Turn ``head`` (an ``nn.Linear``) into a LossHead in place: same object, parameters and state-dict names."""
        if type(head) is not nn.Linear:
            raise TypeError(f"the chunked loss needs the model's output embeddings to be an nn.Linear, not "
                            f"{type(head).__name__}; set --model.loss_chunk_tokens 0 for the plain loss")
        head.__class__ = cls
        head.chunk_tokens, head._labels = chunk_tokens, None
        return head  # type: ignore[return-value]

    @contextmanager
    def targets(self, labels: torch.Tensor) -> Iterator[None]:
        """While open, this head's forward returns the mean loss against ``labels`` (a 0-d tensor)."""
        self._labels = labels
        try:
            yield
        finally:
            self._labels = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self._labels is None:
            return super().forward(hidden)
        return chunked_linear_cross_entropy(hidden, self.weight, self.bias, self._labels, self.chunk_tokens)
