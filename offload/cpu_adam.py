"""Per-unit CPU AdamW on the master shards, on a worker thread, driven by the optimizer Lightning holds.

The LightningModule's ``configure_optimizers`` builds its AdamW (parameter groups, hyperparameters)
and LR schedule as under FSDP2; under SlideFSDP that optimizer holds the network's parameters,
which carry no values between steps, so it never updates anything itself. Each unit gets a fused
CPU ``torch.optim.AdamW`` over this rank's rows of the unit's parameters (views of the master shard),
with one group per group of the held optimizer; before every update the learning rate and the other
hyperparameters are copied from the held optimizer, so the LR scheduler drives the CPU updates.
Moments are allocated at setup, so host memory is claimed before training starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from compress.layout import UnitLayout

# The held optimizer's hyperparameters that the CPU optimizers follow.
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


class CpuAdam:
    """Fused CPU AdamW per unit over master-shard views, updates run in order on one worker thread."""

    def __init__(self, layouts: list[UnitLayout], master: list[torch.Tensor], held: torch.optim.Optimizer,
                 device: torch.device = torch.device("cpu")):
        if not isinstance(held, torch.optim.AdamW):
            raise TypeError(
                f"SlideFSDP updates parameters with AdamW on the CPU; configure_optimizers returned "
                f"{type(held).__name__}: return torch.optim.AdamW"
            )
        self.held = held
        group_of = {id(p): index for index, group in enumerate(held.param_groups) for p in group["params"]}
        self.pieces: list[list[nn.Parameter]] = []
        self.optimizers: list[torch.optim.AdamW] = []
        for layout, shard in zip(layouts, master):
            pieces = [nn.Parameter(view) for view in layout.local_views(shard)]
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
            self.optimizers.append(optimizer)
        # On a GPU the worker waits on CUDA events: it must use this rank's device, not create a context on GPU 0.
        cuda = device.type == "cuda"
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slide-fsdp-adam",
                                          initializer=torch.cuda.set_device if cuda else None, initargs=(device,) if cuda else ())
        self._pending: list[Future] = []
        self.update_intervals: list[tuple[float, float]] = []  # (start, end) perf_counter of each update

    def _hyperparameters(self, index: int) -> dict:
        group = self.held.param_groups[index]
        return {key: group[key] for key in _HYPERPARAMETERS if key in group}

    @staticmethod
    def _fresh_state(piece: torch.Tensor, optimizer: torch.optim.AdamW) -> dict[str, torch.Tensor]:
        state = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(piece, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(piece, memory_format=torch.preserve_format),
        }
        if any(group["amsgrad"] for group in optimizer.param_groups):
            state["max_exp_avg_sq"] = torch.zeros_like(piece, memory_format=torch.preserve_format)
        return state

    def nbytes(self) -> int:
        """Host bytes of the optimizer moments."""
        return sum(
            t.numel() * t.element_size()
            for optimizer in self.optimizers for state in optimizer.state.values() for t in state.values()
        )

    # --- updates ---------------------------------------------------------------------------------

    def update(self, unit: int, gradients: list[torch.Tensor]) -> None:
        """One AdamW step of ``unit``'s pieces with ``gradients`` (this rank's rows), at the held optimizer's settings."""
        began = time.perf_counter()
        optimizer, pieces = self.optimizers[unit], self.pieces[unit]
        for group in optimizer.param_groups:
            group.update(self._hyperparameters(group["held_group"]))
        for piece, gradient in zip(pieces, gradients):
            piece.grad = gradient
        optimizer.step()
        for piece in pieces:
            piece.grad = None
        self.update_intervals.append((began, time.perf_counter()))

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the worker thread after the tasks submitted before it."""
        self._pending.append(self._worker.submit(task))

    def failure(self) -> BaseException | None:
        """The error of a submitted task that has failed, without waiting for the others (None: none has)."""
        for future in self._pending:
            if future.done() and future.exception() is not None:
                return future.exception()
        return None

    def wait(self) -> None:
        """Wait for every submitted task; re-raises the first task's error in the caller."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
