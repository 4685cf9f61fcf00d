"""SlideFSDP when a step is cut short: the updates queued behind it still run at teardown, so every unit's master rows
stay at one step, and where they cannot (an update failed) a save of the weights is refused in one line; and a rank
waiting for another local rank's update of their shared staging copy stops within seconds, in one line naming it,
once that rank has failed or died, where it waited 30 minutes."""

from __future__ import annotations

import os
import signal
import threading
import time
import types
import uuid

import lightning.pytorch as pl
import pytest
import torch

from offload.host import SHM_DIR, SharedMarks

# --- an interrupted step: the queued ordered updates ----------------------------------------------------------------

STEP = 2  # the step whose start is interrupted: the ordered updates of the step before are queued behind its forward
UNITS = 5  # 4 blocks and the root
FAILING_UNIT = 1


class InterruptAtStep(pl.Callback):
    """At the start of optimizer step ``step`` raises, the step before's ordered updates still queued behind its
    forward (each slowed by ``delay_ms`` as ``LIT_FSDP_EMULATED_UPDATE_DELAY_MS`` slows it, in that step alone); or,
    with ``failing_unit``, that unit's ordered update of the step before raises instead, which the forward's load of the
    unit then raises. Keeps the CPU optimizer (the strategy lets go of it at teardown)."""

    def __init__(self, step: int, failing_unit: int | None = None, delay_ms: float = 0.0):
        self.step, self.failing_unit, self.delay_s = step, failing_unit, delay_ms / 1000

    def on_train_start(self, trainer, pl_module):
        self.adam = adam = trainer.strategy.adam
        if self.failing_unit is None:
            return
        update_rows = adam.update_rows

        def failing(unit, *args, **kwargs):
            if unit == self.failing_unit and adam.unit_steps()[unit] == [self.step - 1]:
                raise RuntimeError("injected update failure")
            return update_rows(unit, *args, **kwargs)

        adam.update_rows = failing

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step - 1:
            self.adam.emulated_delay_s = self.delay_s
        if self.failing_unit is None and trainer.global_step == self.step:
            raise RuntimeError("injected interruption")


def _fits_cut_short(rank: int, world: int, tmp: str) -> dict:
    """In one process: a fit interrupted at the start of step ``STEP``, one whose unit ``FAILING_UNIT`` fails its
    update of the step before, and one that ends after ``STEP`` steps (a tiny GPT-2 of 4 blocks, ``update: forward``,
    clipping); after each, the units' step counts, the master rows and what a weights-only save in this process did.
    Trainers built here, not by the CLI, whose parsing would take longer than the fits."""
    from pathlib import Path

    from lit_fsdp.data.synthetic import SyntheticDataModule
    from lit_fsdp.model import CausalLM
    from offload.strategy import SlideFSDPStrategy

    runs = {"interrupted": InterruptAtStep(STEP, delay_ms=50), "failed": InterruptAtStep(STEP, FAILING_UNIT),
            "clean": InterruptAtStep(10**6)}
    found = {}
    for name, probe in runs.items():
        pl.seed_everything(1234)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=SlideFSDPStrategy(update="forward", cpu_threads=1),
            gradient_clip_val=1.0, max_steps=STEP if name == "clean" else 6, limit_val_batches=0, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
            default_root_dir=Path(tmp) / name)
        module = CausalLM(config_overrides={"n_layer": 4}, learning_rate=3e-3, warmup_steps=2)
        data = SyntheticDataModule(seq_len=64, batch_size=1, num_train_blocks=8, num_val_blocks=1)
        try:
            trainer.fit(module, datamodule=data)
            error = None
        except Exception as raised:  # noqa: BLE001 (what the fit raised is part of what the test checks)
            error = str(raised)
        try:
            trainer.save_checkpoint(Path(tmp) / name / "weights", weights_only=True)
            refusal = None
        except Exception as raised:  # noqa: BLE001
            refusal = str(raised)
        found[name] = {"error": error, "steps": probe.adam.unit_steps(), "refusal": refusal,
                       "saved": (Path(tmp) / name / "weights").exists(),
                       "master": [rows.clone() for rows in trainer.strategy.host.master]}
    return found


@pytest.fixture(scope="module")
def cut_short(tmp_path_factory):
    from tests.distributed import run

    tmp = tmp_path_factory.mktemp("cut_short")
    (found,) = run(_fits_cut_short, tmp, str(tmp), world=1)
    return found


def test_a_step_interrupted_with_ordered_updates_queued_leaves_every_unit_at_the_last_step_and_saves(cut_short):
    """``update: forward`` with clipping, interrupted as its third step starts, the ordered updates of its second
    (50 ms each) still queued behind that step's forward: teardown runs them (it cancelled them, leaving the units
    between step counts 1 and 2), so every unit has taken 2 steps, its master rows those of a run that ended after 2
    steps, and the weights-only save in the same process is written."""
    interrupted, clean = cut_short["interrupted"], cut_short["clean"]
    assert "injected interruption" in interrupted["error"] and clean["error"] is None
    assert interrupted["steps"] == {unit: [STEP] for unit in range(UNITS)}
    assert all(torch.equal(got, want) for got, want in zip(interrupted["master"], clean["master"], strict=True))
    assert interrupted["refusal"] is None and interrupted["saved"] and clean["refusal"] is None


def test_a_failed_ordered_update_leaves_its_unit_a_step_behind_and_a_save_is_refused_in_one_line_naming_both(cut_short):
    """Unit 1's second update raises on the worker: the third step's load of unit 1 stops the run, teardown runs the
    other units' updates, and unit 1 stays at step 1 (its rows those of step 1: nothing can make up for its update);
    the weights-only save refuses in one line that says which units are at which step and to resume from the last
    checkpoint."""
    failed, clean = cut_short["failed"], cut_short["clean"]
    assert failed["error"] == ("SlideFSDP: the host side of unit 1's gradients failed (RuntimeError: injected update "
                               "failure)")
    assert failed["steps"] == {**{unit: [STEP] for unit in range(UNITS)}, FAILING_UNIT: [STEP - 1]}
    for unit, (got, want) in enumerate(zip(failed["master"], clean["master"], strict=True)):
        assert torch.equal(got, want) is (unit != FAILING_UNIT), unit
    refusal = failed["refusal"]
    assert not failed["saved"]
    assert refusal == (
        "SlideFSDP will not save: an interrupted step left this rank's master weights at different steps (units "
        "0, 2-4 at step 2; unit 1 at step 1; an update failed (SlideFSDP: the host side of unit 1's gradients failed "
        "(RuntimeError: injected update failure))); resume from the last checkpoint (--ckpt_path last)"), refusal


# --- a local rank that died: the wait for its marks -----------------------------------------------------------------


def node_cells(ranks: int, units: int) -> torch.Tensor:
    """Marks cells in /dev/shm, mapped as a node's ranks map theirs (``map_node_file``): a forked child shares them."""
    path = SHM_DIR / f"lit_fsdp_test_marks_{uuid.uuid4().hex[:12]}"
    with open(path, "wb") as f:
        f.truncate(ranks * (units + 2) * 8)
    try:
        cells = torch.from_file(str(path), shared=True, size=ranks * (units + 2), dtype=torch.int64)
        return cells.view(ranks, units + 2)
    finally:
        path.unlink()


def test_a_wait_for_a_local_rank_that_died_ends_within_seconds_in_one_line_naming_the_rank_and_the_unit():
    """Local rank 1 (a forked child) marks unit 0, then dies before unit 1, and nobody reaps it (a zombie, as a rank is
    until its parent, which may be the rank waiting, reaps it): rank 0's wait for unit 1 ends within seconds, in one
    line naming local rank 1, its pid and unit 1, long before its timeout."""
    cells = node_cells(2, 3)
    waiter = SharedMarks(cells, 0, timeout_s=30.0)
    for unit in range(3):
        waiter.mark(unit, 1)
    child = os.fork()
    if child == 0:  # local rank 1
        try:
            SharedMarks(cells, 1, timeout_s=30.0).mark(0, 1)
        finally:
            os._exit(0)
    try:
        waiter.wait(0, 1, lambda: None)  # reached while the child lived
        began = time.monotonic()
        with pytest.raises(Exception) as raised:
            waiter.wait(1, 1, lambda: None)
        waited = time.monotonic() - began
    finally:
        os.kill(child, signal.SIGKILL)  # a child that hung instead of exiting (a zombie ignores it)
        os.waitpid(child, 0)
    assert str(raised.value) == (f"SlideFSDP: local rank 1 (pid {child}) exited before updating unit 1 for step 1; its "
                                 "log says why")
    assert waited < 5, waited


def test_a_local_rank_leaving_its_step_on_an_error_ends_the_others_waits_at_once():
    """The failing rank's ``on_exception`` flags it in the shared cells: a rank waiting for its mark stops within a
    look (both ranks in this process, so the pid alone would not tell)."""
    from offload.strategy import SlideFSDPStrategy

    cells = node_cells(2, 3)
    waiter, peer = SharedMarks(cells, 0, timeout_s=30.0), SharedMarks(cells, 1, timeout_s=30.0)
    waiter.mark(2, 4)
    strategy = SlideFSDPStrategy()
    strategy.engine = types.SimpleNamespace(gradients=types.SimpleNamespace(marks=peer))
    strategy.on_exception(RuntimeError("the peer's step failed"))
    began = time.monotonic()
    with pytest.raises(Exception, match=rf"^SlideFSDP: local rank 1 \(pid {os.getpid()}\) failed before updating "
                                        r"unit 2 for step 4; its log says why$"):
        waiter.wait(2, 4, lambda: None)
    assert time.monotonic() - began < 2


def test_a_live_local_rank_is_waited_for_with_backing_off_looks_until_it_marks_or_the_timeout():
    """A peer that is alive and marks after 0.3 s is waited for, with looks that back off (at the fixed 0.2 ms pause
    it looked 780 times on a loaded 2-core machine); one that never marks ends the wait at ``timeout_s``, the
    strategy's timeout."""
    cells = node_cells(2, 1)
    waiter, peer = SharedMarks(cells, 0, timeout_s=30.0), SharedMarks(cells, 1, timeout_s=30.0)
    waiter.mark(0, 1)
    looks = []
    reached = waiter.reached
    waiter.reached = lambda unit, epoch: looks.append(1) or reached(unit, epoch)
    marker = threading.Timer(0.3, peer.mark, (0, 1))
    marker.start()
    waiter.wait(0, 1, lambda: None)
    marker.join()
    assert len(looks) < 400, len(looks)
    waiter.timeout_s = 0.3
    waiter.mark(0, 2)
    with pytest.raises(RuntimeError, match=r"^SlideFSDP: local ranks \[1\] did not update unit 0 for step 2 within "
                                           r"0.3 s \(the strategy's timeout\)"):
        waiter.wait(0, 2, lambda: None)
