"""The memory filter: an analytic estimate of one process's device memory (and a node's host memory) per candidate.

Per process on its device, in bytes (P parameters, a mixture's every expert among them, Pb in the largest block, Pr
outside the blocks, L blocks, hidden h, MLP width i, vocabulary V, micro-batch m, sequence s, p bytes per compute
value, r = 4 bytes per reduced gradient value):

- **model states** (FSDP2): fp32 weights, fp32 gradients and the two AdamW moments, 16 x P, divided by
  the shard group (the world for FULL_SHARD and SHARD_GRAD_OP, world / replicas for HYBRID_SHARD, 1
  for NO_SHARD); on the host instead with ``cpu_offload``. SlideFSDP keeps them on the host. With LoRA
  (``--model.lora``; T adapter parameters, counted in P) only the adapters have gradients and AdamW
  state: 4 x P + 12 x T (``lit_fsdp.strategy.model_state_bytes``), divided as above.
- **working set**: the unsharded weights in p bytes: the root (kept gathered from forward to
  backward), and the gathered units: 1 + max(prefetch, 1) units of ``blocks_per_group`` blocks when
  units are resharded after forward (FULL_SHARD, HYBRID_SHARD), every block otherwise; plus a unit's
  and the root's unsharded gradients and their reduce buffers, (p + r) each (with LoRA: of their adapters
  only). SlideFSDP: ``window`` blocks and the root in p bytes, the root's gradients and two blocks of
  gradients in r bytes (with LoRA: of their adapters only), r its reduce dtype's (``auto``: p); its model states are
  the micro-batches' float32 gradient sum with accumulation on the device (4 x trained / processes per node).
- **activations**: per block (8h + 2i) x m x s values (8h + 4i for gated MLPs: Llama), the tensors
  autograd keeps (Korthikanti et al. 2022 without dropout masks; attention's s x s scores are not
  kept by SDPA); a mixture of experts' block (k of E experts a token) takes i as k x the expert's width and keeps
  2kh values more a token, the hidden state each expert received and its output, beside the routing's indices and
  float32 probabilities (``offload.activation_plan.block_activation_bytes``); a checkpointed block keeps only its input (h x m x s) and one block's activations
  come back during its recompute; SlideFSDP's ``activation_offload`` moves the kept inputs to the host.
  LoRA keeps the same tensors (a frozen weight's matmul no longer keeps its input, but the adapter's
  A does: the same tensor) plus per target A's output, rank values a token (Llama-8B, rank 16 on all 7
  targets: 0.1% more), and with ``dropout`` > 0 each target's dropped input and its mask, in-features x
  (p + 1) bytes a token (Llama: 6h + i values a block; 65% more at 8B in bfloat16).
  LoRA on a mixture's expert tensors (``target_parameters``) keeps each block's effective weight W + BA for its
  backward: the block's adapted expert tensors in p bytes, whatever the tokens (``lit_fsdp.lora_parameters``).
- **logits** (``lit_fsdp.loss.loss_bytes``): m x s x V x (p + 8), the logits, their float32 copy and the
  log-softmax; with the chunked loss (C tokens a chunk) 8 x C x V + m x s x h x p + 4 x V x h instead.
- **compression**: what the gradient compressor keeps between steps (``CompressionConfig.state_bytes``):
  error feedback holds a residual per element of every unit's whole unsharded gradient, c x P per process
  (c x T with LoRA) whatever the sharding (c = 4 bytes, 2 with ``residual_dtype: bfloat16``, twice that for DGC's
  velocities; PowerSGD about 4, Sketched-SGD 4, methods without error feedback 0), plus c x P / shard
  group for the replicate all-reduce of NO_SHARD and HYBRID_SHARD. The payload buffers of one unit's
  collective are not counted.
- **outer state** (semi-synchronous training, ``sync_every``): theta_outer and the outer momentum in float32 for the
  process's shard of the trained parameters, its error-feedback residual and one fragment's pseudo-gradient in flight
  (``lit_fsdp.diloco.outer_state_bytes``): on the device with ``outer.state_device: device``, else on the host.
- **overhead**: a constant calibrated from one measured trial (CUDA context, allocator caches; on a
  CPU the whole process: interpreter, libraries, data): measured peak minus the analytic sum.

Per node on the host: SlideFSDP's buffers as ``offload.host_memory`` counts them for its preflight (14-18
bytes per parameter, the gradient ring and offloaded activations, in the configs' reduce dtype; with LoRA the
frozen base's p bytes, and the 14-18 for the adapters only): a kept fp32 gradient (4 more) with accumulation on the host;
otherwise, where clipping or the guard defers the update (or ``update: delayed``), the ring holds a whole step's
gradient pieces (``offload.host_memory.gradient_slots``); ``update: auto``'s split backs up only what the host has
room for beside that, so it is not counted here (``offload.update_split``). Or
FSDP2's 16 x P / shard group per process with ``cpu_offload``. On a CPU
the device is the host, so a process's estimate also carries its share of the node's host bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from lit_fsdp.diloco import outer_state_bytes
from lit_fsdp.flops import matmul_shape
from lit_fsdp.lora import LoraConfig, adapted, as_config, attach, target_parameter_paths
from lit_fsdp.loss import loss_bytes
from lit_fsdp.parallelize import find_blocks
from lit_fsdp.lifecycle import resolve_dtype
from lit_fsdp.strategy import model_state_bytes
from lit_fsdp.commands.tune.hardware import Hardware
from lit_fsdp.commands.tune.space import Candidate, RunShape
from offload.activation_plan import block_activation_bytes
from offload.host_memory import UnitSize
from offload.plan import SlidePlan, SlideRun

GIB = 2**30
REDUCE_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """The sizes the estimate needs, counted on a model built on the meta device."""

    parameters: int
    block_parameters: int  # the largest block
    root_parameters: int  # outside the blocks: embeddings, final norm, an untied head
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    gated_mlp: bool
    # LoRA (0 without): its adapters' parameters, also counted above, in all and in the largest block; what a block's
    # adapters keep for the backward per token: A's outputs (rank values each) and, with dropout, their dropped inputs
    adapters: int = 0
    block_adapters: int = 0
    root_adapters: int = 0
    adapter_ranks: int = 0
    adapter_dropped: int = 0
    # a mixture of experts (0 without): the experts a token is routed to (k) and the router's logits (E), for a MoE
    # block's activations (intermediate is then k x the expert's width); with LoRA on its expert tensors, the largest
    # block's adapted ones, whose effective weight W + BA each block keeps for its backward
    routed_copies: int = 0
    router_logits: int = 0
    block_adapted_experts: int = 0

    @classmethod
    def of(cls, config: PretrainedConfig, block_class: str | None = None,
           lora: LoraConfig | dict[str, Any] | None = None) -> ModelShape:
        lora = as_config(lora)
        with torch.device("meta"):
            network = AutoModelForCausalLM.from_config(config)
        experts = [path for path in target_parameter_paths(network, lora) if ".experts." in path] if lora else []
        adapted_experts = {path: network.get_parameter(path).numel() for path in experts}
        if lora is not None:  # as the run attaches them (on the meta device): the base frozen, the adapters trained
            attach(network, lora)
        blocks = find_blocks(network, block_class)
        unique = {id(p): p for p in network.parameters()}  # a tied head counts once
        parameters = sum(p.numel() for p in unique.values())
        in_blocks = [sum(p.numel() for p in block.parameters()) for _, block in blocks]
        modules = [[m for _, m in adapted(block)] for _, block in blocks]  # each block's adapted modules
        trained = sum(p.numel() for p in unique.values() if p.requires_grad) if lora else 0
        # what trains in each block: its adapters, and any module --model.lora trains beside them
        block_adapters = [sum(p.numel() for p in block.parameters() if p.requires_grad) if lora else 0
                          for _, block in blocks]
        dropped = max(sum(m.lora_A.shape[1] for m in block) for block in modules) if lora and lora.dropout else 0
        shape = matmul_shape(config)
        return cls(
            parameters=parameters, block_parameters=max(in_blocks), root_parameters=parameters - sum(in_blocks),
            layers=len(blocks), hidden=config.hidden_size, intermediate=shape.mlp_width,
            vocab=config.vocab_size, gated_mlp=any(gate in name for name, _ in blocks[0][1].named_parameters() for gate in ("gate_proj", "gate_up_proj")),
            adapters=trained, block_adapters=max(block_adapters), root_adapters=trained - sum(block_adapters),
            adapter_ranks=max(sum(m.lora_A.shape[0] for m in block) for block in modules),
            adapter_dropped=dropped, routed_copies=shape.routed_copies, router_logits=shape.router_logits,
            block_adapted_experts=max((sum(n for path, n in adapted_experts.items() if path.startswith(f"{name}."))
                                       for name, _ in blocks), default=0),
        )

    @property
    def trained(self) -> int:
        """Parameters with gradients and AdamW state: the adapters with LoRA, else all."""
        return self.adapters or self.parameters

    @property
    def block_trained(self) -> int:
        return self.block_adapters if self.adapters else self.block_parameters

    @property
    def root_trained(self) -> int:
        return self.root_adapters if self.adapters else self.root_parameters


@dataclass(frozen=True)
class MemoryEstimate:
    """One process's device bytes by part, and the host bytes per node for offloaded state."""

    model_states: int
    working_set: int
    activations: int
    logits: int
    overhead: int
    host_per_node: int
    host_share: int  # the process's part of ``host_per_node`` when the device is the host (CPU), else 0
    compression: int = 0  # the gradient compressor's state (error-feedback residuals, PowerSGD's, Sketched-SGD's)
    outer_state: int = 0  # semi-synchronous training's outer state, when it is kept on the device

    @property
    def analytic(self) -> int:
        return (self.model_states + self.working_set + self.activations + self.logits + self.host_share + self.compression
                + self.outer_state)

    @property
    def device_total(self) -> int:
        return self.analytic + self.overhead

    def parts_gb(self) -> dict[str, float]:
        parts = ("model_states", "compression", "outer_state", "working_set", "activations", "logits", "overhead",
                 "host_share", "host_per_node")
        return {name: round(getattr(self, name) / GIB, 4) for name in parts} | {"device_total": round(self.device_total / GIB, 4)}


def compute_dtype(candidate: Candidate, accelerator: str) -> torch.dtype:
    """The candidate's compute dtype; ``auto`` as the strategies resolve it: bfloat16 on GPUs that compute it natively
    (this machine's, when it has one: a V100 or T4 gets float32), float32 on CPU."""
    if candidate.param_dtype != "auto":
        return getattr(torch, candidate.param_dtype)
    if accelerator != "cuda":
        return torch.float32
    return resolve_dtype("auto", torch.device("cuda")) if torch.cuda.is_available() else torch.bfloat16


def activation_bytes(candidate: Candidate, model: ModelShape, run: RunShape, p: int) -> tuple[int, int]:
    """(bytes kept on the device, checkpointed inputs moved to the host by this process)."""
    tokens = candidate.micro_batch * run.seq_len
    per_block, block_input = block_activation_bytes(model.hidden, model.intermediate, model.gated_mlp, tokens, p,
                                                    model.routed_copies, model.router_logits)
    per_block += tokens * (model.adapter_ranks * p + model.adapter_dropped * (p + 1))  # LoRA; a dropout mask: 1 byte
    per_block += model.block_adapted_experts * p  # LoRA on expert tensors: W + BA, kept whole (lit_fsdp.lora_parameters)
    # SlideFSDP's auto plan recomputes what the device cannot keep: at most what recomputing every block keeps
    every = 1 if candidate.strategy == "slide_fsdp" and candidate.activation_plan == "auto" else candidate.activation_checkpointing
    checkpointed = math.ceil(model.layers / every) if every else 0
    kept_inputs = checkpointed * block_input
    recompute = per_block if checkpointed else 0
    device = (model.layers - checkpointed) * per_block + recompute
    if candidate.strategy == "slide_fsdp" and candidate.activation_offload == "cpu":
        return device, kept_inputs
    return device + kept_inputs, 0


def shard_group(candidate: Candidate, world_size: int) -> int:
    """Ranks that share one copy of the FSDP2 model states."""
    return {"NO_SHARD": 1, "HYBRID_SHARD": world_size // (candidate.replicate_size or 1)}.get(candidate.sharding, world_size)


def compression_bytes(candidate: Candidate, model: ModelShape, run: RunShape,
                      base_compression: dict[str, Any] | None = None) -> int:
    """Bytes the candidate's gradient compressor keeps between steps per process (``CompressionConfig.state_bytes``)."""
    config = candidate.compression_config(base_compression)
    if config is None:
        return 0
    shard = shard_group(candidate, run.world_size)
    return config.state_bytes(model.trained, shard, run.world_size // shard, model.hidden)


def estimate(candidate: Candidate, model: ModelShape, run: RunShape, overhead: int = 0,
             base_compression: dict[str, Any] | None = None) -> MemoryEstimate:
    """The analytic estimate of ``candidate`` plus the calibrated ``overhead`` (bytes per process).

    ``base_compression``: the configs' compression settings, which a candidate of the same method runs with.
    """
    dtype = compute_dtype(candidate, run.accelerator)
    p = dtype.itemsize
    activations, offloaded_activations = activation_bytes(candidate, model, run, p)
    root = model.root_parameters
    outer_on_device = 0
    if candidate.strategy == "slide_fsdp":
        states = 0
        reduce = dtype if run.reduce_dtype == "auto" else getattr(torch, run.reduce_dtype)
        working = ((candidate.window * model.block_parameters + root) * p
                   + (model.root_trained + 2 * model.block_trained) * reduce.itemsize)
        processes = run.processes_per_node
        units = ([UnitSize.of(model.block_parameters, processes, model.block_trained)] * model.layers
                 + [UnitSize.of(root, processes, model.root_trained)])
        plan = SlidePlan(
            window=candidate.window, param_transfer=candidate.param_transfer, grad_sync=candidate.grad_sync,
            activation_offload=candidate.activation_offload, activation_checkpointing=candidate.activation_checkpointing,
            optimizer_state_dtype=getattr(torch, run.optimizer_state_dtype), update=candidate.update,
            gradient_slots=None, on_nonfinite=run.on_nonfinite,
            run=SlideRun(processes, run.nodes, -(-run.batch_per_process // candidate.micro_batch), run.clipping,
                         run.accelerator),
            compute_dtype=dtype, reduce_dtype=reduce, master_dtype=getattr(torch, run.master_dtype),
            accumulate_on=run.accumulate_on,
        )
        host = sum(plan.host_buffers(units, offloaded_activations).values())
        states = plan.accumulator_bytes(units)  # the micro-batches' float32 sum, on the device
    else:
        states = model_state_bytes(model.parameters, model.trained) // shard_group(candidate, run.world_size)
        unit = candidate.blocks_per_group * model.block_parameters
        if candidate.sharding in ("FULL_SHARD", "HYBRID_SHARD"):
            gathered = min(model.layers * model.block_parameters, (1 + max(candidate.prefetch, 1)) * unit)
        else:  # units stay gathered from their forward until their backward
            gathered = model.layers * model.block_parameters
        unit_gradients = candidate.blocks_per_group * model.block_trained + model.root_trained
        working = (gathered + root) * p + unit_gradients * (p + REDUCE_BYTES)
        host = states * run.processes_per_node if candidate.cpu_offload else 0
        states = 0 if candidate.cpu_offload else states
        if run.outer is not None:
            outer = outer_state_bytes(run.outer, -(-model.trained // shard_group(candidate, run.world_size)))
            if run.outer.state_device == "cpu":
                host += outer * run.processes_per_node
            else:
                outer_on_device = outer
    logits = loss_bytes(candidate.micro_batch * run.seq_len, model.vocab, model.hidden, p, run.loss_chunk_tokens)
    host_share = host // run.processes_per_node if run.accelerator == "cpu" else 0
    compression = compression_bytes(candidate, model, run, base_compression)
    return MemoryEstimate(states, working, activations, logits, overhead, host, host_share, compression, outer_on_device)


class MemoryFilter:
    """Rejects candidates whose estimate exceeds the device (or host) memory less a margin; calibrated by a measured trial."""

    def __init__(self, model: ModelShape, run: RunShape, hardware: Hardware, margin: float,
                 base_compression: dict[str, Any] | None = None):
        self.model, self.run, self.hardware, self.margin = model, run, hardware, margin
        self.base_compression = base_compression  # the configs' compression settings (error feedback, residual dtype)
        self.overhead = 0
        self.calibrated_by: int | None = None  # the trial whose measured peak set the overhead

    @property
    def memory_gb(self) -> float:
        """The device memory one process has."""
        return self.hardware.memory_per_process_gb(self.run.processes_per_node)

    @property
    def device_budget(self) -> int:
        return int(self.memory_gb * (1 - self.margin) * GIB)

    @property
    def host_budget(self) -> int:
        return int(self.hardware.host_memory_gb * (1 - self.margin) * GIB)

    def estimate(self, candidate: Candidate) -> MemoryEstimate:
        return estimate(candidate, self.model, self.run, self.overhead, self.base_compression)

    def calibrate(self, candidate: Candidate, measured_gb: float, trial: int) -> None:
        """Set the overhead so that ``candidate``'s estimate equals its measured peak (it can be negative)."""
        self.overhead = int(measured_gb * GIB) - estimate(candidate, self.model, self.run,
                                                          base_compression=self.base_compression).analytic
        self.calibrated_by = trial

    def rejection(self, candidate: Candidate) -> str | None:
        """Why ``candidate`` does not fit, or None."""
        e = self.estimate(candidate)
        margin = f"less the {self.margin:.0%} margin"
        if e.device_total > self.device_budget:
            parts = ", ".join(f"{name} {gb:.2f}" for name, gb in e.parts_gb().items()
                              if name not in ("device_total", "host_per_node") and gb)
            return (f"needs ~{e.device_total / GIB:.2f} GB per process ({parts}) > {self.device_budget / GIB:.2f} GB "
                    f"({self.hardware.device_memory_gb:g} GB per device {margin})")
        if e.host_per_node > self.host_budget:
            return (f"needs ~{e.host_per_node / GIB:.3f} GB of host memory per node for offloaded state > "
                    f"{self.host_budget / GIB:.3f} GB ({self.hardware.host_memory_gb:g} GB {margin})")
        return None
