"""Host synchronisations per optimizer step on a GPU, by call site, under ``torch.cuda.set_sync_debug_mode("warn")``.

A CUDA run only overlaps communication with compute while the host runs ahead of the device; every ``.item()``,
device-to-host copy, data-dependent shape or ``torch.cuda.synchronize`` makes it wait. CUDA reports each as a
warning in sync-debug mode; this callback turns that mode on after ``warmup_steps``, attributes each warning to
the innermost frame of lit_fsdp's own code (``compress/``, ``lit_fsdp/``, ``callbacks/``, ``offload/``) and the library
frame under it (``call_site``), and writes ``host_syncs.json`` in the run folder. On a CPU
run it does nothing: nothing waits there (``tests/sync_counter.py`` counts the same points on the CPU).
"""

from __future__ import annotations

import statistics
import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from callbacks.run_folder import write_json

_REPO = Path(__file__).resolve().parents[1]
_OWN = tuple(f"{_REPO / package}/" for package in ("compress", "lit_fsdp", "callbacks", "offload"))
#: the start of the message CUDA's sync-debug mode warns with (c10/cuda/CUDAFunctions.cpp)
SYNC_MESSAGE = "called a synchronizing CUDA operation"


def _where(frame: traceback.FrameSummary) -> str:
    path = frame.filename
    if path.startswith(f"{_REPO}/"):
        path = path[len(f"{_REPO}/"):]
    elif "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    return f"{path}:{frame.lineno} ({frame.name})"


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """Where a sync came from: the innermost frame of lit_fsdp's code, then ``>`` and the innermost frame of all where
    that is another (a library's), e.g. ``lit_fsdp/model.py:112 (forward) > transformers/masking_utils.py:761 (...)``;
    paths relative to the repository or to site-packages."""
    frames = [f for f in stack if f.filename != __file__ and not f.filename.endswith(("/warnings.py", "<frozen warnings>"))]
    frames = frames or stack
    own = [f for f in frames if f.filename.startswith(_OWN)]
    if not own:
        return _where(frames[-1])
    return _where(own[-1]) if own[-1] is frames[-1] else f"{_where(own[-1])} > {_where(frames[-1])}"


class HostSyncs(pl.Callback):
    """Counts host syncs per optimizer step by call site on GPU runs; ``host_syncs.json`` and ``host_syncs_*`` in results."""

    def __init__(self, warmup_steps: int = 2, steps: int = 5):
        """
        Args:
            warmup_steps: Optimizer steps run before counting (the first steps build caches and communicators).
            steps: Optimizer steps counted; sync-debug mode is off again after them.
        """
        if warmup_steps < 0 or steps < 1:
            raise ValueError(f"HostSyncs warmup_steps={warmup_steps} must be >= 0 and steps={steps} >= 1")
        self.warmup_steps = warmup_steps
        self.steps = steps
        self.per_step: list[Counter] = []
        self._current: Counter | None = None
        self._lock = threading.Lock()
        self._saved: Any = None

    # --- the mode and the warnings -----------------------------------------------------------------

    def _showwarning(self, message: Any, category: type, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if str(message).startswith(SYNC_MESSAGE) and self._current is not None:
            site = call_site(traceback.extract_stack())
            with self._lock:
                self._current[site] += 1
            return
        self._saved[0](message, category, filename, lineno, file, line)

    def start(self) -> None:
        """Sync-debug mode on; every sync warning counted (none printed), every other warning shown as before."""
        self._saved = (warnings.showwarning, list(warnings.filters))
        warnings.showwarning = self._showwarning
        # "always": Python's default shows a warning once per call site, which would hide repeats
        warnings.filterwarnings("always", message=SYNC_MESSAGE)
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning, warnings.filters[:] = self._saved[0], self._saved[1]
        self._saved = None

    # --- the steps ----------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if pl_module.device.type != "cuda" or self._current is not None or len(self.per_step) >= self.steps:
            return
        if trainer.global_step >= self.warmup_steps:
            if self._saved is None:
                self.start()
            self._current = Counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._current is None or trainer.fit_loop._should_accumulate():
            return
        # No synchronize here: a sync warns when the host calls it, so the step's are all counted by now (and a
        # synchronize would count itself).
        with self._lock:
            self.per_step.append(self._current)
            self._current = None
        if len(self.per_step) >= self.steps:
            self.stop()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._saved is not None:
            self._current = None
            self.stop()
        if self.per_step:
            write_json(trainer, "host_syncs.json", {**self.summary(), "per_step": [dict(c) for c in self.per_step]})

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._saved is not None:
            self.stop()

    def summary(self) -> dict[str, Any]:
        """``host_syncs_per_step`` (median over the counted steps) and ``host_syncs_by_site`` (per step, most first)."""
        if not self.per_step:
            return {}
        total: Counter = sum(self.per_step, Counter())
        return {
            "host_syncs_per_step": statistics.median(sum(c.values()) for c in self.per_step),
            "host_syncs_steps": len(self.per_step),
            "host_syncs_by_site": {site: n / len(self.per_step) for site, n in total.most_common()},
        }
