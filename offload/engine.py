"""SlideFSDP's step: hooks that stream blocks through the device window and send each unit's gradients to the CPU update.

- **forward**: the network's pre-hook makes the root resident and prefetches the first blocks; block
  i's pre-hook makes it resident and prefetches i+1..i+window-1; its post-hook releases it, except
  the last window-1 blocks of a training forward, which the backward needs first. Behind an ordered update, only
  making a block resident waits for its unit's update: a prefetched unit whose update is still running keeps its slot
  and is loaded once the update is done (``DeviceWindow.load_deferred``: at the post-hook of a block, or when needed).
- **backward**: just before block i's backward (``BeforeBackward``, or the checkpointed block's own
  backward) block i is made resident and i-1..i-window+1 prefetched, with their checkpointed inputs.
  When the last gradient of a unit's parameters has accumulated, the unit's gradients are reduced
  and copied to the host, its slot is released, and its CPU update starts on the worker thread while
  the device goes on with the units before it. The root's parameters go one by one (``gradient_parts``): the
  head's update starts with the backward, the embeddings' at its end. Only trained parameters have gradients: a
  block with frozen ones (LoRA's base) still uses them after its adapters' last gradient (its input's gradient needs
  them), so it is released once the backward has reached the block below (``before_backward``) or ended.
- **optimizer step**: wait for the outstanding updates, then account for the step (``OffloadStep``). Where clipping
  or ``on_nonfinite: stop``/``skip_step`` needs the global norm first (``offload.schedule``), the updates wait for it:
  after the norm they are queued one per unit in forward order (``update: forward``, ``split``: not waited for, the
  next forward's load of each unit waits for its own update through ``DeviceWindow.before_load``; ``synchronous``:
  waited for here), a split's first-arriving units having been speculated during the backward; or they are delayed by
  one step (``delayed``, ZeRO-Offload's DPU: queued with the norm known, run during the next step's forward and
  backward, which computes with weights one update old; ``offload.gradients``); or speculative
  (``offload.speculation``): the updates ran during the backward and the norm validates them, undoing them if
  clipping or the guard fires. The CPU update's hidden part is measured against the device's backward
  (``offload.transfers.BackwardClock``), and, delayed or ordered, against the forward and backward that the host ran
  before it waited for the updates, less its waits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from compress.layout import UnitLayout
from offload.activation_plan import ActivationPlan
from offload.checkpointing import ActivationStore, BeforeBackward, CheckpointedBlock
from offload.cpu_adam import CpuAdam
from offload.gradients import GradientPipeline
from offload.residency import DeviceWindow
from offload.saved_on_host import HostSavedBlock, SavedOnHost
from offload.schedule import UpdateSchedule
from offload.transfers import Transfers

IDLE, FORWARD, BACKWARD = "idle", "forward", "backward"


@dataclass
class OffloadStep:
    """What one optimizer step moved and spent (host-device bytes and seconds, CPU update time and its hidden part),
    summed over the step's backwards (one per micro-batch)."""

    h2d_bytes: int
    h2d_s: float
    d2h_bytes: int
    d2h_s: float
    cpu_update_s: float
    cpu_update_hidden_s: float  # the part that ran while the device computed the backward (``hidden_update_s``)
    host_backward_s: float  # from ``loss.backward()`` to its return on the host, its waits for gradient buffers included
    device_backward_s: float  # the device's compute: its span on the compute stream less its idle gaps at those waits
    device_idle_s: float = 0.0  # the device's idle gaps inside the backward, waiting for a gradient buffer
    update_wait_s: float = 0.0  # the host's wait at the optimizer step for CPU updates still running
    rolled_back: bool = False  # a speculative step undone at its validation (clipping or the guard fired)
    rollback_s: float = 0.0  # the undo and the redo of its updates
    forward_wait_s: float = 0.0  # the step's loads' waits for the last step's ordered updates (``update: forward``)


def overlap(interval: tuple[float, float], window: tuple[float, float]) -> float:
    return max(0.0, min(interval[1], window[1]) - max(interval[0], window[0]))


def hidden_update_s(updates: list[tuple[float, float]], backward: tuple[float, float],
                    idle: tuple[tuple[float, float], ...]) -> float:
    """Seconds of the CPU ``updates`` that ran while the device computed the ``backward``: each update's
    overlap with the backward, less its overlap with the device's ``idle`` gaps in it (disjoint, inside the backward),
    all on the host clock. A CPU-bound step, whose device idles while the host waits for the update that frees a
    gradient buffer, hides at most the device's compute, not the host's whole backward."""
    return sum(overlap(update, backward) - sum(overlap(update, gap) for gap in idle) for update in updates)


class SlideEngine:
    """The hooks and the per-step state of SlideFSDP over one network (see the module docstring)."""

    def __init__(
        self,
        network: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        layouts: list[UnitLayout],
        window: DeviceWindow,
        gradients: GradientPipeline,
        transfers: Transfers,
        plan: ActivationPlan,
        offload_activations: bool,
        pin: bool,
        schedule: UpdateSchedule,
    ):
        """
        Args:
            blocks: The network's blocks in forward order; ``layouts`` has one layout per block, then the root (every
                parameter; ``gradients.layouts`` are the trained ones).
            plan: Each block's activations kept, saved on the host or recomputed (``offload.activation_plan``);
                ``offload_activations``: a recomputed block's input on the host.
            schedule: When the CPU updates run (``offload.schedule``): deferred to the end of the backward (clipping,
                skip_step) or delayed to the next step, else started as each unit's gradients arrive.
        """
        self.network = network
        self.layouts = layouts
        self.root = len(layouts) - 1
        # blocks with frozen parameters, which their backward uses after the last gradient (``_backward_done``)
        self.partly_frozen = {unit for unit, (layout, trained) in enumerate(zip(layouts[:-1], gradients.layouts))
                              if len(trained.places) < len(layout.places)}
        self.finished: set[int] = set()  # such blocks whose backward is done (the one below began, or it ended)
        self.num_blocks = len(blocks)
        self.window, self.gradients, self.transfers = window, gradients, transfers
        self.activations = ActivationStore(self, offload_activations, gradients.host, pin)
        self.saved = SavedOnHost(transfers, gradients.host, pin, [slot.buffer for slot in window.slots])
        self.phase = IDLE
        self.accumulating = False  # inside Lightning's block_backward_sync: no update at this backward
        self.schedule = schedule
        if schedule.behind_forward:
            window.before_load, window.update_pending = gradients.await_update, gradients.update_pending
        self.arrived: list[list[int]] = []  # gradients accumulated per unit and gradient part in the current backward
        self.sent = [0] * len(layouts)  # gradient parts sent per unit in the current backward
        self.last_step: OffloadStep | None = None  # the figures of the last optimizer step
        self.step_began: float | None = None  # perf_counter when the last optimizer step returned (delayed updates)
        self._handles: list[RemovableHandle] = []
        self.keep_after_forward = max(0, len(window.slots) - 1)
        self.checkpointed = self._wrap_and_hook(blocks, plan)

    # --- installation ------------------------------------------------------------------------------

    def _wrap_and_hook(self, blocks: list[tuple[str, nn.Module]], plan: ActivationPlan) -> set[int]:
        for index, (name, block) in enumerate(blocks):
            mode = plan.modes[index]
            if mode != "keep":
                parent_name, _, child = name.rpartition(".")
                wrapped = CheckpointedBlock(block, self, index) if mode == "recompute" else HostSavedBlock(
                    block, self.saved, index)
                setattr(self.network.get_submodule(parent_name), child, wrapped)
            self._handles.append(block.register_forward_pre_hook(lambda _m, _a, i=index: self.before_forward(i)))
            self._handles.append(block.register_forward_hook(lambda _m, _a, out, i=index: self.after_forward(i, out)))
        for unit, parts in enumerate(self.gradients.parts):
            for part, members in enumerate(parts):
                for index in members.places:
                    place = self.gradients.layouts[unit].places[index]
                    self._handles.append(place.param.register_post_accumulate_grad_hook(
                        lambda _p, u=unit, k=part: self.on_gradient(u, k)))
        self._handles.append(self.network.register_forward_pre_hook(lambda _m, _a: self.before_network()))
        return set(plan.blocks("recompute"))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # --- forward ---------------------------------------------------------------------------------

    def before_network(self) -> None:
        self.window.ensure_root()
        if self.phase != BACKWARD:
            for block in range(min(self.num_blocks, len(self.window.slots))):
                self.window.prefetch(block)

    def before_forward(self, block: int) -> None:
        self.window.ensure(block)
        if self.phase == BACKWARD:  # recomputation of a checkpointed block
            return
        for ahead in range(block + 1, min(self.num_blocks, block + len(self.window.slots))):
            self.window.prefetch(ahead)

    def after_forward(self, block: int, output: Any) -> Any:
        if self.phase == BACKWARD:
            return output
        self.window.load_deferred()  # the prefetches whose updates have finished since, behind this block's work
        training = self.phase == FORWARD
        if training and block not in self.checkpointed:
            self.window.remember_slot(block)
        if not (training and block >= self.num_blocks - self.keep_after_forward):
            self.window.release(block)
        if training and block not in self.checkpointed and isinstance(output, torch.Tensor) and output.requires_grad:
            return BeforeBackward.apply(output, self, block)
        return output

    # --- backward --------------------------------------------------------------------------------

    def begin_backward(self) -> None:
        self.phase = BACKWARD
        self.arrived = [[0] * len(parts) for parts in self.gradients.parts]
        self.sent = [0] * len(self.layouts)
        self.finished = set()
        self.transfers.clock.begin()
        self.saved.prefetch(self.num_blocks - 1)  # a last block on the host: nothing before it fetches its tensors

    def before_backward(self, block: int) -> None:
        self._backward_done(block + 1)  # its backward made this block's output gradient: its weights are free
        self.saved.done(block + 1)
        self.window.ensure(block)
        self.window.check_same_slot(block)
        for behind in range(block - 1, max(-1, block - len(self.window.slots)), -1):
            self.window.prefetch(behind)
        self.activations.prefetch(block - 1)
        self.saved.prefetch(block - 1)

    def on_gradient(self, unit: int, part: int) -> None:
        self.arrived[unit][part] += 1
        if self.arrived[unit][part] == len(self.gradients.parts[unit][part].places):
            self._part_done(unit, part)

    def _part_done(self, unit: int, part: int) -> None:
        places = [self.gradients.layouts[unit].places[index] for index in self.gradients.parts[unit][part].places]
        grads = [place.param.grad for place in places]
        for place in places:
            place.param.grad = None
        update_now = not (self.accumulating or self.schedule.defer)
        self.gradients.reduce_and_offload(unit, part, grads, update_now, last=not self.accumulating)
        self.sent[unit] += 1
        if self.sent[unit] < len(self.gradients.parts[unit]):
            return
        if unit == self.root:
            self.window.root_used()
        elif unit not in self.partly_frozen or unit in self.finished:
            self.window.release(unit)

    def _backward_done(self, block: int) -> None:
        """Block ``block``'s backward is over: a block with frozen weights is released once its gradients are sent
        too (others were released with their last gradient)."""
        if block not in self.partly_frozen:
            return
        self.finished.add(block)
        if self.sent[block] == len(self.gradients.parts[block]):
            self.window.release(block)

    def end_backward(self) -> None:
        """After ``loss.backward()``: units with some gradients missing (unused parameters) are sent as they are."""
        for unit, counts in enumerate(self.arrived):
            if any(counts):
                for part, members in enumerate(self.gradients.parts[unit]):
                    if counts[part] < len(members.places):
                        self._part_done(unit, part)
        for block in list(self.window.resident):
            self.window.release(block)
        if not self.gradients.parts[self.root]:  # a frozen root (LoRA): its last use is queued now
            self.window.root_used()
        self.activations.clear()
        self.saved.clear()
        self.phase = IDLE
        self.transfers.clock.end()

    # --- optimizer step ----------------------------------------------------------------------------

    def finish_step(self, adam: CpuAdam, warming_up: bool = False) -> OffloadStep:
        """Wait for every CPU update of this step that ran on arrival; queue the ones that waited for the norm (in
        forward order, waited for only by ``synchronous``), or, delayed, this step's for the next (``warming_up``:
        applied before the next step); and account for it."""
        self.gradients.send_leftover_sums()  # none left where the norm or the guard took the step's gradients first
        waited = min([time.perf_counter(), *(start for start, _ in adam.wait_intervals)])  # the host's step ended
        adam.wait()  # the gradients of this step have all arrived (and were applied, without clipping or delay)
        if self.schedule.ordered:  # queued in forward order, now that the norm is known
            self.gradients.start_ordered()
            if not self.schedule.behind_forward:  # synchronous: waited for; else each load waits for its unit
                adam.wait()
        if self.gradients.parts[self.root]:  # a frozen root stays on the device: the step did not change it
            self.window.root_stale = True
        totals = self.transfers.take_totals()
        backwards = self.transfers.clock.take()  # after adam.wait(): nothing left to wait for (``BackwardClock.take``)
        intervals, adam.update_intervals = adam.update_intervals, []
        update_s = sum(end - start for start, end in intervals)
        idle = [gap for b in backwards for gap in b.idle]
        waits, adam.wait_intervals = adam.wait_intervals, []
        forward_waits = self.gradients.take_forward_waits()
        if (self.schedule.delay or self.schedule.behind_forward) and self.step_began is not None:
            step = (self.step_began, waited)  # hidden: ran while the host drove the device's step
            hidden = sum(overlap(update, step) - sum(overlap(update, gap) for gap in [*idle, *waits, *forward_waits])
                         for update in intervals)
        else:
            hidden = sum(hidden_update_s(intervals, b.host, b.idle) for b in backwards)
        if self.schedule.delay:
            self.gradients.start_delayed()
            if warming_up:
                self.gradients.apply_delayed()
                adam.wait_intervals.clear()  # the next step waits for nothing
        self.step_began = time.perf_counter()
        rolled_back, rollback_s = self.gradients.take_rollback()
        step = OffloadStep(
            h2d_bytes=totals.h2d_bytes, h2d_s=totals.h2d_s, d2h_bytes=totals.d2h_bytes, d2h_s=totals.d2h_s,
            cpu_update_s=update_s, cpu_update_hidden_s=hidden,
            host_backward_s=sum(b.host[1] - b.host[0] for b in backwards),
            device_backward_s=sum(b.device_s for b in backwards),
            device_idle_s=sum(end - start for start, end in idle),
            update_wait_s=sum(end - start for start, end in waits), rolled_back=rolled_back, rollback_s=rollback_s,
            forward_wait_s=sum(end - start for start, end in forward_waits),
        )
        self.last_step = step
        return step
