"""FSDP2 applied to a transformer in a fixed order: find blocks, checkpoint, compile, shard, prefetch.

``parallelize`` is the one function to read: it calls the verbs below in the order they must run.
Activation checkpointing wraps blocks before compilation, and both come before ``fully_shard`` so
that the sharded unit is the wrapped, compiled block (the order torchtitan uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from compress.torch_compat import CheckpointImpl, checkpoint_wrapper


@dataclass
class ShardingPlan:
    """How to wrap and shard: what the strategy's knobs resolve to once the mesh exists."""

    mesh: DeviceMesh
    reshard_after_forward: bool
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    block_class: str | None = None
    blocks_per_group: int = 1
    checkpoint_every: int = 0
    compile_blocks: bool = False
    prefetch: int = 0
    cpu_offload: bool = False  # torch's CPUOffloadPolicy: sharded parameters, gradients and the optimizer step on the CPU
    pin_memory: bool = True


def parallelize(model: nn.Module, plan: ShardingPlan) -> tuple[list[tuple[str, nn.Module]], list[FSDPModule]]:
    """Shard ``model`` in place; returns its blocks (name, module) and every FSDP module, root last."""
    blocks = find_blocks(model, plan.block_class)
    if plan.checkpoint_every:
        blocks = apply_activation_checkpointing(model, blocks, plan.checkpoint_every)
    if plan.compile_blocks:
        apply_compile(blocks)
    fsdp_modules = apply_fsdp(model, blocks, plan)
    if plan.prefetch:
        apply_prefetch(fsdp_modules[:-1], plan.prefetch)
    return blocks, fsdp_modules


def find_blocks(model: nn.Module, block_class: str | None = None) -> list[tuple[str, nn.Module]]:
    """The transformer blocks, in forward order: modules of ``block_class`` or of the model's ``_no_split_modules``."""
    names = {block_class} if block_class else set(getattr(model, "_no_split_modules", None) or [])
    blocks = [(name, module) for name, module in model.named_modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(
            f"found no transformer block of class {sorted(names) or '(none declared)'} in {type(model).__name__}; "
            "name it with --trainer.strategy.init_args.block_class"
        )
    return blocks


def apply_activation_checkpointing(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], every: int
) -> list[tuple[str, nn.Module]]:
    """Recompute the activations of every ``every``-th block in the backward pass (1 = every block)."""
    wrapped = []
    for index, (name, block) in enumerate(blocks):
        if index % every == 0:
            parent_name, _, child = name.rpartition(".")
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            setattr(model.get_submodule(parent_name), child, block)
        wrapped.append((name, block))
    return wrapped


def apply_compile(blocks: list[tuple[str, nn.Module]]) -> None:
    """Compile each block in place (parameter names do not change)."""
    for _, block in blocks:
        block.compile()


def apply_fsdp(model: nn.Module, blocks: list[tuple[str, nn.Module]], plan: ShardingPlan) -> list[FSDPModule]:
    """``fully_shard`` each group of ``blocks_per_group`` consecutive blocks, then the root."""
    policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.cpu_offload else OffloadPolicy()
    modules: list[nn.Module] = [block for _, block in blocks]
    groups = [modules[i : i + plan.blocks_per_group] for i in range(0, len(modules), plan.blocks_per_group)]
    sharded = []
    for group in groups:
        fully_shard(
            group if len(group) > 1 else group[0],
            mesh=plan.mesh,
            reshard_after_forward=plan.reshard_after_forward,
            mp_policy=policy,
            offload_policy=offload,
        )
        sharded.append(group[0])
    # The root's parameters (embeddings, final norm, head) are used last in backward: keeping them
    # unsharded after forward saves one all-gather, as torchtitan does.
    fully_shard(model, mesh=plan.mesh, reshard_after_forward=False, mp_policy=policy, offload_policy=offload)
    return [*sharded, model]  # type: ignore[list-item]


def apply_prefetch(blocks: list[FSDPModule], depth: int) -> None:
    """Prefetch the parameters of the next ``depth`` units in forward and the previous ``depth`` in backward."""
    for index, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[index + 1 : index + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(0, index - depth) : index][::-1])
