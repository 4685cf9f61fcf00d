"""Every version-sensitive or private torch API lit_fsdp uses, in one place, for torch 2.11 (the floor) to 2.14.

Private modules move between releases and public collectives appear in some releases only
(``dist.all_gather_single`` is newer than 2.11): the rest of the project imports them from here, so a
new torch release is checked, and if need be adapted, in this module alone. ``tests/test_torch_compat.py``
pins what each name must provide.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.multiprocessing.reductions import StorageWeakRef

#: the oldest torch release lit_fsdp supports and tests (pyproject.toml asks for it; CI runs the distributed tests on it)
TORCH_FLOOR = (2, 11)
#: the newest torch minor release tested (CI runs a list of tests on it; pyproject.toml caps torch below the next one)
TORCH_NEWEST_TESTED = (2, 14)

__all__ = [
    "AllGather", "ReduceScatter", "CheckpointImpl", "checkpoint_wrapper", "TORCH_FLOOR", "TORCH_NEWEST_TESTED",
    "all_gather_bytes", "bf16_native", "torch_version", "kineto_events", "allocation_events", "storage_weak_ref",
]


def torch_version() -> tuple[int, int]:
    """(major, minor) of the running torch."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: Every rank's equally sized tensor concatenated in rank order into one output tensor (one collective), and
#: the flat reduce-scatter: torch 2.13 renamed them ``all_gather_single`` / ``reduce_scatter_single`` and warns on
#: the old names, which 2.11 (where the new ones do not exist) still needs.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_bytes(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None = None,
                     async_op: bool = False):
    """Every rank's equally sized ``local`` concatenated in rank order into ``output`` (one collective)."""
    return all_gather_flat(output, local, group=group, async_op=async_op)


def bf16_native(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 in hardware (Ampere and newer); emulated bf16 (V100, T4) does not count."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)


# --- torch.profiler's kineto events -------------------------------------------------------------------------
# ``prof.profiler.kineto_results.events()`` and the ``_KinetoEvent`` getters are private pybind bindings
# (torch/csrc/autograd/init.cpp); callbacks/comm_profiler.py reads them through this function only.


def kineto_events(prof: torch.profiler.profile) -> list[dict]:
    """The events of ``prof``'s finished cycle as plain dicts (times in ns); empty if it recorded none.

    Keys: ``name``, ``start_ns``, ``end_ns``, ``thread_id`` (torch's id of the CPU thread), ``device_type``
    (``"CPU"``, ``"CUDA"``, ...), ``device_index`` (the GPU; the process id for CPU events), ``resource_id`` (the
    CUDA stream; the system thread id for CPU events) and ``is_user_annotation`` (a ``record_function`` range,
    on the CPU or kineto's copy of it on the GPU timeline).

    ``name``, ``start_ns``, ``duration_ns``, ``start_thread_id``, ``device_type``, ``device_index`` and
    ``device_resource_id`` are bound in every release from before 2.11 to 2.14. ``is_user_annotation`` is bound
    since pytorch/pytorch#130733 (mid 2024), so 2.11 to 2.14 have it; a build without it reads as no annotations.
    """
    results = getattr(prof.profiler, "kineto_results", None)
    out = []
    for e in results.events() if results is not None else []:
        start = e.start_ns()
        is_user_annotation = getattr(e, "is_user_annotation", None)
        out.append({
            "name": e.name(), "start_ns": start, "end_ns": start + e.duration_ns(), "thread_id": e.start_thread_id(),
            "device_type": e.device_type().name, "device_index": e.device_index(),
            "resource_id": e.device_resource_id(),
            "is_user_annotation": bool(is_user_annotation()) if is_user_annotation is not None else False,
        })
    return out


def allocation_events(prof: torch.profiler.profile) -> list[tuple[int, int, int, tuple[int, str] | None]]:
    """The allocator's events of a ``profile_memory=True`` profile, in time order: (start ns, address, bytes (negative:
    freed), the op that was running as (its start ns, its name), or None). ``experimental_event_tree`` and its nodes'
    ``typed`` fields are private bindings of torch's profiler (torch/csrc/profiler/python/init.cpp), in 2.11 to 2.14."""
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children)
    return sorted((n.start_time_ns, n.typed[1].ptr, n.typed[1].alloc_size,
                   None if n.parent is None else (n.parent.start_time_ns, n.parent.name))
                  for n in nodes if n.typed[0].name == "Allocation")


def storage_weak_ref(tensor: torch.Tensor) -> Callable[[], torch.UntypedStorage | None]:
    """A weak reference to ``tensor``'s storage, which its views share: called, the storage while it lives, else None.
    torch's multiprocessing keeps storages so (``StorageWeakRef``); taking one back is its private
    ``UntypedStorage._new_with_weak_ptr``, in 2.11 to 2.14."""
    weak = StorageWeakRef(tensor.untyped_storage())
    return lambda: torch.UntypedStorage._new_with_weak_ptr(weak.cdata)
