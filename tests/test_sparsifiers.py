"""Numerics of the sparsifiers, the count sketch and the low-rank compressor: what they keep, what they send."""

from __future__ import annotations

import math

import pytest
import torch

from compress.lowrank import LowRank
from compress.payload import SCALAR_BYTES, Payload
from compress.quantize import IntQuant
from compress.sketch import CountSketch
from compress.sparsify import RandomK, Sparsified, ThresholdV, TopK


def distinct_magnitudes(n: int, seed: int = 0) -> torch.Tensor:
    """Magnitudes 1..n in random order with random signs, so the top-k set is unique."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(n, generator=generator).float() + 1
    signs = torch.randint(0, 2, (n,), generator=generator).float() * 2 - 1
    return magnitudes * signs


def tensor_bytes(payload: Payload) -> int:
    """Bytes counted independently of ``Payload.nbytes``."""
    return sum(t.numel() * t.element_size() for t in payload.tensors.values()) + SCALAR_BYTES * len(payload.scalars)


# ---------------------------------------------------------------------------------------------- TopK


@pytest.mark.parametrize(
    ("n", "k", "encoding"),
    [(1000, 10, "indices"), (1000, 300, "bitmap"), (1001, 31, "indices"), (1001, 32, "bitmap"), (1, 1, "bitmap")],
)
def test_topk_keeps_exactly_the_k_largest_with_the_cheaper_index_encoding(n, k, encoding):
    x = distinct_magnitudes(n)
    compressor = TopK(k=k)
    payload = compressor.compress(x, "chunk", seed=0)

    assert set(payload.tensors) == {"values", encoding}
    assert payload.index_names == (encoding,)
    expected = torch.zeros(n)
    top = torch.topk(x.abs(), k).indices
    expected[top] = x[top]
    assert torch.equal(compressor.decompress(payload), expected)
    assert payload.tensors["values"].dtype == torch.float32

    index_bytes = 4 * k if encoding == "indices" else math.ceil(n / 8)
    assert payload.index_nbytes == index_bytes
    assert payload.nbytes == 4 * k + index_bytes == tensor_bytes(payload)
    assert payload.index_nbytes / payload.nbytes == pytest.approx(index_bytes / (4 * k + index_bytes))


def test_topk_ratio_rounds_and_clamps_and_takes_bf16():
    x = distinct_magnitudes(999).to(torch.bfloat16)
    assert TopK(ratio=0.01).compress(x, "c", 0).tensors["values"].numel() == 10
    assert TopK(ratio=1e-9).compress(x, "c", 0).tensors["values"].numel() == 1
    assert TopK(k=5000).compress(x, "c", 0).tensors["values"].numel() == 999
    out = TopK(k=3).decompress(TopK(k=3).compress(x, "c", 0))
    assert out.dtype == torch.float32 and out.count_nonzero() == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({}, "exactly one"), ({"ratio": 0.1, "k": 3}, "exactly one"), ({"ratio": 0.0}, "ratio=0.0"),
     ({"ratio": 1.5}, "ratio=1.5"), ({"k": 0}, "k=0"), ({"k": 2.5}, "k=2.5")],
)
def test_size_validation_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TopK(**kwargs)
    with pytest.raises(ValueError, match=message):
        RandomK(**kwargs)


# -------------------------------------------------------------------------------------------- RandomK


def test_randomk_same_seed_picks_the_same_coordinates_and_sends_no_indices():
    n, k = 1000, 50
    compressor = RandomK(k=k)
    a, b = torch.randn(n), torch.randn(n)  # two "ranks"
    pa, pb = compressor.compress(a, "chunk", seed=7), compressor.compress(b, "chunk", seed=7)

    assert set(pa.tensors) == {"values"} and pa.index_names == ()
    assert pa.nbytes == 4 * k + 8 == tensor_bytes(pa)
    da, db = compressor.decompress(pa), compressor.decompress(pb)
    assert torch.equal(da != 0, db != 0) and da.count_nonzero() == k
    assert not torch.equal(da != 0, compressor.decompress(compressor.compress(a, "chunk", seed=8)) != 0)

    summed = Payload(n, {"values": pa.tensors["values"] + pb.tensors["values"]}, pa.scalars)
    torch.testing.assert_close(compressor.decompress(summed), da + db)
    assert compressor.linear


def test_randomk_rescaled_is_unbiased_within_its_variance():
    n, k, draws = 20, 5, 4000
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    compressor = RandomK(k=k)
    mean = sum(compressor.decompress(compressor.compress(x, "c", seed)) for seed in range(draws)) / draws
    # one draw has variance x_i^2 (n/k - 1); allow five standard errors of the mean
    tolerance = 5 * x.abs() * math.sqrt((n / k - 1) / draws)
    assert ((mean - x).abs() <= tolerance).all(), (mean - x).abs() / tolerance
    assert compressor.unbiased and not RandomK(k=k, rescale=False).unbiased


def test_randomk_without_rescale_sends_the_raw_values():
    x = torch.randn(100)
    out = RandomK(k=10, rescale=False).decompress(RandomK(k=10, rescale=False).compress(x, "c", 3))
    kept = out != 0
    assert torch.equal(out[kept], x[kept])


# ----------------------------------------------------------------------------------------- ThresholdV


def test_thresholdv_keeps_exactly_the_coordinates_at_or_above_the_threshold():
    x = torch.tensor([0.5, -2.0, 1.0, -1.0, 0.99, 3.0] * 200)
    compressor = ThresholdV(1.0)
    payload = compressor.compress(x, "c", 0)
    torch.testing.assert_close(compressor.decompress(payload), torch.where(x.abs() >= 1.0, x, 0.0), rtol=0, atol=0)
    assert "bitmap" in payload.tensors  # 800 kept: a bitmap (150 bytes) beats 3200 bytes of positions


def test_thresholdv_keeping_nothing_sends_nothing():
    compressor = ThresholdV(10.0)
    payload = compressor.compress(torch.randn(100), "c", 0)
    assert payload.nbytes == 0
    assert torch.equal(compressor.decompress(payload), torch.zeros(100))


@pytest.mark.parametrize("threshold", [0, -1.0, float("inf"), "1"])
def test_thresholdv_rejects_a_threshold_that_is_not_positive(threshold):
    with pytest.raises(ValueError, match="threshold="):
        ThresholdV(threshold)


# ----------------------------------------------------------------------------------------- Sparsified


def test_sparsified_topk_error_is_the_quantizers_on_kept_values_and_zero_elsewhere():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    topk = TopK(ratio=0.05)  # 205 kept: a 512-byte bitmap beats 820 bytes of positions
    compressor = Sparsified(topk, IntQuant(num_bits=8))
    payload = compressor.compress(x, "c", 0)
    plain = topk.compress(x, "c", 0)

    assert set(payload.tensors) == {"bitmap", "values.values", "values.scales"} and payload.index_names == ("bitmap",)
    out, kept = compressor.decompress(payload), topk.decompress(plain)
    scale = payload.tensors["values.scales"].item()  # one scale: the 205 kept values fit in one 1024-element chunk
    assert torch.equal(out == 0, kept == 0)
    assert (out - kept).abs().max() <= scale / 2 * (1 + 1e-5)
    assert payload.nbytes == 205 + 4 + 4096 // 8 == tensor_bytes(payload) < plain.nbytes == 4 * 205 + 4096 // 8


def test_sparsified_keeps_the_index_encoding_of_randomk_and_handles_an_empty_threshold():
    randomk = Sparsified(RandomK(k=10), IntQuant(num_bits=4))
    payload = randomk.compress(torch.randn(1000), "c", seed=4)
    assert set(payload.tensors) == {"values.values", "values.scales"} and set(payload.scalars) == {"seed"}
    assert payload.nbytes == 5 + 4 + 8 and randomk.decompress(payload).count_nonzero() <= 10

    empty = Sparsified(ThresholdV(10.0), IntQuant())
    payload = empty.compress(torch.randn(100), "c", 0)
    assert payload.nbytes == 0 and torch.equal(empty.decompress(payload), torch.zeros(100))


def test_sparsified_rejects_what_is_not_a_sparsifier_or_a_compressor():
    with pytest.raises(ValueError, match="sparsifier="):
        Sparsified(IntQuant(), IntQuant())
    with pytest.raises(ValueError, match="quantizer="):
        Sparsified(TopK(k=1), object())


# ---------------------------------------------------------------------------------------- CountSketch


def test_countsketch_tables_add_up_to_the_table_of_the_sum():
    n = 5000
    a, b = torch.randn(n), torch.randn(n)
    compressor = CountSketch(ratio=0.1, rows=5)
    ta = compressor.compress(a, "c", seed=11).tensors["table"]
    tb = compressor.compress(b, "c", seed=11).tensors["table"]
    total = compressor.compress(a + b, "c", seed=11)
    torch.testing.assert_close(ta + tb, total.tensors["table"], rtol=1e-5, atol=1e-4)
    assert total.nbytes == 5 * 100 * 4 + 8 == tensor_bytes(total)
    assert compressor.linear


def test_countsketch_recovers_planted_heavy_hitters_in_position():
    n = 10_000
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=generator)
    planted = torch.randperm(n, generator=generator)[:10]
    x[planted] = 100 * (torch.randint(0, 2, (10,), generator=generator).float() * 2 - 1)
    compressor = CountSketch(ratio=0.1, rows=5)  # heavy_ratio 0.01: 100 coordinates kept
    payload = compressor.compress(x, "c", seed=3)
    out = compressor.decompress(payload)

    assert payload.tensors["table"].shape == (5, 200) and out.count_nonzero() == 100
    assert (out[planted] != 0).all()
    assert ((out[planted] - x[planted]).abs() / 100).max() < 0.15
    assert (out[planted] - x[planted]).norm() / x[planted].norm() < 0.08


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"ratio": 0}, "ratio=0"), ({"rows": 0}, "rows=0"), ({"heavy_ratio": 0.1, "k": 5}, "exactly one"),
     ({"k": -1}, "k=-1")],
)
def test_countsketch_validation_names_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CountSketch(**kwargs)


# -------------------------------------------------------------------------------------------- LowRank


def test_lowrank_is_exact_for_a_rank_r_matrix_once_warm():
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(30, 3, generator=generator) @ torch.randn(3, 40, generator=generator)
    compressor = LowRank(rank=3, cols=40)
    for _ in range(3):
        payload = compressor.compress(matrix.flatten(), "layer", seed=1)
    error = (compressor.decompress(payload) - matrix.flatten()).norm() / matrix.norm()
    assert error < 1e-5
    assert payload.tensors["p"].shape == (30, 3) and payload.tensors["q"].shape == (40, 3)
    assert payload.nbytes == 4 * (30 + 40) * 3 == tensor_bytes(payload)


def test_lowrank_error_falls_over_calls_towards_the_best_rank_r_error():
    generator = torch.Generator().manual_seed(0)
    # a decaying spectrum, so power iteration has something to converge to
    u, _ = torch.linalg.qr(torch.randn(32, 32, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(32, 32, generator=generator))
    matrix = u @ torch.diag(0.7 ** torch.arange(32.0)) @ v.T
    x = matrix.flatten()[:1000]  # 1000 elements: a 32x32 matrix with 24 padded zeros
    compressor = LowRank(rank=4)
    errors = [(compressor.decompress(compressor.compress(x, "w", seed=5)) - x).norm().item() for _ in range(12)]

    padded = torch.nn.functional.pad(x, (0, 24)).view(32, 32)
    best = torch.linalg.svdvals(padded)[4:].norm().item()  # Eckart-Young
    assert errors[-1] < errors[0]
    assert all(later <= earlier * 1.01 for earlier, later in zip(errors, errors[1:]))
    assert errors[-1] < best * 1.01


def test_lowrank_keeps_one_warm_start_per_key():
    compressor = LowRank(rank=2)
    a, b = torch.randn(400), torch.randn(400)
    first = compressor.compress(a, "a", seed=0)
    compressor.compress(b, "b", seed=0)
    again = compressor.compress(a, "a", seed=0)
    fresh = LowRank(rank=2)
    fresh.compress(a, "a", seed=0)
    assert torch.equal(again.tensors["q"], fresh.compress(a, "a", seed=0).tensors["q"])
    assert not torch.equal(again.tensors["q"], first.tensors["q"])


def test_lowrank_rank_too_large_for_the_chunk_raises_with_the_fix():
    with pytest.raises(ValueError, match="rank 64 is larger than the 20x20 matrix a 400-element gradient chunk"):
        LowRank(rank=64).compress(torch.randn(400), "c", 0)
    with pytest.raises(ValueError, match="lower rank to at most 20"):
        LowRank(rank=64).check_fits(400)
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match=f"rank={bad!r}"):
            LowRank(rank=bad)


# ----------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "compressor",
    [TopK(k=10), TopK(ratio=0.5), RandomK(ratio=0.1), ThresholdV(1.0), Sparsified(TopK(k=10), IntQuant()),
     CountSketch(ratio=0.1), LowRank(rank=2)],
    ids=lambda c: type(c).__name__,
)
def test_cuda_payloads_and_results_stay_on_the_device(compressor):
    x = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    payload = compressor.compress(x, "c", seed=2**62 + 3)
    assert all(t.is_cuda for t in payload.tensors.values())
    out = compressor.decompress(payload)
    assert out.is_cuda and out.dtype == torch.float32 and out.shape == (1000,)
