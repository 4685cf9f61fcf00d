"""Activation checkpointing for SlideFSDP, with the checkpointed block inputs optionally kept on the host.

A checkpointed block runs its forward without recording a graph and keeps only its input. In the
backward it loads its weights, recomputes its forward from that input and back-propagates through
it (the reentrant scheme: the block's parameter gradients accumulate during that inner backward).
With ``activation_offload: cpu`` the kept input is copied to the host in the forward, into an exact-size
buffer of ``offload.host.HostState`` (pinned in place where pinning is on, counted and closed with the other host
buffers), and copied back in the backward; block i-1's input is fetched while block i computes, so the copies
overlap, and device memory for activations does not grow with depth.

Non-checkpointed blocks are marked with ``BeforeBackward``: an identity whose backward loads the
block's weights (and prefetches the next ones) just before the block's own backward runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from offload.host import HostState
    from offload.transfers import Transfers


class BlockSchedule(Protocol):
    """What checkpointing needs of the engine that streams the blocks (``offload.engine.BlockSchedule``)."""

    transfers: Transfers
    activations: ActivationStore

    def before_backward(self, block: int) -> None:
        """Load block ``block``'s weights (and prefetch the next ones) before its backward runs."""


class BeforeBackward(torch.autograd.Function):
    """Identity in forward; in backward, calls ``engine.before_backward(block)`` first."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, engine: BlockSchedule, block: int) -> torch.Tensor:
        ctx.engine, ctx.block = engine, block
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.engine.before_backward(ctx.block)
        return grad, None, None


class _Recomputed(torch.autograd.Function):
    """The checkpointed forward of one block (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, run: Any, engine: BlockSchedule, block: int) -> torch.Tensor:
        ctx.run, ctx.engine, ctx.block = run, engine, block
        with torch.no_grad():
            output = run(hidden)
        engine.activations.keep(block, hidden)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        engine, block = ctx.engine, ctx.block
        engine.before_backward(block)
        hidden = engine.activations.fetch(block).detach().requires_grad_(True)
        with torch.enable_grad():
            output = ctx.run(hidden)
        torch.autograd.backward(output, grad)
        return hidden.grad, None, None, None


class CheckpointedBlock(nn.Module):
    """Wraps a block so that its forward is checkpointed; parameter names are those of the block.

    The attribute has the name ``checkpoint_wrapper`` uses, which ``lit_fsdp.weights.clean_name``
    removes: checkpoints and init seeds see the same names with and without checkpointing.
    """

    def __init__(self, block: nn.Module, engine: BlockSchedule, index: int):
        super().__init__()
        self._checkpoint_wrapped_module = block
        self._engine = [engine]  # in a list: not registered as a submodule
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        inputs = [*args, *kwargs.values()]
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            raise RuntimeError(
                "SlideFSDP's activation checkpointing back-propagates into a block's hidden states only, but "
                f"block {self.index} got another input that requires grad; set activation_checkpointing: 0"
            )
        block = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled():
            return block(hidden_states, *args, **kwargs)
        if not hidden_states.requires_grad and any(p.requires_grad for p in block.parameters()):
            # A frozen embedding (LoRA) gives an input without a graph, and a Function's output has one only if an
            # input has: without this the block's adapters would get no gradient
            hidden_states = hidden_states.detach().requires_grad_(True)

        def run(hidden: torch.Tensor) -> torch.Tensor:
            return block(hidden, *args, **kwargs)

        return _Recomputed.apply(hidden_states, run, self._engine[0], self.index)


class ActivationStore:
    """The inputs of checkpointed blocks between their forward and their backward: on the device or on the host."""

    def __init__(self, engine: BlockSchedule, offload: bool, buffers: HostState, pin: bool):
        """
        Args:
            buffers: Where the offloaded inputs live (``HostState.activation_buffer``); pin: pin them in place.
        """
        self.engine = engine
        self.offload = offload
        self.buffers, self.pin = buffers, pin
        self.kept: dict[int, torch.Tensor] = {}
        self.offloaded: dict[int, Any] = {}  # block -> the event of its device-to-host copy
        self.host: dict[int, torch.Tensor] = {}  # block -> its host buffer (a view of its region), reused every step
        self.fetched: dict[int, tuple[torch.Tensor, Any]] = {}  # block -> (device tensor, ready event)

    def keep(self, block: int, hidden: torch.Tensor) -> None:
        if not self.offload:
            self.kept[block] = hidden.detach()
            return
        buffer = self.host.get(block)
        if buffer is None or buffer.shape != hidden.shape or buffer.dtype != hidden.dtype:
            buffer = self.buffers.activation_buffer(block, hidden.numel(), hidden.dtype, self.pin).view(hidden.shape)
            self.host[block] = buffer
        self.offloaded[block] = self.engine.transfers.d2h(buffer, hidden.detach())
        self.buffers.activation_copy(block, self.offloaded[block])
        self.kept[block] = buffer

    def prefetch(self, block: int) -> None:
        """Start copying block's kept input back to the device (backward, while a later block computes)."""
        if not self.offload or block not in self.kept or block in self.fetched:
            return
        transfers, source = self.engine.transfers, self.kept[block]
        # allocated on the compute stream, which uses and frees it (``SavedOnHost.prefetch``)
        target = torch.empty(source.shape, dtype=source.dtype, device=transfers.device)
        with transfers.on_h2d_stream(after=self.offloaded.pop(block), after_compute=True):  # after the copy to the host
            transfers.h2d(target, source)
            ready = transfers.record()
        transfers.read_by_h2d(target)
        self.buffers.activation_copy(block, ready)
        self.fetched[block] = (target, ready)

    def fetch(self, block: int) -> torch.Tensor:
        """Block's input on the device (waits for its prefetch, or copies it now)."""
        if not self.offload:
            return self.kept.pop(block)
        self.prefetch(block)
        target, ready = self.fetched.pop(block)
        self.kept.pop(block)
        self.engine.transfers.wait(ready)
        return target

    def clear(self) -> None:
        """Drop what a step left (an interrupted backward); the host buffers are kept for reuse."""
        self.kept.clear()
        self.offloaded.clear()
        self.fetched.clear()
