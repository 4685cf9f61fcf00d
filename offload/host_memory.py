"""SlideFSDP's host memory on one node, buffer by buffer: the one accounting behind the preflight, ``tune`` and ``OffloadStats``.

Trained parameters have a master (float32, or bfloat16 with ``master_dtype``), AdamW moments and gradients on the
host, and a copy in the compute dtype (the staging copy the device loads; a bfloat16 master can be that copy:
``master_in_staging``); frozen ones (LoRA's base) have that copy only.

Every buffer ``offload.host.HostState`` allocates, the offloaded activations' included, is counted at its exact
size: each is one allocation, pinned by registering it in place, so torch's power-of-two rounding of pinned
allocations does not apply. ``runtime`` is what a process needs besides its buffers (Python, torch, the CUDA
runtime's host side, the data loader): an allowance, not a measurement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

GIB = 2**30
RUNTIME_BYTES_PER_PROCESS = 3 * GIB  # allowance per rank: interpreter, libraries, CUDA runtime host side, loader
#: Elements after a unit's gradient in its device-to-host copy: 1 if the device found the gradient finite, else 0
FLAG_ELEMENTS = 1


@dataclass(frozen=True)
class UnitSize:
    """One unit (a block, or the root): its parameters' elements whole, one rank's padded shard of them, the shard
    elements of each part its trained gradients go to the host in (``offload.gradients.gradient_parts``; empty: one
    part), and of those elements the frozen ones (LoRA's base: in the staging copy only)."""

    full_numel: int
    shard_numel: int
    parts: tuple[int, ...] = ()
    frozen_full_numel: int = 0
    frozen_shard_numel: int = 0
    leading_parts: int = 0  # the root's parts used before the blocks (embeddings): their gradients arrive last

    @classmethod
    def of(cls, full_numel: int, shards: int, trained: int | None = None) -> "UnitSize":
        """An estimate from the element counts alone (rows padded to whole shards are left out); ``trained`` of the
        ``full_numel`` elements train (default: all)."""
        frozen = 0 if trained is None else full_numel - trained
        return cls(full_numel, math.ceil(full_numel / shards), (), frozen, math.ceil(frozen / shards))

    def trained(self) -> "UnitSize":
        """The unit's trained parameters alone: what has a master, moments and gradients."""
        if not self.frozen_full_numel:
            return self
        return UnitSize(self.full_numel - self.frozen_full_numel, self.shard_numel - self.frozen_shard_numel, self.parts,
                        leading_parts=self.leading_parts)

    def part_sizes(self) -> tuple[int, ...]:
        trained = self.trained()
        return trained.parts or ((trained.shard_numel,) if trained.shard_numel else ())


@dataclass(frozen=True)
class HostSetup:
    """What decides SlideFSDP's host buffers on one node."""

    compute_dtype: torch.dtype
    reduce_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype  # AdamW's exp_avg and exp_avg_sq
    processes: int  # ranks on the node; they shard the master rows between them
    full_staging: bool  # param_transfer: full (one full-layout copy per node), else each rank's shard
    keep_gradients: bool  # accumulation, or clipping or skip_step without delayed_update: an fp32 gradient per unit
    incoming_full: bool  # grad_sync: cpu_reduce: whole gradients reach the host, not this rank's shard
    window: int  # blocks on the device at once
    gradient_slots: int | None = None  # gradient buffers per rank; None: ``gradient_slots`` chooses
    holds_step: bool = False  # delayed_update: a step's gradients wait in their buffers for the next step
    offloaded_activation_bytes: int = 0  # per rank: checkpointed block inputs kept on the host
    speculate: bool = False  # update: speculative: rows backed up before each update; gradients kept to the step's end
    master_dtype: torch.dtype = torch.float32  # the trained parameters' master rows (``master_dtype``)
    ordered: bool = False  # update: forward or split: each piece held until its update after the norm
    split_blocks: int | None = None  # update: split: the blocks speculated (``offload.update_split``); None: no split

    @classmethod
    def of_knobs(cls, compute_dtype: torch.dtype, reduce_dtype: torch.dtype, optimizer_state_dtype: torch.dtype,
                 processes: int, param_transfer: str, grad_sync: str, window: int, keep_gradients: bool,
                 offloaded_activation_bytes: int = 0, gradient_slots: int | None = None,
                 delayed_update: bool = False, speculate: bool = False,
                 master_dtype: torch.dtype = torch.float32, ordered: bool = False,
                 split_blocks: int | None = None) -> "HostSetup":
        """The setup SlideFSDP's knobs give (``offload.SlideFSDPStrategy`` and the tuner's candidates); ``speculate``,
        ``ordered`` and ``split_blocks``: the schedule's (``offload.schedule``, ``offload.update_split``)."""
        return cls(compute_dtype, reduce_dtype, optimizer_state_dtype, processes, full_staging=param_transfer == "full",
                   keep_gradients=keep_gradients, incoming_full=grad_sync == "cpu_reduce", window=window,
                   gradient_slots=gradient_slots, holds_step=delayed_update,
                   offloaded_activation_bytes=offloaded_activation_bytes, speculate=speculate, master_dtype=master_dtype,
                   ordered=ordered, split_blocks=split_blocks)


def master_in_staging(units: Sequence[UnitSize], setup: HostSetup) -> bool:
    """Whether the master rows are the staging copy's rows (no copy of their own): a bfloat16 master where the device
    computes in bfloat16, every parameter trained (so the master's layout is the staging copy's), each rank's rows
    contiguous in it (``param_transfer: shard``, or one process), and no ``update: delayed``, whose updates run while the
    device may still load the unit's rows of the step before (its staging rows are rewritten after that last load)."""
    return (setup.master_dtype == setup.compute_dtype == torch.bfloat16 and not setup.holds_step
            and (not setup.full_staging or setup.processes == 1) and not any(unit.frozen_full_numel for unit in units))


#: Piece sizes are multiples of this many elements: a piece then starts where a whole update's vector lanes would, and
#: the fused AdamW kernel rounds its elements exactly as when the part is updated at once
PIECE_ALIGNMENT = 64


def piece_capacity(units: Sequence[UnitSize], incoming_full: bool, ranks: int) -> int:
    """Gradient elements one ring buffer holds (its flag aside): the largest block's trained shard (rounded up to
    ``PIECE_ALIGNMENT``), so that the root's larger parts (a 128k-vocabulary embedding) go to the host in pieces
    instead of sizing every buffer (the root's, if no block trains); with whole gradients (``cpu_reduce``), the largest
    unit's whole gradient."""
    shards = [unit.trained().shard_numel for unit in units]
    if incoming_full:
        return max(shards) * ranks
    largest = max(shards[:-1] or shards) or max(shards)
    return math.ceil(largest / PIECE_ALIGNMENT) * PIECE_ALIGNMENT


def pieces(part_numel: int, capacity: int) -> int:
    """Ring buffers a gradient part of ``part_numel`` elements goes to the host in."""
    return max(1, math.ceil(part_numel / capacity))


def pieces_per_step(units: Sequence[UnitSize], capacity: int) -> int:
    """Ring buffers one backward's gradients take: every unit's parts, in pieces of ``capacity`` elements."""
    return sum(pieces(part, capacity) for unit in units for part in unit.part_sizes())


class GradientSlotsError(ValueError):
    """``gradient_slots`` below what the run needs (``update: delayed`` holds a whole step's gradients)."""


def gradient_slots(units: Sequence[UnitSize], setup: HostSetup) -> int:
    """Gradient buffers per rank: ``setup.gradient_slots`` if set (checked), else chosen:

    - with a kept fp32 gradient per unit (accumulation on the host) a piece is added to it on arrival and its buffer freed at once: ``max(2, window)``;
    - else one per piece of a backward, so that the device's backward never waits for a CPU update to free one
      (the updates may run behind the backward);
    - ``update: delayed`` holds each piece until the next step's update of it: a backward's pieces, and ``max(2,
      window)`` more for the next backward's first pieces while the first updates run. Fewer than a backward's
      pieces and one would wait forever, and are refused;
    - a speculative update, or one ordered after the norm, with no fp32 copy holds each piece until the norm is known:
      fewer than a backward's pieces would wait forever, and are refused.
    """
    if setup.incoming_full:  # whole gradients: one piece per unit that trains
        per_step = sum(1 for unit in units if unit.part_sizes())
    else:
        per_step = pieces_per_step(units, piece_capacity(units, False, setup.processes))
    # a speculative step's pieces wait for its validation, an ordered one's for their update after the norm
    held = (setup.speculate or setup.ordered) and not setup.keep_gradients
    least = per_step + 1 if setup.holds_step else per_step if held else 1
    if setup.gradient_slots is not None:
        if setup.gradient_slots < least:
            why = (f"update: delayed holds one step's {per_step} gradient pieces until the next step's updates, so it "
                   f"needs at least {least}" if setup.holds_step else
                   f"update: {'speculative' if setup.speculate else 'forward'} holds one step's {per_step} gradient "
                   f"pieces until the norm is known, so it needs at least {least}" if held else "at least 1 is needed")
            raise GradientSlotsError(f"SlideFSDP gradient_slots={setup.gradient_slots}: {why}; set gradient_slots >= "
                                     f"{least}, or null to have it chosen")
        return setup.gradient_slots
    if setup.keep_gradients:
        return max(2, setup.window)
    return per_step + (max(2, setup.window) if setup.holds_step else 0)


def host_buffers(units: Sequence[UnitSize], setup: HostSetup) -> dict[str, int]:
    """Bytes per node of each host buffer for ``units`` (blocks, then the root): the staging copy holds every
    parameter, the master, moments and gradients the trained ones."""
    ranks = setup.processes
    full = sum(unit.full_numel for unit in units)
    shard = sum(unit.shard_numel for unit in units)
    trained_full = sum(unit.trained().full_numel for unit in units)
    trained_shard = sum(unit.trained().shard_numel for unit in units)
    incoming = piece_capacity(units, setup.incoming_full, ranks) + FLAG_ELEMENTS
    master = setup.master_dtype.itemsize
    parts = {
        # counted in the staging copy when it is the master (``master_in_staging``)
        "master": 0 if master_in_staging(units, setup) else ranks * trained_shard * master,
        # exp_avg and exp_avg_sq of each rank's rows
        "adam_moments": trained_full * 2 * setup.optimizer_state_dtype.itemsize,
        "staging": (full if setup.full_staging else ranks * shard) * setup.compute_dtype.itemsize,
        "kept_gradients": ranks * trained_shard * 4 if setup.keep_gradients else 0,
        "gradient_ring": ranks * gradient_slots(units, setup) * incoming * setup.reduce_dtype.itemsize,
        "activations": ranks * setup.offloaded_activation_bytes,
        # update: speculative (every row) or split (the first-arriving units'): each rank's master rows and both
        # moments as they were before the step's update
        "speculation_backup": ranks * speculated_numel(units, setup) * (master + 2 * setup.optimizer_state_dtype.itemsize),
    }
    return parts


def speculated_numel(units: Sequence[UnitSize], setup: HostSetup) -> int:
    """One rank's trained rows whose updates are speculated: every row (``speculate``), the split's
    (``offload.host_memory.speculated_units``), or none."""
    if setup.speculate:
        return sum(unit.trained().shard_numel for unit in units)
    if setup.split_blocks is None or setup.keep_gradients:
        return 0
    return sum(stop - start for start, stop in speculated_units(units, setup.split_blocks).values())


def with_runtime(parts: dict[str, int], processes: int) -> dict[str, int]:
    """``parts`` and the per-process runtime allowance: what the node must have available."""
    return {**parts, "runtime": processes * RUNTIME_BYTES_PER_PROCESS}


def describe(parts: dict[str, int]) -> str:
    """``master 29.9, adam_moments 59.8, ...`` in GiB, largest first, zeros left out."""
    ordered = sorted(((v, k) for k, v in parts.items() if v), reverse=True)
    return ", ".join(f"{name} {value / GIB:.1f}" for value, name in ordered)


def speculated_units(units: Sequence[UnitSize], blocks: int) -> dict[int, tuple[int, int]]:
    """Each speculated unit's rows ``[start, stop)`` of its trained shard for a split of the last ``blocks`` blocks
    (units: blocks, then the root; the root's parts after its ``leading_parts``, which are laid out last)."""
    trained = [unit.trained() for unit in units]
    root = len(units) - 1
    rows: dict[int, tuple[int, int]] = {}
    parts = trained[root].part_sizes()
    if len(parts) > trained[root].leading_parts:  # the root's trailing parts (one part: the whole root arrives last)
        start = sum(parts[: trained[root].leading_parts])
        rows[root] = (start, sum(parts))
    for block in range(max(0, root - blocks), root):
        if trained[block].shard_numel:
            rows[block] = (0, trained[block].shard_numel)
    return rows
