"""A Hugging Face checkpoint's tensor names and the model's parameters, mapped by transformers' own conversion rules.

transformers 5 holds a mixture-of-experts layer's experts as fused 3D tensors (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``: experts x out x in) while the checkpoints on the Hub keep one tensor per expert
(Qwen3-MoE's ``mlp.experts.E.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.E.w1.weight``). Its conversion
rules (``transformers.conversion_mapping``) say how each family's names and tensors map, in both directions; this
module applies them to our sharded parameters instead of writing rules of our own:

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


def load_converted(model: nn.Module, folder: Path, weight_map: dict[str, str], params: dict[str, torch.Tensor],
                   skip: Collection[str] = ()) -> None:
    """Write the tensors of the safetensors files ``weight_map`` names (key -> file in ``folder``) into ``params``
    (clean name -> parameter, a DTensor shard or a whole tensor), converted by ``conversion_rules``; ``skip``:
    parameters that are not in the checkpoint (LoRA's adapters)."""
    from safetensors import safe_open

    rules = conversion_rules(model)
    renamings = [rule for rule in rules if isinstance(rule, WeightRenaming)]
    converters = [rule for rule in rules if isinstance(rule, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    known = set(params) | set(skip) | _tied_and_buffers(model)
    prefix = getattr(model, "base_model_prefix", None)
    handles: dict[str, Any] = {}
    targets: dict[str, WeightRenaming | WeightConverter] = {}
    unexpected: list[str] = []
    for key in sorted(weight_map, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, params)
        if target not in params and key in params:  # a name the rules would rename but the model holds as it is
            target, pattern = key, None
        if target not in params:
            if target not in known and not _ignored(model, target):
                unexpected.append(key)
            continue
        if pattern is not None:
            mapping = targets.setdefault(target, deepcopy(by_pattern[pattern]))
        else:
            mapping = targets.setdefault(target, WeightRenaming(key, target))
            pattern = key
        param = params[target]
        file = weight_map[key]
        if file not in handles:
            handles[file] = safe_open(str(folder / file), framework="pt")
        if isinstance(mapping, WeightRenaming):
            shape = list(handles[file].get_slice(key).get_shape())
            if shape != list(param.shape):
                raise OneLineError(f"{folder} holds {key!r} of shape {shape}, where the model's {target!r} is "
                                   f"{list(param.shape)}; is it the same architecture and config.json?")
        index = len(mapping.collected_tensors.get(pattern, [])) if isinstance(mapping, WeightConverter) else None
        reader = spawn_materialize(None, handles[file].get_slice(key), dtype=param.dtype,
                                   sharding_op=DtensorShardOperation(param) if isinstance(param, DTensor) else None,
                                   tensor_idx=index)
        mapping.add_tensor(target, key, pattern, reader)
    if unexpected:
        raise OneLineError(f"{folder} holds {unexpected[0]!r}, which {type(model).__name__} has no parameter for "
                           f"({len(unexpected)} such tensors); is it the same architecture?")
    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(), conversion_errors={},
                             error_msgs=[], skipped_pp_keys=set())
    loaded: set[str] = set()
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
            loaded.add(name)
    missing = [name for name in params if name not in loaded and _local(params[name]).numel() > 0]
    if missing:
        raise OneLineError(f"{folder} has no weight for parameter {missing[0]!r} ({len(missing)} missing); is it the "
                           "same architecture?")


def checkpoint_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` (the model's names) under the checkpoint's names, as ``save_pretrained`` writes them: per-expert
    tensors for the mixture-of-experts families whose Hub checkpoints hold them so."""
    return revert_weight_conversion(model, dict(state_dict))


def _tied_and_buffers(model: nn.Module) -> set[str]:
    """State-dict names that are not parameters to fill: tied duplicates (a tied head) and persistent buffers."""
    from lit_fsdp.weights import clean_name

    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in model.named_buffers(remove_duplicate=False)]
    return {clean_name(name) for name in names}


def _ignored(model: nn.Module, name: str) -> bool:
    """Whether the model declares ``name`` as a checkpoint tensor to ignore (``_keys_to_ignore_on_load_unexpected``)."""
    import re

    return any(re.search(pattern, name) for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param``: a DTensor's local shard, or the whole tensor."""
    return param.to_local() if isinstance(param, DTensor) else param
