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


def loss_bytes(tokens: int, vocab_size: int, hidden_size: int, itemsize: int, chunk_tokens: int) -> int:
    """Peak device bytes the loss holds beside the model's activations, for ``tokens`` per micro-batch.

    Plain (``chunk_tokens`` 0): the logits in the compute dtype, their float32 copy and its gradient. Chunked:
    one chunk's float32 logits and softmax, plus the gradients made in forward and kept for backward (the
    hidden states' in the compute dtype, the head's in float32).
    """
    if not chunk_tokens:
        return tokens * vocab_size * (itemsize + 8)
    chunk = min(tokens, chunk_tokens)
    return chunk * vocab_size * 8 + tokens * hidden_size * itemsize + vocab_size * hidden_size * 4


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T + bias`` against ``labels``, with gradients made chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens):  # type: ignore[override]
        counted = (labels != IGNORE_INDEX).sum().clamp_min(1).float()  # a device tensor: no host sync
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
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
            valid = target != IGNORE_INDEX
            grad_logits = torch.softmax(logits, dim=-1)
            del logits
            rows = torch.arange(target.shape[0], device=target.device)
            grad_logits[rows, target.clamp_min(0)] -= 1
            grad_logits.mul_(valid.unsqueeze(1))
            grad_logits = grad_logits.to(part.dtype)  # as autograd casts it back through `.float()`
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[start:start + chunk_tokens])
            if grad_weight is not None:
                grad_weight.add_(grad_logits.t().mm(part).float())
            if grad_bias is not None:
                grad_bias.add_(grad_logits.float().sum(0))
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, counted)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total / counted

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias, counted = ctx.saved_tensors
        scale = grad_output / counted
        weight_dtype, bias_dtype = ctx.dtypes
        return (
            None if grad_hidden is None else grad_hidden * scale.to(grad_hidden.dtype),
            None if grad_weight is None else (grad_weight * scale).to(weight_dtype),
            None if grad_bias is None else (grad_bias * scale).to(bias_dtype),
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
