"""SlideFSDP's host memory: master shards, the staging copy the device loads from, and gradient buffers.

Per unit and rank:

- **master**: this rank's rows of every trained parameter (shard layout; float32, or bfloat16 with ``master_dtype``,
  then the staging rows themselves where they are laid out alike: ``master_in_staging``). The ranks of a node own
  disjoint rows, so a node holds one master copy in all (like FSDP's sharded state), whatever the
  number of ranks. A frozen parameter (LoRA's base) has none: its staging rows are its only host copy.
- **staging**: what the device loads, in the compute dtype, every parameter. With ``param_transfer: shard`` each rank
  keeps its own rows (shard layout) and the devices all-gather the rest. With ``full`` every rank
  copies whole blocks, so the node keeps one full copy (full layout) in shared memory that each rank
  writes its rows into after its update; one process alone keeps it in private memory.
- **gradients** (of the trained parameters): a ring of pinned buffers (``gradient_slots``), each the size of the
  largest block's shard,
  the reduced gradients land in from the device (a larger part of the root in several pieces), each piece followed
  by the device's verdict on whether its part is finite; with gradient accumulation or clipping also one fp32 buffer
  per unit that holds the sum until the optimizer step (clipping needs every gradient before the first update).
- **activations** (``activation_offload: cpu``): one buffer per checkpointed block for its input, made at the
  first forward that needs it (the shape is known only then); and one region per ``host`` block of the activation
  plan, its saved tensors carved out of it (``offload.saved_on_host``). A region is closed (replaced by a larger one,
  or at teardown) only after the last copy from or into it has run: the host may be ahead of the device.

Every buffer is one exact-size allocation (``HostRegion``), closed by ``HostState.close``. Those that cross PCIe
(staging, gradient ring, activations) are pinned in place on GPUs unless pinning is off or fails.
"""

from __future__ import annotations

import ctypes
import os
import queue
import time
import uuid
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from compress.layout import ParamPlace, UnitLayout
from lit_fsdp.errors import PeerLostError
from offload.host_memory import FLAG_ELEMENTS, UnitSize, piece_capacity
from offload.transfers import Event, Transfers

SHM_DIR = Path("/dev/shm")


class HostRegion:
    """One host allocation, pinned in place (``cudaHostRegister``) when asked and possible, unpinned by ``close``.

    Registered in place rather than allocated by torch's pinned allocator, which rounds each allocation up
    to a power of two (a 436 MB block would take 512 MiB); pageable if the registration fails.
    """

    def __init__(self, tensor: torch.Tensor, pin: bool):
        self.tensor = tensor
        self.pinned = register_host_memory(tensor, tensor.numel() * tensor.element_size()) if pin and tensor.numel() else False
        self.last_copy: Event = None  # the event of the last copy queued from or into it (``HostState.activation_copy``)

    @classmethod
    def empty(cls, numel: int, dtype: torch.dtype, pin: bool) -> "HostRegion":
        """A fresh allocation of exactly ``numel`` elements."""
        return cls(torch.empty(numel, dtype=dtype), pin)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        """Unpin, once the last copy noted (``last_copy``) has run: a copy still queued may read or write it."""
        Transfers.synchronize(self.last_copy)
        self.last_copy = None
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


def can_pin(device: torch.device, wanted: bool) -> bool:
    """Whether host buffers can be pinned: only for a CUDA device, and only if a test allocation succeeds."""
    if not wanted or device.type != "cuda":
        return False
    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as error:  # e.g. a container's locked-memory limit
        rank_zero_warn(f"SlideFSDP: pinning host memory failed ({str(error).splitlines()[0]}); copies use pageable memory")
        return False
    return True


CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, not only the current device's


def register_host_memory(tensor: torch.Tensor, nbytes: int) -> bool:
    """Pin ``tensor``'s memory in place (``cudaHostRegister``, portable); False, with a warning, if that fails.

    The binding does not clear CUDA's error state after a failed call, which would make an unrelated later
    kernel fail: the error is read back (and so cleared) with ``cudaGetLastError``; a torch without that
    binding stops here with the fix instead of going on with the error set.
    """
    cudart = torch.cuda.cudart()
    code = int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE))
    if code == 0:
        return True
    clear = getattr(cudart, "cudaGetLastError", None) or loaded_cuda_get_last_error()
    if clear is None:
        raise RuntimeError(f"SlideFSDP: cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (CUDA error {code}); "
                           "set --trainer.strategy.init_args.pin_memory false to use pageable host memory")
    clear()
    rank_zero_warn(f"SlideFSDP: cudaHostRegister of {nbytes / 2**30:.1f} GiB failed (CUDA error {code}); "
                   "host-to-device copies from it use pageable memory")
    return False


def loaded_cuda_get_last_error() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the CUDA runtime this process has loaded (torch's binding lacks it), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libcudart" in line})
    if not paths:
        return None
    try:
        return ctypes.CDLL(paths[0]).cudaGetLastError
    except (OSError, AttributeError):
        return None


def shared_memory_free() -> int:
    """Free bytes in /dev/shm (0 where there is none)."""
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def check_shared_memory(nbytes: int) -> None:
    """Raise, in one line with the fix, unless /dev/shm has ``nbytes`` free for the node's shared staging copy."""
    free = shared_memory_free()
    if free < nbytes:
        raise ValueError(
            f"SlideFSDP needs {nbytes / 2**30:.1f} GiB in {SHM_DIR} for the node's shared staging copy, "
            f"{free / 2**30:.1f} GiB are free; enlarge it (docker run --shm-size) or set param_transfer: shard"
        )


def map_node_file(name: str, numel: int, dtype: torch.dtype, local_rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """A tensor the ranks of a node map together from one file in /dev/shm: local rank 0 creates and sizes it, every
    local rank maps it, then local rank 0 unlinks the name: the memory lives while a rank maps it, and nothing is left
    behind if a rank dies."""
    path = SHM_DIR / name
    if local_rank == 0:
        with open(path, "wb") as f:
            f.truncate(numel * dtype.itemsize)
    dist.barrier(group=group)
    tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
    dist.barrier(group=group)
    if local_rank == 0:
        path.unlink()
    return tensor


class SharedStaging:
    """One file in /dev/shm that the ranks of a node map together: the full-layout staging copy of every unit."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, local_rank: int, node_tag: str, group: dist.ProcessGroup):
        # Every rank checks, before the barrier: a rank that waited there for local rank 0's refusal would wait
        # until the collective timeout. The file is sparse until written, so the ranks see the same free space.
        # The preflight has checked it already, before launch; this catches a /dev/shm that filled up since.
        check_shared_memory(numel * dtype.itemsize)
        self.region = HostRegion(map_node_file(f"lit_fsdp_slide_{node_tag}", numel, dtype, local_rank, group), pin)


class SharedMarks:
    """Per local rank and unit, the last ordered update (its epoch) whose rows that rank has written to the node's
    shared staging copy: a load of a unit waits until every local rank has reached the step's epoch for it. Each
    cell has one writer; the update's stores precede its mark's (the worker releases and takes the GIL between them,
    a full memory barrier).

    Each rank's row ends with its pid and a flag it sets when it leaves the step on an error (``abandon``): a wait for
    a rank that failed or exited (a zombie its parent has not reaped yet counts: the parent may be the rank waiting)
    ends within ``LOOK_S`` with one line naming it, instead of at ``timeout_s``.
    """

    PID, ABANDONED = 0, 1  # the cells after a rank's marks
    #: The wait's first and longest pause between looks: short at first (an update of a block takes milliseconds, and
    #: the forward waits on it), then backing off so that a long wait does not take a core from the updates.
    FIRST_POLL_S, LAST_POLL_S = 0.00005, 0.002
    LOOK_S = 0.2  # how often a wait asks whether the ranks behind are still there

    def __init__(self, cells: torch.Tensor, local_rank: int, timeout_s: float):
        """
        Args:
            cells: The node's shared int64 cells, one row per local rank: a mark per unit, then the pid and the flag.
            timeout_s: The longest wait for a rank that is alive and has not failed (the strategy's ``timeout``).
        """
        self.cells, self.units = cells, cells.shape[1] - 2
        self.marks = cells[:, : self.units]
        self.local_rank, self.timeout_s = local_rank, timeout_s
        cells[local_rank].zero_()
        cells[local_rank, self.units + self.PID] = os.getpid()
        self.unseen: set[int] = set()  # local ranks whose pid this process cannot see (another pid namespace)

    @classmethod
    def on_node(cls, units: int, local_rank: int, local_ranks: int, node_tag: str, group: dist.ProcessGroup,
                timeout_s: float) -> "SharedMarks":
        """The node's marks, in a file of /dev/shm that its ranks map together (``map_node_file``)."""
        cells = map_node_file(f"lit_fsdp_slide_marks_{node_tag}", local_ranks * (units + 2), torch.int64, local_rank,
                              group)
        marks = cls(cells.view(local_ranks, units + 2), local_rank, timeout_s)
        dist.barrier(group=group)
        marks.unseen = {rank for rank in range(local_ranks) if process_gone(marks.pid(rank))}
        return marks

    def pid(self, rank: int) -> int:
        return int(self.cells[rank, self.units + self.PID])

    def mark(self, unit: int, epoch: int) -> None:
        """This rank's rows of ``unit`` are written for ``epoch``."""
        self.marks[self.local_rank, unit] = epoch

    def abandon(self) -> None:
        """This rank leaves the step on an error: it will mark nothing more, and the other ranks' waits end."""
        self.cells[self.local_rank, self.units + self.ABANDONED] = 1

    def reached(self, unit: int, epoch: int) -> bool:
        return bool((self.marks[:, unit] >= epoch).all())

    def wait(self, unit: int, epoch: int, failure: Callable[[], BaseException | None]) -> None:
        """Until every local rank has marked ``unit`` for ``epoch``; raises this rank's update ``failure``, or one line
        naming a rank behind that has failed or exited, or, after ``timeout_s``, one naming the ranks that did not."""
        began = time.monotonic()
        pause, look = self.FIRST_POLL_S, began + self.LOOK_S
        while not self.reached(unit, epoch):
            error = failure()
            if error is not None:
                raise error
            now = time.monotonic()
            if now >= look:
                self._check_behind(unit, epoch)
                look = now + self.LOOK_S
            if now - began > self.timeout_s:
                raise RuntimeError(f"SlideFSDP: local ranks {self._behind(unit, epoch)} did not update unit {unit} for "
                                   f"step {epoch} within {self.timeout_s:g} s (the strategy's timeout); look for an "
                                   "error in their logs")
            time.sleep(pause)
            pause = min(2 * pause, self.LAST_POLL_S)

    def _behind(self, unit: int, epoch: int) -> list[int]:
        return [rank for rank, epochs in enumerate(self.marks[:, unit].tolist()) if epochs < epoch]

    def _check_behind(self, unit: int, epoch: int) -> None:
        for rank in self._behind(unit, epoch):
            pid = self.pid(rank)
            if int(self.cells[rank, self.units + self.ABANDONED]):
                how = "failed"
            elif pid and rank not in self.unseen and process_gone(pid):
                how = "exited"
            else:
                continue
            raise PeerLostError(f"SlideFSDP: local rank {rank} (pid {pid}) {how} before updating unit {unit} for step "
                                f"{epoch}; its log says why")


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended: no such process here, or a zombie its parent has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, under another user
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: the signal's answer stands
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"])


class BufferRing:
    """A fixed number of equal host buffers (one exact-size region) handed out and given back; ``acquire`` waits for a free one."""

    POLL_S = 0.5  # how often a waiting ``acquire`` looks for a failure of the side that gives buffers back

    def __init__(self, count: int, numel: int, dtype: torch.dtype, pin: bool):
        self.count = count
        self.region = HostRegion.empty(count * numel, dtype, pin)
        buffers = self.region.tensor.split(numel) if numel else [self.region.tensor] * count
        self._by_address = {buffer.data_ptr(): buffer for buffer in buffers}
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for buffer in buffers:
            self._free.put(buffer)

    def acquire(self, numel: int, failure: Callable[[], BaseException | None] = lambda: None,
                waiting: Callable[[], AbstractContextManager] = nullcontext) -> torch.Tensor:
        """A free buffer's first ``numel`` elements. While none is free: waits inside ``waiting()`` (the backward's
        clock marks the wait there), and raises ``failure()`` once it is not None (the worker that gives buffers back
        has failed: waiting longer would wait forever)."""
        try:
            return self._free.get_nowait()[:numel]
        except queue.Empty:
            pass
        with waiting():
            while True:
                try:
                    return self._free.get(timeout=self.POLL_S)[:numel]
                except queue.Empty:
                    error = failure()
                    if error is not None:
                        raise error

    def release(self, buffer: torch.Tensor) -> None:
        """Give back a buffer ``acquire`` handed out (or any view that starts where it does)."""
        self._free.put(self._by_address[buffer.data_ptr()])


class HostState:
    """Master shards, staging copies and gradient buffers for every unit (see the module docstring)."""

    def __init__(
        self,
        layouts: list[UnitLayout],
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        full_staging: bool,
        keep_gradients: bool,
        incoming_full: bool,
        ring_size: int,
        pin: bool,
        shared: SharedStaging | None,
        trained: list[UnitLayout] | None = None,
        master_dtype: torch.dtype = torch.float32,
        master_in_staging: bool = False,
    ):
        """
        Args:
            layouts: Every unit, blocks then root.
            trained: Each unit's trained parameters (``offload.layout.trained_layouts``); default: every parameter.
            full_staging: Staging in the full layout (``param_transfer: full``), else this rank's shard.
            keep_gradients: One fp32 gradient buffer per unit (accumulation, clipping).
            incoming_full: Gradients arrive whole (``grad_sync: cpu_reduce``), not as this rank's shard.
            shared: The node's shared memory for full staging, when several ranks share it.
            master_dtype: The master rows' dtype (float32, or bfloat16 rounded stochastically by the update).
            master_in_staging: The master rows are this rank's staging rows (``offload.host_memory.master_in_staging``
                decides): a bfloat16 master the device loads as it is, with no copy of its own.
        """
        self.layouts = layouts
        self.trained = trained or layouts
        self.trained_at: list[list[int]] = []  # per unit, where each trained parameter is among all its parameters
        for layout, trained_layout in zip(layouts, self.trained):
            index = {id(place.param): number for number, place in enumerate(layout.places)}
            self.trained_at.append([index[id(place.param)] for place in trained_layout.places])
        self.full_staging = full_staging
        self.shared = shared
        sizes = [layout.full_numel if full_staging else layout.shard_numel for layout in layouts]
        self.staging_region = shared.region if shared is not None else HostRegion.empty(sum(sizes), compute_dtype, pin)
        self.staging = list(self.staging_region.tensor[: sum(sizes)].split(sizes))
        self.master_in_staging = master_in_staging
        if master_in_staging:
            self.master = self.staging
            for unit in range(len(layouts)):  # the promise the plan made: each master row is its staging row
                rows = zip(self.staging_targets(unit), self.trained[unit].local_views(self.master[unit]))
                if compute_dtype != master_dtype or any(a.data_ptr() != b.data_ptr() or a.shape != b.shape for a, b in rows):
                    raise AssertionError(f"unit {unit}'s master rows are not its staging rows")
        else:
            self.master = [torch.zeros(layout.shard_numel, dtype=master_dtype) for layout in self.trained]
        self.gradients = [torch.zeros(layout.shard_numel, dtype=torch.float32, pin_memory=False)
                          for layout in self.trained] if keep_gradients else None
        units = [UnitSize(layout.full_numel, layout.shard_numel) for layout in self.trained]
        self.piece_capacity = piece_capacity(units, incoming_full, layouts[0].shards)
        self.incoming = BufferRing(ring_size, self.piece_capacity + FLAG_ELEMENTS, reduce_dtype, pin)
        self.activations: dict[Hashable, HostRegion] = {}  # ``activation_buffer``'s regions

    def staging_rows(self, unit: int) -> list[torch.Tensor]:
        """This rank's rows of each of ``unit``'s parameters in the staging copy (views, ``local_views`` order)."""
        layout = self.layouts[unit]
        return layout.local_rows_in_full(self.staging[unit]) if self.full_staging else layout.local_views(self.staging[unit])

    def staging_targets(self, unit: int) -> list[torch.Tensor]:
        """Where this rank's rows of each of ``unit``'s trained parameters go in the staging copy (views, in the order
        of ``trained[unit]``)."""
        rows = self.staging_rows(unit)
        return [rows[index] for index in self.trained_at[unit]]

    def frozen_rows(self) -> list[tuple[ParamPlace, torch.Tensor]]:
        """Every frozen parameter (no master: LoRA's base) with this rank's rows of it in the staging copy."""
        return [(place, rows) for unit, layout in enumerate(self.layouts)
                for place, rows in zip(layout.places, self.staging_rows(unit)) if not place.param.requires_grad]

    def write_staging(self, unit: int) -> None:
        """Copy this rank's master rows of ``unit`` into the staging copy, in the compute dtype (after init or a load;
        the CPU update writes its rows as it goes). Frozen rows are written once, by init or loading, and kept; a master
        in the staging copy is there already."""
        if self.master_in_staging:
            return
        for target, rows in zip(self.staging_targets(unit), self.trained[unit].local_views(self.master[unit])):
            target.copy_(rows)

    def activation_buffer(self, key: Hashable, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """Host memory for activations: ``key`` a checkpointed block's input (``activation_offload: cpu``) or a ``host``
        block's saved tensors (``offload.saved_on_host.region_key``). An exact-size region, made at the first forward
        that needs it and again only if its size or dtype changes; the old one is closed once its last copy ran (with
        accumulation on the device nothing else waits for the last micro-batch's fetch from it)."""
        region = self.activations.get(key)
        if region is None or region.tensor.numel() != numel or region.tensor.dtype != dtype:
            if region is not None:
                region.close()
            region = self.activations[key] = HostRegion.empty(numel, dtype, pin)
        return region.tensor

    def activation_copy(self, key: Hashable, copied: Event) -> None:
        """A copy from or into ``key``'s activation region was queued and completes at ``copied``: closing the region
        waits for it. A key without a region (a copy into pageable memory) is ignored."""
        region = self.activations.get(key)
        if region is not None:
            region.last_copy = copied

    def parameter_count(self) -> int:
        return sum(place.numel for layout in self.layouts for place in layout.places)

    def describe(self, compute: torch.dtype, shards: int, pin: bool) -> str:
        """What the host holds, in a line: parameters (trained and frozen), units, the master and the staging copy."""
        parameters = self.parameter_count()
        trained = sum(place.numel for layout in self.trained for place in layout.places)
        frozen = "" if trained == parameters else (f" ({trained / 1e6:.2f}M trained; the frozen rest has no master, "
                                                   f"only its {compute} copy)")
        master = "the staging copy" if self.master_in_staging else str(self.master[0].dtype) if self.master else "none"
        largest = max(layout.full_numel for layout in self.layouts[:-1]) * compute.itemsize
        return (f"{parameters / 1e6:.1f}M parameters{frozen} in {len(self.layouts) - 1} blocks + root; master "
                f"({master}) sharded over {shards} rank(s) per node; blocks of {largest / 2**20:.1f} MiB in {compute}; "
                f"{self.incoming.count} gradient slots, pinned host buffers: {pin}")

    def buffer_bytes(self, count_shared: bool) -> dict[str, int]:
        """This rank's host bytes per buffer, named as ``offload.host_memory.host_buffers`` names them (a shared
        staging copy only if ``count_shared``)."""
        def nbytes(tensors: list[torch.Tensor] | None) -> int:
            return sum(t.numel() * t.element_size() for t in tensors or [])

        return {
            "master": 0 if self.master_in_staging else nbytes(self.master),
            "staging": nbytes(self.staging) if self.shared is None or count_shared else 0,
            "kept_gradients": nbytes(self.gradients),
            "gradient_ring": self.incoming.region.nbytes,
            "activations": sum(region.nbytes for region in self.activations.values()),
        }

    def close(self) -> None:
        """Unpin the staging copy (the node's shared one too), the gradient ring and the activation buffers."""
        self.staging_region.close()
        self.incoming.region.close()
        for region in self.activations.values():
            region.close()


def node_tag(node_rank: int) -> str:
    """A name shared by the ranks of one job and node, for its shared-memory file (a collective on the world)."""
    tag = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tag, src=0)
    return f"{tag[0]}_node{node_rank}"
