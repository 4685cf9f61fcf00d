"""Error feedback: the residual plus what was sent always equals the corrected input."""

from __future__ import annotations

import torch

from compress.error_feedback import ErrorFeedback
from compress.quantize import IntQuant
from compress.sparsify import TopK


def test_residual_plus_sent_equals_the_input_step_after_step():
    feedback = ErrorFeedback(TopK(ratio=0.05))
    generator = torch.Generator().manual_seed(0)
    owed = torch.zeros(1000)
    for step in range(5):
        grad = torch.randn(1000, generator=generator)
        sent = feedback.decompress(feedback.compress(grad, key="unit0/1", seed=step))
        torch.testing.assert_close(feedback.residuals["unit0/1"] + sent, grad + owed)
        owed = feedback.residuals["unit0/1"]
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
