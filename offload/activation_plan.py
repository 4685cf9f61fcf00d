"""SlideFSDP's activation plan: for each block, where what its backward needs waits after its forward.

- ``keep``: on the device, as autograd saved it: no recompute, the block's activations held on the device;
- ``host``: in pinned host memory (``offload.saved_on_host``): copied out during the forward on the copy stream and
  back one block ahead in the backward, no recompute; the copies share PCIe with the weights streamed in and the
  gradients going out;
- ``recompute``: only the block's input is kept (on the device, or on the host with ``activation_offload: cpu``), and
  its backward runs its forward again (``offload.checkpointing``): a third more arithmetic for the block.

The knob ``activation_plan`` gives the blocks of each mode, in block order: ``host`` first (the earliest blocks, whose
backward comes last: the longest time to copy their tensors back), then ``recompute``, then ``keep`` (the last blocks,
whose backward comes first). Unset, ``activation_checkpointing: k`` recomputes every k-th block and keeps the rest, as
before; ``auto`` lets ``choose`` pick the counts that make the step fastest within the device's and the host's memory
and the link's rate (``offload.plan.SlidePlan.activations``). The bytes a block saves are counted as
``lit_fsdp.commands.tune.memory`` counts them (Korthikanti et al., arXiv 2205.05198, without dropout).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Union

MODES = ("host", "recompute", "keep")
#: ``activation_plan``'s values: None (``activation_checkpointing``'s every k-th block), ``auto``, or counts per mode
ActivationPlanSpec = Union[str, dict, None]


@dataclass(frozen=True)
class ActivationPlan:
    """Each block's mode, in block order."""

    modes: tuple[str, ...]

    @classmethod
    def every(cls, blocks: int, checkpoint_every: int) -> "ActivationPlan":
        """``activation_checkpointing: k``: every k-th block from the first recomputed, the others kept (0: none)."""
        return cls(tuple("recompute" if checkpoint_every and index % checkpoint_every == 0 else "keep"
                         for index in range(blocks)))

    @classmethod
    def of_counts(cls, counts: dict[str, Any], blocks: int) -> "ActivationPlan":
        """``{host: a, recompute: r, keep: k}`` for ``blocks`` blocks (a missing mode: 0; ``keep`` may be left out:
        the rest), refused in one line unless the modes are known and the counts add up."""
        unknown = sorted(set(counts) - set(MODES))
        if unknown or not all(isinstance(value, int) and value >= 0 for value in counts.values()):
            raise ValueError(f"SlideFSDP activation_plan {counts}: give block counts >= 0 per mode of {', '.join(MODES)} "
                             "(e.g. {host: 4, recompute: 20, keep: 8}), or auto")
        given = {mode: counts.get(mode, 0) for mode in MODES}
        if "keep" not in counts:
            given["keep"] = blocks - given["host"] - given["recompute"]
        if given["keep"] < 0 or sum(given.values()) != blocks:
            raise ValueError(f"SlideFSDP activation_plan {counts}: the counts add up to {sum(counts.values())} blocks but "
                             f"the model has {blocks}; make them add up to {blocks}, or use auto")
        return cls(tuple(itertools.chain.from_iterable([mode] * given[mode] for mode in MODES)))

    def count(self, mode: str) -> int:
        return self.modes.count(mode)

    def blocks(self, mode: str) -> list[int]:
        return [index for index, each in enumerate(self.modes) if each == mode]

    def counts(self) -> dict[str, int]:
        return {mode: self.count(mode) for mode in MODES}

    def describe(self) -> str:
        """``4 on the host, 20 recomputed, 8 kept on the device``."""
        return describe(self.counts())


def describe(counts: dict[str, int]) -> str:
    """Block counts per mode in words: ``4 on the host, 20 recomputed, 8 kept on the device``."""
    words = {"host": "on the host", "recompute": "recomputed", "keep": "kept on the device"}
    return ", ".join(f"{counts[mode]} {words[mode]}" for mode in MODES if counts.get(mode))


#: Bytes a MoE block keeps per routed copy of a token beside its values: the int64 indices of the routing (the top-k
#: choice, the sort by expert and its inverse), as transformers' experts keep them (tests/test_moe_offload.py)
ROUTING_INDEX_BYTES = 32


def block_activation_bytes(hidden: int, intermediate: int, gated: bool, tokens: int, itemsize: int,
                           routed_copies: int = 0, router_logits: int = 0) -> tuple[int, int]:
    """(the bytes a block's backward needs when nothing is recomputed, its input's bytes) for ``tokens`` tokens:
    (8h + 2i) values a token, 8h + 4i for a gated MLP (Llama's), the tensors autograd keeps (Korthikanti et al.
    without dropout masks; SDPA keeps no s x s scores). A mixture-of-experts block (``routed_copies`` = k experts a
    token, ``router_logits`` = E): i is k x the expert's width (``lit_fsdp.flops.MatmulShape.mlp_width``), and each
    of the k copies of a token also keeps the hidden state sent to its expert and the expert's output (2kh values,
    the latter for the routing weight's gradient) and its indices; the router's probabilities are float32."""
    values = 8 * hidden + (4 if gated else 2) * intermediate + 2 * routed_copies * hidden
    moe = routed_copies * ROUTING_INDEX_BYTES + router_logits * 4
    return tokens * (values * itemsize + moe), tokens * hidden * itemsize


@dataclass(frozen=True)
class BlockCosts:
    """What ``choose`` weighs, per block and per step (one micro-batch), in bytes and seconds."""

    saved_bytes: int  # what a block's backward needs if nothing is recomputed
    input_bytes: int  # a recomputed block's kept input
    weight_bytes: int  # a block's weights, streamed in for its forward and again for its backward
    forward_s: float  # a block's forward on the device
    device_free: int  # device memory for activations: the device less weights, root, logits and a margin
    host_free: int  # host memory left for activations once SlideFSDP's other buffers are counted
    link_bytes_per_s: float  # host-to-device (and device-to-host) rate of pinned copies
    inputs_on_host: bool = False  # activation_offload: cpu: recomputed blocks' inputs on the host


@dataclass(frozen=True)
class PlanCost:
    plan: ActivationPlan
    saved_bytes: int  # a block's, as ``BlockCosts`` gave it
    step_s: float  # the blocks' forward and backward, each the slower of the compute and the copies it waits for
    device_bytes: int
    host_bytes: int


def cost(plan: ActivationPlan, costs: BlockCosts) -> PlanCost:
    """What ``plan`` costs: the step's block time (forward: the compute, or the weights in and the host blocks' tensors
    out if slower; backward: twice the forward plus the recomputed forwards, or the weights and the host blocks'
    tensors in if slower) and the activation memory it holds on each side (a recomputing backward's block, and two
    host blocks being fetched back, included)."""
    n, host, recompute, keep = len(plan.modes), plan.count("host"), plan.count("recompute"), plan.count("keep")
    rate = costs.link_bytes_per_s
    forward = max(n * costs.forward_s, n * costs.weight_bytes / rate, host * costs.saved_bytes / rate)
    backward = max((2 * n + recompute) * costs.forward_s, (n * costs.weight_bytes + host * costs.saved_bytes) / rate)
    inputs = recompute * costs.input_bytes
    device = (keep * costs.saved_bytes + (costs.saved_bytes if recompute else 0) + min(host, 2) * costs.saved_bytes
              + (0 if costs.inputs_on_host else inputs))
    return PlanCost(plan, costs.saved_bytes, forward + backward, device,
                    host * costs.saved_bytes + (inputs if costs.inputs_on_host else 0))


def choose(blocks: int, costs: BlockCosts) -> PlanCost:
    """The fastest plan whose activations fit the device's and the host's free memory (ties: fewer blocks on the host,
    then more kept); every block recomputed if none fits."""
    best = None
    for host in range(blocks + 1):
        for keep in range(blocks - host + 1):
            plan = ActivationPlan.of_counts({"host": host, "recompute": blocks - host - keep, "keep": keep}, blocks)
            option = cost(plan, costs)
            if option.device_bytes > costs.device_free or option.host_bytes > costs.host_free:
                continue
            if best is None or (option.step_s, host, -keep) < (best.step_s, best.plan.count("host"), -best.plan.count("keep")):
                best = option
    return best or cost(ActivationPlan.of_counts({"recompute": blocks}, blocks), costs)
