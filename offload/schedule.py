"""When SlideFSDP's CPU updates run in a step (``UpdateSchedule``), decided once from the knobs and the trainer by
``offload.plan.SlidePlan``; the engine and the gradient pipeline take it when they are built."""

from __future__ import annotations

from dataclasses import dataclass

#: ``update``'s named schedules (``auto`` picks among the exact ones: every choice but ``delayed``)
UPDATES = ("synchronous", "forward", "split", "speculative", "delayed")
EXACT_UPDATES = UPDATES[:-1]


@dataclass(frozen=True)
class UpdateSchedule:
    """When each unit's CPU update runs, and what it keeps and checks for that."""

    delay: bool = False  # a step's updates run during the next step (ZeRO-Offload's one-step delayed update)
    defer: bool = False  # updates wait for the end of the backward: the global norm (clipping, skip_step) or the next step
    keep_gradients: bool = False  # each unit's gradient is added into an fp32 buffer kept on the host until its update
    norms_on_arrival: bool = False  # the step's gradient norm is summed piece by piece as the pieces reach the host
    check_units_finite: bool = False  # each unit's gradient is checked before its own update (none deferred)
    speculate: bool = False  # updates run on arrival, undone at the optimizer step if clipping or the guard fires
    accumulate_on_device: bool = False  # micro-batches' gradients summed on the device in float32, sent once a step
    ordered: bool = False  # deferred updates run after the norm, one task per unit in forward order (``start_ordered``)
    behind_forward: bool = False  # ordered, not waited for: each unit's next load waits for its own update
    split: bool = False  # ordered, with the first-arriving units speculated (``offload.update_split``)

    @classmethod
    def of(cls, update: str, clipping: bool, accumulation: int, on_nonfinite: str,
           accumulate_on: str = "host") -> "UpdateSchedule":
        """Clipping and skipping non-finite steps need every gradient before the first update of a step, so the
        updates are deferred; a delayed update defers them to the next step and keeps each gradient in its ring
        buffer (the reduce dtype), learning the norm as the pieces arrive, where accumulation and a deferred
        update that is not delayed keep an fp32 copy instead. Deferred updates are guarded by the global norm,
        ``on_nonfinite: warn`` by nothing.

        A speculative update (``offload.speculation``) is not deferred: each unit's update runs on arrival, with its
        rows backed up first, and its gradient is kept until the optimizer step (in its ring buffer, or in the fp32
        copy that accumulation keeps anyway), where the global norm, summed on arrival, validates the step or undoes
        it. It only matters where clipping or the guard could change the step: otherwise it is the overlapped update.

        Gradient accumulation (``accumulation`` micro-batches a step) on the device (``accumulate_on``) sums the
        micro-batches' reduced gradients in float32 there and sends the sum once, in the last micro-batch's backward:
        the host sees one gradient a step, as without accumulation. On the host it adds each micro-batch's pieces
        into the kept fp32 copy.

        ``update`` names the schedule (``UPDATES``; ``auto`` is resolved before, ``offload.update_split``):
        ``synchronous`` defers every update to after the norm and waits for them at the optimizer step;
        ``forward`` runs the same updates (the same arithmetic: the norm summed as the pieces arrive, the coefficient
        applied inside the update) in forward order (the root, then block 0 up) without waiting: the next forward's
        load of a unit waits for that unit's update alone; ``split`` is ``forward`` with the units whose
        gradients arrive first speculated during the backward; ``speculative`` speculates every unit; ``delayed`` runs a
        step's updates during the next step. Where neither clipping nor the guard needs the norm, every exact choice
        is the overlapped update (on arrival)."""
        delayed_update = update == "delayed"
        needs_norm = clipping or on_nonfinite != "warn"
        speculate = update == "speculative" and needs_norm
        defer = (clipping or on_nonfinite == "skip_step" or delayed_update) and not speculate
        ordered = defer and not delayed_update
        host_sum = accumulation > 1 and accumulate_on == "host"
        return cls(
            delay=delayed_update,
            defer=defer,
            keep_gradients=host_sum,
            norms_on_arrival=(delayed_update or speculate or (ordered and not host_sum)) and needs_norm,
            check_units_finite=on_nonfinite != "warn" and not defer and not speculate,
            speculate=speculate,
            accumulate_on_device=accumulation > 1 and accumulate_on == "device",
            ordered=ordered,
            behind_forward=ordered and update in ("forward", "split"),
            split=ordered and update == "split" and not host_sum,
        )

    @property
    def holds_pieces(self) -> bool:
        """Each gradient piece keeps its ring buffer after it arrives: until the next step's update (delayed), or
        until the optimizer step validates the step (speculative, with no fp32 copy to keep it in), or until its update
        after the norm (ordered, with none)."""
        return self.delay or ((self.speculate or self.ordered) and not self.keep_gradients)

    @property
    def overlaps(self) -> bool:
        """The CPU updates run during a backward (this step's, or the next one's when delayed), not after it."""
        return self.delay or not self.defer

    @property
    def name(self) -> str:
        """``delayed``, ``forward`` (after the norm in forward order, behind the next forward), ``after`` (the backward:
        deferred, waited for) or ``overlapped`` (``offload.step_time``; a speculative update overlaps too)."""
        return "delayed" if self.delay else "forward" if self.behind_forward else "after" if self.defer else "overlapped"
