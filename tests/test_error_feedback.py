"""Error feedback: the residual plus what was sent always equals the corrected input."""

from __future__ import annotations

import torch

from compress.error_feedback import ErrorFeedback
from compress.quantize import IntQuant
from compress.sparsify import TopK


def test_residual_plus_sent_equals_the_input_step_after_step_and_the_sent_sum_converges():
    feedback = ErrorFeedback(TopK(ratio=0.05))
    generator = torch.Generator().manual_seed(0)
    drift = 0.5 * torch.randn(1000, generator=generator)  # a mean the gradients share, so their sum grows linearly
    owed, sent_sum, given_sum = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    for step in range(200):
        grad = drift + torch.randn(1000, generator=generator)
        payload = feedback.compress(grad, key="unit0/1", seed=step)
        sent = feedback.decompress(payload)
        torch.testing.assert_close(feedback.residuals["unit0/1"] + sent, grad + owed)
        # 50 of 1000 values (5%), positions as a 125-byte bitmap (cheaper than 50 int32): 325 bytes
        assert payload.kept == 50 and int(sent.count_nonzero()) == 50 and payload.nbytes == 50 * 4 + 125
        owed = feedback.residuals["unit0/1"]
        sent_sum += sent
        given_sum += grad
        # What was sent falls short of what was given by exactly the residual, which stays within 5 gradients'
        # norm (about 36 each) while the sum of the gradients grows to about 3300.
        torch.testing.assert_close(given_sum - sent_sum, owed, rtol=1e-4, atol=1e-3)
        assert torch.linalg.vector_norm(owed) < 5 * torch.linalg.vector_norm(grad), step
    assert torch.linalg.vector_norm(owed) < 0.05 * torch.linalg.vector_norm(given_sum)  # 3.6% after 200 steps
    assert feedback.residual_norm == torch.linalg.vector_norm(owed).item()
    assert feedback.memory_bytes == 1000 * 4


def test_residuals_are_kept_per_chunk_and_feedback_shrinks_the_accumulated_error():
    feedback = ErrorFeedback(IntQuant(num_bits=2, chunk_size=64))
    plain = IntQuant(num_bits=2, chunk_size=64)
    grad = torch.randn(512, generator=torch.Generator().manual_seed(1))
    sent_with, sent_without = torch.zeros(512), torch.zeros(512)
    for step in range(50):  # the same gradient every step: EF's running sum converges to the true sum
        sent_with += feedback.decompress(feedback.compress(grad, key="a", seed=step))
        sent_without += plain.decompress(plain.compress(grad, key="a", seed=step))
    feedback.compress(grad, key="b", seed=0)
    assert set(feedback.residuals) == {"a", "b"}
    error_with = torch.linalg.vector_norm(sent_with - 50 * grad)
    error_without = torch.linalg.vector_norm(sent_without - 50 * grad)
    assert error_with < 0.1 * error_without
