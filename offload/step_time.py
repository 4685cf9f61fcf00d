"""SlideFSDP's step time as the overlap is built: forward, backward, host-device copies and the CPU update.

``estimate`` gives each resource's time from the hardware file's rates (compute at ``peak_tflops`` x
``compute_efficiency``, copies at ``pcie_gbps``, the update at ``host_memory_gbps``); this module puts them in the
order SlideFSDP runs them:

- **forward** and **backward** (recompute included) on the device, each as long as its compute or the weights it
  streams in, whichever is longer (the window prefetches the next blocks while one computes);
- **updates during the backward** (``overlapped``): a unit's update starts when its gradient reaches the host, the first
  about one block's backward into the backward; with enough gradient slots the backward never waits, and the step
  ends when the last update ends: the units whose gradients come last (the first block, the embeddings) follow the
  backward (``tail_share`` of the update);
- **updates after the backward** (``after``: clipping or ``skip_step`` with a kept fp32 gradient): the norm needs every
  gradient first;
- **forward** (``update: forward`` or ``split``, ``ForwardOrder``): after the norm the units are updated in forward order
  (the root, then block 0 up) while the next forward runs; a block's compute waits for its own unit's update (the
  prefetch of a later block whose update is still running is issued once it is done, not waited for). The split's
  speculated units (the root's trailing parts and the last blocks) are updated during the backward, each with a
  backup pass first; on a step whose clipping fires (``clip_rate`` of the steps) each is undone from its backup and
  redone in its turn in the ordered chain;
- **delayed** (``update: delayed``): a step's updates run during the next step's forward and backward; the step is the
  longer of the two, plus the staging rows of the last units to arrive, rewritten at the end of the backward.

With gradient accumulation only the last micro-batch's backward overlaps the update.

A mixture of experts is timed by what each resource does: the device computes the active parameters' FLOPs
(``lit_fsdp.flops``: the k of E experts a token uses), while every expert's weights stream in and every parameter's
update runs on the host, reached by a token or not (docs/offload.md#mixtures-of-experts): its copies and update are a
model of all its parameters', its compute one of its active ones'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offload.host_memory import UnitSize, speculated_units


#: The share of steps whose clipping fires, where a run has not measured its own (``estimate``, ``tune``, and ``auto``
#: until its first steps are measured): twice the 5.6% of the WikiText-2 run's 500 steps with clipping at 1.0
#: (docs/benchmarks.md): early pretraining clips more often than its average.
PRIOR_CLIP_RATE = 0.1


@dataclass(frozen=True)
class ForwardOrder:
    """The ordered update's parts in seconds: the root's update that the forward's first load waits for (its parts not
    speculated), each block's update (forward order), the blocks speculated (the last ones), their update with its
    backup pass and the root's speculated parts', and the device window; for the rollback, the root's speculated
    parts' update alone, a backup (or undo) pass against an update (``backup_share``) and the share of steps whose
    clipping fires (``clip_rate``)."""

    root_s: float
    block_s: tuple[float, ...]
    speculated_blocks: int
    speculated_s: float
    window: int
    root_speculated_s: float = 0.0
    backup_share: float = 0.0
    clip_rate: float = 0.0

    def forward_wait_s(self, forward_s: float, backward_s: float) -> float:
        """How much longer the next forward (``forward_s`` of compute, even over the blocks) takes for waiting on the
        updates, the speculated ones having run during a backward of ``backward_s``: on average over the steps, a
        ``clip_rate`` share of them redoing the speculated units in the ordered chain."""
        steady = self._wait(forward_s, backward_s, clipped=False)
        if not self.clip_rate or not (self.speculated_blocks or self.root_speculated_s):
            return steady
        return (1 - self.clip_rate) * steady + self.clip_rate * self._wait(forward_s, backward_s, clipped=True)

    def _wait(self, forward_s: float, backward_s: float, clipped: bool) -> float:
        blocks = len(self.block_s)
        first_arrival = backward_s / max(1, blocks)
        worker = max(0.0, first_arrival + self.speculated_s - backward_s)  # from the backward's end
        redo = 1 + self.backup_share  # the undo copies the backup back, the redo updates again
        clock = worker + self.root_s + (self.root_speculated_s * redo if clipped else 0.0)
        root_done, done = clock, []
        ordered = blocks - self.speculated_blocks
        for block in range(blocks):
            if block < ordered or clipped:
                clock += self.block_s[block] * (redo if block >= ordered else 1.0)
                done.append(clock)
            else:
                done.append(0.0)  # speculated during the backward, standing
        per_block = forward_s / max(1, blocks)
        end = root_done  # the root's load waits for its update
        for block in range(blocks):
            end = max(end, done[block]) + per_block
        return max(0.0, end - forward_s)


@dataclass(frozen=True)
class SlideStepTime:
    """One optimizer step's parts and its time, in seconds (``schedule``: overlapped, after or delayed)."""

    schedule: str
    forward_s: float
    backward_s: float
    update_s: float
    exposed_update_s: float  # of the update, what the device's compute does not hide
    step_s: float
    speculated_blocks: int | None = None  # ``split``: the blocks speculated (None: not a split)


def slide_step_time(forward_compute_s: float, backward_compute_s: float, h2d_s: float, d2h_s: float, update_s: float,
                    tail_share: float, refresh_tail_s: float, blocks: int, micro_batches: int, schedule: str,
                    order: ForwardOrder | None = None) -> SlideStepTime:
    """The step's time for compute and copy times per optimizer step (summed over its ``micro_batches``), the CPU
    update's, the share of the update whose gradients arrive last (``tail_share``), and the delayed update's staging
    rewrite at the end of the backward (``refresh_tail_s``). Half the weights stream in for the forward, half for the
    backward; gradients stream out during the backward. ``forward`` takes the ordered update's parts (``order``);
    only the first micro-batch's forward hides it."""
    if schedule not in ("overlapped", "after", "delayed", "forward"):
        raise ValueError(f"schedule {schedule!r}: overlapped, after, forward or delayed")
    if (schedule == "forward") != (order is not None):
        raise ValueError("the forward schedule, and it alone, takes the ordered update's parts (order)")
    forward = max(forward_compute_s, h2d_s / 2)
    backward = max(backward_compute_s, h2d_s / 2, d2h_s)
    last_backward = backward / micro_batches
    device = forward + backward
    if schedule == "after":
        step = device + update_s
    elif schedule == "delayed":
        step = max(device + refresh_tail_s, update_s)
    elif schedule == "forward":
        step = device + order.forward_wait_s(forward / micro_batches, last_backward)
    else:
        first_arrival = last_backward / max(1, blocks)
        step = device - last_backward + max(last_backward + tail_share * update_s, first_arrival + update_s)
    return SlideStepTime(schedule, forward, backward, update_s, step - device, step,
                         order.speculated_blocks if order is not None else None)


def adamw_state_bytes(optimizer_state_dtype: torch.dtype, master_dtype: torch.dtype = torch.float32) -> int:
    """Host bytes SlideFSDP's AdamW moves per parameter besides the gradient reads and the staging write: the master
    weight (in ``master_dtype``) and the two moments (in ``optimizer_state_dtype``) read and written."""
    return master_dtype.itemsize * 2 + optimizer_state_dtype.itemsize * 2 * 2


def cpu_update_bytes(trainer: Any, parameters: int, compute: torch.dtype, reduce_dtype: torch.dtype,
                     units: list[UnitSize] = ()) -> int:
    """Host bytes SlideFSDP's CPU updates of ``parameters`` trained parameters read and write per node per optimizer
    step, as implemented today (a frozen one, LoRA's base, is never updated).

    Per trained parameter, in one pass per chunk (``offload.cpu_adam``): AdamW's master weight and moments read and
    written
    (``adamw_state_bytes``), the staging copy written from the chunk in cache (the compute dtype), and the gradient,
    read by AdamW in the dtype it arrives in, or accumulated into the kept fp32 buffer each micro-batch it reaches the
    host in when gradients are kept (one a step where the device sums them); no staging write where the master is the staging copy (``units``: the model's, to tell; by
    default assumed to train every parameter). A delayed update cannot write the staging copy while the next step may load it: the unit's
    rows are rewritten from the master (read again) once it is loaded for the last time. The non-finite check is the device's with ``gpu_reduce``; with ``cpu_reduce`` the host
    reads the gradient once more for it.
    """
    strategy = trainer.strategy
    plan = strategy.plan(trainer, compute)
    schedule, master = plan.schedule, plan.master_dtype
    reduce = reduce_dtype.itemsize
    state = adamw_state_bytes(plan.optimizer_state_dtype, master)
    per = state + (0 if plan.master_in_staging(units) else compute.itemsize)
    if schedule.keep_gradients:
        per += plan.host_accumulation * (reduce + 8) + 4
    else:
        per += reduce
    if schedule.delay:  # the staging row rewritten from the master after the unit's last load of the step
        per += master.itemsize
    if schedule.speculate:  # the rows backed up before the update (read, then written), the gradient read for its norm
        per += state + (4 if schedule.keep_gradients else reduce)
    elif schedule.ordered and not schedule.keep_gradients:  # the held gradient read once more, for its norm on arrival
        per += reduce
    if schedule.check_units_finite and strategy.grad_sync == "cpu_reduce":
        per += 4 if schedule.keep_gradients else reduce
    return parameters * per


def backup_share(trainer: Any, compute: torch.dtype, reduce_dtype: torch.dtype, units: list[UnitSize]) -> float:
    """A speculated row's backup pass (its master and moments read and written once more) against its update's bytes
    (``cpu_update_bytes``); its undo before a redo moves as much."""
    plan = trainer.strategy.plan(trainer, compute)
    return (adamw_state_bytes(plan.optimizer_state_dtype, plan.master_dtype)
            / cpu_update_bytes(trainer, 1, compute, reduce_dtype, units))


def forward_order(plan: Any, units: list[UnitSize], update_s: float, window: int, backup_share: float,
                  clip_rate: float = 0.0) -> ForwardOrder:
    """The ordered update's parts (``offload.step_time.ForwardOrder``) for ``plan``'s split: each unit's share of the
    node's ``update_s`` by its trained rows; a speculated row's update also reads and writes its master and moments
    once more for the backup (``backup_share`` of its update's bytes), and, on the ``clip_rate`` share of steps whose
    clipping fires, again to undo it before its redo."""
    trained = [unit.trained() for unit in units]
    total = sum(unit.shard_numel for unit in trained) or 1
    seconds = [update_s * unit.shard_numel / total for unit in trained]
    speculated = speculated_units(units, plan.split_blocks) if plan.split_blocks is not None else {}
    backup = 1 + backup_share
    root = len(units) - 1
    rows = speculated.get(root, (0, 0))
    root_speculated = (rows[1] - rows[0]) / max(1, trained[root].shard_numel)
    speculated_s = seconds[root] * root_speculated * backup + sum(
        seconds[block] * backup for block in speculated if block != root)
    return ForwardOrder(seconds[root] * (1 - root_speculated), tuple(seconds[:root]), plan.split_blocks or 0,
                        speculated_s, window, seconds[root] * root_speculated, backup_share, clip_rate)
