"""A Hugging Face checkpoint's tensor names and the model's parameters, mapped by transformers' own conversion rules.

transformers 5 holds a mixture-of-experts layer's experts as fused 3D tensors (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``: experts x out x in) while the checkpoints on the Hub keep one tensor per expert
(Qwen3-MoE's ``mlp.experts.E.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.E.w1.weight``). Its conversion
rules (``transformers.conversion_mapping``) say how each family's names and tensors map, in both directions; this
module applies them to our sharded parameters instead of writing rules of our own:

- ``check_layout``: from the files' headers alone, a tensor no parameter takes, a parameter none fills, a shape or
  an expert count that does not match: refused in one line, by the launcher before any process starts.
- ``load_converted``: the checkpoint's tensors, renamed and merged as ``from_pretrained`` does, into the local shard
  of each parameter. Each tensor is read through transformers' shard-on-read (``DtensorShardOperation``): a rank reads
  only the rows of its shard, and of a per-expert list only the experts of its shard. Every target is converted and
  written before the next is read, so no more than one parameter is ever held in full.
- ``checkpoint_state_dict``: the reverse, the model's state dict under the checkpoint's names (what
  ``save_pretrained`` writes).

These are transformers' internal APIs (``transformers.core_model_loading``), declared in pyproject.toml's bounds and
guarded by a round-trip test (tests/test_moe_load.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    SkipParameters,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
    spawn_materialize,
)
from transformers.distributed.sharding_utils import DtensorShardOperation
from transformers.utils.loading_report import LoadStateDictInfo

from lit_fsdp.errors import OneLineError


def conversion_rules(model: nn.Module) -> list[WeightRenaming | WeightConverter]:
    """transformers' renamings and converters for ``model``'s family (empty for a family stored as it is built)."""
    return get_model_conversion_mapping(model)


def _rules(model: nn.Module) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    rules = conversion_rules(model)
    return ([rule for rule in rules if isinstance(rule, WeightRenaming)],
            [rule for rule in rules if isinstance(rule, WeightConverter)])


def check_layout(model: nn.Module, folder: Path, weight_map: dict[str, str], params: dict[str, torch.Tensor],
                 known: Collection[str] = ()) -> dict[str, list[tuple[str, str | None]]]:
    """Refuse in one line a checkpoint (``weight_map``: key -> file in ``folder``) that does not fill ``params`` (clean
    name -> parameter; ``known``: other names a checkpoint may hold or lack, LoRA's adapters, a tied head, the
    buffers): a tensor no parameter takes, a parameter
    no tensor fills, a tensor renamed alone of another shape, a converter's sources in unequal numbers (an expert
    missing). Reads the files' headers only, so the launcher checks a folder before any process starts. Returns each
    parameter's sources: (checkpoint key, the converter's pattern it matched, or None where it is renamed alone)."""
    from safetensors import safe_open

    renamings, converters = _rules(model)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    known = set(params) | set(known)
    prefix = getattr(model, "base_model_prefix", None)
    sources: dict[str, list[tuple[str, str | None]]] = {}
    filled: set[str] = set()
    unexpected: list[str] = []
    for key in sorted(weight_map, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, params)
        if target not in params and key in params:  # a name the rules would rename but the model holds as it is
            target, pattern = key, None
        if target in params:
            sources.setdefault(target, []).append((key, pattern))
            # a converter that splits (q, k, v from one tensor) is keyed by its first target and fills the others
            filled.update(target.replace(by_pattern[pattern].target_patterns[0], other)
                          for other in (by_pattern[pattern].target_patterns if pattern is not None else ()))
        elif target not in known and not _ignored(model, target):
            unexpected.append(key)
    if unexpected:
        raise OneLineError(f"{folder} holds {unexpected[0]!r}, which {type(model).__name__} has no parameter for "
                           f"({len(unexpected)} such tensors); is it the same architecture?")
    missing = [name for name in params if name not in sources and name not in filled]
    if missing:
        raise OneLineError(f"{folder} has no weight for parameter {missing[0]!r} ({len(missing)} missing); is it the "
                           "same architecture?")
    with contextlib.ExitStack() as files:
        handles: dict[str, Any] = {}
        for target, keys in sources.items():
            counts = {}
            for key, pattern in keys:
                if pattern is not None:
                    counts[pattern] = counts.get(pattern, 0) + 1
                    continue
                file = weight_map[key]
                if file not in handles:
                    handles[file] = files.enter_context(safe_open(str(folder / file), framework="pt"))
                shape = list(handles[file].get_slice(key).get_shape())
                if shape != list(params[target].shape):
                    raise OneLineError(f"{folder} holds {key!r} of shape {shape}, where the model's {target!r} is "
                                       f"{list(params[target].shape)}; is it the same architecture and config.json?")
            if len(set(counts.values())) > 1:
                found = ", ".join(f"{count} of {pattern}" for pattern, count in counts.items())
                raise OneLineError(f"{folder} holds {found} for {target!r}; is one missing, or is config.json another "
                                   "model's?")
    return sources


def load_converted(model: nn.Module, folder: Path, weight_map: dict[str, str], params: dict[str, torch.Tensor],
                   known: Collection[str] = ()) -> None:
    """Write the tensors of the safetensors files ``weight_map`` names (key -> file in ``folder``) into ``params``
    (clean name -> parameter, a DTensor shard or a whole tensor), converted by ``conversion_rules``; ``known``:
    other names it may hold or lack (``check_layout``, first)."""
    from safetensors import safe_open

    sources = check_layout(model, folder, weight_map, params, known)
    _, converters = _rules(model)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    handles: dict[str, Any] = {}
    targets: dict[str, WeightRenaming | WeightConverter] = {}
    for target, keys in sources.items():
        param = params[target]
        for key, pattern in keys:
            if pattern is not None:
                mapping = targets.setdefault(target, deepcopy(by_pattern[pattern]))
            else:
                mapping = targets.setdefault(target, WeightRenaming(key, target))
                pattern = key
            file = weight_map[key]
            if file not in handles:
                handles[file] = safe_open(str(folder / file), framework="pt")
            index = len(mapping.collected_tensors.get(pattern, [])) if isinstance(mapping, WeightConverter) else None
            reader = spawn_materialize(None, handles[file].get_slice(key), dtype=param.dtype,
                                       sharding_op=DtensorShardOperation(param) if isinstance(param, DTensor) else None,
                                       tensor_idx=index)
            mapping.add_tensor(target, key, pattern, reader)
    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(), conversion_errors={},
                             error_msgs=[], skipped_pp_keys=set())
    for first, mapping in targets.items():
        if _local(params[first]).numel() == 0:  # fewer experts than ranks: this rank holds none of them
            continue
        try:
            converted = mapping.convert(first, model=model, config=model.config, loading_info=info)
        except SkipParameters:  # transformers recorded why (a traceback's text) in info.conversion_errors
            lines = [line.strip() for line in str(info.conversion_errors.get(first, "")).splitlines() if line.strip()]
            reason = lines[-1][:200] if lines else "no reason given"
            raise OneLineError(f"{folder}: the tensors for {first!r} do not convert ({reason}); is one missing, or is "
                               "config.json another model's?") from None
        for name, value in converted.items():
            value = value[0] if isinstance(value, list) else value
            if name not in params:
                raise OneLineError(f"{folder}: converting {first!r} gave {name!r}, which {type(model).__name__} has "
                                   "no parameter for; is it the same architecture?")
            local = _local(params[name])
            if tuple(value.shape) != tuple(local.shape):
                raise OneLineError(f"{folder}: the tensors converted into {name!r} give this rank {list(value.shape)} "
                                   f"where its shard of the model's {list(params[name].shape)} is {list(local.shape)}; "
                                   "is it the same architecture and config.json?")
            local.copy_(value)


def checkpoint_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (the model's names) under the checkpoint's names, as ``save_pretrained`` writes them: per-expert
    tensors for the mixture-of-experts families whose Hub checkpoints hold them so."""
    return revert_weight_conversion(model, dict(state_dict))


def _ignored(model: nn.Module, name: str) -> bool:
    """Whether the model declares ``name`` as a checkpoint tensor to ignore (``_keys_to_ignore_on_load_unexpected``)."""
    import re

    return any(re.search(pattern, name) for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``: a DTensor's local shard, or the whole tensor."""
    return param.to_local() if isinstance(param, DTensor) else param
