"""Sparsifiers (top-k, random-k, threshold) and sparsify-then-quantize, with one shared index encoding.

A sparsifier sends some coordinates' values plus whatever the receiver needs to know where they go: the
cheaper of int32 positions and a bitmap (``encode_positions``), or, for random-k, only the seed the
positions are drawn from.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from compress.payload import Compressor, Layout, Payload
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


def index_layout(n: int, k: int) -> Layout:
    """How ``k`` of ``n`` positions travel: the cheaper of int32 positions (4 bytes each) and a bitmap of ``n`` bits."""
    if 4 * k <= math.ceil(n / 8):
        return ((POSITIONS, torch.int32, (k,)),)
    return ((BITMAP, torch.uint8, (math.ceil(n / 8),)),)


def encode_positions(positions: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """``positions`` in the encoding ``index_layout`` chooses, under its own name.

    ``positions`` must be ascending so that both encodings give the values back in the same order.
    """
    if n > _INT32_LIMIT:
        raise ValueError(f"a {n}-element chunk is too long for int32 positions; split it below {_INT32_LIMIT + 1}")
    if index_layout(n, positions.numel())[0][0] == POSITIONS:
        return {POSITIONS: positions.to(torch.int32)}
    mask = torch.zeros(n, dtype=torch.uint8, device=positions.device).index_fill_(0, positions, 1)
    return {BITMAP: pack_bits(mask, 1)}


def decode_positions(tensors: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """The ``k`` ascending int64 positions from whichever encoding ``encode_positions`` chose.

    ``k`` is known on the host, so a bitmap decodes with a fixed output size and no host synchronisation.
    """
    if POSITIONS in tensors:
        return tensors[POSITIONS].long()
    return torch.nonzero_static(unpack_bits(tensors[BITMAP], 1, n), size=k).squeeze(1)


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
    def select(self, tensor: torch.Tensor, seed: int, kept: int | None = None, key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        """Ascending int64 positions and the float32 values to send for them (``kept``: their count, if known;
        ``key``: the chunk, for sparsifiers with state per chunk)."""

    def encode(self, positions: torch.Tensor, n: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Index tensors and scalars that let the receiver recover ``positions``."""
        return encode_positions(positions, n), {}

    def decode(self, payload: Payload) -> torch.Tensor:
        """The ascending positions ``encode`` described."""
        return decode_positions(payload.tensors, payload.numel, payload.kept)

    def index_layout(self, n: int, k: int) -> Layout:
        """The index tensors ``encode`` sends for ``k`` of ``n`` positions."""
        return index_layout(n, k)

    def compress(self, tensor: torch.Tensor, key: str, seed: int, kept: int | None = None) -> Payload:
        positions, values = self.select(tensor, seed, kept, key=key)
        index, scalars = self.encode(positions, tensor.numel(), seed)
        return Payload(tensor.numel(), {"values": values, **index}, scalars, tuple(index), kept=positions.numel())

    def layout(self, numel: int, kept: int) -> tuple[Layout, Payload]:
        """A peer's payload keeping ``kept`` of ``numel`` coordinates: its layout, and its fields besides tensors."""
        index = self.index_layout(numel, kept)
        return (("values", torch.float32, (kept,)), *index), Payload(numel, {}, {}, tuple(n for n, _, _ in index), kept)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return scatter(payload.numel, self.decode(payload), payload.tensors["values"])


class TopK(_Sparsifier):
    """The ``k`` largest magnitudes (``k`` fixed, or ``ratio`` of the chunk), with their positions."""

    def __init__(self, ratio: float | None = None, k: int | None = None) -> None:
        check_size("TopK", ratio, k)
        self.ratio, self.k = ratio, k

    def select(self, tensor: torch.Tensor, seed: int, kept: int | None = None, key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        k = count(tensor.numel(), self.ratio, self.k)
        # sorted=False: the order comes from sorting positions, which both encodings need anyway
        positions = torch.topk(tensor.abs(), k, sorted=False).indices.sort().values
        return positions, tensor[positions].float()


class ThresholdV(_Sparsifier):
    """Every coordinate with ``|x| >= threshold``: a variable count, possibly none (a ``VariableSizeCompressor``).

    With ``density`` instead of a fixed ``threshold``, each chunk's threshold is ``r`` times its mean
    magnitude, so a change of the gradients' scale moves it at once. ``r`` starts from the chunk's first
    call (the magnitude its largest ``density`` share reaches, over the mean) and is corrected after each
    call from the count sent: ``r *= sqrt(kept / target)``, at most 2x either way, with no sort and no host
    read. About the share ``density`` is sent whatever the scale; ``r`` per chunk is in checkpoints.
    """

    variable_size = True
    _STEP_LIMIT = 2.0  # the most one call's correction may move r

    def __init__(self, threshold: float | None = None, density: float | None = None) -> None:
        if (threshold is None) == (density is None):
            raise ValueError(f"ThresholdV: give exactly one of threshold= and density=, got threshold={threshold!r}, "
                             f"density={density!r}")
        if threshold is not None and not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"ThresholdV: threshold={threshold!r} is not a finite number > 0")
        if density is not None:
            check_size("ThresholdV", density, None, ratio_name="density")
        self.threshold, self.density = threshold, density
        self.ratios: dict[str, torch.Tensor] = {}  # density target: each chunk's threshold over its mean magnitude

    def current(self, tensor: torch.Tensor, key: str) -> float | torch.Tensor:
        """The threshold chunk ``key`` uses for ``tensor``."""
        if self.density is None:
            return self.threshold
        magnitude = tensor.abs().float()
        mean = magnitude.mean().clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero chunk keeps nothing
        if key not in self.ratios:  # the first call: this call's own quantile, one top-k
            k = count(tensor.numel(), self.density, None)
            quantile = torch.topk(magnitude, k, sorted=False).values.min()
            self.ratios[key] = torch.where(quantile > 0, quantile / mean, 1.0)
        return (self.ratios[key] * mean).clamp_min(torch.finfo(torch.float32).tiny)

    def kept_count(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        """How many coordinates reach the threshold, on the device."""
        return (tensor.abs() >= self.current(tensor, key)).sum()

    def select(self, tensor: torch.Tensor, seed: int, kept: int | None = None, key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        mask = tensor.abs() >= self.current(tensor, key)
        if kept is None:  # called outside a communicator: one host read of the count
            kept = int(mask.sum())
        positions = torch.nonzero_static(mask, size=kept).squeeze(1)
        if self.density is not None:  # too many sent: raise the threshold, too few: lower it
            target = self.density * tensor.numel()
            factor = min(max(math.sqrt(max(kept, 0.5) / target), 1 / self._STEP_LIMIT), self._STEP_LIMIT)
            self.ratios[key] = self.ratios[key] * factor
        return positions, tensor[positions].float()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The density target's ratio per chunk, for checkpoints."""
        return {f"ratio/{key}": value for key, value in self.ratios.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.ratios = {k.removeprefix("ratio/"): v for k, v in state.items() if k.startswith("ratio/")}


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

    def select(self, tensor: torch.Tensor, seed: int, kept: int | None = None, key: str = "") -> tuple[torch.Tensor, torch.Tensor]:
        n = tensor.numel()
        positions = self.positions(n, seed, tensor.device)
        values = tensor[positions].float()
        if self.rescale:
            values = values * (n / positions.numel())
        return positions, values

    def encode(self, positions: torch.Tensor, n: int, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return {}, {"seed": wire_seed(seed)}

    def index_layout(self, n: int, k: int) -> Layout:
        return ()

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
        self.variable_size = getattr(sparsifier, "variable_size", False)

    def kept_count(self, tensor: torch.Tensor, key: str = "") -> torch.Tensor:
        return self.sparsifier.kept_count(tensor, key)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The sparsifier's state (threshold-v's density target), for checkpoints."""
        state = getattr(self.sparsifier, "state_dict", None)
        return state() if state is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if hasattr(self.sparsifier, "load_state_dict"):
            self.sparsifier.load_state_dict(state)

    def layout(self, numel: int, kept: int) -> tuple[Layout, Payload]:
        """The sparsifier's index layout and the quantiser's layout of ``kept`` values."""
        index = self.sparsifier.index_layout(numel, kept)
        values: Layout = ()
        if kept:  # the quantiser's layout for ``kept`` values
            values = tuple((self._PREFIX + name, dtype, shape) for name, dtype, shape in self.quantizer.layout(kept))
        return (*index, *values), Payload(numel, {}, {}, tuple(n for n, _, _ in index), kept)

    def compress(self, tensor: torch.Tensor, key: str, seed: int, kept: int | None = None) -> Payload:
        positions, values = self.sparsifier.select(tensor, seed, kept, key=key)
        tensors, scalars = self.sparsifier.encode(positions, tensor.numel(), seed)
        index_names = tuple(tensors)
        # a threshold may keep nothing, and compressors take at least one element
        if values.numel():
            inner = self.quantizer.compress(values, f"{key}/values", seed)
            tensors.update({self._PREFIX + name: t for name, t in inner.tensors.items()})
            scalars.update({self._PREFIX + name: v for name, v in inner.scalars.items()})
            index_names += tuple(self._PREFIX + name for name in inner.index_names)
        return Payload(tensor.numel(), tensors, scalars, index_names, kept=positions.numel())

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
