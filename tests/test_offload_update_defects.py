"""SlideFSDP's updates after the norm, driven through the engine's hooks as the strategy drives them: a block's forward
waits for its own unit's update, not for the units it prefetches; a device sum that no last micro-batch sent is in its
step's norm (the one ``torch.nn.utils.clip_grad_norm_`` takes), not in the next step's; a split's rollback finishing
on the worker while the step takes the rollbacks is kept."""

from __future__ import annotations

import copy
import threading
import types

import pytest
import torch
from torch import nn

from offload import cpu_adam
from offload.activation_plan import ActivationPlan
from offload.engine import FORWARD, SlideEngine
from offload.gradients import GradientPipeline
from offload.host import HostState
from offload.layout import build_layouts
from offload.residency import DeviceWindow, replace_meta_parameters
from offload.schedule import UpdateSchedule
from offload.strategy import SlideFSDPStrategy
from offload.transfers import Transfers

WIDTH = 8
LR, WEIGHT_DECAY = 1e-2, 0.1


class Chain(nn.Module):
    """A root (a layer before the blocks, a head after them) around ``blocks`` tanh layers. ``cut``: the block whose
    output the loss is not differentiated through, so that the backward reaches neither it nor anything before it."""

    def __init__(self, blocks: int):
        super().__init__()
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))
        self.head = nn.Linear(WIDTH, 1)
        self.cut: int | None = None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(inputs)
        for index, block in enumerate(self.blocks):
            hidden = torch.tanh(block(hidden))
            if index == self.cut:
                hidden = hidden.detach()
        return self.head(hidden).square().mean()


class Slide:
    """A ``Chain`` under SlideFSDP's engine on one process, built as ``SlideFSDPStrategy.place`` builds it (every block
    kept, ``param_transfer: full``, ``grad_sync: gpu_reduce``, float32), with the same initial weights as ``reference``."""

    def __init__(self, reference: Chain, schedule: UpdateSchedule, window: int, emulated_copy_ms: float | None = None):
        self.network = network = copy.deepcopy(reference)
        blocks = [(f"blocks.{index}", block) for index, block in enumerate(network.blocks)]
        block_layouts, root = build_layouts(network, blocks, 1, 0)
        layouts = [*block_layouts, root]
        self.host = HostState(layouts, torch.float32, torch.float32, full_staging=True,
                              keep_gradients=schedule.keep_gradients, incoming_full=False, ring_size=32, pin=False,
                              shared=None)
        for unit, layout in enumerate(layouts):
            for view, place in zip(layout.local_views(self.host.master[unit]), layout.places):
                view.copy_(place.param.detach())
        replace_meta_parameters(network, layouts, torch.device("cpu"), torch.float32)
        for unit in range(len(layouts)):
            self.host.write_staging(unit)
        transfers = Transfers(torch.device("cpu"), emulated_delay_ms=emulated_copy_ms)
        self.window = DeviceWindow(layouts, len(layouts) - 1, self.host, transfers, window, torch.float32,
                                   torch.device("cpu"), None)
        self.window.unbind_all()
        held = torch.optim.AdamW(network.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        self.adam = cpu_adam.CpuAdam(layouts, self.host.master, held)
        self.gradients = GradientPipeline(layouts, self.host, self.adam, transfers, gpu_reduce=True,
                                          reduce_dtype=torch.float32, world_size=1, shard_rank=0, shard_group=None,
                                          replicate_group=None, host_group=None, schedule=schedule)
        self.engine = SlideEngine(network, blocks, layouts, self.window, self.gradients, transfers,
                                  ActivationPlan.every(len(blocks), 0), False, False, schedule)
        self.losses: list[float] = []  # each micro-batch's, in the order they ran
        # what ``SlideFSDPStrategy.clip_gradients`` reads of the strategy, on one process
        self.strategy = types.SimpleNamespace(engine=self.engine, adam=self.adam, on_nonfinite="stop",
                                              cpu_mesh={"shard": types.SimpleNamespace(size=lambda: 1)})

    def step(self, micro_batches: list[tuple[torch.Tensor, int | None]], max_norm: float | None,
             on_nonfinite: str = "stop") -> tuple[torch.Tensor | None, int]:
        """One optimizer step as Lightning and the strategy run it: each micro-batch's forward and backward (all but
        the last inside ``block_backward_sync``), the strategy's ``clip_gradients``, the guard (``skip_step`` drops a
        step whose norm is not finite or whose units were withheld), then ``finish_step``. Returns the norm and the
        number of units withheld."""
        for index, (inputs, cut) in enumerate(micro_batches):
            self.engine.accumulating = index < len(micro_batches) - 1
            self.engine.phase = FORWARD
            self.network.cut = cut
            loss = self.network(inputs)
            self.losses.append(loss.item())
            self.engine.begin_backward()
            loss.backward()
            self.engine.end_backward()
            self.engine.accumulating = False
        self.strategy.on_nonfinite = on_nonfinite
        norm = SlideFSDPStrategy.clip_gradients(self.strategy, max_norm)
        withheld = self.gradients.take_nonfinite()
        if on_nonfinite == "skip_step" and (withheld or (norm is not None and not torch.isfinite(norm))):
            self.gradients.discard(undo=True)  # the strategy's drop_gradients
        self.engine.finish_step(self.adam)
        return norm, withheld

    def master(self) -> list[torch.Tensor]:
        self.adam.wait()
        return [master.clone() for master in self.host.master]

    def close(self) -> None:
        self.adam.close()


def reference_master(network: Chain, layouts_of: Slide) -> list[torch.Tensor]:
    """``network``'s weights in the master's layout of ``layouts_of``."""
    masters = [torch.zeros_like(master) for master in layouts_of.host.master]
    params = dict(network.named_parameters())
    for unit, layout in enumerate(layouts_of.host.layouts):
        for view, place in zip(layout.local_views(masters[unit]), layout.places):
            view.copy_(params[place.names[0]].detach())
    return masters


def micro_batch(generator: torch.Generator, cut: int | None = None) -> tuple[torch.Tensor, int | None]:
    return torch.randn(4, WIDTH, generator=generator), cut


# --- defect 4: a block's forward and the updates of the blocks it prefetches --------------------------------------


@pytest.mark.parametrize("window", [2, 3])
def test_a_blocks_forward_begins_before_the_update_of_the_block_it_prefetches_is_done(monkeypatch, window):
    """``update: forward`` with clipping, every unit's CPU update slowed (emulated) and every copy asynchronous: in each
    step's forward, block 0 prefetches blocks 1..window-1, whose updates after the last step's norm are still running.
    Unit 1's update is held until block 0's forward has begun (for at most 5 s): block 0 begins first, and every block
    still begins after its own unit's update. The steps are the synchronous update's, loss for loss to the last bit
    (a block loaded before its update would compute with the weights before it), with every block back in its
    forward's slot for its backward (``check_same_slot``)."""
    monkeypatch.setenv(cpu_adam.EMULATED_UPDATE_DELAY_VARIABLE, "10")
    events: list[tuple[str, int, int]] = []  # (what, unit, step): an update done, a block's forward begun
    forwards = [0] * 4  # of each block so far
    begun, done = threading.Condition(), threading.Event()  # done: the last step's updates are not held
    ordered_update = GradientPipeline._ordered_update

    def held(self, unit, *args):
        if unit == 1 and self.schedule.behind_forward:  # the last step's update, behind this step's forward
            with begun:
                begun.wait_for(lambda: forwards[0] > self.epoch or done.is_set(), timeout=5)
        ordered_update(self, unit, *args)
        events.append(("updated", unit, self.epoch))

    def begins(block: int) -> None:
        with begun:
            forwards[block] += 1
            events.append(("forward", block, forwards[block] - 1))
            begun.notify_all()

    monkeypatch.setattr(GradientPipeline, "_ordered_update", held)
    torch.manual_seed(0)
    reference = Chain(blocks=4)
    losses = {}
    for update in ("synchronous", "forward"):
        events.clear()
        forwards[:] = [0] * 4
        slide = Slide(reference, UpdateSchedule.of(update, True, 1, "stop"), window=window, emulated_copy_ms=1.0)
        for index, block in enumerate(slide.network.blocks):  # after the engine's hook: the block's compute begins
            block.register_forward_pre_hook(lambda _m, _a, i=index: begins(i))
        generator = torch.Generator().manual_seed(1)
        done.clear()
        for _ in range(3):
            slide.step([micro_batch(generator)], max_norm=0.5)
        with begun:
            done.set()
            begun.notify_all()
        slide.close()
        losses[update] = slide.losses
    assert losses["forward"] == losses["synchronous"]
    for step in (1, 2):  # behind the forward of steps 1 and 2: the updates of steps 0 and 1
        assert events.index(("forward", 0, step)) < events.index(("updated", 1, step)), events
        for block in range(4):
            assert events.index(("updated", block, step)) < events.index(("forward", block, step)), events


def test_a_prefetch_deferred_for_its_update_keeps_its_slot_and_the_loads_keep_their_order():
    """The window alone, 3 slots: block 1's update is pending when blocks 1 and 2 are prefetched. Neither waits:
    block 1 takes its slot unloaded (its parameters bound to nothing), and block 2, whose update is done, waits behind
    it (with ``param_transfer: shard`` each load is a collective every rank issues in the same order). Once the
    update is done both load, in order, into the slots they would have taken at once; a deferred block released
    before its use is loaded all the same."""
    from compress.layout import UnitLayout

    params = [nn.Parameter(torch.zeros(2, 3)) for _ in range(5)]
    layouts = [UnitLayout.build(f"unit{i}", [((f"p{i}",), p)], 1, 0) for i, p in enumerate(params)]
    staging = [torch.full((6,), float(i)) for i in range(5)]
    window = DeviceWindow(layouts, 4, types.SimpleNamespace(staging=staging), Transfers(torch.device("cpu")), 3,
                          torch.float32, torch.device("cpu"), None)
    window.unbind_all()
    pending, loads = {1}, []
    window.before_load, window.update_pending = loads.append, lambda unit: unit in pending
    window.ensure(0)
    assert window.prefetch(1) and window.prefetch(2)
    assert loads == [0] and params[1].numel() == 0 and params[2].numel() == 0
    window.load_deferred()
    assert loads == [0]
    pending.clear()
    window.load_deferred()
    assert loads == [0, 1, 2] and [window._slot_number(block) for block in (0, 1, 2)] == [0, 1, 2]
    assert (params[1] == 1).all() and (params[2] == 2).all()
    window.release(0)
    pending.add(3)
    assert window.prefetch(3) and loads == [0, 1, 2]
    window.release(3)
    assert loads == [0, 1, 2, 3] and 3 not in window.resident


# --- defect 5: a device sum sent at the optimizer step --------------------------------------------------------------


@pytest.mark.parametrize("update", ["synchronous", "forward", "speculative", "delayed"])
def test_a_sum_the_last_micro_batch_did_not_reach_is_in_its_steps_clipping_norm_and_not_carried_into_the_next(update):
    """2 micro-batches summed on the device, clipping at 0.5: the first reaches every unit, the second is cut after
    block 1, so block 0 and the layer before the blocks keep their sums on the device past the last backward. The norm
    the step clips with is ``clip_grad_norm_``'s on the same summed gradients, and the next step's (every unit
    reached) is too: nothing of the first is carried into it. The exact schedules then hold AdamW's weights after
    both steps (the delayed one computes the second step on the first's weights, and updates after it)."""
    torch.manual_seed(0)
    reference = Chain(blocks=3)
    schedule = UpdateSchedule.of(update, True, 2, "stop", accumulate_on="device")
    assert schedule.accumulate_on_device and schedule.norms_on_arrival
    slide = Slide(reference, schedule, window=2)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    generator = torch.Generator().manual_seed(1)
    steps = [[micro_batch(generator), micro_batch(generator, cut=1)], [micro_batch(generator), micro_batch(generator)]]
    max_norm = 0.5
    for step, micro_batches in enumerate(steps):
        for inputs, cut in micro_batches:
            reference.cut = cut
            reference(inputs).backward()
        want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        if update != "delayed":  # delayed: the second step computes on the first's weights (its update runs then)
            optimizer.step()
        optimizer.zero_grad()
        assert want > max_norm, "clipping fires"
        norm, _ = slide.step(micro_batches, max_norm)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=0, msg=f"step {step}")
        slide.adam.wait()
        assert slide.gradients.squared_norm == 0.0, f"step {step}: carried into the next step's norm"
    if update != "delayed":  # the delayed update applies the second step's during the next
        for got, want in zip(slide.master(), reference_master(reference, slide)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    slide.close()


def test_a_non_finite_sum_the_last_micro_batch_did_not_reach_is_seen_by_its_steps_guard():
    """``on_nonfinite: skip_step`` without clipping, 2 micro-batches summed on the device: an infinity in block 0's
    gradient of the first, which the second does not reach. The step's norm is not finite, so the guard skips the
    step: no weight changes, and the next step's norm starts from zero."""
    torch.manual_seed(0)
    slide = Slide(Chain(blocks=3), UpdateSchedule.of("forward", False, 2, "skip_step", accumulate_on="device"), window=2)
    before = slide.master()
    poisoned = slide.network.blocks[0].weight.register_hook(lambda gradient: torch.full_like(gradient, float("inf")))
    generator = torch.Generator().manual_seed(1)
    norm, _ = slide.step([micro_batch(generator), micro_batch(generator, cut=1)], None, on_nonfinite="skip_step")
    poisoned.remove()
    assert norm is not None and not torch.isfinite(norm)
    after = slide.master()
    assert all(torch.equal(got, want) for got, want in zip(after, before))
    assert slide.gradients.squared_norm == 0.0
    slide.close()


# --- defect 8: a split's rollback recorded by the worker while the step takes them ----------------------------------


def test_a_splits_rollback_finishing_while_the_step_takes_the_rollbacks_is_kept(monkeypatch):
    """A split whose speculated units clipping rolls back: the worker records the rollback after the step's ordered
    updates, while the main thread goes on and takes the rollbacks at once (``finish_step``). Parked inside that
    record (after the rollback was counted, before it is stored) while the main thread takes them, the worker's
    rollback is still there for the next take: none is lost from ``offload/rollbacks``."""
    from offload.host_memory import UnitSize, speculated_units
    from offload.speculation import SpeculativeBackup
    from tests.test_offload_speculative import PIECES_PER_STEP, backward, pipeline_of, random_gradients

    schedule = UpdateSchedule.of("split", True, 1, "stop")
    pipeline, params = pipeline_of(schedule, slots=PIECES_PER_STEP)
    sizes = [UnitSize(layout.full_numel, layout.shard_numel, tuple(p.layout.shard_numel for p in parts) if unit else (),
                      leading_parts=1 if unit else 0)
             for unit, (layout, parts) in enumerate(zip(pipeline.layouts, pipeline.parts))]
    pipeline.speculated = speculated_units(sizes, 1)
    pipeline.attach(pipeline.adam)
    counted, taken = threading.Event(), threading.Event()
    end_step = SpeculativeBackup.end_step

    def parked(self):
        result = end_step(self)
        counted.set()
        taken.wait(timeout=10)  # until the main thread has taken the rollbacks
        return result

    monkeypatch.setattr(SpeculativeBackup, "end_step", parked)
    backward(pipeline, random_gradients(params, torch.Generator().manual_seed(3), 100.0))
    assert pipeline.ordered_norm(1.0, None, "stop") > 1.0  # clipping fires: the speculated units are redone
    pipeline.start_ordered()
    assert counted.wait(timeout=10)
    first = pipeline.take_rollback()
    taken.set()
    pipeline.adam.wait()
    second = pipeline.take_rollback()
    pipeline.adam.close()
    assert first[0] or second[0], (first, second)
    assert first[1] + second[1] > 0
