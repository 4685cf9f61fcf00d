"""What ``offload.SlideFSDPStrategy`` reports: the ``lit_fsdp.reporting.OffloadReport`` contract that
``callbacks.OffloadStats`` reads (the last step's pieces, the host's buffers as allocated and as the preflight counts
them), and the plan with its split taken that ``estimate`` and the preflight count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch

from offload.engine import OffloadStep
from offload.host_memory import UnitSize
from offload.plan import SlidePlan
from offload.preflight import host_memory_budget


class SlideReport:
    """``SlideFSDPStrategy``'s reports (a mixin: the strategy holds ``engine``, ``host``, ``adam``, ``cpu_mesh``, ``plan``,
    ``model_units`` and ``taken_plan``)."""

    def offload_report(self) -> SlideReport | None:
        """This strategy: it gives what ``lit_fsdp.reporting.OffloadReport`` declares, once its engine is built."""
        return self if self.engine is not None else None

    @property
    def last_step(self) -> OffloadStep | None:
        """The pieces of the last optimizer step (transfers, CPU update, backward), None before the first."""
        return self.engine.last_step if self.engine is not None else None

    def parameter_count(self) -> int:
        assert self.host is not None
        return self.host.parameter_count()

    def whole_numels(self, module: torch.nn.Module) -> dict[int, int]:
        """The host's layouts give the sizes: the module's parameters are empty while their block is not loaded."""
        sizes = super().whole_numels(module)
        if self.host is not None:
            sizes.update({id(place.param): place.numel for layout in self.host.layouts for place in layout.places})
        return sizes

    def host_buffer_bytes(self) -> dict[str, int]:
        """This rank's host bytes per buffer as allocated (``offload.host_memory`` names; a shared staging copy is
        counted by local rank 0; offloaded activations once the first step has made them)."""
        assert self.host is not None and self.engine is not None
        parts = self.host.buffer_bytes(count_shared=self.cpu_mesh["shard"].get_local_rank() == 0)
        parts["adam_moments"] = self.adam.nbytes() if self.adam is not None else 0
        parts["speculation_backup"] = self.engine.gradients.speculation_bytes()
        return parts

    def host_state_bytes(self) -> int:
        """This rank's host buffers in all (``host_buffer_bytes``)."""
        return sum(self.host_buffer_bytes().values())

    def host_buffer_estimate(self, trainer: Any, module: pl.LightningModule, datamodule: Any = None) -> dict[str, int]:
        """The node's host bytes per buffer for this run, its split as taken (``split_plan``); offloaded activations
        need ``datamodule`` (its batch size and sequence length)."""
        units = self.model_units(module, datamodule, trainer.num_devices)
        plan = self.split_plan(trainer, module, datamodule, units)
        return plan.host_buffers(units, plan.activation_bytes(units, module, datamodule))

    def split_plan(self, trainer: Any, module: pl.LightningModule, datamodule: Any, units: list[UnitSize],
                   compute: torch.dtype | None = None, host_bytes: int | None = None,
                   step_s: Callable[[int | None], float] | None = None) -> SlidePlan:
        """This run's plan with its split taken within ``host_bytes`` per node (default: the split ``place`` took, or
        this host's budget before it, its reserve kept), the host's activations counted; by the step-time model
        ``step_s`` where it is given (``offload.update_split.choose_split``)."""
        if self.taken_plan is not None and compute is None and host_bytes is None:
            return self.taken_plan
        plan = self.plan(trainer, compute)
        available = host_bytes if host_bytes is not None else host_memory_budget(self.host_memory_gb,
                                                                                  self.host_reserve_gb)[0]
        return plan.split(units, available, plan.activation_bytes(units, module, datamodule), step_s)
