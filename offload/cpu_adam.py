"""Per-unit CPU AdamW on the master shards, on a worker thread, driven by the optimizer Lightning holds.

The LightningModule's ``configure_optimizers`` builds its AdamW (parameter groups, hyperparameters)
and LR schedule as under FSDP2; under SlideFSDP that optimizer holds the network's parameters,
which carry no values between steps, so it never updates anything itself. Each unit gets a fused
CPU ``torch.optim.AdamW`` over this rank's rows of the unit's trained parameters (views of the master shard; a unit
with nothing to train, LoRA's root, gets none),
with one group per group of the held optimizer; before every update the learning rate and the other
hyperparameters are copied from the held optimizer, so the LR scheduler drives the CPU updates.
Moments are allocated at setup, so host memory is claimed before training starts.

The update is one pass over memory per element (``adamw_step_in_chunks``): the native kernel
(``offload/adamw_kernel.c``, built once per host and loaded before training by ``offload.adamw_kernel.prepare``; at
the first update where nothing called it) reads the gradient as it arrived, reads and writes the float32 master and
the moments in place (bfloat16 moments rounded to nearest-even on the way back) and writes the new weight to the
staging copy the device loads from, on ``torch.get_num_threads()`` threads with the GIL released. The host memory
touched per parameter is AdamW's own (weight and moments read and written, the gradient read) plus the staging
copy's write: 28 B/param with float32 moments and a bfloat16 gradient, 20 with bfloat16 moments. Where the kernel
cannot be built (no C compiler: each rank warns so) or does not take the tensors, torch's fused AdamW kernel runs
per cache-sized chunk on float32 copies of what is not float32, the chunk's new weights then copied to the staging
rows while in cache: the same arithmetic (the same bits for whole pieces), slower.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.optim.adamw import adamw

from compress.layout import UnitLayout
from offload import adamw_kernel
from offload import rounding
from offload.rounding import MasterRounding, stochastic_round

# The held optimizer's hyperparameters that the CPU optimizers follow.
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
#: Elements per chunk of the torch path's update (no native kernel): its float32 copies (3 x 4 MiB) stay in L3, and
#: each chunk's calls (tens of microseconds of dispatch for the fused kernel's Python wrapper and the copies) have
#: enough work to hide it. On one core (``python scripts/bench_cpu_update.py --numel 16000000 --threads 1 --paths torch
#: --chunks 65536 262144 1048576 4194304``)
#: 64K, 256K, 1M and 4M elements gave 1.24, 0.87, 0.81 and 0.79 ns/param with a float32 gradient, and 1.50, 0.97,
#: 0.90 and 0.97 with a bfloat16 one (two passes over whole tensors: 0.79); on two threads 1M gave 0.66 for both
#: (two passes 0.64, 256K 0.77 and 0.75).
CHUNK = 1_048_576
#: Milliseconds each unit's update sleeps first where set (CPU tests): a slow host, so that a schedule that loads a unit
#: before its update is done computes with other weights and shows it (``offload.transfers``' copy delay's companion)
EMULATED_UPDATE_DELAY_VARIABLE = "LIT_FSDP_EMULATED_UPDATE_DELAY_MS"


def adamw_step_in_chunks(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor], group: dict,
                         scratch: torch.Tensor, staging: torch.Tensor | None = None,
                         span: tuple[int, int] | None = None, grad_scale: float = 1.0,
                         rounding: MasterRounding | None = None) -> None:
    """One torch.optim.AdamW step of elements ``span`` (default: all) of ``param`` (float32), with the gradient
    multiplied by ``grad_scale`` first: the native kernel's one pass (``offload.adamw_kernel``) where it is built and
    takes these dtypes, else ``scratch.shape[1]`` elements at a time by torch's fused CPU AdamW kernel, on float32
    copies of what is not float32: a bfloat16 or scaled gradient and bfloat16 moments (rounded to nearest on the way
    back). Both give the fused kernel's bits. Decoupled weight decay, bias correction, amsgrad, maximize and the
    arithmetic are AdamW's own. ``grad`` holds the span's gradient; ``staging`` (``param``'s shape, any dtype) receives
    the new weights while they are in cache. The step count advances with the span that ends ``param``.
    A bfloat16 ``param`` (``master_dtype: bfloat16``) is rounded by ``rounding`` (``offload.rounding``; its position
    is that of the span's first element). ``scratch`` is 4 float32 rows: the two moments, the gradient and the master.
    """
    numel = param.numel()
    first, last = span or (0, numel)
    if staging is not None and staging.data_ptr() == param.data_ptr():
        staging = None  # the master is the staging copy (``master_in_staging``): written once, as the master
    param, grad = param.view(-1)[first:last], grad.reshape(-1)
    staging = staging.view(-1)[first:last] if staging is not None else None
    moments = [state["exp_avg"].view(-1)[first:last], state["exp_avg_sq"].view(-1)[first:last]]
    amsgrad = bool(group.get("amsgrad", False))
    peak = state["max_exp_avg_sq"].view(-1)[first:last] if amsgrad else None
    beta1, beta2 = (float(beta) for beta in group["betas"])
    hyperparameters = {"maximize": bool(group.get("maximize", False)), "beta1": beta1, "beta2": beta2,
                       "lr": float(group["lr"]), "weight_decay": float(group["weight_decay"]), "eps": float(group["eps"])}
    if adamw_kernel.supported(param, grad, moments + ([peak] if amsgrad else []), staging):
        tail, tail_mode = adamw_kernel.scalar_tail(numel, first, last)
        adamw_kernel.adamw_step(param, grad, *moments, peak, staging, step=float(state["step"]) + 1,
                                grad_scale=grad_scale, tail=tail, tail_mode=tail_mode, rounding=rounding,
                                **hyperparameters)
    else:
        _fused_step_in_chunks(param, grad, moments, peak, state["step"], hyperparameters, scratch, staging, grad_scale,
                              rounding or MasterRounding())
    if last == numel:
        state["step"] += 1


def _fused_step_in_chunks(param: torch.Tensor, grad: torch.Tensor, moments: list[torch.Tensor],
                          peak: torch.Tensor | None, step: torch.Tensor, hyperparameters: dict, scratch: torch.Tensor,
                          staging: torch.Tensor | None, grad_scale: float, rounding: MasterRounding) -> None:
    """``adamw_step_in_chunks`` by torch's fused kernel, chunk by chunk (see there)."""
    chunk_step = torch.empty_like(step)
    chunk, copied = scratch.shape[1], moments[0].dtype != torch.float32
    narrow = param.dtype != torch.float32  # a bfloat16 master: stepped on a float32 copy, rounded back
    for start in range(0, param.numel(), chunk):
        end = min(start + chunk, param.numel())
        n = end - start
        g = grad[start:end]
        if g.dtype != torch.float32 or grad_scale != 1.0:
            # multiplied here, not by the kernel's grad_scale: that divides, and writes the result back to the gradient
            g = scratch[2, :n].copy_(g)
            if grad_scale != 1.0:
                g.mul_(grad_scale)
        m, v = (moment[start:end] for moment in moments)
        if copied:
            m, v = scratch[0, :n].copy_(m), scratch[1, :n].copy_(v)
        p = scratch[3, :n].copy_(param[start:end]) if narrow else param[start:end]
        chunk_step.copy_(step)  # the kernel counts the step in it: every chunk takes the same one
        adamw([p], [g], [m], [v], [peak[start:end]] if peak is not None else [], [chunk_step],
              fused=True, amsgrad=peak is not None, **hyperparameters)
        if narrow:
            param[start:end].copy_(stochastic_round(p, rounding.at(start)))
        if copied:
            moments[0][start:end].copy_(m)
            moments[1][start:end].copy_(v)
        if staging is not None:
            staging[start:end].copy_(param[start:end])


class CpuAdam:
    """CPU AdamW per unit over master-shard views, run in order on one worker thread (fused kernel, chunk by chunk)."""

    def __init__(self, layouts: list[UnitLayout], master: list[torch.Tensor], held: torch.optim.Optimizer,
                 device: torch.device = torch.device("cpu"), state_dtype: torch.dtype = torch.float32,
                 chunk: int | None = None, rank: int = 0):
        if not isinstance(held, torch.optim.AdamW):
            raise TypeError(
                f"SlideFSDP updates parameters with AdamW on the CPU; configure_optimizers returned "
                f"{type(held).__name__}: return torch.optim.AdamW"
            )
        for option in ("amsgrad", "maximize") if state_dtype != torch.float32 else ():
            if any(group.get(option) for group in held.param_groups):
                raise ValueError(f"SlideFSDP's bfloat16 optimizer state has no {option}: set {option}=False in "
                                 "configure_optimizers or optimizer_state_dtype: float32")
        self.held, self.state_dtype = held, state_dtype
        self.rank = rank  # of the master's shard: a bfloat16 master's rounding seed (``offload.rounding.seed``)
        self.frozen: list[dict] | None = None  # the hyperparameters per held group (``freeze_hyperparameters``)
        # the chunked update's float32 copies, used by the worker thread only (one update at a time)
        self._scratch = torch.empty(4, chunk or CHUNK)
        group_of = {id(p): index for index, group in enumerate(held.param_groups) for p in group["params"]}
        self.pieces: list[list[nn.Parameter]] = []
        self.layouts = layouts
        self.piece_groups: list[list[dict]] = []  # per unit, the group of each piece (groups are fixed once built)
        self.optimizers: list[torch.optim.AdamW | None] = []  # None: the unit trains nothing
        for layout, shard in zip(layouts, master):
            pieces = [nn.Parameter(view) for view in layout.local_views(shard)]
            if not pieces:
                self.pieces.append([])
                self.piece_groups.append([])
                self.optimizers.append(None)
                continue
            groups: dict[int, list[nn.Parameter]] = {}
            for place, piece in zip(layout.places, pieces):
                if id(place.param) not in group_of:
                    raise ValueError(f"{place.names[0]} is in no parameter group of the optimizer configure_optimizers returned")
                groups.setdefault(group_of[id(place.param)], []).append(piece)
            optimizer = torch.optim.AdamW(
                [{"params": params, "held_group": index, **self._hyperparameters(index)} for index, params in groups.items()],
                fused=True,
            )
            for piece in pieces:
                optimizer.state[piece] = self._fresh_state(piece, optimizer)
            self.pieces.append(pieces)
            group_of_piece = {piece: group for group in optimizer.param_groups for piece in group["params"]}
            self.piece_groups.append([group_of_piece[piece] for piece in pieces])
            self.optimizers.append(optimizer)
        # On a GPU the worker waits on CUDA events: it must use this rank's device, not create a context on GPU 0.
        cuda = device.type == "cuda"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slide-fsdp-adam",
                                          initializer=torch.cuda.set_device if cuda else None, initargs=(device,) if cuda else ())
        self._pending: list[Future] = []
        self.failures: list[str] = []  # the first line of each failed task's error, in the order they were seen
        self._noted: set[int] = set()  # id() of the failed tasks' futures in ``failures``
        self.emulated_delay_s = float(os.environ.get(EMULATED_UPDATE_DELAY_VARIABLE) or 0) / 1000
        self.update_intervals: list[tuple[float, float]] = []  # (start, end) perf_counter of each update
        self.wait_intervals: list[tuple[float, float]] = []  # (start, end) of the caller's waits for running updates

    def _hyperparameters(self, index: int) -> dict:
        return self.frozen[index] if self.frozen is not None else self._held_hyperparameters(index)

    def _held_hyperparameters(self, index: int) -> dict:
        group = self.held.param_groups[index]
        return {key: group[key] for key in _HYPERPARAMETERS if key in group}

    def hyperparameters_now(self) -> list[dict]:
        """The held optimizer's hyperparameters per group as they are now: what an update queued now and run after the
        scheduler has moved on takes (``update_rows``' ``hyperparameters``)."""
        return [self._held_hyperparameters(index) for index in range(len(self.held.param_groups))]

    def freeze_hyperparameters(self) -> None:
        """Updates from now on take the held optimizer's hyperparameters as they are now, not as they are when the
        update runs: a delayed update applies a step with its own learning rate after the scheduler has moved on."""
        self.frozen = [self._held_hyperparameters(index) for index in range(len(self.held.param_groups))]

    def _fresh_state(self, piece: torch.Tensor, optimizer: torch.optim.AdamW) -> dict[str, torch.Tensor]:
        """AdamW's state of ``piece`` (its keys and shapes), the moments in ``state_dtype``."""
        moments = ["exp_avg", "exp_avg_sq"]
        if any(group["amsgrad"] for group in optimizer.param_groups):
            moments.append("max_exp_avg_sq")
        zeros = {key: torch.zeros_like(piece, dtype=self.state_dtype, memory_format=torch.preserve_format) for key in moments}
        return {"step": torch.tensor(0.0, dtype=torch.float32), **zeros}

    def nbytes(self) -> int:
        """Host bytes of the optimizer moments (the per-piece step counters left out)."""
        return sum(
            t.numel() * t.element_size()
            for optimizer in self.optimizers if optimizer is not None for state in optimizer.state.values()
            for key, t in state.items() if key != "step"
        )

    # --- updates ---------------------------------------------------------------------------------

    def update(self, unit: int, gradients: list[torch.Tensor], staging: list[torch.Tensor | None] | None = None,
               grad_scale: float = 1.0) -> None:
        """One AdamW step of ``unit``'s pieces with ``gradients`` (this rank's rows) times ``grad_scale``, at the held
        optimizer's settings; each piece's new weights are also written to its ``staging`` view (one per piece; None:
        not written)."""
        pieces = self.pieces[unit]
        self._step(unit, [(index, None, gradient) for index, gradient in enumerate(gradients)],
                   staging or [None] * len(pieces), grad_scale)

    def update_rows(self, unit: int, gradient: torch.Tensor, start: int, stop: int, staging: list[torch.Tensor | None],
                    grad_scale: float = 1.0, hyperparameters: list[dict] | None = None) -> None:
        """The AdamW step of elements ``[start, stop)`` of ``unit``'s shard (``gradient`` holds theirs, in the shard
        layout, to be multiplied by ``grad_scale``): the parts of the pieces that lie there, padding skipped. A piece's step count advances with its
        last elements, so the ranges of one step may come in any number of calls, in order. ``hyperparameters``
        (``hyperparameters_now``): the step's, taken when it was queued; default: the held optimizer's now."""
        spans = [(index, (first - begins, last - begins), gradient[first - start : last - start])
                 for index, begins, first, last in self.spans(unit, start, stop)]
        self._step(unit, spans, staging, grad_scale, hyperparameters)

    def spans(self, unit: int, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """The pieces of ``unit`` that elements ``[start, stop)`` of its shard cover, padding skipped: (piece index,
        where the piece begins in the shard, the first and the last covered element in the shard)."""
        spans = []
        for index, piece in enumerate(self.pieces[unit]):
            begins = self.layouts[unit].places[index].shard_offset
            first, last = max(start, begins), min(stop, begins + piece.numel())
            if first < last:
                spans.append((index, begins, first, last))
        return spans

    def _step(self, unit: int, spans: list[tuple[int, tuple[int, int] | None, torch.Tensor]],
              staging: list[torch.Tensor | None], grad_scale: float = 1.0, hyperparameters: list[dict] | None = None
              ) -> None:
        if self.emulated_delay_s:
            time.sleep(self.emulated_delay_s)
        began = time.perf_counter()
        optimizer, pieces = self.optimizers[unit], self.pieces[unit]
        for group in optimizer.param_groups:
            index = group["held_group"]
            group.update(hyperparameters[index] if hyperparameters is not None else self._hyperparameters(index))
        with torch.no_grad():
            for index, span, gradient in spans:
                piece, state = pieces[index], optimizer.state[pieces[index]]
                how = None if piece.dtype == torch.float32 else MasterRounding(
                    rounding.stochastic, rounding.seed(int(state["step"]) + 1, unit, index, self.rank), span[0] if span else 0)
                adamw_step_in_chunks(piece, gradient, state, self.piece_groups[unit][index], self._scratch,
                                     staging[index], span, grad_scale=grad_scale, rounding=how)
        self.update_intervals.append((began, time.perf_counter()))

    def submit(self, task: Callable[[], None]) -> Future:
        """Run ``task`` on the worker thread after the tasks submitted before it; its future."""
        future = self._worker.submit(task)
        self._pending.append(future)
        future.add_done_callback(self._note_failure)
        return future

    def _note_failure(self, future: Future) -> None:
        # kept for ``mixed_steps`` after ``wait`` has raised the error and forgotten the future; called by the worker
        # once the task is done, and by ``settle``, which may see it done first
        error = None if future.cancelled() else future.exception()
        if error is not None and id(future) not in self._noted:
            self._noted.add(id(future))
            self.failures.append(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)

    def failure(self) -> BaseException | None:
        """The error of a submitted task that has failed, without waiting for the others (None: none has)."""
        for future in self._pending:
            if future.done() and future.exception() is not None:
                return future.exception()
        return None

    def wait(self) -> None:
        """Wait for every submitted task; re-raises the first task's error in the caller. Waits that found work still
        running are kept in ``wait_intervals`` (perf_counter start, end)."""
        pending, self._pending = self._pending, []
        began = time.perf_counter()
        busy = any(not future.done() for future in pending)
        for future in pending:
            future.result()
        if busy:
            self.wait_intervals.append((began, time.perf_counter()))

    def unit_steps(self) -> dict[int, list[int]]:
        """Each unit that trains: the step counts of its pieces, as many different ones as there are (one, between
        steps)."""
        return {unit: sorted({int(optimizer.state[piece]["step"]) for piece in pieces})
                for unit, (optimizer, pieces) in enumerate(zip(self.optimizers, self.pieces)) if optimizer is not None}

    def mixed_steps(self) -> str | None:
        """Once the worker is idle: None where every unit's rows are at one step and no update failed; else what is
        where, in words ("units 0-1, 4 at step 3; units 2-3 at step 2; ..."), for a refusal to save them."""
        by_step: dict[str, list[int]] = {}
        for unit, steps in self.unit_steps().items():
            by_step.setdefault(" and ".join(map(str, steps)), []).append(unit)
        if len(by_step) <= 1 and not self.failures:
            return None
        where = "; ".join(f"unit{'s' if len(units) > 1 else ''} {_spans(units)} at step {steps}"
                          for steps, units in sorted(by_step.items(), key=lambda item: item[1]))
        failed = f"; an update failed ({self.failures[0]})" if self.failures else ""
        return where + failed

    def settle(self) -> str | None:
        """Wait for every submitted task, as ``wait`` does but without raising their errors (``failures`` keeps them);
        ``mixed_steps``."""
        pending, self._pending = self._pending, []
        began, busy = time.perf_counter(), any(not future.done() for future in pending)
        for future in pending:
            try:
                future.result()
            except Exception:  # noted below; a cancelled one has nothing to note
                pass
            self._note_failure(future)
        if busy:
            self.wait_intervals.append((began, time.perf_counter()))
        return self.mixed_steps()

    def close(self) -> str | None:
        """Stop the worker once every task submitted has run: an update queued when a step was interrupted (the
        ordered updates behind the next forward, the delayed ones) has its gradient and runs, so that the units do not
        stay at two steps. ``mixed_steps`` after it."""
        self._worker.shutdown(wait=True)
        return self.settle()


def _spans(units: list[int]) -> str:
    """``[0, 1, 2, 5]`` as "0-2, 5"."""
    runs: list[list[int]] = []
    for unit in units:
        if runs and unit == runs[-1][-1] + 1:
            runs[-1].append(unit)
        else:
            runs.append([unit])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
