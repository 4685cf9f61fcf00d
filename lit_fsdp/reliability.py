"""What every lit_fsdp strategy adds to Lightning's: a guard against non-finite steps, and checkpoints never half-used.

Both are mixins placed before the Lightning strategy class (``class FSDP2Strategy(NonFiniteGuard,
AtomicCheckpoints, ModelParallelStrategy)``): they wrap Lightning's ``training_step``,
``save_checkpoint`` and ``load_checkpoint`` and call through to them.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.tensor import DTensor

from lit_fsdp import checkpoints
from lit_fsdp.errors import RunError

OnNonFinite = Literal["stop", "skip_step", "warn"]


class NonFiniteError(RunError):
    """A non-finite loss or gradient stopped the run (``on_nonfinite: stop``)."""


class NonFiniteGuard:
    """Every optimizer step: clip, then stop, skip or report the step if its loss or gradients are not finite.

    The strategy sets ``on_nonfinite`` and may override where its gradients are (``clip_gradients``,
    ``drop_gradients``, ``nonfinite_values``); the defaults handle gradients on the network's
    parameters, plain or DTensor. ``CausalLM.configure_gradient_clipping`` calls ``clip_and_guard``.
    """

    on_nonfinite: OnNonFinite = "stop"
    nonfinite_steps = 0  # optimizer steps with a non-finite loss or gradient, this run
    _loss_finite: torch.Tensor | None = None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().training_step(*args, **kwargs)
        loss = output.get("loss") if isinstance(output, dict) else output
        if isinstance(loss, torch.Tensor):  # kept on the device: read once per optimizer step, in the guard
            finite = torch.isfinite(loss.detach()).all()
            self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        return output

    def clip_gradients(self, max_norm: float | None) -> torch.Tensor | None:
        """The global norm of this step's gradients (a DTensor reduction when sharded), clipped if ``max_norm``."""
        params = [p for p in self.lightning_module.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def drop_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget this step's gradients on every rank, so that the optimizer step changes nothing."""
        optimizer.zero_grad(set_to_none=True)  # AdamW leaves parameters without a gradient untouched

    def nonfinite_values(self) -> int | torch.Tensor:
        """Gradient values found non-finite on the way since the last step (compression, host updates): a host
        count or a device tensor, which the guard reads together with its other flags."""
        return 0

    def any_rank_flags(self, flags: list[torch.Tensor | bool]) -> bool:
        """Whether any flag is set on any rank: combined on the device, one all-reduce, one read to the host."""
        device = self.root_device
        bad = torch.zeros((), dtype=torch.int32, device=device)
        for flag in flags:
            if isinstance(flag, torch.Tensor):
                bad = bad.bitwise_or(flag.reshape(()).to(device=device, dtype=torch.int32, non_blocking=True))
            elif flag:
                bad = bad.bitwise_or(1)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return bool(bad)  # the guard's one host synchronisation per optimizer step

    def clip_and_guard(self, optimizer: torch.optim.Optimizer, max_norm: float | None) -> torch.Tensor | None:
        """Clip, then stop, skip or report the step if its loss or gradients are not finite (``on_nonfinite``).

        Every rank takes the same decision (one all-reduce of a flag), so a skipped step is skipped everywhere.
        The flags stay on the device until that decision, the one point where the step waits for the device.
        Returns the gradient norm before clipping (None where the strategy does not compute it).
        """
        if not getattr(optimizer, "clipping_applies", True):  # e.g. 1-bit Adam after its freeze: the norm only
            max_norm = None
        norm = self.clip_gradients(max_norm)
        nonfinite = self.nonfinite_values()
        flags: list[torch.Tensor | bool] = [nonfinite > 0]
        if self._loss_finite is not None:
            flags.append(self._loss_finite.logical_not())
        if norm is not None:
            flags.append(torch.isfinite(norm).logical_not())
        self._loss_finite = None
        if not self.any_rank_flags(flags):
            return norm
        self.nonfinite_steps += 1
        step = self.lightning_module.trainer.global_step + 1
        what = f"a non-finite loss or gradient at optimizer step {step} (gradient norm {'not computed' if norm is None else float(norm)})"
        if self.on_nonfinite == "stop":
            self.drop_gradients(optimizer)  # an update already applied (SlideFSDP's speculative one) is undone first
            raise NonFiniteError(
                f"{what}; no update and no checkpoint were made from it: lower --model.learning_rate, or set "
                "--trainer.strategy.init_args.on_nonfinite skip_step to skip such steps"
            )
        if self.on_nonfinite == "skip_step":
            self.drop_gradients(optimizer)
            rank_zero_warn(f"{what}: step skipped on every rank ({self.nonfinite_steps} so far)")
        else:
            rank_zero_warn(f"{what}: applied anyway (on_nonfinite: warn; {self.nonfinite_steps} so far)")
        return norm


class AtomicCheckpoints:
    """Checkpoints written aside and renamed into place after a manifest (``lit_fsdp.checkpoints``); loads verified."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write aside, add the manifest, rename into place; a failure is one line and leaves the previous checkpoint
        as it was."""
        trainer = self.lightning_module.trainer
        path = Path(self.broadcast(str(filepath)))
        partial = checkpoints.partial_path(path, self.broadcast(f"{trainer.global_step}-{uuid.uuid4().hex[:8]}"))
        manifest = checkpoints.manifest_for(trainer)
        sharded = getattr(self, "_save_distributed_checkpoint", False)
        if not sharded:
            checkpoint[checkpoints.MANIFEST_KEY] = {**manifest, "layout": "full"}
        failure: checkpoints.CheckpointError | None = None
        try:
            super().save_checkpoint(checkpoint, partial, storage_options)
        except (Exception, CheckpointException) as error:  # every rank must reach the decision below
            failure = checkpoints.write_error(path, error)  # diagnosed now, while the partial files still fill the disk
        if self.reduce_boolean_decision(failure is None, all=True):
            if self.is_global_zero:
                try:
                    checkpoints.publish(partial, path, {**manifest, "layout": "sharded"})
                except OSError as error:
                    failure = checkpoints.write_error(path, error)
            if self.broadcast(failure is None):
                return
        if self.is_global_zero:
            checkpoints.remove(partial)
        raise failure or checkpoints.write_error(path, RuntimeError("another rank could not write its part"))

    def verify_checkpoint(self, path: Path) -> None:
        """Refuse a checkpoint without a complete manifest (the CLI checks before starting; this guards the API)."""
        found = checkpoints.inspect(path)
        if found.problem is not None:
            raise checkpoints.CheckpointError(f"checkpoint {path} cannot be loaded: {found.problem}")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Verified (complete, nothing but tensors and plain values), then read with ``weights_only=True`` whatever
        ``fit(weights_only=...)`` asked: a checkpoint never needs more (``checkpoints.load``)."""
        self.verify_checkpoint(Path(self.broadcast(str(checkpoint_path))))
        return super().load_checkpoint(checkpoint_path, True)
