"""SparseLoCo's codec (Sarfi et al., arXiv 2508.15706): top-k per chunk of a decayed error-feedback accumulator, the
kept values in 2 bits, their positions in log2(chunk) bits.

Per chunk ``key`` this rank keeps an accumulator ``e`` (float32, one per element). A call with ``delta``:

    e = decay * e + delta                        # the decayed error feedback stands in for DiLoCo's outer momentum
    sent = Q(top-k per chunk of |e|)             # k of every chunk_size values, quantised to num_bits
    e = e - sent                                 # what was not sent (or was rounded) stays owed

``Q``: per chunk one float32 scale, the largest kept magnitude, and ``2 ** num_bits`` levels spread evenly over
``[-scale, scale]`` (for 2 bits: -1, -1/3, 1/3, 1 times the scale), each kept value sent as the nearest level. No
level is zero: a kept value is among its chunk's largest, and a ternary code would send the smaller ones as zeros.
Positions are offsets inside their chunk, ``log2(chunk_size)`` bits each (12 for 4,096) packed as a low byte and
the high bits. The paper pairs it with outer lr 1 and no momentum: ``outer: {lr: 1.0, momentum: 0.0, codec:
{method: sparseloco}}``.

Bytes per kept value (``bytes_per_kept``): for 4,096-value chunks, 64 kept, 2 bits: 12 + 2 bits, and 4 bytes of
scale per 64, 1.8125 bytes (14.5 bits), against 4 bytes of a float32 value: 141x fewer bytes than the dense
float32 chunk.
"""

from __future__ import annotations

import math

import torch

from compress.error_feedback import Residuals
from compress.payload import Layout, Payload
from compress.quantize import _check_int, pack_bits, packed_bytes, unpack_bits


class SparseLoCo(Residuals):
    """Top-``k`` of every ``chunk_size`` values of a decayed accumulator, quantised to ``num_bits``, 12-bit positions."""

    linear = False
    unbiased = False

    def __init__(self, chunk_size: int = 4096, k: int = 64, decay: float = 0.95, num_bits: int = 2) -> None:
        # positions take a low byte and 1 to 8 high bits: chunks of 257 to 65,536 values
        _check_int("SparseLoCo", "chunk_size", chunk_size, 257, 1 << 16)
        _check_int("SparseLoCo", "k", k, 1, chunk_size)
        _check_int("SparseLoCo", "num_bits", num_bits, 1, 8)
        if not (isinstance(decay, (int, float)) and 0 <= decay <= 1):
            raise ValueError(f"SparseLoCo: decay={decay!r} is not accepted; expected a number in [0, 1]")
        self.chunk_size, self.k, self.decay, self.num_bits = chunk_size, k, float(decay), num_bits
        self.index_bits = math.ceil(math.log2(chunk_size))
        self.residuals: dict[str, torch.Tensor] = {}

    @property
    def levels(self) -> int:
        return 1 << self.num_bits

    def bytes_per_kept(self) -> float:
        """Bytes sent per kept value of a whole chunk: its position, its code and its share of the chunk's scale."""
        return (self.index_bits + self.num_bits) / 8 + 4 / self.k

    def _counts(self, n: int) -> tuple[int, int]:
        """The whole chunks of an ``n``-element tensor, and what its shorter last chunk keeps (0 without one)."""
        whole = n // self.chunk_size
        return whole, min(self.k, n - whole * self.chunk_size)

    def _chunk_of(self, n: int, device: torch.device) -> torch.Tensor:
        """The chunk of each kept value, in payload order (known from ``n`` alone: no read of the device)."""
        whole, tail = self._counts(n)
        return torch.cat([torch.arange(whole, device=device).unsqueeze(1).expand(whole, self.k).reshape(-1),
                          torch.full((tail,), whole, device=device)])

    def layout(self, n: int) -> Layout:
        whole, tail = self._counts(n)
        kept = whole * self.k + tail
        high = self.index_bits - 8
        return (("index_low", torch.uint8, (kept,)), ("index_high", torch.uint8, (packed_bytes(kept, high),)),
                ("codes", torch.uint8, (packed_bytes(kept, self.num_bits),)),
                ("scales", torch.float32, (math.ceil(n / self.chunk_size),)))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        if tensor.dim() != 1:
            raise ValueError(f"compressors take a 1-D tensor; got shape {tuple(tensor.shape)}")
        n = tensor.numel()
        residual = self.residuals.get(key)
        accumulated = tensor.float() if residual is None else residual.mul(self.decay).add_(tensor.float())
        offsets, values = self._select(accumulated)
        chunk_of = self._chunk_of(n, tensor.device)
        scales = torch.zeros(math.ceil(n / self.chunk_size), device=tensor.device)
        scales.scatter_reduce_(0, chunk_of, values.abs(), reduce="amax")
        codes = self._encode(values, scales[chunk_of])
        positions = chunk_of * self.chunk_size + offsets
        sent = torch.zeros_like(accumulated).index_put_((positions,), self._decode(codes, scales[chunk_of]))
        self.residuals[key] = accumulated - sent
        high = self.index_bits - 8
        tensors = {"index_low": (offsets & 0xFF).to(torch.uint8),
                   "index_high": pack_bits((offsets >> 8).to(torch.uint8), high),
                   "codes": pack_bits(codes, self.num_bits), "scales": scales}
        return Payload(n, tensors, {}, ("index_low", "index_high"), kept=positions.numel())

    def decompress(self, payload: Payload) -> torch.Tensor:
        n, tensors = payload.numel, payload.tensors
        chunk_of = self._chunk_of(n, tensors["scales"].device)
        kept = chunk_of.numel()
        offsets = tensors["index_low"].long() | (unpack_bits(tensors["index_high"], self.index_bits - 8, kept).long() << 8)
        values = self._decode(unpack_bits(tensors["codes"], self.num_bits, kept), tensors["scales"][chunk_of])
        out = torch.zeros(n, dtype=torch.float32, device=values.device)
        return out.index_put_((chunk_of * self.chunk_size + offsets,), values)

    def _select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chunk's kept offsets (ascending) and their values, chunk after chunk."""
        n, size = x.numel(), self.chunk_size
        full = n // size * size
        parts = []
        if full:  # the whole chunks at once
            rows = x[:full].view(-1, size)
            offsets = rows.abs().topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values
            parts.append((offsets.reshape(-1), rows.gather(1, offsets).reshape(-1)))
        if n > full:  # a shorter last chunk
            tail = x[full:]
            offsets = tail.abs().topk(min(self.k, tail.numel()), sorted=False).indices.sort().values
            parts.append((offsets, tail[offsets]))
        return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]

    def _encode(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The nearest of the evenly spread levels, as its number 0 .. levels - 1."""
        top = self.levels - 1
        unit = torch.where(scales > 0, values / scales, 0.0)  # in [-1, 1]
        return ((unit + 1) * top / 2).round().clamp(0, top).to(torch.uint8)

    def _decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return (codes.float() * 2 / (self.levels - 1) - 1) * scales
