"""Deep Gradient Compression around top-k: warm-up schedule, momentum correction and masking, clipping, state."""

from __future__ import annotations

import pytest
import torch

from compress.config import CompressionConfig
from compress.dgc import DeepGradientCompression, warmup_density
from compress.error_feedback import ErrorFeedback
from compress.sparsify import TopK


def gradients(steps: int, n: int = 1000) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=generator) for _ in range(steps)]


def test_density_falls_exponentially_from_dense_to_the_target_over_the_warmup():
    densities = [warmup_density(0.001, step, 4) for step in range(6)]
    assert densities[0] == 1.0 and densities[4:] == [0.001, 0.001]
    ratios = [densities[i + 1] / densities[i] for i in range(3)]
    assert ratios == pytest.approx([0.001 ** 0.25] * 3)  # a constant factor per step: exponential
    dgc = DeepGradientCompression(TopK(ratio=0.01), warmup_steps=3)
    kept = [int(dgc.compress(g, "unit0/0", i).tensors["values"].numel()) for i, g in enumerate(gradients(5))]
    assert kept == [1000, round(1000 * 0.01 ** (1 / 3)), round(1000 * 0.01 ** (2 / 3)), 10, 10]


def test_momentum_correction_accumulates_velocity_and_masks_it_where_sent():
    dgc = DeepGradientCompression(TopK(ratio=0.05), momentum=0.9)
    velocity, accumulated = torch.zeros(1000), torch.zeros(1000)
    for step, grad in enumerate(gradients(4)):
        velocity = 0.9 * velocity + grad
        accumulated = accumulated + velocity
        sent = dgc.decompress(dgc.compress(grad, "k", step))
        torch.testing.assert_close(dgc.residuals["k"] + sent, accumulated)  # nothing lost: error feedback of velocity
        where = sent != 0
        assert int(where.sum()) == 50 and (dgc.velocities["k"][where] == 0).all()  # momentum factor masking
        torch.testing.assert_close(dgc.velocities["k"][~where], velocity[~where])
        accumulated, velocity = dgc.residuals["k"].clone(), dgc.velocities["k"].clone()


def test_without_dgc_options_it_is_plain_error_feedback_and_clipping_bounds_what_is_accumulated():
    plain = CompressionConfig(method="topk", error_feedback=True).build(0)
    assert type(plain) is ErrorFeedback
    dgc = CompressionConfig(method="topk", ratio=0.5, error_feedback=True, clip_norm=1.0).build(0)
    assert isinstance(dgc, DeepGradientCompression)
    grad = 100 * gradients(1)[0]
    sent = dgc.decompress(dgc.compress(grad, "k", 0))
    assert torch.linalg.vector_norm(dgc.residuals["k"] + sent) == pytest.approx(1.0, rel=1e-5)
    with pytest.raises(ValueError, match="set error_feedback true"):
        CompressionConfig(method="topk", momentum=0.9).build(0)
    with pytest.raises(ValueError, match="does not apply to method 'int8'"):
        CompressionConfig(method="int8", momentum=0.9, error_feedback=True).build(0)
    with pytest.raises(ValueError, match="momentum=1.5"):
        CompressionConfig(method="topk", momentum=1.5, error_feedback=True).build(0)
    with pytest.raises(ValueError, match="warmup_steps needs ratio"):
        CompressionConfig(method="topk", k=10, warmup_steps=5, error_feedback=True).build(0)


def test_a_restored_state_continues_as_the_uninterrupted_compressor():
    config = CompressionConfig(method="topk", ratio=0.02, quantize="int8", error_feedback=True, momentum=0.9, warmup_steps=4)
    whole, first = config.build(0), config.build(0)
    grads = gradients(8)
    expected = [whole.decompress(whole.compress(g, "k", i)) for i, g in enumerate(grads)]
    for i, g in enumerate(grads[:4]):
        first.compress(g, "k", i)
    resumed = config.build(0)
    resumed.load_state_dict({name: value.clone() for name, value in first.state_dict().items()})
    for i, g in enumerate(grads[4:], start=4):
        torch.testing.assert_close(resumed.decompress(resumed.compress(g, "k", i)), expected[i])
