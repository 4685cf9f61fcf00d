"""Rank-r approximation by one warm-started power-iteration step per call, as in PowerSGD (Vogels et al., 2019)."""

from __future__ import annotations

import math

import torch

from compress.payload import Payload


class LowRank:
    """The chunk as a ``rows x cols`` matrix M (zero-padded), sent as P (``rows x rank``) and Q (``cols x rank``).

    Each call does one power-iteration step from the Q the previous call left for the same ``key``
    (warm start): P = orthonormal(M Q), Q = Mᵀ P, and M ≈ P Qᵀ. ``cols`` defaults to ``ceil(sqrt(n))`` and
    is clamped to ``n``.

    Not linear: each rank's P and Q span its own subspace. PowerSGD proper shares Q across ranks and
    all-reduces P and then Q, which is linear but takes two rounds of communication per step.
    """

    linear = False
    unbiased = False

    def __init__(self, rank: int = 4, cols: int | None = None) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LowRank: rank={rank!r} is not an integer >= 1")
        if cols is not None and (isinstance(cols, bool) or not isinstance(cols, int) or cols < 1):
            raise ValueError(f"LowRank: cols={cols!r} is not an integer >= 1 (or None for about sqrt(n))")
        self.rank, self.cols = rank, cols
        self._q: dict[str, torch.Tensor] = {}  # warm starts, by chunk key

    def shape(self, n: int) -> tuple[int, int]:
        """The (rows, cols) matrix a chunk of ``n`` elements is reshaped into."""
        cols = min(self.cols or math.ceil(math.sqrt(n)), n)
        return math.ceil(n / cols), cols

    def check_fits(self, n: int) -> None:
        """Raise if ``rank`` exceeds the smaller side of the matrix a chunk of ``n`` elements makes."""
        rows, cols = self.shape(n)
        if self.rank > min(rows, cols):
            raise ValueError(
                f"LowRank: rank {self.rank} is larger than the {rows}x{cols} matrix a {n}-element gradient chunk "
                f"makes; lower rank to at most {min(rows, cols)}"
            )

    def compress(self, tensor: torch.Tensor, key: str, seed: int) -> Payload:
        n = tensor.numel()
        self.check_fits(n)
        rows, cols = self.shape(n)
        matrix = torch.nn.functional.pad(tensor.float(), (0, rows * cols - n)).view(rows, cols)
        q = self._q.get(key)
        # a chunk seen for the first time, or one whose size changed, starts from a random Q
        if q is None or q.shape != (cols, self.rank):
            generator = torch.Generator(device=tensor.device)
            generator.manual_seed(seed % 2**63)
            q = torch.randn(cols, self.rank, generator=generator, device=tensor.device)
        p = torch.linalg.qr(matrix @ q.to(tensor.device)).Q
        q = matrix.T @ p
        # a copy: a communicator may reduce payload tensors in place, and the warm start must stay this rank's
        self._q[key] = q.clone()
        return Payload(n, {"p": p, "q": q})

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The warm starts, for checkpoints."""
        return {f"q/{key}": q for key, q in self._q.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._q = {key.removeprefix("q/"): q for key, q in state.items() if key.startswith("q/")}

    def decompress(self, payload: Payload) -> torch.Tensor:
        p, q = payload.tensors["p"], payload.tensors["q"]
        return (p @ q.T).flatten()[: payload.numel]
