"""threshold-v with a density target: the share sent holds whatever the gradients' scale, and resumes exactly."""

from __future__ import annotations

import pytest
import torch

from compress.error_feedback import ErrorFeedback
from compress.sparsify import Sparsified, ThresholdV
from compress.quantize import IntQuant

N = 20_000


def gradients(steps: int, scale_per_step: float = 1.3) -> list[torch.Tensor]:
    """Heavy-tailed rows whose scale grows 30% a step: a fixed threshold would send ever more of them."""
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(N, generator=generator).pow(3) * scale_per_step**step for step in range(steps)]


@pytest.mark.parametrize("density", [0.01, 0.05])
def test_the_share_sent_stays_within_20_percent_of_the_target_whatever_the_scale(density):
    compressor = ThresholdV(density=density)
    fixed = ThresholdV(threshold=1.0)
    shares, fixed_shares = [], []
    for step, x in enumerate(gradients(12)):
        shares.append(compressor.compress(x, "chunk", step).kept / N)
        fixed_shares.append(fixed.compress(x, "chunk", step).kept / N)
    assert shares[0] == pytest.approx(density, rel=0.01)  # the first call uses its own quantile
    for share in shares[2:]:
        assert share == pytest.approx(density, rel=0.2)
    assert fixed_shares[-1] > 2 * fixed_shares[0]  # what the density target is for


def test_with_error_feedback_the_share_sent_averages_the_target_after_a_few_steps():
    compressor = ErrorFeedback(ThresholdV(density=0.01))
    shares = [compressor.compress(x, "chunk", step).kept / N for step, x in enumerate(gradients(30))]
    assert sum(shares[5:]) / len(shares[5:]) == pytest.approx(0.01, rel=0.1)
    assert all(share == pytest.approx(0.01, rel=0.3) for share in shares[5:])


def test_the_count_is_known_before_compressing_and_matches_what_is_sent():
    compressor = ErrorFeedback(Sparsified(ThresholdV(density=0.02), IntQuant()))
    for step, x in enumerate(gradients(5)):
        kept = int(compressor.kept_count(x, "chunk"))
        payload = compressor.compress(x, "chunk", step, kept=kept)
        assert payload.kept == kept and compressor.layout(N, kept)[0] == tuple(
            (name, t.dtype, tuple(t.shape)) for name, t in payload.tensors.items())


def test_thresholds_are_checkpointed_so_a_resumed_run_sends_what_the_uninterrupted_one_would():
    xs = gradients(8)
    straight = ErrorFeedback(Sparsified(ThresholdV(density=0.01), IntQuant()))
    sent = [straight.decompress(straight.compress(x, "c", i)) for i, x in enumerate(xs)]
    first = ErrorFeedback(Sparsified(ThresholdV(density=0.01), IntQuant()))
    for i, x in enumerate(xs[:4]):
        first.compress(x, "c", i)
    resumed = ErrorFeedback(Sparsified(ThresholdV(density=0.01), IntQuant()))
    resumed.load_state_dict({k: v.clone() for k, v in first.state_dict().items()})
    assert any(k.startswith("inner/ratio/") for k in first.state_dict())
    for i, x in enumerate(xs[4:], start=4):
        torch.testing.assert_close(resumed.decompress(resumed.compress(x, "c", i)), sent[i], rtol=0, atol=0)


def test_exactly_one_of_threshold_and_density():
    with pytest.raises(ValueError, match="exactly one of threshold= and density="):
        ThresholdV(threshold=1e-3, density=0.01)
    with pytest.raises(ValueError, match="density=1.5"):
        ThresholdV(density=1.5)


def test_an_all_zero_chunk_keeps_nothing():
    assert ThresholdV(density=0.1).compress(torch.zeros(100), "z", 0).kept == 0
