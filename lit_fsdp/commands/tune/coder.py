"""The Coder: candidates that address the Judge's findings, as moves of one knob from the best trial so far.

For each finding the moves that relieve it, most promising first; the proposals take the findings in
turns (each finding's first move, in the Judge's order, then each one's second, ...):

- ``communication``: prefetch more units, larger units, keep parameters gathered (SHARD_GRAD_OP,
  NO_SHARD), hybrid sharding across nodes, a bigger micro-batch (fewer all-gathers per sample), a
  gradient compressor the user allowed; under SlideFSDP the other transfer and reduction paths;
- ``memory_pressure``: a smaller micro-batch, checkpoint every block, FULL_SHARD, fewer units in
  flight, torch's CPU offload, and SlideFSDP (blocks streamed from the host) for a model that fits
  nowhere else;
- ``memory_headroom``: a bigger micro-batch, less checkpointing, less sharding (the model is small
  next to the memory), FSDP2 instead of offload, SlideFSDP's activation plan (``auto``: what fits stays on the
  device or goes to the host instead of being recomputed), a wider SlideFSDP window;
- ``host_overhead``: a bigger micro-batch, larger units, compiled blocks (GPUs);
- ``compute``: bfloat16 and compiled blocks on GPUs, less recompute (SlideFSDP: its activation plan), a bigger
  micro-batch;
- ``cpu_update`` (SlideFSDP's CPU AdamW update gates the device): ``update: auto`` (the exact schedule that hides
  most: the update after the norm behind the next forward, the first-arriving units speculated), or, from ``auto`` and
  where the space allows it, ``update: delayed`` (the update of a step runs during the whole next step's forward and
  backward; accumulating on the host it cannot accumulate, so there a micro-batch under the batch per process becomes
  the whole batch in the same move), then a bigger micro-batch
  (more tokens per step amortise the update, whose time does not grow with them), then a wider window, the other
  transfer and reduction paths, no activation offload;
- ``numerics``: back to exact gradients and float32;
- ``failure``: back from compilation, offload and the delayed update.

A move that would make a delayed update accumulate on the host (a smaller micro-batch) turns the delayed update
off. Moves
with a value the search space does not allow are dropped; the Controller drops repeats and what cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lit_fsdp.commands.tune.judge import Finding
from lit_fsdp.commands.tune.space import Candidate, RunShape

Move = dict[str, Any]


@dataclass(frozen=True)
class Proposal:
    """A candidate and why it was proposed."""

    candidate: Candidate
    reason: str


class Coder:
    """Turns findings on the best trial into the next candidates."""

    def __init__(self, allowed: dict[str, list], run: RunShape):
        self.allowed, self.run = allowed, run

    # --- moves along one knob --------------------------------------------------------------------

    def _next(self, name: str, current: Any, up: bool) -> Move:
        """The allowed value of ``name`` just above (or below) ``current``; nothing at the end of the range."""
        values = sorted(v for v in self.allowed[name] if (v > current if up else v < current))
        return {} if not values else {name: values[0] if up else values[-1]}

    def _set(self, name: str, value: Any, current: Any) -> Move:
        return {name: value} if value != current else {}

    def _fsdp2(self, base: Candidate, move: Move) -> Move:
        return move if base.strategy == "fsdp2" else {}

    def _slide(self, base: Candidate, move: Move) -> Move:
        return move if base.strategy == "slide_fsdp" else {}

    def _other(self, name: str, current: Any) -> Move:
        return next(({name: v} for v in self.allowed[name] if v != current), {})

    def _less_checkpointing(self, base: Candidate) -> Move:
        if base.strategy == "slide_fsdp" and base.activation_plan == "auto":  # the plan decides, not the count
            return {}
        every = base.activation_checkpointing
        return self._set("activation_checkpointing", 0, every) if every else {}

    # --- moves per finding -----------------------------------------------------------------------

    def communication(self, base: Candidate) -> list[Move]:
        hybrid = {"sharding": "HYBRID_SHARD", "replicate_size": self.run.nodes} if self.run.nodes > 1 else {}
        compressors = [{"compression": m} for m in self.allowed["compression"] if m != "none" and base.compression == "none"]
        return [
            self._fsdp2(base, self._next("prefetch", base.prefetch, up=True)),
            self._fsdp2(base, self._next("blocks_per_group", base.blocks_per_group, up=True)),
            self._fsdp2(base, self._set("sharding", "SHARD_GRAD_OP", base.sharding)),
            self._fsdp2(base, self._set("sharding", "NO_SHARD", base.sharding)),
            self._fsdp2(base, hybrid),
            self._next("micro_batch", base.micro_batch, up=True),
            *(self._fsdp2(base, move) for move in compressors),
            self._slide(base, self._other("param_transfer", base.param_transfer)),
            self._slide(base, self._other("grad_sync", base.grad_sync)),
        ]

    def memory_pressure(self, base: Candidate) -> list[Move]:
        offload = {"strategy": "slide_fsdp", "activation_checkpointing": 1, "window": min(self.allowed["window"]),
                   "activation_offload": "cpu" if "cpu" in self.allowed["activation_offload"] else "none"}
        return [
            self._next("micro_batch", base.micro_batch, up=False),
            self._set("activation_checkpointing", 1, base.activation_checkpointing),
            self._fsdp2(base, self._set("sharding", "FULL_SHARD", base.sharding)),
            self._fsdp2(base, self._next("prefetch", base.prefetch, up=False)),
            self._fsdp2(base, self._next("blocks_per_group", base.blocks_per_group, up=False)),
            self._fsdp2(base, self._set("cpu_offload", True, base.cpu_offload)),
            offload if base.strategy == "fsdp2" else {},
            self._slide(base, self._next("window", base.window, up=False)),
            self._slide(base, self._set("activation_offload", "cpu", base.activation_offload)),
        ]

    def memory_headroom(self, base: Candidate) -> list[Move]:
        return [
            self._next("micro_batch", base.micro_batch, up=True),
            self._less_checkpointing(base),
            self._fsdp2(base, self._set("sharding", "SHARD_GRAD_OP", base.sharding)),
            self._fsdp2(base, self._set("sharding", "NO_SHARD", base.sharding)),
            self._fsdp2(base, self._set("cpu_offload", False, base.cpu_offload)),
            self._slide(base, {"strategy": "fsdp2"}),
            self._slide(base, self._set("activation_plan", "auto", base.activation_plan)),
            self._slide(base, self._next("window", base.window, up=True)),
            self._slide(base, self._set("activation_offload", "none", base.activation_offload)),
        ]

    def host_overhead(self, base: Candidate) -> list[Move]:
        return [
            self._next("micro_batch", base.micro_batch, up=True),
            self._fsdp2(base, self._next("blocks_per_group", base.blocks_per_group, up=True)),
            self._set("compile_blocks", True, base.compile_blocks) if self.run.accelerator == "cuda" else {},
        ]

    def compute(self, base: Candidate) -> list[Move]:
        on_gpu = self.run.accelerator == "cuda"
        return [
            self._set("param_dtype", "bfloat16", base.param_dtype) if on_gpu and base.param_dtype == "float32" else {},
            self._set("compile_blocks", True, base.compile_blocks) if on_gpu else {},
            self._less_checkpointing(base),
            self._slide(base, self._set("activation_plan", "auto", base.activation_plan)),
            self._next("micro_batch", base.micro_batch, up=True),
        ]

    def cpu_update(self, base: Candidate) -> list[Move]:
        whole = self.run.batch_per_process
        whole_batch = base.micro_batch < whole and self.run.accumulate_on == "host"
        delayed = {"update": "delayed", **({"micro_batch": whole} if whole_batch else {})}
        schedule = self._set("update", "auto", base.update) if base.update not in ("auto", "delayed") else (
            delayed if base.update == "auto" and "delayed" in self.allowed["update"] else {})
        return [
            self._slide(base, schedule),
            self._next("micro_batch", base.micro_batch, up=True),
            self._next("window", base.window, up=True),
            self._other("param_transfer", base.param_transfer),
            self._other("grad_sync", base.grad_sync),
            self._set("activation_offload", "none", base.activation_offload),
        ]

    def numerics(self, base: Candidate) -> list[Move]:
        return [self._set("compression", "none", base.compression), self._set("param_dtype", "float32", base.param_dtype)]

    def failure(self, base: Candidate) -> list[Move]:
        return [self._set("compile_blocks", False, base.compile_blocks), self._set("cpu_offload", False, base.cpu_offload),
                self._slide(base, self._set("update", "auto", base.update)),
                self._slide(base, {"strategy": "fsdp2"})]

    def _runnable(self, base: Candidate, move: Move) -> Move:
        """``move``, with the delayed update turned off where the move would make it accumulate on the host (it cannot)."""
        moved = base.with_knobs(move)
        if (moved.strategy == "slide_fsdp" and moved.update == "delayed" and moved.micro_batch < self.run.batch_per_process
                and self.run.accumulate_on == "host"):
            return {**move, "update": "auto"}
        return move

    # --- proposals -------------------------------------------------------------------------------

    def propose(self, findings: list[Finding], base: Candidate) -> list[Proposal]:
        """Candidates one move from ``base``: the findings' first moves (most pressing first), then their second, ..."""
        moves: dict[str, Callable[[Candidate], list[Move]]] = {
            "communication": self.communication, "memory_pressure": self.memory_pressure,
            "memory_headroom": self.memory_headroom, "host_overhead": self.host_overhead, "compute": self.compute,
            "cpu_update": self.cpu_update, "numerics": self.numerics, "failure": self.failure,
        }
        runnable = [[self._runnable(base, move) for move in moves[finding.kind](base) if move] for finding in findings]
        per_finding = [[(finding, move) for move in finding_moves
                        if all(value in self.allowed[name] for name, value in move.items())]
                       for finding, finding_moves in zip(findings, runnable)]
        proposals: dict[str, Proposal] = {}
        # In turns: each finding's best move before any finding's second, so that one finding's list does not
        # use up the trials (a new best re-plans anyway).
        for turn in range(max(map(len, per_finding), default=0)):
            for finding, move in (moves_of[turn] for moves_of in per_finding if turn < len(moves_of)):
                candidate = base.with_knobs(move)
                change = ", ".join(f"{name} {getattr(base, name)} -> {value}" for name, value in move.items())
                proposals.setdefault(candidate.key(), Proposal(candidate, f"rules: {finding.kind}: {change}"))
        return [p for p in proposals.values() if p.candidate.key() != base.key()]
