"""``estimate``'s view of SlideFSDP's activation plan (``offload.activation_plan``): the plan a run would take on the
hardware file's machine, and what it holds and moves.

``auto`` is chosen there from the hardware file's figures in place of the ones the run measures when it places the
model (``offload.plan.placed_costs``): the device's memory less the rest of estimate's device figures, the host's less
SlideFSDP's buffers, ``pcie_gbps`` and a block's forward at the hardware file's ``compute_efficiency`` of its peak.
"""

from __future__ import annotations

from typing import Any

import torch

from offload.activation_plan import PlanCost, cost
from offload.host_memory import GIB, UnitSize
from offload.plan import COMPUTE_EFFICIENCY, DEVICE_SHARE, block_costs

#: The link's rate where the hardware file does not give pcie_gbps (PCIe 4.0 x16, pinned)
DEFAULT_LINK_GBPS = 25.0


def planned_activations(strategy: Any, trainer: Any, data: Any, config: Any, units: list[UnitSize],
                        compute: torch.dtype, hardware: Any, device_others: int, host_others: int,
                        host_budget: int | None = None) -> PlanCost:
    """The plan ``strategy`` takes for ``units`` on ``hardware`` and its cost; ``device_others`` and ``host_others``:
    the device's and the host's other bytes (estimate's figures without the activations); ``host_budget``: the
    host's bytes SlideFSDP may take (default: all of the hardware file's)."""
    slide_plan = strategy.plan(trainer, compute)
    peak = (hardware.peak_for(compute) or 100.0) * 1e12 * (hardware.efficiency(strategy.compile_blocks)
                                                           or COMPUTE_EFFICIENCY)
    host = int(hardware.host_memory_gb * GIB) if host_budget is None else host_budget
    device_memory = hardware.memory_per_process_gb(trainer.num_devices) * GIB
    costs = block_costs(slide_plan, config, data, units, peak, int(device_memory * DEVICE_SHARE) - device_others,
                        host - host_others, (hardware.pcie_gbps or DEFAULT_LINK_GBPS) * 1e9)
    return cost(slide_plan.activations(len(units) - 1, lambda: costs), costs)
