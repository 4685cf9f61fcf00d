"""SlideFSDP's host state seen as DTensors: checkpoints in FSDP2's layout, and weight init or loading through them.

Each rank's master rows of a parameter are a ``Shard(0)`` chunk of the full tensor (``compress.layout``),
so they, and the AdamW moments beside them, can be presented as DTensors on a CPU device mesh without
a copy. ``torch.distributed.checkpoint`` then saves and loads them in place, under the same keys and
shapes as an FSDP2 checkpoint (``model.<name>``, ``optimizer_0.state.model.<name>.exp_avg``, ...):
``lit_fsdp export`` reads either, and one strategy's checkpoint resumes under the other.

Only trained parameters are saved: a frozen one (LoRA's base) has no master, and as under FSDP2 a LoRA checkpoint
holds the adapters and their optimizer state alone. For init and loading a frozen parameter is its staging rows, in
the compute dtype: what init or the pretrained folder writes there is its only host copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from compress.layout import ParamPlace, UnitLayout
from lit_fsdp.weights import clean_name
from offload.cpu_adam import CpuAdam

_PREFIX = "model."  # CausalLM keeps the network in `self.model`


def as_dtensor(local: torch.Tensor, place: ParamPlace, mesh: DeviceMesh) -> DTensor:
    """This rank's rows ``local`` of ``place``'s parameter, as a DTensor of the full shape (no copy)."""
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    stride = torch.empty(place.shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=place.shape, stride=stride)


class HostStateDict:
    """State dicts of the network and the CPU optimizer over SlideFSDP's host buffers (see the module docstring)."""

    def __init__(self, network: nn.Module, layouts: list[UnitLayout], master: list[torch.Tensor], mesh: DeviceMesh,
                 frozen: Iterable[tuple[ParamPlace, torch.Tensor]] = ()):
        """
        Args:
            layouts: Each unit's trained parameters, whose ``master`` rows are saved and loaded.
            frozen: Each frozen parameter and its staging rows (``HostState.frozen_rows``): written by init, not saved.
        """
        self.network, self.layouts, self.mesh = network, layouts, mesh
        self.weights: dict[int, DTensor] = {}  # id(parameter) -> its master rows (frozen: staging rows) as a DTensor
        for layout, shard in zip(layouts, master):
            for place, rows in zip(layout.places, layout.local_views(shard)):
                self.weights[id(place.param)] = as_dtensor(rows, place, mesh)
        for place, rows in frozen:
            self.weights[id(place.param)] = as_dtensor(rows, place, mesh)

    @contextmanager
    def parameters_as_dtensors(self) -> Iterator[None]:
        """While open, the network's parameters are their master rows (DTensors): what init and loading write."""
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        replacements: dict[int, nn.Parameter] = {}
        for module in self.network.modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                if id(param) not in replacements:
                    replacements[id(param)] = nn.Parameter(self.weights[id(param)], requires_grad=False)
                swapped.append((module, name, param))
                module._parameters[name] = replacements[id(param)]
        try:
            yield
        finally:
            for module, name, param in swapped:
                module._parameters[name] = param

    def model_state(self) -> dict[str, Any]:
        """``model.<name>``: master rows of the trained parameters (every tied name too), and the network's persistent
        buffers."""
        state: dict[str, Any] = {}
        for layout in self.layouts:
            for place in layout.places:
                for name in place.names:
                    state[_PREFIX + name] = self.weights[id(place.param)]
        parameter_names = {name for name, _ in self.network.named_parameters(remove_duplicate=False)}
        for name, buffer in self.network.state_dict(keep_vars=True).items():
            if name not in parameter_names:
                state[_PREFIX + clean_name(name)] = buffer
        return state

    def optimizer_state(self, adam: CpuAdam) -> dict[str, Any]:
        """``get_optimizer_state_dict``'s layout: per-parameter moments and step, then the held optimizer's groups."""
        state: dict[str, dict[str, Any]] = {}
        for layout, optimizer, pieces in zip(self.layouts, adam.optimizers, adam.pieces):
            for place, piece in zip(layout.places, pieces):
                entry = optimizer.state[piece]
                state[_PREFIX + place.names[0]] = {
                    key: value if key == "step" else as_dtensor(value, place, self.mesh) for key, value in entry.items()
                }
        names = {id(place.param): _PREFIX + place.names[0] for layout in self.layouts for place in layout.places}
        groups = [
            {**{key: value for key, value in group.items() if key != "params"}, "params": [names[id(p)] for p in group["params"]]}
            for group in adam.held.param_groups
        ]
        return {"state": state, "param_groups": groups}

    @staticmethod
    def restore_groups(adam: CpuAdam, saved: dict[str, Any]) -> None:
        """Learning rates and the other settings of the held optimizer's groups, as saved."""
        for group, saved_group in zip(adam.held.param_groups, saved["param_groups"]):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
