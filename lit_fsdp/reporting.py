"""What callbacks read from a strategy, declared: ``StrategyReport``, which lit_fsdp's strategies subclass.

Callbacks (``callbacks/``) measure any Lightning run; they never probe a strategy's attributes. They call
``strategy_report(trainer)``: a lit_fsdp strategy answers for itself, and any other strategy (Lightning's own, in a
run built without the CLI) through ``LightningStrategyReport``, which has no compression and no offload.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import lightning.pytorch as pl
import torch

if TYPE_CHECKING:
    from compress.config import CompressionConfig


class OffloadReport(Protocol):
    """What SlideFSDP tells ``callbacks.OffloadStats`` once its engine is built."""

    #: The pieces of a layer-streaming strategy's step: ``h2d_bytes``, ``h2d_s``, ``d2h_bytes``, ``d2h_s``,
    #: ``cpu_update_s``, ``cpu_update_hidden_s``, ``device_backward_s``, ``host_backward_s``; None before the first.
    last_step: Any
    #: How many CPU update threads, and why (the run record keeps it).
    update_threads_reason: str
    #: The activation plan taken, in words (``4 on the host, 20 recomputed, 8 kept on the device``): what ``auto`` chose.
    activation_plan_taken: str
    #: The update schedule taken, in words (``split: the root's head side and the last 12 blocks speculated, ...``).
    update_taken: str
    #: Why: ``update: auto``'s last choice by the step model with the run's rates, in words ("" before one).
    update_reason: str
    #: Of this rank's trained rows, the share a split speculates (0 without one).
    speculated_share: float

    def host_state_bytes(self) -> int:
        """This rank's host buffers (weights, moments, gradients, staging), as allocated."""

    def parameter_count(self) -> int:
        """The model's parameters."""

    def host_buffer_estimate(self, trainer: pl.Trainer, module: pl.LightningModule, datamodule: Any = None) -> dict[str, int]:
        """What the host-memory preflight counted for the same buffers, per node, by buffer."""


class CommCounters(Protocol):
    """A compression's counters as ``callbacks.CompressionStats`` reads them, once per optimizer step: the hooks'
    ``compress.communicator.CommStats``, or the outer exchanges' ``lit_fsdp.diloco.ExchangeCounters``."""

    #: Set on the steps CompressionStats samples the decoded gradient's error against the gradient.
    sampling: bool

    def take(self) -> dict[str, float]:
        """Every counter since the last take (``CommStats``' fields; ``bytes_raw`` is what per-step float32 gradient
        collectives would send), then zero."""


class CompressionReport(Protocol):
    """What ``callbacks.CompressionStats`` reads of the strategy's compression: the per-step hook
    (``compress.hook.GradientCompression``) or semi-synchronous training's outer exchange (``lit_fsdp.diloco.OuterSync``)."""

    #: The codec's configuration (method, parameters, warm-up).
    config: CompressionConfig
    #: This rank's counters.
    stats: CommCounters
    #: The built codec (its residuals, for error feedback); None for ``none``.
    compressor: Any


@dataclass(frozen=True)
class SemiSyncFigures:
    """What semi-synchronous training (``lit_fsdp.semi_sync.SemiSync``) tells ``callbacks.CompressionStats`` about the
    run, beside the exchanges' counters; the field names are the results record's keys."""

    #: Synchronisations of a fragment (of the model, without streaming), the run's final one included.
    outer_syncs: int
    #: Seconds the exchanges took, on the exchange thread or in line.
    outer_sync_s: float
    #: Seconds the training waited for them.
    outer_wait_s: float
    #: Bytes a gathered payload spent per value it carried (positions, codes, scales); None for ``none``, ``fp16``,
    #: ``bf16`` and payloads added on the wire.
    outer_bytes_per_value: float | None
    #: 1 - waited / exchanged with ``outer.delay`` (None before any exchange); 0 without.
    outer_hidden_share: float | None
    #: Inner optimizer steps between two synchronisations of a fragment.
    sync_every: int
    #: The outer step's settings (``lit_fsdp.diloco.OuterConfig.as_dict``).
    outer: dict[str, Any]


class StrategyReport(ABC):
    """The figures a strategy gives the callbacks (``callbacks/``): its name, compression, dtype, offload and
    semi-synchronous training."""

    #: The strategy's name in results records and sweeps (``ddp``, ``fsdp2``, ``slide_fsdp``, ...).
    label: str
    #: Every k-th block recomputes its forward in the backward (0: none); the FLOP count of MFU adds it.
    activation_checkpointing: int = 0
    #: The blocks that recompute their forward, where a plan lists them (None: every k-th, as above), and whether
    #: the whole forward runs again (SlideFSDP's) or stops before the block's last matmul (torch's checkpointing).
    recomputed_blocks: tuple[int, ...] | None = None
    recomputes_whole_block: bool = False

    #: The gradient compression configuration; None without one.
    compression: CompressionConfig | None = None

    @abstractmethod
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in (MFU's peak)."""

    def recompute_flops(self, config: Any, seq_len: int) -> int:
        """FLOPs per token the backward's recompute adds (HFU counts them, MFU does not)."""
        from lit_fsdp.flops import recompute_flops_per_token

        every = self.recomputed_blocks if self.recomputed_blocks is not None else self.activation_checkpointing
        return recompute_flops_per_token(config, seq_len, every, self.recomputes_whole_block)

    def unsteady_steps(self) -> int:
        """The first optimizer steps of training that run unlike the rest (SlideFSDP's synchronous updates before its
        delayed ones): ``callbacks.Throughput`` leaves them out of its steady-state figures."""
        return 0

    def compression_hook(self) -> CompressionReport | None:
        """The installed gradient compression (its counters and state), None where gradients go uncompressed."""
        return None

    def compression_method(self) -> str:
        """The run's compression in records and run names: the method, ``none`` without one."""
        return "none" if self.compression is None else self.compression.method

    def offload_report(self) -> OffloadReport | None:
        """The layer streaming's figures, None for a strategy that streams nothing (or before its engine is built)."""
        return None

    def semi_sync_figures(self) -> SemiSyncFigures | None:
        """Semi-synchronous training's run figures, None for a strategy that synchronises every step."""
        return None

    def requeue_signal(self) -> int | None:
        """The signal SLURM sends before a job's time limit where the strategy's cluster environment is Lightning's
        SLURMEnvironment with ``auto_requeue`` (``callbacks.interrupt`` saves on it); None elsewhere."""
        from lightning.fabric.plugins.environments import SLURMEnvironment

        environment = getattr(self, "cluster_environment", None)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            return environment.requeue_signal
        return None

    def whole_numels(self, module: torch.nn.Module) -> dict[int, int]:
        """The size in the model, whole, of each of ``module``'s parameters, by ``id``: its ``numel()`` (a sharded
        DTensor's is the whole one); a strategy whose parameters stay empty between uses (SlideFSDP's) says theirs."""
        return {id(parameter): parameter.numel() for parameter in module.parameters()}


class LightningStrategyReport(StrategyReport):
    """The report of a strategy that is not lit_fsdp's: its class name, the trainer's precision, nothing else."""

    def __init__(self, trainer: pl.Trainer):
        self.label = type(trainer.strategy).__name__
        self._precision = str(trainer.precision)  # "bf16-mixed", "16-mixed", "32-true", ...
        self.cluster_environment = getattr(trainer.strategy, "cluster_environment", None)

    def compute_dtype(self) -> torch.dtype:
        if self._precision.startswith("bf16"):
            return torch.bfloat16
        return torch.float16 if self._precision.startswith("16") else torch.float32


def strategy_report(trainer: pl.Trainer) -> StrategyReport:
    """The trainer's strategy as the callbacks see it."""
    strategy = trainer.strategy
    return strategy if isinstance(strategy, StrategyReport) else LightningStrategyReport(trainer)
