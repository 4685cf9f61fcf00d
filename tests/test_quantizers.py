"""Numerics of the quantisers, single process: round-trip bounds, unbiasedness, variance and byte accounting."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import pytest
import torch

from compress.payload import SCALAR_BYTES, Payload
from compress.quantize import (
    FP8,
    QSGD,
    CastBF16,
    CastFP16,
    IntQuant,
    NaturalCompression,
    OneBit,
    SignSGD,
    pack_bits,
    unpack_bits,
)

LENGTHS = [1, 7, 1000, 4099]  # one element, under one byte of bits, and lengths no chunk size or 8 divides
CHUNK = 64  # small enough that the longer vectors span many chunks and end in a short one


def _vector(n: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """Gaussian values with magnitudes spread over four decades, and exact zeros at every fifth position from 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10 ** torch.empty(n).uniform_(-3, 1, generator=g)
    x[1::5] = 0
    return x.to(device)


def _per_element(x: torch.Tensor, chunk_size: int, stat: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``stat`` of each element's chunk, repeated over the chunk."""
    return torch.cat([stat(c).expand(len(c)) for c in x.split(chunk_size)])


def _round_trip(compressor, x: torch.Tensor, seed: int = 0) -> tuple[Payload, torch.Tensor]:
    payload = compressor.compress(x, "chunk", seed)
    return payload, compressor.decompress(payload)


# Round-trip bounds, one per method: (compressor, x, x̂) -> None, asserting.


def _within_relative(eps: float, floor: float) -> Callable:
    def check(compressor, x: torch.Tensor, y: torch.Tensor) -> None:
        assert ((x - y).abs() <= eps * x.abs() + floor).all()

    return check


def _check_fp8(compressor: FP8, x: torch.Tensor, y: torch.Tensor) -> None:
    # 3 mantissa bits: half a step is 2^-4 relative; e4m3 subnormals step by 2^-9, scaled by the chunk's scale.
    scale = _per_element(x, compressor.chunk_size, lambda c: c.abs().max() / 448)
    assert ((x - y).abs() <= 2**-4 * x.abs() + (2**-10 + 1e-6) * scale).all()


def _check_int(compressor: IntQuant, x: torch.Tensor, y: torch.Tensor) -> None:
    scale = _per_element(x, compressor.chunk_size, lambda c: c.abs().max() / compressor.levels)
    assert ((x - y).abs() <= scale / 2 * (1 + 1e-6)).all()


def _check_qsgd(compressor: QSGD, x: torch.Tensor, y: torch.Tensor) -> None:
    # Stochastic rounding lands on one of the two levels around |x| / norm: at most one step (norm / s) away.
    step = _per_element(x, compressor.chunk_size, lambda c: c.norm() / compressor.levels)
    assert ((x - y).abs() <= step * (1 + 1e-5)).all()
    assert (y * x >= 0).all()


def _check_natural(compressor: NaturalCompression, x: torch.Tensor, y: torch.Tensor) -> None:
    assert (y[x == 0] == 0).all()
    nonzero = x != 0
    x, y = x[nonzero], y[nonzero]
    # The power of two at or below |x|, exactly (frexp: |x| = m 2^e, m in [0.5, 1)); log2 and pow are not exact
    # on every device, and on an H200 (torch 2.11) a reference built from them rejected correct values.
    floor = torch.ldexp(torch.full_like(x, 0.5, dtype=torch.float64), torch.frexp(x.abs()).exponent)
    assert (torch.sign(y) == torch.sign(x)).all()
    assert (torch.frexp(y).mantissa.abs() == 0.5).all(), "every value is a power of two"
    wrong = ~((y.abs() == floor) | (y.abs() == 2 * floor))
    assert not wrong.any(), f"not a neighbouring power of two: x={x[wrong][:5].tolist()} y={y[wrong][:5].tolist()}"


def _check_sign(compressor: SignSGD, x: torch.Tensor, y: torch.Tensor) -> None:
    assert ((y < 0) == (x < 0)).all()
    for xc, yc in zip(x.split(compressor.chunk_size), y.split(compressor.chunk_size)):
        torch.testing.assert_close(yc.abs(), xc.abs().mean().expand(len(xc)))
        # The mean magnitude is the least-squares scale for the signs: the error is what it cannot explain.
        expected = xc.square().sum() - xc.abs().sum() ** 2 / len(xc)
        torch.testing.assert_close((xc - yc).square().sum(), expected, rtol=1e-4, atol=1e-6 * xc.square().sum().item())


def _check_onebit(compressor: OneBit, x: torch.Tensor, y: torch.Tensor) -> None:
    assert ((y < 0) == (x < 0)).all()
    for xc, yc in zip(x.split(compressor.chunk_size), y.split(compressor.chunk_size)):
        torch.testing.assert_close(yc.sum(), xc.sum(), rtol=1e-5, atol=1e-5 * xc.abs().sum().item())
        for side in (xc < 0, xc >= 0):
            if side.any():
                torch.testing.assert_close(yc[side], xc[side].mean().expand(int(side.sum())))


CASES = [
    (CastFP16(), _within_relative(2**-11, 2**-25)),  # 2^-25: half of fp16's subnormal step
    (CastBF16(), _within_relative(2**-8, 0.0)),
    (FP8(chunk_size=CHUNK), _check_fp8),
    (IntQuant(num_bits=8, chunk_size=CHUNK), _check_int),
    (IntQuant(num_bits=3, chunk_size=CHUNK), _check_int),
    (QSGD(levels=16, chunk_size=CHUNK), _check_qsgd),
    (QSGD(levels=1, chunk_size=CHUNK), _check_qsgd),
    (NaturalCompression(), _check_natural),
    (SignSGD(chunk_size=CHUNK), _check_sign),
    (OneBit(chunk_size=CHUNK), _check_onebit),
]
CASE_IDS = [repr(compressor) for compressor, _ in CASES]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("compressor", "check"), CASES, ids=CASE_IDS)
def test_round_trip_is_fp32_of_the_same_length_within_the_method_bound(compressor, check, n):
    x = _vector(n, seed=n)
    _, y = _round_trip(compressor, x)
    assert y.dtype == torch.float32 and y.shape == (n,) and y.device == x.device
    check(compressor, x, y)


@pytest.mark.parametrize(("compressor", "check"), CASES, ids=CASE_IDS)
def test_bf16_input_decodes_to_fp32_within_the_method_bound(compressor, check):
    x = _vector(1000).bfloat16()
    _, y = _round_trip(compressor, x)
    assert y.dtype == torch.float32
    check(compressor, x.float(), y)


@pytest.mark.parametrize("compressor", [compressor for compressor, _ in CASES], ids=CASE_IDS)
def test_all_zero_vector_decodes_to_zeros(compressor):
    _, y = _round_trip(compressor, torch.zeros(100))
    assert (y == 0).all()


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", LENGTHS)
def test_pack_bits_round_trips_in_ceil_n_bits_over_8_bytes(bits, n):
    values = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, n), values)


def test_pack_bits_order_is_least_significant_first():
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [0b10000001]
    assert pack_bits(torch.tensor([3, 1], dtype=torch.uint8), 2).tolist() == [0b0111]


@pytest.mark.parametrize("n", LENGTHS)
def test_int_quant_error_is_at_most_half_a_scale_and_bytes_shrink_with_bits(n):
    x = _vector(n, seed=1)
    sizes = []
    for bits in range(2, 9):
        compressor = IntQuant(num_bits=bits, chunk_size=CHUNK)
        payload, y = _round_trip(compressor, x)
        _check_int(compressor, x, y)
        assert payload.nbytes == math.ceil(n * bits / 8) + 4 * math.ceil(n / CHUNK)
        sizes.append(payload.nbytes)
    if n >= 8:  # below one byte of bits, the packed size cannot shrink further
        assert sizes == sorted(set(sizes)), f"bytes must strictly grow with bits: {sizes}"


def _chunks_of(n: int, chunk_size: int) -> int:
    return math.ceil(n / chunk_size)


EXPECTED_BYTES = [
    (CastFP16(), lambda n: 2 * n),
    (CastBF16(), lambda n: 2 * n),
    (FP8(), lambda n: n + 4 * _chunks_of(n, 1024)),
    (IntQuant(), lambda n: n + 4 * _chunks_of(n, 1024)),
    (IntQuant(num_bits=5, chunk_size=256), lambda n: math.ceil(5 * n / 8) + 4 * _chunks_of(n, 256)),
    (QSGD(), lambda n: math.ceil(6 * n / 8) + 4 * _chunks_of(n, 1024)),  # 33 signed levels: 6 bits
    (QSGD(levels=1), lambda n: math.ceil(2 * n / 8) + 4 * _chunks_of(n, 1024)),  # -1, 0, 1: 2 bits
    (NaturalCompression(), lambda n: n + math.ceil(n / 8)),
    (SignSGD(), lambda n: math.ceil(n / 8) + 4 * _chunks_of(n, 1024)),
    (OneBit(), lambda n: math.ceil(n / 8) + 8 * _chunks_of(n, 1024)),
]


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize(("compressor", "expected"), EXPECTED_BYTES, ids=[repr(c) for c, _ in EXPECTED_BYTES])
def test_payload_bytes_are_the_tensors_sent_and_match_the_formula(compressor, expected, n):
    payload = compressor.compress(_vector(n), "chunk", 0)
    sent = sum(t.numel() * t.element_size() for t in payload.tensors.values()) + SCALAR_BYTES * len(payload.scalars)
    assert payload.numel == n
    assert payload.nbytes == sent == expected(n)


def test_int8_bytes_for_4099_elements_are_values_plus_five_scales():
    assert IntQuant(num_bits=8, chunk_size=1024).compress(_vector(4099), "chunk", 0).nbytes == 4099 + 5 * 4


def test_only_casts_are_linear_and_only_stochastic_rounding_is_unbiased():
    compressors = [compressor for compressor, _ in CASES]
    assert {type(c) for c in compressors if c.linear} == {CastFP16, CastBF16}
    assert {type(c) for c in compressors if c.unbiased} == {QSGD, NaturalCompression}


@pytest.mark.parametrize(
    ("compressor", "eps", "floor"), [(CastFP16(), 2**-11, 2**-25), (CastBF16(), 2**-8, 0.0)], ids=["fp16", "bf16"]
)
def test_cast_payloads_summed_on_the_wire_decode_to_the_sum_of_inputs(compressor, eps, floor):
    ranks = 4
    inputs = [_vector(1000, seed=rank) for rank in range(ranks)]
    payloads = [compressor.compress(x, "chunk", 0) for x in inputs]
    summed = Payload(1000, {"values": sum(p.tensors["values"] for p in payloads)})
    # A rounding per cast and per partial sum, each at most eps of the magnitudes involved (floor: fp16 subnormals).
    bound = (2 * ranks - 1) * (eps * sum(x.abs() for x in inputs) + floor)
    assert ((compressor.decompress(summed) - sum(inputs)).abs() <= bound).all()


DRAWS = 2000


def _draws(compressor, x: torch.Tensor) -> torch.Tensor:
    """(DRAWS, n) decodings of ``x``, one per seed."""
    return torch.stack([_round_trip(compressor, x, seed=seed)[1] for seed in range(DRAWS)])


@pytest.mark.parametrize("levels", [1, 16])
def test_qsgd_is_unbiased_with_variance_within_the_paper_bound(levels):
    chunk_size = 128
    compressor = QSGD(levels=levels, chunk_size=chunk_size)
    x = _vector(300, seed=2)  # chunks of 128, 128 and 44
    draws = _draws(compressor, x)
    # Per element the draw is one of two levels a step (norm / s) apart: variance at most step^2 / 4.
    step = _per_element(x, chunk_size, lambda c: c.norm() / levels)
    assert ((draws.mean(0) - x).abs() <= 5 * step / 2 / math.sqrt(DRAWS)).all()
    # Lemma 3.1 of Alistarh et al. 2017, per chunk of length d.
    squared_error = (draws - x).square().mean(0)
    for error, xc in zip(squared_error.split(chunk_size), x.split(chunk_size)):
        d = len(xc)
        assert error.sum() <= min(d / levels**2, math.sqrt(d) / levels) * xc.square().sum()


def test_natural_compression_is_unbiased_with_variance_at_most_an_eighth_of_x_squared():
    x = _vector(300, seed=3)
    x[:4] = torch.tensor([1.0, -0.25, 4 / 3, -(2**-20) * 4 / 3])  # exact powers of two, and the worst case 4/3 * 2^e
    draws = _draws(NaturalCompression(), x)
    assert torch.equal(draws[:, :2], x[:2].expand(DRAWS, 2)), "powers of two are kept exactly"
    std_bound = x.abs() * math.sqrt(1 / 8)
    assert ((draws.mean(0) - x).abs() <= 5 * std_bound / math.sqrt(DRAWS)).all()
    variance = (draws - x).square().mean(0)
    assert (variance <= 1.1 * x.square() / 8).all()  # 1.1: sampling noise where the bound is attained
    assert variance[4:].sum() <= x[4:].square().sum() / 8  # random values: the bound holds with room to spare


@pytest.mark.parametrize("compressor", [QSGD(chunk_size=CHUNK), NaturalCompression()], ids=repr)
def test_private_randomness_repeats_for_a_seed_and_differs_across_salts_and_seeds(compressor):
    x = _vector(1000)
    salted = dataclasses.replace(compressor, salt=1)
    drawn = _round_trip(compressor, x, seed=7)[1]
    assert torch.equal(drawn, _round_trip(compressor, x, seed=7)[1])
    assert not torch.equal(drawn, _round_trip(salted, x, seed=7)[1])
    assert not torch.equal(drawn, _round_trip(compressor, x, seed=8)[1])


@pytest.mark.parametrize(
    ("build", "value", "accepted"),
    [
        (lambda: IntQuant(num_bits=1), "num_bits=1", "in [2, 8]"),
        (lambda: IntQuant(num_bits=9), "num_bits=9", "in [2, 8]"),
        (lambda: QSGD(levels=0), "levels=0", "in [1, 127]"),
        (lambda: QSGD(levels=128), "levels=128", "in [1, 127]"),
        (lambda: FP8(chunk_size=0), "chunk_size=0", ">= 1"),
        (lambda: IntQuant(chunk_size=0), "chunk_size=0", ">= 1"),
        (lambda: QSGD(chunk_size=0), "chunk_size=0", ">= 1"),
        (lambda: SignSGD(chunk_size=0), "chunk_size=0", ">= 1"),
        (lambda: OneBit(chunk_size=0), "chunk_size=0", ">= 1"),
        (lambda: OneBit(chunk_size=2.5), "chunk_size=2.5", ">= 1"),
    ],
)
def test_bad_constructor_arguments_name_the_value_and_the_accepted_range(build, value, accepted):
    with pytest.raises(ValueError) as error:
        build()
    assert value in str(error.value) and f"expected an integer {accepted}" in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("compressor", "check"), CASES, ids=CASE_IDS)
def test_round_trip_on_cuda_stays_on_the_device_within_the_method_bound(compressor, check):
    x = _vector(4099, device="cuda")
    payload, y = _round_trip(compressor, x)
    assert all(t.device == x.device for t in payload.tensors.values())
    assert y.dtype == torch.float32 and y.shape == x.shape and y.device == x.device
    check(compressor, x.cpu(), y.cpu())  # the reference arithmetic on the CPU, in float64 where it matters
