"""What SlideFSDP's offload costs per optimizer step: host-device traffic, CPU update time and how much of it was hidden."""

from __future__ import annotations

import statistics
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from callbacks.run_folder import log_metrics
from lit_fsdp.reporting import strategy_report

_GB = 1e9


class OffloadStats(pl.Callback):
    """Logs ``offload/*`` per optimizer step under ``offload.SlideFSDPStrategy`` and summarises them for the results record.

    Per step: gigabytes copied host-to-device (weights, checkpointed activations) and device-to-host
    (gradients, activations) and their rates, measured between CUDA events on the copy streams (on
    a CPU "device", around the copies); the time of the CPU AdamW updates and the share of it that
    was hidden: that ran while the device was computing the backward (``offload.engine.hidden_update_s``),
    not merely while the host was inside it; and the backward's time on the device (its compute, from
    CUDA events on the compute stream, less the gaps where it idled while the host waited for a gradient
    buffer) and on the host (waits included). A CPU-bound step shows a host backward near the update
    time, a device backward far below it, and a low hidden share. Beside them: the device's idle time inside
    the backward (``device_idle_ms``), the hideable share (device backward / update: what the update could
    hide under the backward alone) and the host's wait for updates at the optimizer step (``update_wait_ms``); with
    ``update: forward`` or ``split``, how long the step's forward waited for the last step's updates after the norm
    (``forward_wait_ms``) and the share of the trained rows speculated (``speculated_share``, 0 without a split); with
    ``update: speculative`` or ``split``, the steps rolled back at their validation (``rollbacks``, ``rollback_share``, and
    ``rollback_ms``, the mean time of one's undo and redo; the summary counts the warm-up steps too). On a CPU "device" the computing
    thread is the device: host times, its waits for a buffer left out of the device's. The record also
    gets the node's host state (master weights, moments, staging copy, kept gradients, activations) in
    GB and per billion parameters, the update threads, the activation plan and the update taken.
    """

    def __init__(self, warmup_steps: int = 2):
        """
        Args:
            warmup_steps: Optimizer steps left out of the summary (allocation and first-touch of host buffers).
        """
        self.warmup_steps = warmup_steps
        self.steps: list[Any] = []
        self._host: dict[str, float] | None = None
        self._trainer: pl.Trainer | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps, self._host, self._trainer = [], None, trainer
        if strategy_report(trainer).offload_report() is None:
            rank_zero_warn(f"OffloadStats measures offload.SlideFSDPStrategy; {type(trainer.strategy).__name__} has none")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        offload = strategy_report(trainer).offload_report()
        if offload is None or trainer.fit_loop._should_accumulate() or offload.last_step is None:
            return
        step = offload.last_step
        self.steps.append(step)
        figures = {**self._figures([step]), **self._rollbacks([step]), "speculated_share": offload.speculated_share}
        log_metrics(trainer, {f"offload/{key}": value for key, value in figures.items()})

    @staticmethod
    def _rollbacks(steps: list[Any]) -> dict[str, float]:
        """``update: speculative`` or ``split``: the steps undone at their validation (clipping or the guard fired), their share
        of the steps and the mean time of one (undo and redo)."""
        rolled = [s for s in steps if s.rolled_back]
        return {"rollbacks": len(rolled), "rollback_share": len(rolled) / len(steps),
                "rollback_ms": statistics.fmean(s.rollback_s for s in rolled) * 1000 if rolled else 0.0}

    @staticmethod
    def _figures(steps: list[Any]) -> dict[str, float]:
        mean = statistics.fmean
        update_s = mean(s.cpu_update_s for s in steps)
        h2d_s, d2h_s = mean(s.h2d_s for s in steps), mean(s.d2h_s for s in steps)
        return {
            "h2d_gb": mean(s.h2d_bytes for s in steps) / _GB,
            "h2d_gbps": mean(s.h2d_bytes for s in steps) / _GB / h2d_s if h2d_s > 0 else 0.0,
            "d2h_gb": mean(s.d2h_bytes for s in steps) / _GB,
            "d2h_gbps": mean(s.d2h_bytes for s in steps) / _GB / d2h_s if d2h_s > 0 else 0.0,
            "cpu_update_ms": update_s * 1000,
            "cpu_update_hidden_share": mean(s.cpu_update_hidden_s for s in steps) / update_s if update_s > 0 else 0.0,
            "device_backward_ms": mean(s.device_backward_s for s in steps) * 1000,
            "host_backward_ms": mean(s.host_backward_s for s in steps) * 1000,
            # the device waiting inside the backward for a gradient buffer an update had not freed yet
            "device_idle_ms": mean(s.device_idle_s for s in steps) * 1000,
            # the most the update could hide under the device's backward: 1 once the backward is the longer
            "cpu_update_hideable_share": (min(1.0, mean(s.device_backward_s for s in steps) / update_s)
                                          if update_s > 0 else 0.0),
            "update_wait_ms": mean(s.update_wait_s for s in steps) * 1000,
            "forward_wait_ms": mean(s.forward_wait_s for s in steps) * 1000,
        }

    def _host_state(self) -> dict[str, float]:
        """The node's host state in GB (summed over its ranks: a collective, run once on every rank)."""
        if self._host is None:
            trainer = self._trainer
            offload = strategy_report(trainer).offload_report()
            mine = torch.tensor(float(offload.host_state_bytes()), dtype=torch.float64)
            total = trainer.strategy.reduce(mine, reduce_op="sum") if trainer.world_size > 1 else mine
            per_node = float(total) / trainer.num_nodes / _GB
            billions = offload.parameter_count() / 1e9
            # What the preflight counted for the same buffers (offload.host_memory), beside what was allocated.
            estimate = offload.host_buffer_estimate(trainer, trainer.lightning_module, trainer.datamodule)
            self._host = {"host_state_gb_per_node": per_node, "host_gb_per_billion_params": per_node / billions,
                          "host_estimate_gb_per_node": sum(estimate.values()) / _GB}
        return self._host

    def summary(self) -> dict[str, Any]:
        """Means over the steps after warm-up (``offload_*``) and the host state; empty without SlideFSDP."""
        offload = strategy_report(self._trainer).offload_report() if self._trainer is not None else None
        if offload is None or not self.steps:
            return {}
        steps = self.steps[self.warmup_steps :] or self.steps
        record = {f"offload_{key}": value for key, value in self._figures(steps).items()}
        record.update({f"offload_{key}": value for key, value in self._rollbacks(self.steps).items()})  # warm-up too
        record["offload_update_threads"] = offload.update_threads_reason  # how many, and why
        record["offload_activation_plan"] = offload.activation_plan_taken  # what activation_plan auto chose
        record["offload_update"] = offload.update_taken  # what update: auto chose
        record["offload_update_reason"] = offload.update_reason  # and why (its step model with the run's rates)
        record["offload_speculated_share"] = offload.speculated_share
        record.update(self._host_state())
        return record

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        summary = self.summary()
        if summary:
            log_metrics(trainer, {f"offload/{key}": value for key, value in summary.items() if key.startswith("host")})
