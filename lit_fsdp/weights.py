"""Building a model without memory, then filling its shards: random init or a local pretrained folder.

The model is built with its parameters on the meta device (buffers stay real, they are small and
often computed, like rotary frequencies). After ``fully_shard`` each rank allocates only its shard;
values are then written shard by shard, so no rank ever holds more than one FSDP unit in full.
Random init is seeded per unit name, which makes the weights independent of the world size and of
the wrapping: 1 and N processes start from the same model.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lit_fsdp.checkpoint_layout import check_layout, load_converted

# Wrappers that FSDP2, activation checkpointing and torch.compile add to parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter name as Hugging Face saves it, without wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` on the meta device while the context is open; buffers stay real."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def materialize(model: nn.Module, device: torch.device, buffer_device: torch.device | None = None) -> None:
    """Allocate (uninitialised) storage for meta parameters on ``device``; buffers keep their values, on ``buffer_device``."""
    copies: dict[int, torch.Tensor] = {}  # by identity: a buffer shared by two modules stays shared
    owners = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                copies.setdefault(id(buf), buf.detach().to(buffer_device or device, copy=True))
                owners.append((module, name, id(buf)))
    model.to_empty(device=device)
    for module, name, key in owners:
        module._buffers[name] = copies[key]


def shard_rows(param: torch.Tensor) -> tuple[int, int]:
    """The rows ``[start, stop)`` of the full parameter that this rank holds (``torch.chunk`` on dim 0)."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 0
    start, stop = 0, param.shape[0]
    coordinate = param.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(param.placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise NotImplementedError(f"only dim-0 sharding is supported, got {placement}")
            length = stop - start
            size = math.ceil(length / param.device_mesh.size(mesh_dim))
            start = min(stop, start + coordinate[mesh_dim] * size)
            stop = min(stop, start + size)
    return start, stop


def write_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's rows of ``full`` (a CPU tensor of the parameter's global shape) into ``param``."""
    local = param.to_local() if isinstance(param, DTensor) else param
    if full.dim() == 0:
        local.copy_(full)
        return
    start, stop = shard_rows(param)
    local.copy_(full[start:stop])


def init_by_unit(
    model: nn.Module, units: list[tuple[str, nn.Module]], init_module: Callable[[nn.Module], None], seed: int
) -> None:
    """Initialise every parameter with ``init_module`` applied unit by unit on full CPU copies.

    ``units`` are the wrapped blocks; the remaining modules that own parameters become units of
    their own. Each unit is seeded from ``seed`` and its name, then its rows are copied to the shards.
    """
    in_blocks = {id(m) for _, block in units for m in block.modules()}
    # (name, module whose parameters are swapped, the modules init_module is applied to)
    work = [(name, list(block.modules())) for name, block in units] + [
        (name, [module])
        for name, module in model.named_modules()
        if id(module) not in in_blocks and any(True for _ in module.parameters(recurse=False))
    ]
    done: set[int] = set()
    # fork_rng: per-unit seeding must not leave the global generator in a state that depends on the model.
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for unit_name, modules in work:
            owners = [(m, pname, param) for m in modules for pname, param in m.named_parameters(recurse=False)]
            for module, pname, param in owners:
                module._parameters[pname] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype))
            torch.manual_seed(seed + zlib.crc32(clean_name(unit_name).encode()))
            for module in reversed(modules):  # children before parents, as nn.Module.apply does
                init_module(module)
            for module, pname, param in owners:
                full = module._parameters[pname].data
                module._parameters[pname] = param
                if id(param) not in done:  # a tied parameter keeps the values of its first owner
                    write_shard(param, full)
                    done.add(id(param))


def has_weights(folder: str | Path) -> bool:
    """Whether a Hugging Face folder holds its safetensors weights (or only its config, as ``estimate`` needs)."""
    return any((Path(folder) / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))


def checkpoint_files(folder: str | Path) -> dict[str, str]:
    """Each tensor of a Hugging Face folder's safetensors files and the file that holds it; a folder without them, or
    an index naming a file outside the folder, is refused in one line."""
    folder = Path(folder)
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
    elif (folder / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    else:
        raise FileNotFoundError(
            f"no model.safetensors or model.safetensors.index.json in {folder}; "
            "save the model with save_pretrained(..., safe_serialization=True)"
        )
    for file in set(weight_map.values()):
        # by name, not by resolving links: the Hub cache links each snapshot file to ../../blobs/<sha>
        if not Path(os.path.normpath(folder / file)).is_relative_to(os.path.normpath(folder)):
            key = next(k for k, v in weight_map.items() if v == file)
            raise ValueError(f"{index_file} maps {key!r} to {file!r}, which is not a file inside {folder}; "
                             "use the index that save_pretrained wrote with the weights")
    return weight_map


def _parameters(model: nn.Module, skip: Collection[str]) -> dict[str, torch.Tensor]:
    return {key: param for key, param in ((clean_name(n), p) for n, p in model.named_parameters()) if key not in skip}


def _state_names(model: nn.Module) -> set[str]:
    """Every state-dict name of ``model`` (tied duplicates and persistent buffers too), without wrapper prefixes."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    return {clean_name(name) for name in names + [name for name, _ in model.named_buffers(remove_duplicate=False)]}


def check_pretrained(model: nn.Module, folder: str | Path, skip: Collection[str] = ()) -> None:
    """Refuse in one line a folder whose tensors do not fill ``model`` (built on the meta device will do), from the
    files' headers alone: what the launcher checks before any process starts (``checkpoint_layout.check_layout``)."""
    check_layout(model, Path(folder), checkpoint_files(folder), _parameters(model, skip), {*skip, *_state_names(model)})


def load_by_shard(model: nn.Module, folder: str | Path, skip: Collection[str] = ()) -> None:
    """Fill every parameter but those named in ``skip`` (clean names: LoRA's adapters) from the safetensors files of
    a Hugging Face folder, reading only local rows.

    The checkpoint's names are mapped to the model's by transformers' own conversion rules (``checkpoint_layout``):
    a mixture-of-experts checkpoint with one tensor per expert fills the model's fused 3D expert tensors, each rank
    reading only the experts of its shard. A missing, unexpected or mis-shaped tensor is refused in one line.
    """
    with torch.no_grad():
        load_converted(model, Path(folder), checkpoint_files(folder), _parameters(model, skip),
                       {*skip, *_state_names(model)})
