"""SlideFSDP's native CPU AdamW step (``adamw_kernel.c``): built once per host before training, called through ctypes.

``prepare`` (the strategy calls it at setup on every rank) builds and loads the kernel, so no update builds anything;
an update that finds nothing prepared loads it then. The C file is compiled with the system's C compiler
(``$LIT_FSDP_CC``, else ``cc``, else ``gcc``; ``-O3 -march=native``) into ``$LIT_FSDP_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/lit_fsdp/kernels``, else ``~/.cache/lit_fsdp/kernels``), under a name made of the source's hash, the
compiler and its version, the flags and the CPU's feature flags, so a changed source, compiler or host builds anew and
a shared home folder serves every machine. One process builds while the others calling at once wait on a lock file
beside the library and then load its build; the library is written to a temporary name and renamed into place, so a
process that does not lock (an older version, a file system without flock) still loads a whole file.

A library is loaded only from a folder this user owns and no one else can write, and only if it is this user's and no
one else's to write: anything else is refused in one line (``CacheFolderError``), since loading it would run whatever
another user put there. Without a compiler, or when the build fails, the rank falls back to torch's fused kernel
(``offload.cpu_adam``) after a warning of its own saying why.

ctypes releases the GIL for the whole call; the kernel runs on ``threads`` threads of its own on contiguous ranges.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import math
import os
import platform
import pwd
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.optim.adamw import adamw

from lit_fsdp.errors import OneLineError
from offload.rounding import MASK32, MasterRounding

SOURCE = Path(__file__).with_name("adamw_kernel.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-pthread"]
# the C file's dtype codes; staging None is NONE
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NONE = 3
MASTER_DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
#: False: every update takes torch's path (benchmarks compare the two)
enabled = True
_library: ctypes.CDLL | None = None
_tried = False
_reason: str | None = None  # why this process's update runs on torch's kernel (None: loaded, or not tried yet)
_tail = (8, 0)  # torch's fused kernel's vector width and scalar-loop rounding (``_probe_tail``)


def compiler() -> str | None:
    """The C compiler to build with: ``$LIT_FSDP_CC`` (a name or a path) if set, else ``cc`` or ``gcc`` on PATH."""
    named = os.environ.get("LIT_FSDP_CC")
    if named:
        return shutil.which(named)
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    """Where built kernels are kept: ``$LIT_FSDP_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/lit_fsdp/kernels``, else
    ``~/.cache/lit_fsdp/kernels`` (``build`` creates it, mode 700)."""
    if os.environ.get("LIT_FSDP_KERNEL_CACHE"):
        return Path(os.environ["LIT_FSDP_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lit_fsdp" / "kernels"


def _cpu_features() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def library_path(cc: str) -> Path:
    """The built library's path for compiler ``cc`` on this CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *version, *FLAGS, _cpu_features()]).encode()).hexdigest()
    return cache_dir() / f"adamw_{key[:24]}.so"


class CacheFolderError(OneLineError):
    """The kernel cache, or a library in it, is not this user's alone: loading from it would run another user's code."""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_owned(path: Path) -> None:
    """Refuse ``path``, the cache folder or a library in it, in one line unless this user owns it and neither its group
    nor others can write it: whoever can write there chooses the code that every rank loads."""
    info, uid = path.stat(), os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid == uid and not mode & 0o022:
        return
    problem = (f"owned by {_user(info.st_uid)}, not by {_user(uid)}" if info.st_uid != uid
               else "writable by its group or others")
    folder = path.is_dir()
    what, risk = ("cache folder", "loading a library from it") if folder else ("library", "loading it")
    fix = f"`chown {uid} {path} && chmod go-w {path}`" if folder else f"`rm {path}` (it is built again)"
    raise CacheFolderError(f"SlideFSDP's native CPU AdamW {what} {path} is {problem} (mode {mode:o}), so {risk} could "
                           f"run another user's code: set LIT_FSDP_KERNEL_CACHE to a folder of your own, or run {fix}")


def _flock(path: Path) -> int | None:
    """An exclusive lock on the file ``path`` (created if missing), waited for: its descriptor. A holder removes the
    file before it lets go, so a waiter that then gets the lock of a removed file locks the new one instead. None where
    the file system has no flock (Lustre mounted without it): the caller then builds unlocked, renaming a whole file."""
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError:
            os.close(handle)
            return None
        try:
            if os.path.samestat(os.fstat(handle), os.stat(path)):
                return handle
        except FileNotFoundError:
            pass
        os.close(handle)


def build(cc: str) -> Path:
    """Compile the kernel with ``cc`` unless this source, compiler and CPU's build is cached; its path. Of processes
    that call it at once, one compiles and the others wait for it (a lock file beside the library) and take its build.
    Raises ``CacheFolderError`` where the folder or the library is not this user's alone (``check_owned``)."""
    target = library_path(cc)
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_owned(target.parent)
    if not target.exists():
        lock = target.with_suffix(".lock")
        handle = _flock(lock)
        try:
            if not target.exists():  # else another process built it while this one waited
                _compile(cc, target)
        finally:
            if handle is not None:
                lock.unlink(missing_ok=True)
                os.close(handle)
    check_owned(target)
    return target


def _compile(cc: str, target: Path) -> None:
    # built in a folder of its own (mode 700, as mkdtemp makes it) that no one else can enter while the linker's file
    # still has the umask's mode, then renamed into place: atomic, a process loading it sees no file or the whole one
    with tempfile.TemporaryDirectory(prefix=target.stem + ".", suffix=".tmp", dir=target.parent) as private:
        partial = Path(private) / target.name
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(partial), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines()
            raise RuntimeError(next((line for line in lines if "error" in line), lines[-1] if lines else "no output"))
        partial.chmod(0o755)
        os.replace(partial, target)


def _load() -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        named = os.environ.get("LIT_FSDP_CC")
        raise RuntimeError(f"LIT_FSDP_CC={named} is not an executable" if named else "no C compiler (cc or gcc) on PATH")
    library = ctypes.CDLL(str(build(cc)))
    f32, i32, i64, ptr = ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    u32 = ctypes.c_uint32
    library.lit_adamw_step.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32, i32, i32,
                                       f32, f32, f32, f32, f32, f32, f32, f32, i32, u32, u32, i32]
    library.lit_adamw_step.restype = i32
    library.lit_adamw_supported.argtypes = [i32, i32, i32]
    library.lit_adamw_supported.restype = i32
    return library


def _who(rank: int | None) -> str:
    """Who warns: every rank says it of itself (``rank``, default Lightning's rank of this process), with its host."""
    return f"SlideFSDP rank {getattr(rank_zero_only, 'rank', 0) if rank is None else rank} on {socket.gethostname()}"


def prepare(rank: int | None = None) -> str | None:
    """Build the kernel unless this source, compiler and CPU's build is cached (once per host: ``build``) and load it,
    so that no update builds anything: the strategy calls it at setup, on every rank. None when the kernel is loaded;
    otherwise why this process's updates run on torch's fused kernel, which a warning naming ``rank`` (default:
    Lightning's rank of this process) has said. Raises ``CacheFolderError`` where the cache is not this user's alone,
    before loading anything from it. Later calls return the first one's outcome."""
    global _library, _tried, _tail, _reason
    with _lock:
        if not _tried:
            try:
                loaded = _load()
                tail = _probe_tail(loaded, rank)
            except CacheFolderError:
                raise
            except Exception as error:  # a missing compiler, a failed build or load: the torch path still works
                _reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                warnings.warn(f"{_who(rank)}: the native CPU AdamW is unavailable ({_reason}); this rank's update runs "
                              "on torch's fused kernel instead, slower: install gcc (apt-get install gcc), or set "
                              "LIT_FSDP_CC to a C compiler or LIT_FSDP_KERNEL_CACHE to a folder this user can write",
                              stacklevel=2)
            else:
                _library, _tail = loaded, tail
            _tried = True
    return _reason


def library() -> ctypes.CDLL | None:
    """The loaded kernel, loaded now (``prepare``) where nothing has; None where this process falls back to torch's."""
    prepare()
    return _library


def reset() -> None:
    """Forget the loaded kernel, so that the next ``library()`` builds or loads it again (tests)."""
    global _library, _tried, _reason
    with _lock:
        _library, _tried, _reason = None, False, None


def _code(tensor: torch.Tensor | None) -> int | None:
    return NONE if tensor is None else DTYPES.get(tensor.dtype)


def supported(param: torch.Tensor, grad: torch.Tensor, moments: list[torch.Tensor], staging: torch.Tensor | None) -> bool:
    """Whether the kernel can step these tensors: a float32 or bfloat16 master, contiguous same-length tensors, dtypes
    it knows, moments of one dtype, a kernel built, and ``enabled``."""
    tensors = [param, grad, *moments] + ([staging] if staging is not None else [])
    if not enabled or param.dtype not in MASTER_DTYPES:
        return False
    if any(t.device.type != "cpu" or not t.is_contiguous() or t.numel() != param.numel() for t in tensors):
        return False
    if len({moment.dtype for moment in moments}) != 1:
        return False
    codes = (_code(grad), _code(moments[0]), _code(staging))
    lib = library() if None not in codes else None
    return lib is not None and bool(lib.lit_adamw_supported(*codes))


def _probe_tail(lib: ctypes.CDLL, rank: int | None = None) -> tuple[int, int]:
    """torch's fused kernel's vector width and how its scalar loop over a tensor's last elements rounds exp_avg_sq (the
    C file's tail mode): its build decides them (16 or 8 floats, what the compiler contracted), so they are found by
    stepping a small tensor both ways. The first candidate that gives torch's bits; if none does, the vector loop's
    rule, after a warning naming ``rank`` (``_who``)."""
    generator = torch.Generator().manual_seed(0)
    numel = 16 * 4 + 15
    start, grads = torch.randn(numel, generator=generator), [torch.randn(numel, generator=generator) for _ in range(3)]
    weight, exp_avg, exp_avg_sq, steps = start.clone(), torch.zeros(numel), torch.zeros(numel), torch.zeros(())
    for grad in grads:
        adamw([weight], [grad.clone()], [exp_avg], [exp_avg_sq], [], [steps], fused=True, amsgrad=False, maximize=False,
              beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.1, eps=1e-8)
    for width, mode in ((8, 2), (16, 2), (8, 1), (16, 1)):
        ours = [start.clone(), torch.zeros(numel), torch.zeros(numel)]
        for step, grad in enumerate(grads, 1):
            _call(lib, *ours, None, grad, None, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                  maximize=False, grad_scale=1.0, tail=numel % width, tail_mode=mode, threads=1, rounding=None)
        if all(torch.equal(a, b) for a, b in zip(ours, (weight, exp_avg, exp_avg_sq))):
            return width, mode
    warnings.warn(f"{_who(rank)}: the native CPU AdamW matched none of torch's fused kernel's roundings of a tensor's "
                  "last elements (vector widths 8 and 16, scalar loop modes 1 and 2): the last elements of each tensor "
                  "(fewer than 16) round as its vector loop does and may differ from torch's in their last bits")
    return 8, 0


def scalar_tail(numel: int, first: int, last: int) -> tuple[int, int]:
    """Of elements ``[first, last)`` of a ``numel``-element tensor, how many last ones torch's fused kernel steps in its
    scalar loop, and how it rounds there (``adamw_step``'s ``tail`` and ``tail_mode``)."""
    if library() is None:
        return 0, 0
    width, mode = _tail
    return max(0, last - max(first, numel - numel % width)), mode


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               max_exp_avg_sq: torch.Tensor | None, staging: torch.Tensor | None, *, step: float, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool = False,
               grad_scale: float = 1.0, tail: int = 0, tail_mode: int = 0, threads: int | None = None,
               rounding: MasterRounding | None = None) -> None:
    """One AdamW step, in place, as torch's fused kernel computes it at step count ``step`` (the step being taken,
    from 1), of tensors ``supported`` accepts; the gradient multiplied by ``grad_scale`` first and the new weights
    also written to ``staging`` (None: not written). The last ``tail`` elements are computed as the fused kernel's
    scalar loop does, rounding by ``tail_mode`` (``scalar_tail``). A bfloat16 master is rounded by ``rounding``
    (default: stochastically, seed 0, from position 0). ``threads`` defaults to ``torch.get_num_threads()``."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native AdamW kernel is not built: check supported() first")
    _call(lib, param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, staging, step=step, lr=lr, beta1=beta1, beta2=beta2,
          eps=eps, weight_decay=weight_decay, maximize=maximize, grad_scale=grad_scale, tail=tail, tail_mode=tail_mode,
          threads=threads or torch.get_num_threads(), rounding=rounding)


def _call(lib: ctypes.CDLL, param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          max_exp_avg_sq: torch.Tensor | None, grad: torch.Tensor, staging: torch.Tensor | None, *, step: float,
          lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool, grad_scale: float,
          tail: int, tail_mode: int, threads: int, rounding: MasterRounding | None) -> None:
    # the scalars as the fused kernel forms them: in double, then rounded to float32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    rounding = rounding or MasterRounding()
    status = lib.lit_adamw_step(
        param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        max_exp_avg_sq.data_ptr() if max_exp_avg_sq is not None else None,
        staging.data_ptr() if staging is not None else None, param.numel(), tail, tail_mode,
        _code(param), _code(grad), _code(exp_avg), _code(staging), int(max_exp_avg_sq is not None),
        -grad_scale if maximize else grad_scale, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
        math.sqrt(bias_correction2), eps, -(lr / bias_correction1), int(rounding.stochastic), rounding.seed,
        rounding.position & MASK32, threads,
    )
    if status != 0:
        raise RuntimeError(f"the native AdamW kernel has no case for master {param.dtype}, gradient {grad.dtype}, "
                           f"moments {exp_avg.dtype}, staging {None if staging is None else staging.dtype}")
