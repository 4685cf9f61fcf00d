"""Rank-r approximation by one warm-started power-iteration step per call, as in PowerSGD (Vogels et al., 2019)."""

from __future__ import annotations

import math

import torch

from compress.layout import MatrixStack
from compress.payload import Payload


class LowRank:
    """The chunk as a ``rows x cols`` matrix M (zero-padded), sent as P (``rows x rank``) and Q (``cols x rank``).

    Each call does one power-iteration step from the Q the previous call left for the same ``key``
    (warm start): P = orthonormal(M Q), Q = Mᵀ P, and M ≈ P Qᵀ. ``cols`` defaults to ``ceil(sqrt(n))`` and
    is clamped to ``n``.

    Stacks of matrices the communicator declares in a chunk (``stacks[key]``: a MoE layer's experts, from
    ``UnitLayout.stacks``) are compressed matrix by matrix instead, each at rank ``min(rank, rows, cols)``, as
    ``p.i`` (``count x rows x rank``) and ``q.i`` (``count x cols x rank``) for the chunk's ``i``-th stack; the rest
    of the chunk, joined up, is the matrix above.

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
        self._q: dict[str, torch.Tensor] = {}  # warm starts, by chunk key (and stack)
        self.stacks: dict[str, tuple[MatrixStack, ...]] = {}  # matrices compressed one by one, by chunk key

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
        stacks = self.stacks.get(key, ())
        rest, matrices = _split(tensor.float(), stacks)
        tensors = {}
        if rest.numel():
            n = rest.numel()
            self.check_fits(n)
            rows, cols = self.shape(n)
            matrix = torch.nn.functional.pad(rest, (0, rows * cols - n)).view(rows, cols)
            tensors["p"], tensors["q"] = self._power_step(matrix, self.rank, key, seed)
        for index, (stack, stacked) in enumerate(zip(stacks, matrices)):
            rank = min(self.rank, stack.rows, stack.cols)
            tensors[f"p.{index}"], tensors[f"q.{index}"] = self._power_step(stacked, rank, f"{key}/{index}", seed)
        return Payload(tensor.numel(), tensors, matrices=stacks)

    def _power_step(self, matrix: torch.Tensor, rank: int, key: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """P and Q of ``matrix`` (or of each matrix of a stack) from ``key``'s warm start, which becomes the new Q."""
        q_shape = (*matrix.shape[:-2], matrix.shape[-1], rank)
        q = self._q.get(key)
        # a chunk seen for the first time, or one whose size changed, starts from a random Q
        if q is None or q.shape != q_shape:
            generator = torch.Generator(device=matrix.device)
            generator.manual_seed(seed % 2**63)
            q = torch.randn(q_shape, generator=generator, device=matrix.device)
        p = torch.linalg.qr(matrix @ q.to(matrix.device)).Q
        q = matrix.mT @ p
        # a copy: a communicator may reduce payload tensors in place, and the warm start must stay this rank's
        self._q[key] = q.clone()
        return p, q

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The warm starts, for checkpoints."""
        return {f"q/{key}": q for key, q in self._q.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._q = {key.removeprefix("q/"): q for key, q in state.items() if key.startswith("q/")}

    def decompress(self, payload: Payload) -> torch.Tensor:
        tensors = payload.tensors
        rest_numel = payload.numel - sum(s.count * s.rows * s.cols for s in payload.matrices)
        rest = (tensors["p"] @ tensors["q"].T).flatten()[:rest_numel] if rest_numel else None
        matrices = [tensors[f"p.{i}"] @ tensors[f"q.{i}"].mT for i in range(len(payload.matrices))]
        return _join(rest, matrices, payload.matrices)


def _split(chunk: torch.Tensor, stacks: tuple[MatrixStack, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``chunk``'s elements outside ``stacks`` joined up, and each stack's matrices (``count x rows x cols``)."""
    rest, matrices, start = [], [], 0
    for stack in stacks:
        rest.append(chunk[start : stack.offset])
        matrices.append(chunk[stack.offset : stack.end].view(stack.count, stack.rows, stack.cols))
        start = stack.end
    rest.append(chunk[start:])
    return (torch.cat(rest) if stacks else chunk), matrices


def _join(rest: torch.Tensor | None, matrices: list[torch.Tensor], stacks: tuple[MatrixStack, ...]) -> torch.Tensor:
    """The inverse of ``_split``: the chunk from its rest and its stacks' matrices."""
    if not stacks:
        return rest
    parts, start, taken = [], 0, 0
    for stack, stacked in zip(stacks, matrices):
        gap = stack.offset - start
        parts += [rest[taken : taken + gap], stacked.reshape(-1)] if gap else [stacked.reshape(-1)]
        taken, start = taken + gap, stack.end
    if rest is not None and taken < rest.numel():
        parts.append(rest[taken:])
    return torch.cat(parts)
