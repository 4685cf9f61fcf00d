"""How a bfloat16 master is rounded after each update: stochastically, by a counter-based generator.

A bfloat16 master (``master_dtype: bfloat16``) loses an update smaller than half its last place when rounded to
nearest: late in training most of AdamW's steps are that small, and the weights stop moving. Rounded stochastically,
up with probability equal to the value's distance from its lower neighbour over the gap, the rounding is unbiased
and the small updates add up in expectation (Zamirai et al., arXiv 2010.06192, which finds it trains as well as a
float32 master).

The random bits come from a hash of a seed and the element's position (``mix32``: Chris Wellons' lowbias32), not
from a generator's state: the seed is a function of (step, unit, piece, rank) (``seed``), so a run resumed from a
checkpoint (which holds the step counts) rounds with the same bits, and so do any number of threads or chunks. The
native kernel (``offload/adamw_kernel.c``) computes it in its one pass; ``stochastic_round`` is the same arithmetic in
torch, for the update's torch path and as the tests' reference.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

import torch

#: Environment variable that, set to ``nearest``, rounds a bfloat16 master to nearest-even instead: the control that
#: scripts/bench_master_dtype.py measures stochastic rounding against, not a setting for training
ROUNDING_VARIABLE = "LIT_FSDP_MASTER_ROUNDING"
stochastic = os.environ.get(ROUNDING_VARIABLE, "stochastic") != "nearest"
MASK32 = 0xFFFFFFFF
_EXPONENT = 0x7F800000  # all ones: infinity or NaN, which keep the nearest rounding


@dataclass(frozen=True)
class MasterRounding:
    """How one update call rounds a bfloat16 master: stochastically (False: to nearest-even) with ``seed``, element
    ``i`` of the call with counter ``position + i`` (its index in the parameter's rows)."""

    stochastic: bool = True
    seed: int = 0
    position: int = 0

    def at(self, offset: int) -> "MasterRounding":
        """The rounding of the elements from ``offset`` on (a chunk of the call)."""
        return MasterRounding(self.stochastic, self.seed, self.position + offset)


def seed(step: int, unit: int, piece: int, rank: int) -> int:
    """The stochastic rounding's 32-bit seed of a piece's update at ``step`` (the step being taken): distinct per step,
    unit, piece and rank, and the same when a resumed run takes that step again."""
    return zlib.crc32(struct.pack("<qiii", step, unit, piece, rank))


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 ``x`` holding 32-bit values (the C file's ``mix32``): products wrap in int64, whose low 32
    bits are the uint32 product's."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def stochastic_round(values: torch.Tensor, rounding: MasterRounding) -> torch.Tensor:
    """``values`` (float32, 1-D) rounded to bfloat16 as the native kernel rounds a master (``rounding``)."""
    nearest = values.to(torch.bfloat16)
    if not rounding.stochastic:
        return nearest
    bits = values.view(torch.int32).to(torch.int64) & MASK32
    counter = (torch.arange(values.numel(), dtype=torch.int64) + rounding.position) & MASK32
    noise = mix32(counter ^ (rounding.seed & MASK32)) & 0xFFFF
    rounded = ((bits + noise) >> 16) & 0xFFFF
    special = (bits & _EXPONENT) == _EXPONENT
    rounded = torch.where(special, nearest.view(torch.int16).to(torch.int64) & 0xFFFF, rounded)
    return rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)
