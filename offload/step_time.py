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
  (the root, then block 0 up) while the next forward runs; the forward's load of a unit waits for that unit's update,
  and the host, which issues the loads of the next ``window - 1`` blocks before a block's compute, waits there. The
  split's speculated units (the root's trailing parts and the last blocks) are updated during the backward, each
  with a backup pass first; their rollback, when clipping fires, is not modelled;
- **delayed** (``update: delayed``): a step's updates run during the next step's forward and backward; the step is the
  longer of the two, plus the staging rows of the last units to arrive, rewritten at the end of the backward.

With gradient accumulation only the last micro-batch's backward overlaps the update.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardOrder:
    """The ordered update's parts in seconds: the root's update that the forward's first load waits for (its parts not
    speculated), each block's update (forward order), the blocks speculated (the last ones), their update with its
    backup pass and the root's speculated parts', and the device window."""

    root_s: float
    block_s: tuple[float, ...]
    speculated_blocks: int
    speculated_s: float
    window: int

    def forward_wait_s(self, forward_s: float, backward_s: float) -> float:
        """How much longer the next forward (``forward_s`` of compute, even over the blocks) takes for waiting on the
        updates, the speculated ones having run during a backward of ``backward_s``."""
        blocks = len(self.block_s)
        first_arrival = backward_s / max(1, blocks)
        worker = max(0.0, first_arrival + self.speculated_s - backward_s)  # from the backward's end
        done, clock = [], worker + self.root_s
        ordered = blocks - self.speculated_blocks
        for block in range(ordered):
            clock += self.block_s[block]
            done.append(clock)
        per_block = forward_s / max(1, blocks)
        end = worker + self.root_s  # the root's load waits for its update
        for block in range(blocks):
            gate = done[min(block + self.window - 1, ordered - 1)] if ordered else 0.0
            end = max(end, gate) + per_block
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
