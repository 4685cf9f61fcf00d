"""Count sketch with heavy-hitter recovery, as in Sketched-SGD (Ivkin et al., 2019)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import torch

from compress.payload import Payload
from compress.sparsify import check_size, count, wire_seed

# Carter-Wegman hashing modulo a Mersenne prime: with a, b and i below 2**31, a * i + b fits in an int64, so
# the hash is exact on every device without relying on integer overflow.
_PRIME = 2**31 - 1


class CountSketch:
    """A ``rows x cols`` table of signed bucket sums; decoding keeps the top-``k`` median estimates.

    ``ratio`` sizes the table (``rows * cols`` is about ``ratio * n``); ``heavy_ratio`` or ``k`` (at most one;
    ``heavy_ratio=0.01`` when neither is given) is how many coordinates decoding keeps. The hash functions
    come from ``seed``, so tables from different ranks add up to the table of the sum (linear).
    """

    linear = True
    unbiased = False

    def __init__(
        self, ratio: float = 0.1, rows: int = 5, heavy_ratio: float | None = None, k: int | None = None
    ) -> None:
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"CountSketch: ratio={ratio!r} is not a fraction in (0, 1]")
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"CountSketch: rows={rows!r} is not an integer >= 1")
        if heavy_ratio is None and k is None:
            heavy_ratio = 0.01
        check_size("CountSketch", heavy_ratio, k, ratio_name="heavy_ratio")
        self.ratio, self.rows, self.heavy_ratio, self.k = ratio, rows, heavy_ratio, k

    def cols(self, n: int) -> int:
        """Table width for a chunk of ``n`` elements."""
        return max(1, math.ceil(self.ratio * n / self.rows))

    def _hashes(self, n: int, cols: int, seed: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Per row, the bucket (int64) and sign (float32, +-1) of each of ``n`` coordinates."""
        if n >= _PRIME:
            raise ValueError(f"CountSketch: a {n}-element chunk is too long to hash; split it below {_PRIME}")
        # the coefficients come from Python's generator on the host: every device type hashes alike, and no
        # tensor is read back; from 1: a zero multiplier would put every coordinate in one bucket
        generator = random.Random(wire_seed(seed))
        coefficients = [[generator.randrange(1, _PRIME) for _ in range(4)] for _ in range(self.rows)]
        index = torch.arange(n, device=device)
        for a, b, c, d in coefficients:
            bucket = (a * index + b) % _PRIME % cols
            sign = 1.0 - 2.0 * ((c * index + d) % _PRIME % 2).float()
            yield bucket, sign

    def table(self, tensor: torch.Tensor, seed: int) -> torch.Tensor:
        """The ``rows x cols`` sketch of a 1-D tensor with the hash functions of ``seed``."""
        n, values = tensor.numel(), tensor.float()
        cols = self.cols(n)
        table = torch.zeros(self.rows, cols, dtype=torch.float32, device=tensor.device)
        for row, (bucket, sign) in zip(table, self._hashes(n, cols, seed, tensor.device)):
            row.index_add_(0, bucket, values * sign)
        return table

    def heavy(self, table: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Ascending positions of the ``k`` largest median estimates of a sketched ``n``-vector, and the estimates."""
        hashes = self._hashes(n, table.shape[1], seed, table.device)
        estimates = torch.stack([sign * row[bucket] for row, (bucket, sign) in zip(table, hashes)])
        # torch.median takes the lower middle value when rows is even
        estimate = estimates.median(dim=0).values
        positions = torch.topk(estimate.abs(), count(n, self.heavy_ratio, self.k), sorted=False).indices.sort().values
        return positions, estimate[positions]

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        return Payload(tensor.numel(), {"table": self.table(tensor, seed)}, {"seed": wire_seed(seed)})

    def decompress(self, payload: Payload) -> torch.Tensor:
        """The heavy hitters' estimates at their positions (one round: estimates, not exact values)."""
        positions, estimates = self.heavy(payload.tensors["table"], payload.numel, int(payload.scalars["seed"]))
        out = torch.zeros(payload.numel, dtype=torch.float32, device=positions.device)
        out[positions] = estimates
        return out
