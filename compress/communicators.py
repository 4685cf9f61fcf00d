"""Each method's communicator, declared: which FSDP2 hooks move its gradients between ranks, and what they need.

``compress.config.METHODS`` gives every method one of these; ``GradientCompression.register`` installs what the
method's entry declares and knows no method by name. The hooks themselves are elsewhere: the payload-moving pair
every plain compressor uses in ``compress.communicator``, and the methods that communicate on their own beside their
compressors (``powersgd``, ``sketched_sgd``, ``onebit_communicator``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from compress.communicator import CompressedAllReduce, CompressedReduceScatter
from compress.layout import UnitLayout
from compress.lowrank import LowRank
from compress.onebit_adam import OneBitAdam
from compress.onebit_communicator import OneBitAdamAllReduce, OneBitAdamReduceScatter
from compress.onebit_momentum import OneBitMomentum
from compress.powersgd import PowerSGDAllReduce, PowerSGDReduceScatter
from compress.sketched_sgd import SketchedAllReduce, SketchedReduceScatter


@dataclass(frozen=True)
class Communicator:
    """How one method's gradients cross ranks: the hooks ``GradientCompression.register`` gives each FSDP2 unit.

    ``reduce_scatter(compressor, stats, name, restored=, [layout=])`` replaces FSDP2's reduce-scatter where the
    shard group has more than one rank; ``all_reduce(compressor, stats, name, group=, restored=, [layout=])`` is the
    replicate all-reduce where replicas average (NO_SHARD, HYBRID_SHARD). ``layout=`` is passed when ``layout``.
    """

    reduce_scatter: Callable[..., Any]
    all_reduce: Callable[..., Any]
    #: the hooks take the unit's flat layout (``layout=``): they work per parameter, or keep per-parameter state
    layout: bool = False
    #: after a reduce-scatter, the compressor the all-reduce gets instead of the method's own (None: the same one)
    second_stage: Callable[[Any], Any] | None = None
    #: the all-reduce hook runs on one process too, over its own group (FSDP2 calls it there anyway)
    one_process: bool = False
    #: the hooks have a ``mover`` whose call count seeds shared randomness; checkpoints keep the counts
    movers: bool = True
    #: ``optimizer(params, compressor, **adamw)``: the optimizer the method needs in place of AdamW (None: AdamW)
    optimizer: Callable[..., torch.optim.Optimizer] | None = None


def _powersgd_all_reduce(state, stats, name: str, *, group, layout, restored=None) -> PowerSGDAllReduce:
    """PowerSGD's replicate all-reduce keeps its state under ``<unit>/ar``, apart from the reduce-scatter's."""
    return PowerSGDAllReduce(state, stats, f"{name}/ar", layout, group, restored)


def _lowrank_reduce_scatter(compressor, stats, name: str, *, layout: UnitLayout, restored=None) -> CompressedReduceScatter:
    """Any compressor's reduce-scatter, with each destination row's stacked matrices (a MoE layer's experts) declared
    to the low-rank codec, which compresses them one by one."""
    hook = CompressedReduceScatter(compressor, stats, name, restored)
    for destination in range(layout.shards):
        _low_rank(compressor).stacks[hook.key(destination)] = layout.stacks(destination)
    return hook


def _lowrank_all_reduce(compressor, stats, name: str, *, group, layout: UnitLayout, restored=None) -> CompressedAllReduce:
    """Any compressor's replicate all-reduce, with the stacked matrices of this rank's shard declared to the codec."""
    hook = CompressedAllReduce(compressor, stats, name, group, restored)
    _low_rank(compressor).stacks[hook.key] = layout.stacks()
    return hook


def _low_rank(compressor) -> LowRank:
    return getattr(compressor, "inner", compressor)  # error feedback's


def _onebit_adam(params, compressor: OneBitMomentum, **adamw: Any) -> OneBitAdam:
    return OneBitAdam(params, compressor.phase, **adamw)


#: any compressor's payloads: compressed reduce-scatter (all-to-all or summed on the wire) and all-reduce
COMPRESSED = Communicator(CompressedReduceScatter, CompressedAllReduce)
#: lowrank: any compressor's hooks, stacked matrices (MoE experts) in each row declared to the codec
LOWRANK = Communicator(_lowrank_reduce_scatter, _lowrank_all_reduce, layout=True)
#: PowerSGD: native all-reduces of P and Q per parameter matrix, no payloads
POWERSGD = Communicator(PowerSGDReduceScatter, _powersgd_all_reduce, layout=True, movers=False)
#: Sketched-SGD: summed count sketches, then the candidates' exact values
SKETCHED = Communicator(SketchedReduceScatter, SketchedAllReduce)
#: 1-bit and 0/1 Adam: denominators gathered in the reduce-scatter's layout; replicas average what shard groups
#: averaged (the second stage); one process still compresses its momentum; OneBitAdam replaces AdamW
ONEBIT_ADAM = Communicator(OneBitAdamReduceScatter, OneBitAdamAllReduce, layout=True,
                           second_stage=OneBitMomentum.second_stage, one_process=True, optimizer=_onebit_adam)
