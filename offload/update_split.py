"""SlideFSDP's update split: which units' updates are speculated during the backward (``update: split``), and what
``update: auto`` takes.

The backward sends the gradients top first: the root's parameters used after the blocks (final norm, head), then the
blocks from the last down, then the root's parameters used before them (the embeddings). The next forward needs the
weights in the other order. ``split`` speculates the units whose gradients arrive first: the root's trailing parts
and the last ``blocks`` blocks (``offload.host_memory.speculated_units``), each updated on arrival after a backup of its rows (``offload.speculation``), hidden
behind the rest of the backward; every other unit is updated after the norm in forward order, hidden behind the
next forward (``offload.schedule``). The backup holds the speculated rows alone, so the split takes as many blocks as
the host has room for (``largest_split``), and, where the step-time model is known (``estimate``, ``tune``, and at
run time once the first steps are measured: ``offload.auto_update``), the fastest of those and ``forward``, their
backup pass and their rollback at the steps whose clipping fires counted (``choose_split``).
"""

from __future__ import annotations

from collections.abc import Callable


def largest_split(blocks: int, fits: Callable[[int], bool]) -> int | None:
    """The most blocks (0 to ``blocks``) whose split ``fits`` the host, or None where not even the root's trailing
    parts do (then ``update: forward``: nothing speculated)."""
    low, high = -1, blocks  # fits(low) holds (or low is -1), the answer is in [low, high]
    if not fits(0):
        return None
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def choose_split(blocks: int, fits: Callable[[int], bool],
                 step_s: Callable[[int | None], float] | None = None) -> int | None:
    """``auto``'s split: by ``step_s`` (the step-time model; None: ``forward``, nothing speculated), the fastest of
    ``forward`` and the splits that fit (among equals the smallest backup); without the model, the largest split that
    fits; None (``forward``) where none does."""
    most = largest_split(blocks, fits)
    if step_s is None:
        return most
    candidates = [None, *(range(most + 1) if most is not None else ())]
    return min(candidates, key=lambda k: (round(step_s(k), 6), -1 if k is None else k))
