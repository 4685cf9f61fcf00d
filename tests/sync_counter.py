"""``SyncCounter``: count, on the CPU, the points where a CUDA run of the same code would block the host.

A CUDA program only overlaps communication with compute while the host runs ahead of the device. It stops
running ahead wherever it needs a value or a shape that the device has not produced yet, or copies from
the host in a way that waits. On the CPU nothing waits, so those points are invisible; this counter makes
them visible by what they are:

- ``aten._local_scalar_dense``: ``.item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``bytes(t)`` (one per element);
  ``aten.equal`` (``torch.equal``), whose answer is a bool on the host;
- ops whose output shape depends on the data: ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
  with tensor repeats, indexing with a boolean mask, and index-put with a boolean mask of more than one value;
- ``aten.lift_fresh``: a tensor built from Python data (``torch.tensor([...])``, or the value of ``t[0] = 5``), a
  blocking host-to-device copy on CUDA; not where the value only fills (``t[:2] = 5``, ``t[mask] = 5``);
- ``Tensor.tolist()``, ``Tensor.cpu()``, ``Tensor.numpy()``: device-to-host copies; on CPU tensors they never reach
  the dispatcher, so the ``torch.Tensor`` methods are patched while the counter is active;
- ``Tensor.to(...)`` to the host: a target named as the CPU (``"cpu"``, ``device="cpu"``), or a CPU ``torch.device`` or
  tensor when the source is not on the CPU. A ``torch.device`` alone does not count from a CPU source: on the CPU every
  ``t.device`` is the CPU, and ``x.to(t.device)`` stays on the device in a CUDA run;
- ``aten.copy_`` into a CPU tensor from one on another device, except a ``non_blocking`` copy into pinned memory;
- calls of ``compress.timing.wait_for_device`` (the communication path's one deliberate wait) and of
  ``torch.cuda.synchronize``.

On the CPU every tensor is on the host, so a tensor that a CUDA run would also keep on the host (a CPU
generator's draws, a lookup table) counts when it is read or built: keep such data in Python.

A dispatch mode is thread-local: enter the counter on the thread that runs the code measured (FSDP2's hooks
run on the autograd thread, which for CPU tensors is the thread that called ``backward``). The patched
methods are process-wide. Entering is re-entrant: nested ``with counter:`` blocks count once.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import compress.timing

_REPO = Path(__file__).resolve().parents[1]
#: where a sync point is reported: the innermost frame in one of these folders of the repository
_PACKAGES = ("compress", "lit_fsdp", "callbacks")
_OWN_CODE = tuple(str(_REPO / package) + "/" for package in _PACKAGES)

aten = torch.ops.aten
#: aten ops that read a value on the host, or whose output shape depends on the values (always)
_SYNC_OPS = {
    aten._local_scalar_dense, aten.equal, aten.nonzero, aten.masked_select, aten.lift_fresh,
    aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive, aten.unique_dim_consecutive,
}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_HOST_COPIES = ("tolist", "cpu", "numpy")


class SyncPoint(NamedTuple):
    op: str  # "aten._local_scalar_dense", "Tensor.tolist", "wait_for_device", ...
    where: str  # "compress/communicator.py:123 (screen)": the innermost frame in compress/, lit_fsdp/ or callbacks/


def summary(points: list[SyncPoint]) -> str:
    """``3 x aten._local_scalar_dense at compress/communicator.py:140 (screen); ...``, most frequent first."""
    return "; ".join(f"{n} x {op} at {where}" for (op, where), n in Counter(points).most_common()) or "no syncs"


def _bool_index(args: tuple, kwargs: dict) -> bool:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _copies_to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``aten.copy_(dst, src, non_blocking)`` copies from another device into host memory and waits for it."""
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return dst.device.type == "cpu" and src.device.type != "cpu" and not (non_blocking and dst.is_pinned())


def _moves_to_host(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` is a device-to-host copy (see the module docstring for a CPU source)."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str):
        return target.split(":")[0] == "cpu"
    if isinstance(target, torch.Tensor):
        target = target.device
    return isinstance(target, torch.device) and target.type == "cpu" and tensor.device.type != "cpu"


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    packet = func.overloadpacket
    if packet in _SYNC_OPS:
        return True
    if packet is aten.copy_:
        return _copies_to_host(args, kwargs)
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):  # length: the repeats' sum
        return kwargs.get("output_size") is None
    if packet is aten.index:  # a boolean mask index is a nonzero() in disguise
        return _bool_index(args, kwargs)
    if packet in _INDEX_OPS:  # ... unless one value fills the mask: index_put_ is then a masked_fill_
        value = args[2] if len(args) > 2 else kwargs.get("values")
        return _bool_index(args, kwargs) and value.numel() != 1
    return False


def _fills_from_host(func: Any, args: tuple, fresh: torch.Tensor) -> bool:
    """Whether ``func`` uses the host scalar ``fresh`` (a Python number in ``t[...] = 5``) without a copy to the device.

    ``t[:2] = 5`` and ``t[...] = 5`` become ``fill_`` and ``t[mask] = 5`` a ``masked_fill_``: the value travels as a
    kernel argument. ``t[0] = 5`` (``copy_``) and ``t[positions] = 5`` (``index_put_``) copy it to the device first,
    a blocking copy on CUDA (pytorch/pytorch#186482, #188267).
    """
    if fresh.dim() != 0:
        return False
    if func.overloadpacket is aten.fill_:
        return len(args) > 1 and args[1] is fresh
    if func.overloadpacket in _INDEX_OPS:
        return len(args) > 2 and args[2] is fresh and _bool_index(args, {})
    return False


def _location() -> str:
    """The innermost frame of our own code (compress/, lit_fsdp/, callbacks/), else of any file in the repository."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_OWN_CODE):
            return f"{Path(filename).relative_to(_REPO)}:{frame.f_lineno} ({frame.f_code.co_name})"
        if fallback is None and filename != __file__ and filename.startswith(f"{_REPO}/") and "/.venv" not in filename:
            fallback = f"{Path(filename).relative_to(_REPO)}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return fallback or "outside the repository"


class _Mode(TorchDispatchMode):
    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter
        self._fresh: tuple[int, torch.Tensor] | None = None  # the last lift_fresh: its point's index, its output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if self._fresh is not None and any(a is self._fresh[1] for a in args):
            index, fresh = self._fresh
            self._fresh = None
            if _fills_from_host(func, args, fresh) and index < len(counter.points):
                del counter.points[index]  # not a copy to the device after all
        if counter._inside_patch or not _is_sync(func, args, kwargs):
            return func(*args, **kwargs)
        counter._record(f"aten.{func.overloadpacket.__name__}")
        out = func(*args, **kwargs)
        if func.overloadpacket is aten.lift_fresh:
            self._fresh = (len(counter.points) - 1, out)
        return out


class SyncCounter:
    """Records a ``SyncPoint`` for every host synchronisation made while it is entered; see the module docstring."""

    def __init__(self) -> None:
        self.points: list[SyncPoint] = []
        self._depth = 0
        self._inside_patch = 0
        self._mode: _Mode | None = None
        self._saved: dict[tuple[Any, str], Any] = {}  # (owner, name): the owner's own attribute, or None if inherited

    def __len__(self) -> int:
        return len(self.points)

    def summary(self) -> str:
        return summary(self.points)

    def _record(self, op: str) -> None:
        self.points.append(SyncPoint(op, _location()))

    def _counting(self, owner: Any, name: str, label: str, when: Any = None) -> None:
        """Patch ``owner.name`` to record ``label`` at each call (where ``when(*args, **kwargs)`` holds, if given).

        A call made inside another counted call (``wait_for_device`` calls ``torch.cuda.synchronize``) is that
        call's own work: it is not recorded again.
        """
        original = getattr(owner, name)
        self._saved[(owner, name)] = vars(owner).get(name)
        counter = self

        def counted(*args, **kwargs):
            if counter._inside_patch or (when is not None and not when(*args, **kwargs)):
                return original(*args, **kwargs)
            counter._record(label)
            counter._inside_patch += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._inside_patch -= 1

        setattr(owner, name, counted)

    def __enter__(self) -> "SyncCounter":
        self._depth += 1
        if self._depth == 1:
            for name in _HOST_COPIES:
                self._counting(torch.Tensor, name, f"Tensor.{name}")
            self._counting(torch.Tensor, "to", "Tensor.to(cpu)", when=_moves_to_host)
            wait = compress.timing.wait_for_device
            for module in [m for name, m in sys.modules.items() if name.split(".")[0] in _PACKAGES]:
                if getattr(module, "wait_for_device", None) is wait:  # also where it was imported by name
                    self._counting(module, "wait_for_device", "wait_for_device")
            self._counting(torch.cuda, "synchronize", "torch.cuda.synchronize")
            self._mode = _Mode(self)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._mode.__exit__(*exc)
            self._mode = None
            for (owner, name), own in self._saved.items():
                if own is None:  # inherited (torch.Tensor's methods live on torch._C.TensorBase)
                    delattr(owner, name)
                else:
                    setattr(owner, name, own)
            self._saved.clear()
