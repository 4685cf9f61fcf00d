"""``offload.SlideFSDPStrategy``'s split and ``update: auto`` at run time: the split placement takes (the ceiling, for
``auto``), the rates of each step given to the step model (``offload.auto_update``), and its choice applied on every
rank between steps."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info

from offload.auto_update import FIRST_DECISION, AutoUpdate, StepRates, name
from offload.host_memory import UnitSize, speculated_units
from offload.plan import SlidePlan
from offload.preflight import host_memory_budget
from offload.step_time import backup_share


class SlideUpdateChoice:
    """``SlideFSDPStrategy``'s choice of update at run time (a mixin: the strategy holds ``update``,
    ``speculated_blocks``, ``on_nonfinite``, ``engine``, ``adam``, ``taken_plan``, ``auto``, ``pending_split``,
    ``model_sizes``, ``update_taken``, ``update_reason``, ``speculated_share``, ``host_memory_gb``,
    ``host_reserve_gb`` and ``split_plan``)."""

    def placed_split(self, module: pl.LightningModule, sizes: list[UnitSize]) -> SlidePlan:
        """This run's plan with its split taken when the model is placed, as the preflight takes it
        (``split_plan``: the activations on the host counted, the reserve kept), within the host's budget now
        (``host_memory_gb``, else MemAvailable now, which lacks nothing placed yet: the buffers are allocated after),
        the node's smallest on every rank: the same split everywhere."""
        trainer = module.trainer
        available = host_memory_budget(self.host_memory_gb, self.host_reserve_gb)[0]
        if self.world_size > 1:
            figure = torch.tensor([available if available is not None else -1], dtype=torch.int64)
            dist.all_reduce(figure, op=dist.ReduceOp.MIN, group=self.cpu_mesh["shard"].get_group())
            available = None if int(figure) < 0 else int(figure)
        return self.split_plan(trainer, module, getattr(trainer, "datamodule", None), sizes, host_bytes=available)

    def start_auto(self, trainer: Any, plan: SlidePlan, sizes: list[UnitSize]) -> SlidePlan:
        """With ``update: auto`` and a split, the plan the run starts with: ``forward`` (nothing speculated, no
        backup) until its first steps are measured, the split placement took kept as the ceiling; else ``plan``."""
        self.model_sizes, self.auto = sizes, None
        if self.update != "auto" or not plan.schedule.split or self.speculated_blocks is not None:
            return plan
        self.auto = AutoUpdate(plan, sizes, backup_share(trainer, plan.compute_dtype, plan.reduce_dtype, sizes),
                               plan.run.clipping or self.on_nonfinite != "warn")
        return replace(plan, split_blocks=None)

    def describe_auto(self) -> str:
        """What ``update: auto`` will do, for the placement's log line ("" without it)."""
        if self.auto is None:
            return ""
        ceiling = self.auto.allocated
        room = "" if ceiling is None else f" (the host has room for the head side and {ceiling} blocks)"
        return f" until step {FIRST_DECISION}, then the step model's choice with this run's rates{room}"

    def note_speculated(self, rows: dict[int, tuple[int, int]]) -> None:
        """``speculated_share``: of this rank's trained rows, those ``rows`` speculate."""
        self.speculated_share = sum(stop - start for start, stop in rows.values()) / max(
            1, sum(unit.trained().shard_numel for unit in self.model_sizes))

    def choose_update(self, rates: StepRates) -> None:
        """``update: auto`` at run time: record this step's rates; where a choice is due, take global rank 0's,
        applied before the next backward (``take_update``)."""
        if self.auto is None or not self.auto.observe(rates):
            return
        blocks = self.auto.decide()
        if self.world_size > 1:  # a host tensor: gloo, beside NCCL on GPUs
            chosen = torch.tensor([-1 if blocks is None else blocks], dtype=torch.int64)
            dist.broadcast(chosen, src=0)
            blocks = None if int(chosen) < 0 else int(chosen)
        self.pending_split = (blocks, self.auto.reason)

    def take_update(self) -> None:
        """Apply a pending choice of ``update: auto``, once no update of the step before is outstanding."""
        if self.pending_split is None:
            return
        assert self.engine is not None and self.adam is not None and self.auto is not None
        (blocks, reason), self.pending_split = self.pending_split, None
        plan = replace(self.auto.plan, split_blocks=blocks)
        changed = plan != self.taken_plan
        self.adam.wait()
        rows = speculated_units(self.model_sizes, blocks) if blocks is not None else {}
        self.engine.gradients.speculate(rows)
        self.taken_plan, self.update_reason = plan, reason
        self.note_speculated(rows)
        self.update_taken = plan.describe_update(self.model_sizes)
        if changed or len(self.auto.steps) == FIRST_DECISION:
            rank_zero_info(f"SlideFSDP update: auto took {name(blocks)} at step {len(self.auto.steps)}: {reason}")
