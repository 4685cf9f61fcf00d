"""The flat layouts of a model's units: which parameters make up each block and the root.

How a unit's parameters sit in a flat buffer (whole, or sharded by rows as FSDP2 does) is
``compress.layout``: compress's PowerSGD reads FSDP2's reduce-scatter buffer through it, and SlideFSDP
(``offload``) keeps its master weights, gradients and staging copies in it.

Each unit has two layouts: every parameter (the staging copy and the device slots) and its trained parameters
(``requires_grad``: the master weights, AdamW moments and gradients). They are the same but under LoRA, whose frozen
base has a staging copy only.
"""

from __future__ import annotations

from torch import nn

from compress.layout import UnitLayout
from lit_fsdp.weights import clean_name


def unit_params(module: nn.Module, prefix: str, skip: set[int]) -> list[tuple[tuple[str, ...], nn.Parameter]]:
    """``module``'s parameters not in ``skip`` (ids), each with its name under ``prefix`` and its tied aliases."""
    found: dict[int, tuple[list[str], nn.Parameter]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in skip:
            continue
        full_name = clean_name(f"{prefix}.{name}" if prefix else name)
        found.setdefault(id(param), ([], param))[0].append(full_name)
    return [(tuple(names), param) for names, param in found.values()]


def build_layouts(
    network: nn.Module, blocks: list[tuple[str, nn.Module]], shards: int, shard_rank: int
) -> tuple[list[UnitLayout], UnitLayout]:
    """One layout per block (in forward order) and one for the root: every parameter not in a block."""
    layouts, in_blocks = [], set()
    for name, block in blocks:
        params = unit_params(block, name, skip=set())
        in_blocks.update(id(param) for _, param in params)
        layouts.append(UnitLayout.build(name, params, shards, shard_rank))
    root = UnitLayout.build("root", unit_params(network, "", skip=in_blocks), shards, shard_rank)
    return layouts, root


def trained_layouts(layouts: list[UnitLayout], shards: int, shard_rank: int) -> list[UnitLayout]:
    """Each unit's trained parameters (``requires_grad``) laid out alone; a unit whose every parameter trains keeps its
    layout. Rows shard per parameter, so a unit's shard is its trained and frozen parameters' shards together."""
    return [layout if all(place.param.requires_grad for place in layout.places) else UnitLayout.build(
        layout.name, [(place.names, place.param) for place in layout.places if place.param.requires_grad], shards,
        shard_rank) for layout in layouts]


def leading_root_places(network: nn.Module, blocks: list[tuple[str, nn.Module]], root: UnitLayout) -> int:
    """How many of ``root``'s places come before the first block's parameters in ``network.named_parameters()``: the
    parameters a causal LM uses before its blocks (embeddings), whose gradients reach the host last. The rest (final
    norm, head) are used after the blocks: their gradients come first (``offload.update_split``). A tied head is the
    embedding's parameter, registered with it."""
    in_blocks = {id(param) for _, block in blocks for param in block.parameters()}
    root_params = {id(place.param) for place in root.places}
    before: set[int] = set()
    for _, param in network.named_parameters():
        if id(param) in in_blocks:
            break
        if id(param) in root_params:
            before.add(id(param))
    return sum(1 for place in root.places if id(place.param) in before)
