"""Synthetic language-model data from a seeded Markov source whose entropy rate is known exactly.

A model that predicts the next token perfectly from the previous one reaches a loss equal to the
entropy rate, so training curves on this data have a known floor. Nothing is read from disk.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np

from lit_fsdp.data.blocks import BlockDataModule, TokenBlocks


@functools.lru_cache(maxsize=4)
def _chain(vocab_size: int, branching: int, concentration: float, seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """The chain's successor sets and transition rows, drawn from ``seed``, and the generator's state after them.

    Kept per process: drawing a 128k vocabulary's takes about 9 s (``choice`` without replacement is linear in the
    vocabulary, per row), and the tests and ``estimate`` build the same sources many times in one process."""
    rng = np.random.default_rng(seed)
    # Sparse rows (vocab_size x branching): a dense matrix would not fit for a 50k vocabulary.
    successors = np.stack([rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)])
    probs = rng.dirichlet(np.full(branching, concentration), size=vocab_size)
    successors.flags.writeable = probs.flags.writeable = False  # shared by every source of these arguments
    return successors, probs, rng.bit_generator.state


class MarkovSource:
    """First-order Markov chain over ``vocab_size`` tokens, each with ``branching`` possible successors.

    Transition rows are Dirichlet(``concentration``) draws over a random successor set; the stream starts
    from the stationary distribution so every prediction has the same expected loss, the entropy rate.
    """

    def __init__(self, vocab_size: int, branching: int, concentration: float, seed: int):
        if not 2 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [2, vocab_size={vocab_size}], got {branching}")
        self.vocab_size = vocab_size
        self.successors, self.probs, state = _chain(vocab_size, branching, concentration, seed)
        self.stationary = self._stationary()
        self._successor_lists = self.successors.tolist()
        self._cumulative = np.cumsum(self.probs, axis=1).tolist()
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state  # where the seeded generator stood after drawing the chain
        self.key = (vocab_size, branching, concentration, seed)

    def _stationary(self) -> np.ndarray:
        # Power iteration on the lazy chain (same stationary distribution, guaranteed to converge).
        pi = np.full(self.vocab_size, 1.0 / self.vocab_size)
        for _ in range(100_000):
            step = np.bincount(self.successors.ravel(), weights=(pi[:, None] * self.probs).ravel(), minlength=self.vocab_size)
            nxt = 0.5 * (pi + step)
            if np.abs(nxt - pi).sum() < 1e-13:
                break
            pi = nxt
        return nxt / nxt.sum()

    @property
    def entropy_rate(self) -> float:
        """Entropy rate in nats per token: the lowest expected next-token loss."""
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.where(self.probs > 0, np.log(self.probs), 0.0)
        return float(-(self.stationary[:, None] * self.probs * logs).sum())

    def sample(self, num_tokens: int) -> np.ndarray:
        """``num_tokens`` consecutive tokens of the chain, started from the stationary distribution."""
        token = int(self._rng.choice(self.vocab_size, p=self.stationary))
        out = [token]
        for u in self._rng.random(num_tokens - 1).tolist():
            cumulative = self._cumulative[token]
            token = self._successor_lists[token][min(bisect.bisect_right(cumulative, u), len(cumulative) - 1)]
            out.append(token)
        return np.asarray(out, dtype=np.int64)


class SyntheticDataModule(BlockDataModule):
    """Token blocks sampled from a seeded Markov source; the loss floor is logged as ``data/entropy_rate``."""

    def __init__(
        self,
        vocab_size: int = 512,
        branching: int = 4,
        concentration: float = 1.0,
        seq_len: int = 128,
        batch_size: int = 8,
        num_train_blocks: int = 2048,
        num_val_blocks: int = 64,
        seed: int = 1234,
        num_workers: int = 0,
    ):
        """
        Args:
            vocab_size: Number of distinct tokens.
            branching: Successors each token can have; lower means an easier source with a lower loss floor.
            concentration: Dirichlet concentration of the transition rows; lower means more peaked rows.
            seq_len: Tokens per training sequence.
            batch_size: Sequences per process per micro-batch.
            num_train_blocks: Training sequences per epoch.
            num_val_blocks: Validation sequences.
            seed: Seed of the source and of the sampling order.
            num_workers: DataLoader worker processes.
        """
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        self.vocab_size = vocab_size
        self.num_train_blocks = num_train_blocks
        self.num_val_blocks = num_val_blocks
        self.source = MarkovSource(vocab_size, branching, concentration, seed)

    @property
    def entropy_rate(self) -> float:
        return self.source.entropy_rate

    def setup(self, stage: str) -> None:
        if hasattr(self, "train_set"):
            return
        # Both streams are generated up front, in the same order on every rank: a few MB at most.
        train, val = _streams(self.source, self.num_train_blocks * self.seq_len + 1, self.num_val_blocks * self.seq_len + 1)
        self.train_set = TokenBlocks(train, self.seq_len)
        self.val_set = TokenBlocks(val, self.seq_len)


_STREAMS: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def _streams(source: MarkovSource, train_tokens: int, val_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``source``'s training then validation stream, kept per process by what determines them (its chain's arguments,
    its generator's state and the lengths): a run's sampling is a Python loop over every token, repeated by each run
    of a process. Read only: the arrays may be another run's too."""
    key = (source.key, repr(source._rng.bit_generator.state), train_tokens, val_tokens)
    if key not in _STREAMS:
        train, val = source.sample(train_tokens), source.sample(val_tokens)
        _STREAMS.clear()  # the last only: a few MB
        _STREAMS[key] = train, val
    return _STREAMS[key]
