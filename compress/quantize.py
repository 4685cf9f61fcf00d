"""Quantisers: fewer bits per gradient element, with a per-chunk scale where the format needs one.

Every compressor takes a 1-D float tensor and sends only what a real implementation would: packed bits
are ``ceil(n * bits / 8)`` bytes, per-chunk statistics are one fp32 each, and chunk padding never
travels. Chunks are consecutive runs of ``chunk_size`` elements, the last one shorter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from compress.payload import Layout, Payload

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The low ``bits`` bits of each uint8 in ``values``, packed into ceil(n * bits / 8) bytes, low bits first."""
    _check_int("pack_bits", "bits", bits, 1, 8)
    if bits == 8:
        return values
    stream = ((values.unsqueeze(-1) >> _bit_positions(bits, values.device)) & 1).flatten()
    stream = F.pad(stream, (0, -stream.numel() % 8))
    return (stream.view(-1, 8) << _bit_positions(8, values.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The ``n`` uint8 values that ``pack_bits(values, bits)`` packed."""
    _check_int("unpack_bits", "bits", bits, 1, 8)
    if bits == 8:
        return packed[:n]
    stream = ((packed.unsqueeze(-1) >> _bit_positions(8, packed.device)) & 1).flatten()[: n * bits]
    return (stream.view(n, bits) << _bit_positions(bits, packed.device)).sum(-1, dtype=torch.uint8)


def packed_bytes(n: int, bits: int) -> int:
    """Bytes ``pack_bits`` makes of ``n`` values of ``bits`` bits."""
    return math.ceil(n * bits / 8)


def _chunk_count(n: int, chunk_size: int) -> int:
    return math.ceil(n / chunk_size)


def _bit_positions(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(bits, dtype=torch.uint8, device=device)


def _check_int(owner: str, name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise a ValueError naming ``value`` unless it is an integer in ``[low, high]``."""
    accepted = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"{owner}: {name}={value!r} is not accepted; expected {accepted}")


def _flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() != 1:
        raise ValueError(f"compressors take a 1-D tensor; got shape {tuple(tensor.shape)}")
    return tensor.float()


def _generator(device: torch.device, seed: int, salt: int) -> torch.Generator:
    """Private randomness: the same ``seed`` on every rank, decorrelated by each rank's ``salt``."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + salt) % 2**63)
    return generator


def _chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``x`` zero-padded to whole chunks, as a (chunks, chunk_size) view; zeros leave sums and maxima alone."""
    return F.pad(x, (0, -x.numel() % chunk_size)).view(-1, chunk_size)


def _chunk_lengths(n: int, chunk_size: int, device: torch.device) -> torch.Tensor:
    """The number of real (unpadded) elements in each chunk, as fp32."""
    starts = torch.arange(0, n, chunk_size, device=device)  # no element written from the host: no copy to the device
    return (n - starts).clamp(max=chunk_size).float()


def _padded_fp32(values: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``values`` (any dtype) as float32 zero-padded to whole chunks, (chunks, chunk_size): one converting copy."""
    n = values.numel()
    out = torch.empty(math.ceil(n / chunk_size) * chunk_size, dtype=torch.float32, device=values.device)
    out[:n].copy_(values)
    out[n:].zero_()
    return out.view(-1, chunk_size)


def _times_chunk(values: torch.Tensor, per_chunk: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """float32 ``values * per_chunk[chunk of each element]`` without materialising the per-element factors."""
    return _padded_fp32(values, chunk_size).mul_(per_chunk.unsqueeze(1)).view(-1)[: values.numel()]


def _spread(per_chunk: torch.Tensor, n: int, chunk_size: int) -> torch.Tensor:
    """A per-chunk statistic repeated over the chunk's elements: length ``n``."""
    return per_chunk.unsqueeze(1).expand(-1, chunk_size).reshape(-1)[:n]


def _scaled(x: torch.Tensor, scales: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``x`` divided by its chunk's scale; an all-zero chunk (scale 0) stays zero instead of becoming NaN."""
    safe = torch.where(scales > 0, scales, 1.0).unsqueeze(1)
    return (_chunks(x, chunk_size) / safe).view(-1)[: x.numel()]


def _absmax_scales(x: torch.Tensor, chunk_size: int, top: float) -> torch.Tensor:
    """Per-chunk scales that map each chunk's largest magnitude onto ``top``."""
    return _chunks(x, chunk_size).abs().amax(1) / top


def _pack_signs(x: torch.Tensor) -> torch.Tensor:
    return pack_bits((x < 0).to(torch.uint8), 1)


def _unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """True where the packed element was negative."""
    return unpack_bits(packed, 1, n).bool()


@dataclass
class _Cast:
    """Cast to a 16-bit float for transport; sums of payloads are sums of inputs, so ranks can add them on the wire."""

    dtype: ClassVar[torch.dtype]
    linear: ClassVar[bool] = True
    unbiased: ClassVar[bool] = False

    def layout(self, n: int) -> Layout:
        """The payload's tensors for ``n`` values (what ``compress`` returns, known without compressing)."""
        return (("values", self.dtype, (n,)),)

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        return Payload(tensor.numel(), {"values": _flat_fp32(tensor).to(self.dtype)})

    def decompress(self, payload: Payload) -> torch.Tensor:
        return payload.tensors["values"].float()


class CastFP16(_Cast):
    """float16 for transport: 2 bytes per element. Magnitudes above 65504 overflow to inf."""

    dtype = torch.float16


class CastBF16(_Cast):
    """bfloat16 for transport: 2 bytes per element, fp32's range with 8 bits of precision."""

    dtype = torch.bfloat16


@dataclass
class FP8:
    """float8 e4m3 with one fp32 scale (absmax / 448) per chunk.

    Payload: ``values`` float8_e4m3fn (n bytes), ``scales`` fp32 (4 * ceil(n / chunk_size) bytes).
    Error per element: at most 2^-4 |x| (3 mantissa bits), or 2^-10 * scale among e4m3 subnormals.
    """

    chunk_size: int = 1024
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_int("FP8", "chunk_size", self.chunk_size, 1)

    def layout(self, n: int) -> Layout:
        return (("values", torch.float8_e4m3fn, (n,)), ("scales", torch.float32, (_chunk_count(n, self.chunk_size),)))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        x = _flat_fp32(tensor)
        scales = _absmax_scales(x, self.chunk_size, FP8_MAX)
        # x / scale can round a hair past 448 at the absmax; clamp rather than trust every backend's e4m3fn conversion
        # to saturate (c10's scalar conversion turns 480 and up into NaN).
        values = _scaled(x, scales, self.chunk_size).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Payload(x.numel(), {"values": values, "scales": scales})

    def decompress(self, payload: Payload) -> torch.Tensor:
        return _times_chunk(payload.tensors["values"], payload.tensors["scales"], self.chunk_size)


@dataclass
class IntQuant:
    """Symmetric integer quantisation to ``2^(num_bits-1) - 1`` levels a sign, one fp32 scale (absmax / levels) a chunk.

    Payload: ``values`` int8 (n bytes) for 8 bits; below that, values offset to unsigned and packed into
    ``ceil(n * num_bits / 8)`` uint8; ``scales`` fp32 (4 * ceil(n / chunk_size) bytes). Rounds to nearest:
    error per element at most scale / 2.
    """

    num_bits: int = 8
    chunk_size: int = 1024
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_int("IntQuant", "num_bits", self.num_bits, 2, 8)
        _check_int("IntQuant", "chunk_size", self.chunk_size, 1)

    @property
    def levels(self) -> int:
        return 2 ** (self.num_bits - 1) - 1

    def layout(self, n: int) -> Layout:
        values = ("values", torch.int8, (n,)) if self.num_bits == 8 else (
            "values", torch.uint8, (packed_bytes(n, self.num_bits),))
        return (values, ("scales", torch.float32, (_chunk_count(n, self.chunk_size),)))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        x = _flat_fp32(tensor)
        scales = _absmax_scales(x, self.chunk_size, self.levels)
        q = _scaled(x, scales, self.chunk_size).round_().clamp_(-self.levels, self.levels)
        if self.num_bits == 8:
            values = q.to(torch.int8)
        else:
            values = pack_bits((q + self.levels).to(torch.uint8), self.num_bits)
        return Payload(x.numel(), {"values": values, "scales": scales})

    def decompress(self, payload: Payload) -> torch.Tensor:
        n, values = payload.numel, payload.tensors["values"]
        if self.num_bits < 8:
            values = unpack_bits(values, self.num_bits, n).float() - self.levels
        return _times_chunk(values, payload.tensors["scales"], self.chunk_size)


@dataclass
class QSGD:
    """Stochastic quantisation of |x| / ||chunk||_2 to ``levels`` steps, with sign (Alistarh et al. 2017). Unbiased.

    Payload: ``norms`` fp32 (4 * ceil(n / chunk_size) bytes); ``values``: the signed level offset to
    [0, 2 * levels], packed at ``bits = (2 * levels).bit_length()`` bits (6 for 16 levels), so
    ``ceil(n * bits / 8)`` uint8. Variance per chunk of length d: at most min(d / s^2, sqrt(d) / s) ||x||^2.
    """

    levels: int = 16
    chunk_size: int = 1024
    salt: int = 0
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = True

    def __post_init__(self) -> None:
        # 127 keeps a signed level within one byte before packing; more levels would not be QSGD's regime anyway.
        _check_int("QSGD", "levels", self.levels, 1, 127)
        _check_int("QSGD", "chunk_size", self.chunk_size, 1)

    @property
    def bits(self) -> int:
        return (2 * self.levels).bit_length()

    def layout(self, n: int) -> Layout:
        return (("values", torch.uint8, (packed_bytes(n, self.bits),)),
                ("norms", torch.float32, (_chunk_count(n, self.chunk_size),)))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        x = _flat_fp32(tensor)
        norms = _chunks(x, self.chunk_size).norm(dim=1)
        ratio = _scaled(x.abs(), norms, self.chunk_size) * self.levels
        low = ratio.floor()
        up = torch.rand(x.numel(), generator=_generator(x.device, seed, self.salt), device=x.device) < ratio - low
        # |x| / norm can round a hair above 1 when one element carries the chunk; the clamp keeps it in range.
        level = (low + up).clamp(max=self.levels)
        signed = torch.where(x < 0, -level, level)
        values = pack_bits((signed + self.levels).to(torch.uint8), self.bits)
        return Payload(x.numel(), {"values": values, "norms": norms})

    def decompress(self, payload: Payload) -> torch.Tensor:
        n = payload.numel
        signed = unpack_bits(payload.tensors["values"], self.bits, n).float() - self.levels
        return _times_chunk(signed, payload.tensors["norms"], self.chunk_size) / self.levels


@dataclass
class NaturalCompression:
    """Stochastic rounding of each value to a neighbouring power of two, keeping the sign (Horváth et al. 2019).

    Unbiased, with variance at most x^2 / 8 per element. Payload: ``exponents`` uint8 (n bytes), fp32's own
    biased exponent field (2^(code - 127) for codes 1..254, 0 for zero), and ``signs`` packed
    (ceil(n / 8) bytes): 9 bits per element. Values below fp32's smallest normal 2^-126 round to 0 or
    2^-126, still unbiased but outside the x^2 / 8 bound; values at or above 2^127 round down to 2^127.
    """

    salt: int = 0
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = True

    def layout(self, n: int) -> Layout:
        return (("exponents", torch.uint8, (n,)), ("signs", torch.uint8, (packed_bytes(n, 1),)))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        x = _flat_fp32(tensor)
        magnitude = x.abs()
        # frexp is exact: |x| = m * 2^e, m in [0.5, 1), so 2^(e-1) <= |x| < 2^e, whose fp32 biased exponent is e + 126.
        low = torch.where(magnitude < torch.finfo(torch.float32).tiny, 0, torch.frexp(magnitude).exponent + 126)
        # Code 255 decodes to inf, so magnitudes from 2^127 up get probability 0 of rounding up.
        low_value, high_value = _power_of_two(low), _power_of_two(low + 1)
        up_probability = (magnitude - low_value) / (high_value - low_value)
        up = torch.rand(x.numel(), generator=_generator(x.device, seed, self.salt), device=x.device) < up_probability
        exponents = (low + up).to(torch.uint8)
        return Payload(x.numel(), {"exponents": exponents, "signs": _pack_signs(x)})

    def decompress(self, payload: Payload) -> torch.Tensor:
        magnitude = _power_of_two(payload.tensors["exponents"])
        return torch.where(_unpack_signs(payload.tensors["signs"], payload.numel), -magnitude, magnitude)


def _power_of_two(code: torch.Tensor) -> torch.Tensor:
    """fp32 with biased exponent ``code`` and a zero mantissa: 2^(code - 127), or 0 for code 0."""
    return (code.to(torch.int32) << 23).view(torch.float32)


@dataclass
class SignSGD:
    """Scaled sign: each element becomes its chunk's mean |x| with the element's sign; zeros come back as +scale.

    Payload: ``signs`` packed (ceil(n / 8) bytes), ``scales`` fp32 (4 * ceil(n / chunk_size) bytes). The
    mean magnitude is the least-squares scale for the signs: ||x - x̂||^2 = ||x||^2 - ||x||_1^2 / d per chunk.
    """

    chunk_size: int = 1024
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_int("SignSGD", "chunk_size", self.chunk_size, 1)

    def layout(self, n: int) -> Layout:
        return (("signs", torch.uint8, (packed_bytes(n, 1),)), ("scales", torch.float32, (_chunk_count(n, self.chunk_size),)))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        x = _flat_fp32(tensor)
        lengths = _chunk_lengths(x.numel(), self.chunk_size, x.device)
        scales = _chunks(x, self.chunk_size).abs().sum(1) / lengths
        return Payload(x.numel(), {"signs": _pack_signs(x), "scales": scales})

    def decompress(self, payload: Payload) -> torch.Tensor:
        scales = _spread(payload.tensors["scales"], payload.numel, self.chunk_size)
        return torch.where(_unpack_signs(payload.tensors["signs"], payload.numel), -scales, scales)


@dataclass
class OneBit:
    """1-bit SGD (Seide et al. 2014): one bit per element (x >= 0), decoded as the chunk's mean of that sign's values.

    Payload: ``signs`` packed (ceil(n / 8) bytes), ``means`` fp32 of shape (chunks, 2): the mean of the
    non-negative and of the negative values (8 * ceil(n / chunk_size) bytes). Each chunk's sum survives
    exactly; the error is the spread of the values around their side's mean.
    """

    chunk_size: int = 1024
    linear: ClassVar[bool] = False
    unbiased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check_int("OneBit", "chunk_size", self.chunk_size, 1)

    def layout(self, n: int) -> Layout:
        return (("signs", torch.uint8, (packed_bytes(n, 1),)), ("means", torch.float32, (_chunk_count(n, self.chunk_size), 2)))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        x = _flat_fp32(tensor)
        blocks = _chunks(x, self.chunk_size)
        negatives = (blocks < 0).sum(1)
        # Padding zeros add nothing to either sum, and the real lengths keep them out of the counts.
        non_negatives = _chunk_lengths(x.numel(), self.chunk_size, x.device) - negatives
        positive = blocks.clamp(min=0).sum(1) / non_negatives.clamp(min=1)
        negative = blocks.clamp(max=0).sum(1) / negatives.clamp(min=1)
        means = torch.stack([positive, negative], dim=1)
        return Payload(x.numel(), {"signs": _pack_signs(x), "means": means})

    def decompress(self, payload: Payload) -> torch.Tensor:
        n, means = payload.numel, payload.tensors["means"]
        positive, negative = (_spread(means[:, side], n, self.chunk_size) for side in (0, 1))
        return torch.where(_unpack_signs(payload.tensors["signs"], n), negative, positive)
