"""Sparsifiers (top-k, random-k, threshold) and sparsify-then-quantize, with one shared index encoding.

A sparsifier sends some coordinates' values plus whatever the receiver needs to know where they go: the
cheaper of int32 positions and a bitmap (``encode_positions``), or, for random-k, only the seed the
positions are drawn from.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from compress.payload import Compressor, Payload
from compress.quantize import pack_bits, unpack_bits

#: names of the two index encodings; which one a payload holds says how its positions were encoded
POSITIONS, BITMAP = "indices", "bitmap"
_INT32_LIMIT = 2**31 - 1


def wire_seed(seed: int) -> int:
    """``seed`` reduced to 53 bits: exact in a float64, so it survives a scalar sent as a double."""
    return seed % 2**53


def check_size(owner: str, ratio: float | None, k: int | None, ratio_name: str = "ratio") -> None:
    """Raise unless exactly one of ``ratio`` in (0, 1] and an integer ``k`` >= 1 is given."""
    if (ratio is None) == (k is None):
        raise ValueError(f"{owner}: give exactly one of {ratio_name}= and k=, got {ratio_name}={ratio!r}, k={k!r}")
    if ratio is not None and not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
        raise ValueError(f"{owner}: {ratio_name}={ratio!r} is not a fraction in (0, 1]")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"{owner}: k={k!r} is not an integer >= 1")


def count(n: int, ratio: float | None, k: int | None) -> int:
    """How many of ``n`` coordinates a ``ratio`` or a fixed ``k`` (clamped to ``n``) asks for; at least one."""
    return max(1, round(ratio * n)) if ratio is not None else min(k, n)


def encode_positions(positions: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """The cheaper of int32 ``positions`` (4 bytes each) and a bitmap of ``n`` bits, under its own name.

    ``positions`` must be ascending so that both encodings give the values back in the same order.
    """
    if n > _INT32_LIMIT:
        raise ValueError(f"a {n}-element chunk is too long for int32 positions; split it below {_INT32_LIMIT + 1}")
    if 4 * positions.numel() <= math.ceil(n / 8):
        return {POSITIONS: positions.to(torch.int32)}
    mask = torch.zeros(n, dtype=torch.uint8, device=positions.device)
    mask[positions] = 1
    return {BITMAP: pack_bits(mask, 1)}


def decode_positions(tensors: dict[str, torch.Tensor], n: int) -> torch.Tensor:
    """Ascending int64 positions from whichever encoding ``encode_positions`` chose."""
    if POSITIONS in tensors:
        return tensors[POSITIONS].long()
    return unpack_bits(tensors[BITMAP], 1, n).nonzero().squeeze(1)


def scatter(n: int, positions: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A float32 vector of ``n`` zeros with ``values`` at ``positions``."""
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    out[positions] = values.float()
    return out


class _Sparsifier(ABC):
    """Shared by the sparsifiers: pick positions, send their values and the positions' encoding.

    Subclasses say which positions (``select``); random-k also overrides how positions travel.
    """

    linear = False
    unbiased = False

    @abstractmethod
    def select(self, tensor: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ascending int64 positions and the float32 values to send for them."""

    def encode(self, positions: torch.Tensor, n: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Index tensors and scalars that let the receiver recover ``positions``."""
        return encode_positions(positions, n), {}

    def decode(self, payload: Payload) -> torch.Tensor:
        """The ascending positions ``encode`` described."""
        return decode_positions(payload.tensors, payload.numel)

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        positions, values = self.select(tensor, seed)
        index, scalars = self.encode(positions, tensor.numel(), seed)
        return Payload(tensor.numel(), {"values": values, **index}, scalars, index_names=tuple(index))

    def decompress(self, payload: Payload) -> torch.Tensor:
        return scatter(payload.numel, self.decode(payload), payload.tensors["values"])


class TopK(_Sparsifier):
    """The ``k`` largest magnitudes (``k`` fixed, or ``ratio`` of the chunk), with their positions."""

    def __init__(self, ratio: float | None = None, k: int | None = None) -> None:
        check_size("TopK", ratio, k)
        self.ratio, self.k = ratio, k

    def select(self, tensor: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = count(tensor.numel(), self.ratio, self.k)
        # sorted=False: the order comes from sorting positions, which both encodings need anyway
        positions = torch.topk(tensor.abs(), k, sorted=False).indices.sort().values
        return positions, tensor[positions].float()


class ThresholdV(_Sparsifier):
    """Every coordinate with ``|x| >= threshold``: a variable count, possibly none."""

    def __init__(self, threshold: float) -> None:
        if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"ThresholdV: threshold={threshold!r} is not a finite number > 0")
        self.threshold = threshold

    def select(self, tensor: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = (tensor.abs() >= self.threshold).nonzero().squeeze(1)
        return positions, tensor[positions].float()


class RandomK(_Sparsifier):
    """``k`` coordinates drawn uniformly without replacement from ``seed``; only their values are sent.

    Every rank draws the same positions for the same seed, so value vectors add up (linear). With
    ``rescale`` the values are multiplied by ``n / k``, which makes the estimate unbiased.
    """

    linear = True

    def __init__(self, ratio: float | None = None, k: int | None = None, rescale: bool = True) -> None:
        check_size("RandomK", ratio, k)
        self.ratio, self.k, self.rescale = ratio, k, rescale
        self.unbiased = rescale

    def positions(self, n: int, seed: int, device: torch.device) -> torch.Tensor:
        """The ascending positions both sides draw for a chunk of ``n`` elements and ``seed``."""
        generator = torch.Generator(device=device)
        generator.manual_seed(wire_seed(seed))
        k = count(n, self.ratio, self.k)
        return torch.randperm(n, generator=generator, device=device)[:k].sort().values

    def select(self, tensor: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = tensor.numel()
        positions = self.positions(n, seed, tensor.device)
        values = tensor[positions].float()
        if self.rescale:
            values = values * (n / positions.numel())
        return positions, values

    def encode(self, positions: torch.Tensor, n: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return {}, {"seed": wire_seed(seed)}

    def decode(self, payload: Payload) -> torch.Tensor:
        device = next(iter(payload.tensors.values())).device
        return self.positions(payload.numel, int(payload.scalars["seed"]), device)


class Sparsified:
    """Sparsify, then quantize the kept values with any compressor (e.g. ``IntQuant``).

    The payload holds the sparsifier's index tensors and scalars, and the quantizer's tensors and scalars
    under ``values.``-prefixed names. Unbiased when both parts are; never linear, since quantized payloads
    of different ranks do not add up.
    """

    linear = False
    _PREFIX = "values."

    def __init__(self, sparsifier: TopK | RandomK | ThresholdV, quantizer: Compressor) -> None:
        if not isinstance(sparsifier, _Sparsifier):
            raise ValueError(f"Sparsified: sparsifier={sparsifier!r} is not a TopK, RandomK or ThresholdV")
        if not (callable(getattr(quantizer, "compress", None)) and callable(getattr(quantizer, "decompress", None))):
            raise ValueError(f"Sparsified: quantizer={quantizer!r} has no compress/decompress; pass a compressor")
        self.sparsifier, self.quantizer = sparsifier, quantizer
        self.unbiased = sparsifier.unbiased and bool(getattr(quantizer, "unbiased", False))

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        positions, values = self.sparsifier.select(tensor, seed)
        tensors, scalars = self.sparsifier.encode(positions, tensor.numel(), seed)
        index_names = tuple(tensors)
        # a threshold may keep nothing, and compressors take at least one element
        if values.numel():
            inner = self.quantizer.compress(values, f"{key}/values", seed)
            tensors.update({self._PREFIX + name: t for name, t in inner.tensors.items()})
            scalars.update({self._PREFIX + name: v for name, v in inner.scalars.items()})
            index_names += tuple(self._PREFIX + name for name in inner.index_names)
        return Payload(tensor.numel(), tensors, scalars, index_names)

    def decompress(self, payload: Payload) -> torch.Tensor:
        positions = self.sparsifier.decode(payload)
        if not positions.numel():
            return torch.zeros(payload.numel, dtype=torch.float32, device=positions.device)
        inner = Payload(
            positions.numel(),
            {name.removeprefix(self._PREFIX): t for name, t in payload.tensors.items() if name.startswith(self._PREFIX)},
            {name.removeprefix(self._PREFIX): v for name, v in payload.scalars.items() if name.startswith(self._PREFIX)},
            tuple(name.removeprefix(self._PREFIX) for name in payload.index_names if name.startswith(self._PREFIX)),
        )
        return scatter(payload.numel, positions, self.quantizer.decompress(inner))
