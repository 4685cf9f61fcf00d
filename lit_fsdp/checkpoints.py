"""Checkpoints that are never half-used: written aside, described by a manifest written last, then renamed into place.

Saving ``NAME`` (a sharded folder or one full file) writes ``.NAME.partial-<token>`` beside it. When
every rank has finished, rank 0 adds the manifest (step, world size, global batch, data position and,
for a folder, every file with its size), then renames the result to ``NAME``; the previous ``NAME``
is removed only after that. A folder's manifest is ``lit_fsdp_manifest.json`` inside it; a file's
is stored in the file (``checkpoint["lit_fsdp_manifest"]``) and the rename of the finished file is
what makes it complete. A checkpoint without a complete manifest is never loaded.

``--ckpt_path last`` takes the newest complete checkpoint in the run's checkpoint folder (``last`` or
any step checkpoint, or one whose save was killed after its manifest and before its rename): the one written last,
whatever its step. A run that starts afresh in a folder holding checkpoints says so in its first lines.

``check_space`` refuses, before launch, checkpoints whose folder's disk cannot hold as many as exist at once.

Every checkpoint file is read by ``load``: ``torch.load`` with ``weights_only=True``, which unpickles tensors and
plain Python values only. That is all lit_fsdp writes (every kind saved and read back: FSDP2 sharded and full-file,
SlideFSDP, DDP, each compression method that keeps state), so a file holding anything else is refused before any
of it runs. A sharded folder's ``.metadata`` is unpickled by torch.distributed.checkpoint itself, with no such
restriction: such folders must come from a trusted source.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import socket
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lit_fsdp.errors import RunError
from lit_fsdp.lightning_compat import METADATA_FILENAME

if TYPE_CHECKING:
    from lit_fsdp.lora import LoraConfig

MANIFEST = "lit_fsdp_manifest.json"
MANIFEST_KEY = "lit_fsdp_manifest"  # in a full-file checkpoint
FORMAT = "lit_fsdp checkpoint v1"


class CheckpointError(RunError):
    """A checkpoint that cannot be written or read; the message is one line that names the path."""


class UntrustedCheckpointError(CheckpointError):
    """A checkpoint file holding objects lit_fsdp never writes: refused, since unpickling them could run code."""


# --- writing ---------------------------------------------------------------------------------------


def partial_path(path: Path, token: str) -> Path:
    return path.with_name(f".{path.name}.partial-{token}")


def manifest_for(trainer: Any) -> dict[str, Any]:
    """What a resume needs to know before loading: step, world size, global batch and data position."""
    datamodule = getattr(trainer, "datamodule", None)
    batch_size = getattr(datamodule, "batch_size", None)
    position = datamodule.state_dict() if hasattr(datamodule, "state_dict") else {}
    # LoRA: the checkpoint holds what trains only, and names the frozen base it needs (lit_fsdp.lora.base_record)
    adapters = getattr(getattr(trainer, "lightning_module", None), "adapter_checkpoint", None)
    lora = {} if adapters is None else {"lora": adapters, "weights": "LoRA adapters " + (
        "and the modules trained beside them" if adapters["lora"].get("train") else "only") + ", without the frozen base"}
    return {
        **lora,
        "format": FORMAT,
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "batch_size": batch_size,
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "global_batch": None if batch_size is None else batch_size * trainer.world_size * trainer.accumulate_grad_batches,
        "samples_consumed": position.get("samples_consumed"),
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _fsync(path: Path) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def publish(partial: Path, path: Path, manifest: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote ``partial``: add the manifest, rename into place, drop what it replaced."""
    if partial.is_dir():
        files = {}
        for file in sorted(partial.rglob("*")):
            if file.is_file():
                _fsync(file)
                files[str(file.relative_to(partial))] = file.stat().st_size
        temporary = partial / f"{MANIFEST}.tmp"
        temporary.write_text(json.dumps({**manifest, "files": files}, indent=2))
        _fsync(temporary)
        os.replace(temporary, partial / MANIFEST)
    else:
        _fsync(partial)
    _fsync(partial.parent)
    replaced = None
    if path.is_dir() and not path.is_symlink():
        replaced = path.with_name(f".{path.name}.old-{partial.name.rsplit('-', 1)[-1]}")
        os.rename(path, replaced)
    os.replace(partial, path)  # a file replaces the old one atomically; a folder takes the freed name
    _fsync(path.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    for stale in path.parent.glob(f".{path.name}.*"):  # saves of the same name that an earlier run left unfinished
        remove(stale)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def write_error(path: Path, error: BaseException) -> CheckpointError:
    """One line that says why ``path`` could not be written: no space, a read-only folder, or the error itself."""
    reason = None
    pending: list[BaseException] = [error]
    while pending and reason is None:
        current = pending.pop()
        number = getattr(current, "errno", None)
        if number in (errno.ENOSPC, errno.EDQUOT):
            reason = "no space left on device"
        elif number in (errno.EROFS, errno.EACCES, errno.EPERM):
            reason = "read-only file system" if number == errno.EROFS else "permission denied"
        # torch.distributed.checkpoint gathers every rank's failure into one CheckpointException
        for failure in getattr(current, "failures", {}).values():  # (exception, traceback) per rank
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("/"))
    if reason is None:
        try:
            usage = shutil.disk_usage(folder)
            if usage.free < 1 << 20:  # torch's zip writer reports a full disk as "unexpected pos"
                reason = "no space left on device"
        except OSError:
            pass
    if reason is None and os.statvfs(folder).f_flag & os.ST_RDONLY:
        reason = "read-only file system"
    if reason is None:
        reason = " ".join(str(error).split())[:300] or type(error).__name__
    return CheckpointError(f"cannot write checkpoint to {path}: {reason}; the previous checkpoint is unchanged")


# --- reading ---------------------------------------------------------------------------------------

_WEIGHTS_ONLY_FAILED = "Weights only load failed"  # how torch.load(weights_only=True) starts its refusal


def load(file: Path, **options: Any) -> Any:
    """``torch.load(file, weights_only=True, **options)``; a file it refuses raises ``UntrustedCheckpointError``."""
    try:
        return torch.load(file, weights_only=True, **options)
    except pickle.UnpicklingError as error:
        raise _refusal(Path(file), error) from None


def _refusal(file: Path, error: pickle.UnpicklingError) -> Exception:
    """The one-line error for ``file`` that ``torch.load(weights_only=True)`` refused with ``error`` (else ``error``)."""
    if _WEIGHTS_ONLY_FAILED not in str(error):
        return error
    try:  # read from the pickle's opcodes, without running them
        found = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(str(file)))
    except Exception:  # noqa: BLE001 - the names only illustrate; the refusal stands without them
        found = ""
    return UntrustedCheckpointError(
        f"{file} holds objects a checkpoint written by lit_fsdp never holds ({found or 'not tensors or plain values'}); "
        "it is refused because unpickling it could run code: use a checkpoint that fit wrote, from a source you trust"
    )


@dataclass
class Found:
    """A checkpoint in a folder: its manifest if complete, else why it is not."""

    path: Path
    manifest: dict[str, Any] | None
    problem: str | None


def inspect(path: Path) -> Found:
    """Whether ``path`` is a complete lit_fsdp checkpoint (see the module docstring) and its manifest; one that holds
    what lit_fsdp never writes raises ``UntrustedCheckpointError``, which no caller may take for a broken save."""
    if path.is_dir():
        manifest_file = path / MANIFEST
        if not manifest_file.is_file():
            return Found(path, None, f"it has no {MANIFEST} (its save was interrupted, or an older lit_fsdp wrote it)")
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, ValueError) as error:
            return Found(path, None, f"its {MANIFEST} cannot be read ({error})")
        for name, size in manifest.get("files", {}).items():
            file = path / name
            if not _inside(file, path):
                return Found(path, None, f"its {MANIFEST} names {name!r}, which is not a file inside the checkpoint")
            if not file.is_file():
                return Found(path, None, f"{name} is missing")
            if file.stat().st_size != size:
                return Found(path, None, f"{name} has {file.stat().st_size} bytes, the manifest says {size}")
        if (path / METADATA_FILENAME).is_file():  # Lightning unpickles it on load: refused here first if it is not ours
            load(path / METADATA_FILENAME, map_location="cpu", mmap=True)
        return Found(path, manifest, None)
    if path.is_file():
        try:
            zipfile.ZipFile(path).close()
            manifest = load(path, map_location="cpu", mmap=True).get(MANIFEST_KEY)
        except UntrustedCheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure to read is "not a complete checkpoint"
            return Found(path, None, f"it cannot be read ({' '.join(str(error).split())[:120]})")
        if manifest is None:
            return Found(path, None, "it holds no lit_fsdp manifest (an older lit_fsdp or another program wrote it)")
        return Found(path, manifest, None)
    return Found(path, None, "it does not exist")


def _inside(file: Path, folder: Path) -> bool:
    return file.resolve().is_relative_to(folder.resolve())


def candidates(folder: Path) -> list[Path]:
    """Checkpoints in ``folder``: ``*.ckpt`` files and folders, and saves killed between manifest and rename."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.endswith(".ckpt") or ".ckpt.partial-" in p.name)


def written_at(path: Path) -> float:
    """When the checkpoint at ``path`` was finished: its manifest's modification time for a folder (written last;
    renaming the folder does not change it), the file's for a file."""
    manifest = path / MANIFEST
    return (manifest if manifest.is_file() else path).stat().st_mtime


def newest_complete(folder: Path) -> tuple[Found | None, list[Found]]:
    """The complete checkpoint written last (not the highest step: a later run in the same folder may have stopped
    at a lower one, beside the earlier run's), and the broken ones newer than it."""
    found = [inspect(path) for path in candidates(folder)]
    complete = sorted((f for f in found if f.manifest is not None),
                      key=lambda f: (written_at(f.path), f.manifest.get("step", -1)), reverse=True)
    best = complete[0] if complete else None
    newer_than = written_at(best.path) if best else float("-inf")
    broken = [f for f in found if f.manifest is None and not f.path.name.startswith(".") and written_at(f.path) >= newer_than]
    return best, broken


# --- choosing what to resume from ------------------------------------------------------------------

# Values of --ckpt_path that Lightning resolves itself.
_LIGHTNING_NAMES = ("best", "hpc", "registry")


def resolve(ckpt_path: str | None, folder: Path) -> tuple[str | None, dict[str, Any] | None, list[str]]:
    """What ``--ckpt_path`` resumes from: ``(path or None, its manifest, lines to print)``.

    ``last``: the newest complete checkpoint in ``folder``, with a line for it and for each broken one
    skipped; none at all starts fresh and says so. A named checkpoint must be complete, or this raises a
    one-line ``CheckpointError`` naming it and what is missing.
    """
    if ckpt_path is None or ckpt_path in _LIGHTNING_NAMES or ckpt_path.startswith(_LIGHTNING_NAMES):
        return ckpt_path, None, []
    if ckpt_path == "last":
        best, broken = newest_complete(folder)
        notes = [f"lit_fsdp: skipping checkpoint {f.path}: {f.problem}" for f in broken]
        if best is None:
            return None, None, [*notes, f"lit_fsdp: no complete checkpoint in {folder}; starting from step 0"]
        manifest = best.manifest
        notes.append(f"lit_fsdp: resuming from {best.path} (step {manifest.get('step')}, "
                     f"written by {manifest.get('world_size')} process(es))")
        return str(best.path), manifest, notes
    return ckpt_path, resumable(ckpt_path).manifest, []


def resumable(ckpt_path: str) -> Found:
    """``inspect`` of a named ``--ckpt_path``, refused in one line where it is not a complete checkpoint (an empty or
    truncated file, a save cut short) before anything reads it."""
    found = inspect(Path(ckpt_path))
    if found.problem is not None:
        raise CheckpointError(f"checkpoint {ckpt_path} cannot be resumed: {found.problem}; pass another one, "
                              f"or --ckpt_path last for the newest complete checkpoint of the run")
    return found


def earlier_run(folder: Path) -> list[str]:
    """For a fit that starts from step 0 (no ``--ckpt_path``) with its checkpoints in ``folder``: a line if the folder
    holds another run's complete checkpoints (its own go beside them, Lightning adding ``-v1`` to a name taken)."""
    best, _ = newest_complete(folder)
    if best is None:
        return []
    return [f"lit_fsdp: {folder} holds an earlier run's checkpoints (the newest, {best.path.name}, at step "
            f"{best.manifest.get('step')}); this run starts from step 0 and saves beside them, and --ckpt_path last "
            "takes whichever was written last"]


def check_writable(folder: Path, flag: str) -> None:
    """Fail in one line now, not after hours of training, if ``folder`` cannot be created and written. The probe
    file is named for this host and process: every rank (and every node on a shared file system) probes at once."""
    probe = folder / f".lit_fsdp_write_test.{socket.gethostname()}.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        reason = {errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on device",
                  errno.EACCES: "permission denied", errno.EPERM: "permission denied"}.get(error.errno, error.strerror)
        raise RunError(f"cannot write to {folder} ({flag}): {reason}; choose a writable folder") from error


# --- space ---------------------------------------------------------------------------------------

#: Added to the counted tensors: the scheduler's, loops' and callbacks' state, buffers, the manifest, DCP's metadata.
SPACE_MARGIN = 0.02
_GIB = 2**30


@dataclass(frozen=True)
class CheckpointSize:
    """One checkpoint's bytes: its weights, what a full one adds (optimizer and compression state), what is counted."""

    weights: int
    training_state: int
    counted: str

    def total(self, weights_only: bool) -> int:
        return int((self.weights + (0 if weights_only else self.training_state)) * (1 + SPACE_MARGIN))


def checkpoint_size(strategy: Any, config: Any, world: int, nodes: int,
                    lora: LoraConfig | dict[str, Any] | None = None) -> CheckpointSize:
    """The bytes of one checkpoint of ``config``'s model saved by ``strategy``: all of it, as on one disk.

    Counted: the weights under every parameter name in float32 (FSDP2's master, DDP's model) or SlideFSDP's
    ``master_dtype``, the dtype its master is saved in (a tied
    head under each of its names), AdamW's two moments per parameter in the strategy's ``optimizer_state_dtype``
    (SlideFSDP; float32 elsewhere) and, where the strategy saves it (FSDP2's sharded checkpoints), every rank's
    compression state as ``CompressionConfig.state_bytes`` counts it; then ``SPACE_MARGIN`` more. With ``lora``
    (``--model.lora``) the checkpoint holds what trains (the adapters, the modules trained beside them), their
    moments and compression state only, no frozen base.
    """
    from transformers import AutoModelForCausalLM

    from lit_fsdp.lora import as_config, attach

    with torch.device("meta"):
        network = AutoModelForCausalLM.from_config(config)
    master = getattr(strategy, "master_dtype", "float32")
    weights = f"{master} weights"
    if lora := as_config(lora):
        attach(network, lora)
        weights = f"LoRA adapters' {master} weights" + (", and the modules trained beside them" if lora.train else "") \
            + " (no frozen base)"
    saved = [(name, p) for name, p in network.named_parameters(remove_duplicate=False) if p.requires_grad]
    named = sum(p.numel() for _, p in saved)
    unique = sum({id(p): p.numel() for _, p in saved}.values())
    dtype = getattr(strategy, "optimizer_state_dtype", "float32")
    state = unique * 2 * getattr(torch, dtype).itemsize
    counted = f"{weights}, AdamW's two moments in {dtype}"
    compression = getattr(strategy, "compression", None)
    # FSDP2 puts each rank's compression state in sharded checkpoints only (FSDP2Strategy.lightning_module_state_dict)
    if compression is not None and compression.active and getattr(strategy, "_save_distributed_checkpoint", False):
        mesh = strategy.mesh_shape(world, nodes)
        replicas, shard = mesh if len(mesh) == 2 else (1, mesh[0])
        kept = world * compression.state_bytes(unique, shard, replicas, config.hidden_size)
        if kept:
            state += kept
            counted += f", {compression.method}'s state on each of {world} ranks"
    return CheckpointSize(named * getattr(torch, master).itemsize, state, f"{counted}, +{SPACE_MARGIN:.0%}")


def saves_in_run(callback: Any, trainer: Any) -> int | None:
    """How often a ModelCheckpoint saves in the run, where ``max_steps`` and a step cadence tell; None: unknown."""
    steps = trainer.max_steps
    if steps is None or steps < 0 or getattr(callback, "_train_time_interval", None) is not None:
        return None
    every_steps = getattr(callback, "_every_n_train_steps", 0)  # Lightning keeps the step cadence private
    if every_steps and not callback.every_n_epochs:
        return steps // every_steps
    # No cadence given: at every validation, when validation runs every val_check_interval steps
    interval = trainer.val_check_interval
    if not every_steps and callback.every_n_epochs == 1 and trainer.check_val_every_n_epoch is None \
            and isinstance(interval, int) and interval > 0 and trainer.limit_val_batches != 0:
        return steps // interval
    return None


def copies_at_once(callback: Any, trainer: Any) -> tuple[int, str]:
    """The most checkpoints a ModelCheckpoint has in its folder at once (0: it saves none), and why.

    Those it keeps (``save_top_k``; -1 keeps every save of the run), ``last`` (a copy with ``save_last: true``,
    written at the end of training too, a link with ``link``) and the one being written: a save goes aside and
    what it replaces is removed after.
    """
    top, saves = callback.save_top_k, saves_in_run(callback, trainer)
    last = int(callback.save_last is True or (callback.save_last == "link" and (top == 0 or saves == 0)))
    kept = (1 if saves is None else saves) if top == -1 else top
    copies = kept + last + 1 if kept or last else 0
    if saves is not None:  # no more than the files the run ever writes
        copies = min(copies, (saves if top else 0) + (max(saves, 1) if last else 0))
    if not copies:
        return 0, "it saves none"
    reason = f"save_top_k {top}" + (" (every save)" if top == -1 else "") + (", save_last" if last else "")
    reason += ", one being written" if copies == kept + last + 1 else f", {saves} saves in the run"
    return copies, reason


def _on_disk(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(file.stat().st_size for file in path.rglob("*") if file.is_file() and not file.is_symlink())
    return path.stat().st_size if path.is_file() and not path.is_symlink() else 0


def check_space(trainer: Any, config: Any, lora: LoraConfig | dict[str, Any] | None = None) -> None:
    """Fail in one line, before launch, when a disk cannot hold the checkpoints that the ModelCheckpoint callbacks
    on it have at once (``copies_at_once`` x ``checkpoint_size``, of the adapters only with ``lora``); checkpoints
    already in their folders count as free (a resumed run replaces them). Without a callback that saves, nothing is
    checked."""
    plans = []
    for callback in trainer.checkpoint_callbacks:
        if not hasattr(callback, "save_top_k"):
            continue
        copies, reason = copies_at_once(callback, trainer)
        if copies:
            folder = Path(callback.dirpath or Path(trainer.default_root_dir) / "checkpoints").absolute()
            existing = next(p for p in [folder, *folder.parents] if p.exists())
            plans.append((folder, existing, callback, copies, reason))
    if not plans:
        return
    world = trainer.num_nodes * trainer.num_devices
    size = checkpoint_size(trainer.strategy, config, world, trainer.num_nodes, lora)
    by_disk: dict[int, list] = {}
    for plan in plans:
        by_disk.setdefault(os.stat(plan[1]).st_dev, []).append(plan)
    for group in by_disk.values():
        needed = sum(copies * size.total(callback.save_weights_only) for _, _, callback, copies, _ in group)
        reusable = sum(_on_disk(path) for folder in {plan[0] for plan in group} for path in candidates(folder))
        free = shutil.disk_usage(group[0][1]).free
        if needed - reusable <= free:
            continue
        folder, _, callback, copies, reason = group[0]
        each = size.total(callback.save_weights_only)
        what = f"{copies} at once ({reason}) of {each / _GIB:.1f} GiB each ({size.counted})"
        if len(group) > 1:
            what += f" and {len(group) - 1} more ModelCheckpoint(s) on the same disk"
        if reusable:
            what += f", less {reusable / _GIB:.1f} GiB of checkpoints already there"
        raise CheckpointError(
            f"checkpoints need {(needed - reusable) / _GIB:.1f} GiB ({needed - reusable} bytes) in {folder} but "
            f"{free / _GIB:.1f} GiB ({free} bytes) are free there: {what}; set the ModelCheckpoint's dirpath to a "
            "disk with room, keep fewer (save_top_k 0 or 1, save_last false, save_weights_only true) or turn "
            "checkpointing off (no ModelCheckpoint in trainer.callbacks and --trainer.enable_checkpointing false)"
        )
