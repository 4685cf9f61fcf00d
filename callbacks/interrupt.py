"""Ctrl-C and preemption: the run stops at a step every rank agrees on, saves it, and says how to resume.

Lightning raises ``KeyboardInterrupt`` wherever Ctrl-C finds each rank, and its SIGTERM handler broadcasts from inside
the handler and stops each rank where it sees its own flag: under FSDP the ranks then meet different collectives.
Here a signal only marks the run; at the end of each step one all-reduce tells every rank whether any was marked, and
where one was, Lightning's own SIGTERM stop (``trainer.received_sigterm``, raising ``SIGTERMException`` where the step
ends) takes every rank out at the same point, where the checkpoint is saved as Lightning's ``OnExceptionCheckpoint``
saves one. It is not one: a trainer holding an OnExceptionCheckpoint resumes every fit given no ``ckpt_path`` from the
newest checkpoint it finds (Lightning's fault-tolerant fit), where lit_fsdp's ``--ckpt_path`` decides.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

from callbacks.run_summary import RESUME
from lit_fsdp import checkpoints
from lit_fsdp.lightning_compat import stop_as_on_sigterm
from lit_fsdp.reporting import strategy_report


class InterruptCheckpoint(Checkpoint):
    """OnExceptionCheckpoint's save, for an interrupt alone: Ctrl-C (SIGINT), SIGTERM (a preemption) or SLURM's requeue
    signal stops the run at the end of the step under way on every rank and saves ``interrupted.ckpt`` there
    (SlideFSDP's host updates of that step applied first, as for any save), which ``--ckpt_path last`` takes as the
    newest. A second Ctrl-C stops at once, without a checkpoint. Other errors save nothing: their state may be bad.

    The CLI adds one beside the first ModelCheckpoint, in its folder; after SLURM's requeue signal rank 0 also requeues
    the job (``scontrol requeue``), as Lightning's ``SLURMEnvironment(auto_requeue=True)`` does.
    """

    def __init__(self, dirpath: str | None = None, filename: str = "interrupted"):
        """
        Args:
            dirpath: Folder of the checkpoint; default (the CLI's): the first ModelCheckpoint's.
            filename: Its name, without ``.ckpt``.
        """
        self.dirpath, self.filename = dirpath or "", filename
        self.signal: int | None = None  # the first signal this rank received, or the one another rank did
        self.step: int | None = None  # the step saved

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.dirpath, f"{self.filename}.ckpt")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take over the signals from Lightning's handlers (installed just before; its teardown puts the previous back)."""
        if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
            return
        self.signal = None
        for signum in stop_signals(trainer):
            signal.signal(signum, self._mark)

    def _mark(self, signum: int, _: Any) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:  # Ctrl-C twice: stop now, as Python would
            raise KeyboardInterrupt
        self.signal = self.signal or signum

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Where an optimizer step ends, every rank learns whether any was signalled (one all-reduce), so that all stop
        after this same step (not inside an accumulation window, whose gradients a checkpoint does not hold)."""
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        signalled = self.signal is not None
        if trainer.world_size > 1:  # one process needs no all-reduce, nor the wait for the device its read costs
            signalled = trainer.strategy.reduce_boolean_decision(signalled, all=False)
        if signalled:
            self.signal = self.signal or signal.SIGTERM  # signalled on another rank: that one's log names it
            stop_as_on_sigterm(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not (isinstance(exception, SIGTERMException) and self.signal is not None):
            return
        rank_zero_info(f"lit_fsdp: {signal.Signals(self.signal).name}: saving step {trainer.global_step} to "
                       f"{self.ckpt_path}")
        trainer.save_checkpoint(self.ckpt_path)
        self.step = trainer.global_step
        if self.signal == strategy_report(trainer).requeue_signal() and trainer.is_global_zero:
            requeue_slurm_job()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A fit that trained past the interrupted step removes it (its checkpoints cover it); another run leaves it."""
        path = Path(self.ckpt_path)
        if stage != "fit" or not trainer.is_global_zero or not path.exists():  # rank 0 removes checkpoints
            return
        found = checkpoints.inspect(path)
        if found.manifest is not None and trainer.global_step > found.manifest.get("step", trainer.global_step):
            trainer.strategy.remove_checkpoint(self.ckpt_path)


def stop_signals(trainer: pl.Trainer) -> list[int]:
    return [signal.SIGINT, signal.SIGTERM, *filter(None, [strategy_report(trainer).requeue_signal()])]


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this job (an array job's task by its own id): it starts again with the same script."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    rank_zero_info(f"lit_fsdp: requeued SLURM job {job}" if result.returncode == 0 else
                   f"lit_fsdp: scontrol requeue {job} failed ({result.stderr.strip() or result.returncode})")


def interrupted(trainer: pl.Trainer) -> int:
    """After a run stopped by a signal: its last line (rank 0), and the exit status a shell gives a process the signal
    ended (128 + its number)."""
    saver = next((callback for callback in trainer.callbacks if isinstance(callback, InterruptCheckpoint)), None)
    signum = saver.signal if saver is not None and saver.signal else signal.SIGTERM
    name = signal.Signals(signum).name
    if trainer.is_global_zero:
        if saver is not None and saver.step is not None:
            print(f"stopped by {name} after step {saver.step}, saved as {Path(saver.ckpt_path).resolve()} ({RESUME})",
                  flush=True)
        else:  # checkpointing off, or a signal before training started
            off = " (checkpointing is off)" if saver is None else ""
            print(f"stopped by {name} after step {trainer.global_step}, with no checkpoint saved{off}", flush=True)
    return 128 + signum
