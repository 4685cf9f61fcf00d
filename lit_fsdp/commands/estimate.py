"""``python -m lit_fsdp estimate``: what one optimizer step of a run needs, and how fast it can go, before it runs.

    python -m lit_fsdp estimate --config configs/quickstart.yaml --config configs/llama_8b_offload.yaml \\
        --tune.hardware configs/hardware/h100_128g.json [--json]

It takes ``fit``'s configs and arguments and ``--tune.hardware`` (default: this machine, detected), builds the
model on the meta device and no Trainer (the hardware need not be here), and prints, per process and optimizer
step: host memory per node by buffer, the device peak by component, host-device bytes, the CPU update's bytes
and time, network bytes per collective, compute time at the device's peak, and the step time and MFU; and one
checkpoint's bytes. With ``--model.lora`` only the adapters have gradients, AdamW state,
reduce-scatters and checkpoints; under FSDP2 the frozen base is still sharded in float32 and gathered in the compute
dtype, under SlideFSDP it is kept on the host in the compute dtype alone and streamed, with no master.
The memory figures are the preflight's and the tuner's (``offload.host_memory``, ``lit_fsdp.commands.tune.memory``,
``lit_fsdp.checkpoints.checkpoint_size``);
times are bytes or FLOPs over the hardware file's rates, overlapped as the strategy overlaps them (SlideFSDP's
schedule: ``offload.step_time``). With the hardware file's ``compute_efficiency`` (the share of its peak the device
reaches, as ``scripts/gpu_check.py``'s probe measures it) the step time is a prediction; without it every resource
is at its peak and the step time a bound. MFU is over the datasheet's peak where ``lit_fsdp.device_peaks`` knows
the device, as ``callbacks.Throughput`` measures it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import torch

from lit_fsdp.checkpoints import checkpoint_size
from lit_fsdp.commands.cli import LitFsdpCLI, run as parse_fit
from lit_fsdp.commands.activation_estimate import planned_activations
from lit_fsdp.flops import block_matmul_flops_per_token, lora_flops_per_token, recompute_flops_per_token
from offload.activation_plan import describe as describe_plan
from lit_fsdp.commands.help import plain
from lit_fsdp.device_peaks import device_peaks, matmul_format
from lit_fsdp.lifecycle import CausalLMStrategy
from lit_fsdp.commands.tune.command import default_candidate, parse_options, run_shape, split_arguments
from lit_fsdp.commands.tune.hardware import Hardware, detect, load
from lit_fsdp.commands.tune.memory import GIB, ModelShape, compute_dtype, estimate as device_estimate
from lit_fsdp.commands.tune.space import Candidate
from lit_fsdp.diloco import exchange_bytes, outer_state_bytes
from offload.host_memory import (FLAG_ELEMENTS, RUNTIME_BYTES_PER_PROCESS, UnitSize, describe, piece_capacity, pieces,
                                  speculated_units, with_runtime)
from offload.preflight import host_reserve_bytes
from offload.step_time import PRIOR_CLIP_RATE, backup_share, cpu_update_bytes, forward_order, slide_step_time


class _ConfigOnly(LitFsdpCLI):
    """The fit command's parser and classes (model, data, strategy) without a Trainer: no device is needed."""

    def instantiate_trainer(self, **kwargs: Any) -> None:
        return None


@dataclass
class RunTrainer:
    """The Trainer fields the accounting reads, from the configs (``lit_fsdp.commands.tune`` and the strategies read these)."""

    num_nodes: int
    num_devices: int
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    strategy: Any
    hardware: Hardware
    """the machine the strategy was placed on"""


def _devices(given: Any, hardware: Hardware) -> int:
    if isinstance(given, (list, tuple)):
        return len(given)
    if given in (None, "auto", -1, "-1"):
        return hardware.devices_per_node if hardware.accelerator == "cuda" else 1
    return int(given)


def parse(fit_args: Sequence[str], hardware: Hardware | None = None) -> tuple[RunTrainer, Any, Any]:
    """(trainer fields, LightningModule, DataModule) of ``fit_args``, the strategy placed on ``hardware``'s devices
    (default: this machine as the configs' accelerator sees it: a CPU config on a GPU host is estimated on its CPU)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = parse_fit(list(fit_args), run=False, cli_class=_ConfigOnly)
    config = cli._get(cli.config_init, "trainer")
    strategy = config.strategy
    if not isinstance(strategy, CausalLMStrategy):
        raise ValueError(f"--trainer.strategy is {strategy!r}; estimate needs lit_fsdp.strategy.FSDP2Strategy or "
                         "offload.SlideFSDPStrategy (a class_path with init_args)")
    trains_on = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}.get(str(config.accelerator))
    hardware = hardware or detect(trains_on)
    if trains_on is not None and trains_on != hardware.accelerator:
        raise ValueError(f"the configs train on {trains_on} but the hardware is {hardware.accelerator}; "
                         "fix --trainer.accelerator or the hardware file's accelerator")
    devices = _devices(config.devices, hardware)
    strategy.parallel_devices = [torch.device(hardware.accelerator, index) for index in range(devices)]
    trainer = RunTrainer(num_nodes=config.num_nodes or 1, num_devices=devices,
                         accumulate_grad_batches=config.accumulate_grad_batches or 1,
                         gradient_clip_val=config.gradient_clip_val, strategy=strategy, hardware=hardware)
    strategy.check_compression(trainer)
    return trainer, cli.model, cli.datamodule


def _ring(nbytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-gather or reduce-scatter whose full buffer is ``nbytes``."""
    return nbytes * (ranks - 1) / ranks if ranks > 1 else 0.0


def slide_traffic(trainer: RunTrainer, units: list[UnitSize], micro_batch: int, seq_len: int, hidden: int,
                  compute: torch.dtype, reduce_dtype: torch.dtype) -> dict[str, float]:
    """SlideFSDP's host-device bytes per process per optimizer step and its device collectives' bytes.

    Per micro-batch every block is loaded for the forward and again for the backward, less the last
    ``window - 1`` blocks, which stay; the root is loaded once per optimizer step (the step changes it), a frozen one
    (LoRA) once per run. Every unit's reduced gradient of its trained parameters goes to the host each micro-batch
    (once a step where the device sums the micro-batches); checkpointed inputs go there and back.
    """
    strategy, steps = trainer.strategy, trainer.accumulate_grad_batches
    plan = strategy.plan(trainer, compute)
    schedule = plan.schedule
    p = compute.itemsize
    reduce = reduce_dtype.itemsize
    full = strategy.param_transfer == "full"
    shards = trainer.num_devices
    blocks, root = units[:-1], units[-1]
    trained = [unit.trained() for unit in units]
    load = (lambda unit: unit.full_numel * p) if full else (lambda unit: unit.shard_numel * p)
    kept = max(0, strategy.window - 1)
    per_micro_batch = sum(map(load, blocks)) + sum(map(load, blocks[: len(blocks) - kept]))
    every = strategy.activation_checkpointing
    inputs = 0
    if strategy.activation_offload == "cpu" and every:
        inputs = math.ceil(len(blocks) / every) * micro_batch * seq_len * hidden * p
    incoming = sum(unit.shard_numel * (shards if strategy.grad_sync == "cpu_reduce" else 1) for unit in trained)
    if strategy.grad_sync == "gpu_reduce" and schedule.check_units_finite:
        # the device's verdict on each gradient part travels after each of its ring-buffer pieces
        capacity = piece_capacity(units, incoming_full=False, ranks=shards)
        incoming += FLAG_ELEMENTS * sum(pieces(part, capacity) for unit in units for part in unit.part_sizes())
    traffic = {
        "h2d": (load(root) if trained[-1].full_numel else 0) + steps * (per_micro_batch + inputs),
        "d2h": plan.host_accumulation * incoming * reduce + steps * inputs,
        "reduce_scatter": 0.0, "all_gather": 0.0, "all_reduce": 0.0,
    }
    whole = sum(unit.shard_numel for unit in trained) * shards
    if strategy.grad_sync == "gpu_reduce":
        traffic["reduce_scatter"] = steps * _ring(whole * reduce, shards)
    else:  # the host all-reduces whole gradients with gloo
        traffic["all_reduce"] = steps * 2 * _ring(whole * reduce, shards)
    if not full:
        loads = len(blocks) * 2 - min(kept, len(blocks))
        traffic["all_gather"] = steps * loads * _ring(blocks[0].shard_numel * shards * p, shards)
    if trainer.num_nodes > 1:
        traffic["all_reduce"] += steps * 2 * _ring(sum(u.shard_numel for u in trained) * reduce, trainer.num_nodes)
    return traffic


def fsdp2_traffic(trainer: RunTrainer, candidate: Candidate, parameters: int, trained: int, compute: torch.dtype,
                  reduce_dtype: torch.dtype) -> dict[str, float]:
    """FSDP2's collectives' bytes (uncompressed) and, with ``cpu_offload``, its host-device bytes, per process per step.

    Every parameter is gathered; only the ``trained`` ones (LoRA's adapters; else all) have gradients to reduce."""
    steps = trainer.accumulate_grad_batches
    world = trainer.num_nodes * trainer.num_devices
    replicas = {"NO_SHARD": world, "HYBRID_SHARD": candidate.replicate_size or trainer.num_nodes}.get(candidate.sharding, 1)
    shard = world // replicas
    p = compute.itemsize
    reduce = reduce_dtype.itemsize
    gathers = 2 if candidate.sharding in ("FULL_SHARD", "HYBRID_SHARD") else 1  # backward gathers again after a reshard
    traffic = {
        "all_gather": steps * gathers * _ring(parameters * p, shard),
        "reduce_scatter": steps * _ring(trained * reduce, shard),
        "all_reduce": steps * 2 * _ring(trained // shard * reduce, replicas),
        "h2d": 0.0, "d2h": 0.0,
    }
    if candidate.cpu_offload:  # the fp32 shards come to the device for each gather; gradients go back
        traffic["h2d"] = steps * gathers * parameters // shard * 4
        traffic["d2h"] = steps * trained // shard * 4
    return traffic


def float8_peak(peak: float | None, fp8_peak: float | None, flops: float, in_float8: float) -> float | None:
    """The device's rate over ``flops`` of which ``in_float8`` run at ``fp8_peak`` (the hardware file's; a probed one
    is ``torch._scaled_mm``'s measured rate) and the rest at ``peak``: the harmonic mix. Unchanged where either is
    unknown (a CPU emulates float8, no faster). Casts and scales are not counted."""
    if peak is None or fp8_peak is None:
        return peak
    return flops / ((flops - in_float8) / peak + in_float8 / fp8_peak)


def _sum_known(parts: list[float | None]) -> float | None:
    """The sum, or None where a part is unknown (a rate missing from the hardware file)."""
    return None if any(part is None for part in parts) else sum(parts)


def seconds(nbytes: float, gbps: float | None) -> float | None:
    return None if gbps is None else nbytes / (gbps * 1e9)


def estimate_step(trainer: RunTrainer, module: Any, data: Any, hardware: Hardware) -> dict[str, Any]:
    """Everything ``estimate`` prints, as one dict (the ``--json`` object)."""
    candidate = default_candidate(trainer, data, searched=False)
    run = run_shape(trainer, module, data, hardware)
    config = module.hf_config(datamodule=data)
    strategy = trainer.strategy
    lora = module.hparams.get("lora")
    model = ModelShape.of(config, getattr(strategy, "block_class", None), lora)
    compute = compute_dtype(candidate, hardware.accelerator)
    reduce = strategy.resolve_dtype(strategy.reduce_dtype, fallback=compute)
    compression = getattr(strategy, "compression", None)
    semi = getattr(strategy, "semi_sync", None)  # FSDP2's semi-synchronous training: H and the outer step
    semi_sync = None if semi is None else semi.config
    memory = device_estimate(candidate, model, run, base_compression=asdict(compression) if compression else None)
    processes = run.processes_per_node
    device = {"model_states": memory.model_states, "compression_state": memory.compression,
              "weights_and_gradients_in_flight": memory.working_set, "activations": memory.activations,
              "loss": memory.logits}
    tokens = trainer.accumulate_grad_batches * data.batch_size * data.seq_len  # per process per optimizer step
    model_flops = tokens * lora_flops_per_token(config, data.seq_len, lora)
    units: list[UnitSize] = []
    reserve = 0
    if candidate.strategy == "slide_fsdp":
        units = strategy.model_units(module, data, trainer.num_devices)
        reserve = host_reserve_bytes(int(hardware.host_memory_gb * GIB), strategy.host_reserve_gb)
    budget = int(hardware.host_memory_gb * GIB) - reserve

    def figures(slide_plan: Any = None) -> dict[str, Any]:
        """The figures with SlideFSDP's ``slide_plan`` (its split taken; None: FSDP2)."""
        recompute, activation_plan = candidate.activation_checkpointing, None
        parts = dict(device)
        if slide_plan is not None:
            host = slide_plan.host_buffers(units, slide_plan.activation_bytes(units, module, data))
            traffic = slide_traffic(trainer, units, data.batch_size, data.seq_len, config.hidden_size, compute, reduce)
            update_bytes = cpu_update_bytes(trainer, model.trained, compute, reduce, units)
            planned = planned_activations(strategy, trainer, data, config, units, compute, trainer.hardware,
                                          sum(parts.values()) - parts["activations"],
                                          sum(with_runtime(host, processes).values()), budget)
            activation_plan, recompute = planned.plan, planned.plan.blocks("recompute")
            if strategy.activation_plan is not None:  # else the every-k-th count above, LoRA's extra tensors included
                parts["activations"] = planned.device_bytes
            if strategy.activation_plan == "auto":  # chosen here: the preflight could not count it
                host["activations"] = host.get("activations", 0) + planned.host_bytes
            moved = trainer.accumulate_grad_batches * activation_plan.count("host") * planned.saved_bytes
            traffic["h2d"], traffic["d2h"] = traffic["h2d"] + moved, traffic["d2h"] + moved
        else:
            host = {"model_states": memory.host_per_node} if candidate.cpu_offload else {}
            traffic = fsdp2_traffic(trainer, candidate, model.parameters, model.trained, compute, reduce)
            update_bytes = 0
            if semi_sync is not None:  # semi-synchronous: the outer state, and an exchange every H steps
                replicas, shard = strategy.mesh_shape(run.world_size, trainer.num_nodes)
                trained = -(-model.trained // shard)
                outer = outer_state_bytes(semi_sync.outer, trained)
                if semi_sync.outer.state_device == "cpu":
                    host["outer_state"] = outer * processes
                else:
                    parts["outer_state"] = outer
                traffic["all_reduce"] = exchange_bytes(semi_sync, trained, replicas)
        host = with_runtime(host, processes)
        flops = model_flops + tokens * recompute_flops_per_token(config, data.seq_len, recompute,
                                                                 whole_block=activation_plan is not None)
        peak = hardware.peak_for(compute)
        if (module.hparams.get("float8") or "off") != "off":  # the blocks' linear layers at the fp8 rate
            in_float8 = tokens * block_matmul_flops_per_token(config, recompute, activation_plan is not None, bool(lora))
            peak = float8_peak(peak, hardware.peak_tflops.get("fp8"), flops, in_float8)
        network = {name: traffic[name] for name in ("all_gather", "reduce_scatter", "all_reduce")}
        # a shard group inside one node gathers and reduce-scatters over its fast links; replicas on several nodes
        # all-reduce across nodes
        shape = strategy.mesh_shape(run.world_size, trainer.num_nodes) if slide_plan is None else (1,)
        within_node = shape[-1] <= trainer.num_devices
        shard_link = hardware.intra_node_gbps if trainer.num_nodes == 1 or within_node else hardware.inter_node_gbps
        replica_link = hardware.intra_node_gbps if trainer.num_nodes == 1 else hardware.inter_node_gbps
        sharded, replicated = network["all_gather"] + network["reduce_scatter"], network["all_reduce"]
        times = {
            "compute_s": None if peak is None else flops / (peak * 1e12),
            "h2d_s": seconds(traffic["h2d"], hardware.pcie_gbps) if traffic["h2d"] else 0.0,
            "d2h_s": seconds(traffic["d2h"], hardware.pcie_gbps) if traffic["d2h"] else 0.0,
            # the CPU updates of a node share its memory bandwidth
            "cpu_update_s": seconds(update_bytes, hardware.host_memory_gbps) if update_bytes else 0.0,
            "network_s": _sum_known([seconds(sharded, shard_link) if sharded else 0.0,
                                     seconds(replicated, replica_link) if replicated else 0.0]),
        }
        missing = [name for name, value in times.items() if value is None]
        step_time = bound = mfu = None
        step_model: dict[str, Any] | None = None
        efficiency = hardware.efficiency(getattr(strategy, "compile_blocks", False)) or 1.0
        # MFU's denominator is the datasheet's peak, as callbacks.Throughput's, where the table knows the device (a
        # probed hardware file's peak_tflops is the measured matmul rate); else the hardware file's
        mfu_peak = device_peaks(hardware.device_name).get(matmul_format(compute)) or peak
        if not missing:
            # the device's compute at the share of its peak it reaches; transfers and the network at their rates
            reached = {**times, "compute_s": times["compute_s"] / efficiency}
            step_time = max(reached.values())
            if slide_plan is not None:
                slide = slide_step(trainer, units, model_flops, flops, peak * 1e12 * efficiency, times, hardware,
                                   compute, slide_plan)
                step_model = asdict(slide)
                step_time = max(step_time, slide.step_s)
            bound = max(reached, key=reached.get).removesuffix("_s")
            mfu = model_flops / (step_time * mfu_peak * 1e12)
        device_total, host_total = sum(parts.values()), sum(host.values())
        device_memory = hardware.memory_per_process_gb(processes) * GIB
        checkpoint = checkpoint_size(strategy, config, run.world_size, trainer.num_nodes, lora)
        return {
            "hardware": asdict(hardware), "strategy": candidate.strategy, "knobs": candidate.knobs(),
            "parameters": model.parameters, "trained_parameters": model.trained,
            "compute_dtype": str(compute).removeprefix("torch."),
            "tokens_per_step": tokens * run.world_size, "tokens_per_process": tokens,
            "host_bytes": host_total, "host_by_buffer": host, "host_memory_bytes": int(hardware.host_memory_gb * GIB),
            "host_reserve_bytes": reserve,
            "device_peak_bytes": device_total, "device_by_component": parts, "device_memory_bytes": int(device_memory),
            "fits": device_total <= device_memory and host_total <= budget,
            "h2d_bytes": traffic["h2d"], "d2h_bytes": traffic["d2h"], "network_bytes": network,
            "semi_synchronous": semi_sync is not None,
            "cpu_update_bytes": update_bytes, "model_flops": model_flops, "flops": flops, "times": times,
            "missing_rates": missing, "bound": bound, "step_time_s": step_time, "mfu": mfu, "mfu_peak_tflops": mfu_peak,
            "compute_efficiency": efficiency if hardware.compute_efficiency else None, "step_model": step_model,
            "activation_plan": None if activation_plan is None else activation_plan.counts(),
            "update": slide_plan.describe_update(units) if slide_plan is not None else None,
            "checkpoint_bytes": checkpoint.total(weights_only=False), "checkpoint_counted": checkpoint.counted,
        }

    if candidate.strategy != "slide_fsdp":
        return figures()
    # auto's split: the fastest of forward and the splits that fit by the step model (the rollback at
    # offload.step_time.PRIOR_CLIP_RATE), each with its own activation plan; without the rates, the largest that fits
    largest = strategy.split_plan(trainer, module, data, units, compute, budget)
    by_split = {largest.split_blocks: figures(largest)}
    if not largest.schedule.split or by_split[largest.split_blocks]["step_time_s"] is None \
            or strategy.speculated_blocks is not None:
        return by_split[largest.split_blocks]

    def split_figures(blocks: int | None) -> dict[str, Any]:
        if blocks not in by_split:
            by_split[blocks] = figures(replace(largest, split_blocks=blocks))
        return by_split[blocks]

    chosen = strategy.split_plan(trainer, module, data, units, compute, budget,
                                 step_s=lambda blocks: split_figures(blocks)["step_time_s"])
    return split_figures(chosen.split_blocks)


def slide_step(trainer: RunTrainer, units: list[UnitSize], model_flops: float, flops: float, rate: float,
               times: dict[str, float], hardware: Hardware, compute: torch.dtype, plan: Any):
    """SlideFSDP's step as ``offload.step_time`` schedules it, at ``rate`` FLOP/s on the device; ``plan``: the
    strategy's plan with its split taken within the hardware file's host."""
    forward = model_flops / 3 / rate
    trained = [unit.trained() for unit in units]
    total = sum(unit.shard_numel for unit in trained) or 1
    root = trained[-1]
    # the last gradients of a backward: the first block's and the root's last part (the embeddings)
    last = trained[0].shard_numel + (max(root.part_sizes()) if root.part_sizes() else 0)
    refresh = last * trainer.num_devices * (4 + compute.itemsize) / (hardware.host_memory_gbps * 1e9)
    schedule = plan.schedule
    update = times["cpu_update_s"]
    order = None
    if schedule.behind_forward:
        clip_rate = PRIOR_CLIP_RATE if plan.run.clipping else 0.0
        order = forward_order(plan, units, update, trainer.strategy.window,
                              backup_share(trainer, compute, plan.reduce_dtype, units), clip_rate)
    return slide_step_time(forward, flops / rate - forward, times["h2d_s"], times["d2h_s"], update,
                           last / total, refresh, len(units) - 1, trainer.accumulate_grad_batches, schedule.name, order)


def _gib(value: float) -> str:
    return f"{value / GIB:.2f} GiB"


def report(figures: dict[str, Any]) -> str:
    """The figures as the text ``estimate`` prints."""
    hardware = figures["hardware"]
    trained = figures["trained_parameters"]
    lora = "" if trained == figures["parameters"] else f" ({trained / 1e6:.3g}M of them trained: LoRA)"
    lines = [
        f"{figures['strategy']} on {hardware['nodes']} node(s) x {hardware['devices_per_node']} {hardware['device_name']}: "
        f"{figures['parameters'] / 1e9:.3g}B parameters{lora} in {figures['compute_dtype']}, "
        f"{figures['tokens_per_process']:,} tokens per process per step ({figures['tokens_per_step']:,} in all)",
        f"host per node: {_gib(figures['host_bytes'])} of {_gib(figures['host_memory_bytes'])}"
        + (f" less a reserve of {_gib(figures['host_reserve_bytes'])} (host_reserve_gb)"
           if figures["host_reserve_bytes"] else "")
        + f" ({describe(figures['host_by_buffer'])} GiB; runtime is an allowance of "
        f"{RUNTIME_BYTES_PER_PROCESS / GIB:.0f} GiB per process)",
        f"device per process: {_gib(figures['device_peak_bytes'])} of {_gib(figures['device_memory_bytes'])} "
        f"({describe(figures['device_by_component'])} GiB; allocator and CUDA context not counted)",
        f"fits: {'yes' if figures['fits'] else 'NO'}",
        f"one checkpoint: {_gib(figures['checkpoint_bytes'])} ({figures['checkpoint_counted']})",
        f"host-device per process per step: H2D {figures['h2d_bytes'] / 1e9:.2f} GB, D2H {figures['d2h_bytes'] / 1e9:.2f} GB",
        "network per process per step (uncompressed" + ("; all_reduce: the semi-synchronous exchange, compressed, over "
                                                         "its sync_every steps" if figures["semi_synchronous"] else "")
        + "): " + ", ".join(f"{name} {value / 1e9:.2f} GB" for name, value in figures["network_bytes"].items()),
    ]
    if figures["cpu_update_bytes"]:
        lines.append(f"CPU update per node per step: {figures['cpu_update_bytes'] / 1e9:.1f} GB "
                     f"({figures['cpu_update_bytes'] / trained:.0f} B per trained parameter)")
    if figures["activation_plan"]:
        lines.append(f"activations: {describe_plan(figures['activation_plan'])} (activation_plan)")
    if figures.get("update"):
        lines.append(f"update: {figures['update']}")
    lines.append(f"compute per process per step: {figures['flops'] / 1e12:.1f} TFLOP "
                 f"({figures['model_flops'] / 1e12:.1f} without recompute)")
    times = ", ".join(f"{name.removesuffix('_s')} {value:.3f} s" for name, value in figures["times"].items()
                      if value is not None)
    lines.append(f"times at peak rates: {times}")
    if figures["missing_rates"]:
        lines.append("step time and MFU: unknown; the hardware file lacks the rates for "
                     f"{', '.join(figures['missing_rates'])} (peak_tflops, pcie_gbps, host_memory_gbps, *_node_gbps)")
        return "\n".join(lines)
    efficiency = figures["compute_efficiency"]
    which = "compiled_efficiency" if efficiency and efficiency != hardware.get("compute_efficiency") else \
        "compute_efficiency"
    at = (f"the device at {efficiency:.0%} of its peak (the hardware file's {which})" if efficiency
          else "the device at its peak (no compute_efficiency in the hardware file): an upper bound")
    if figures["step_model"]:
        model = figures["step_model"]
        lines.append(f"step ({model['schedule']} update): forward {model['forward_s']:.3f} s, backward "
                     f"{model['backward_s']:.3f} s, CPU update {model['update_s']:.3f} s of which "
                     f"{model['exposed_update_s']:.3f} s exposed; step time {figures['step_time_s']:.3f} s, "
                     f"MFU {figures['mfu']:.1%}, with {at}")
    elif efficiency:
        lines.append(f"bound: {figures['bound']}; step time {figures['step_time_s']:.3f} s, MFU {figures['mfu']:.1%}, "
                     f"with {at} and every other rate at its peak")
    else:
        lines.append(f"bound: {figures['bound']}; step time >= {figures['step_time_s']:.3f} s; "
                     f"MFU <= {figures['mfu']:.1%} (every rate at its peak: an upper bound)")
    return "\n".join(lines)


def usage() -> argparse.ArgumentParser:
    """``estimate --help``: its own options, and where fit's are (every other argument is fit's)."""
    parser = argparse.ArgumentParser(prog="lit_fsdp estimate", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Every other argument is fit's (--config FILE, --trainer.devices 2, ...): "
                                            "python -m lit_fsdp fit --help lists them.")
    parser.add_argument("--tune.hardware", metavar="FILE", help="hardware JSON file, the format python -m lit_fsdp "
                        "hardware prints (default: this machine, detected)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return parser


def main(argv: Sequence[str]) -> None:
    """``estimate``'s command line: fit's configs, ``--tune.hardware FILE`` and ``--json``."""
    as_json = "--json" in argv
    tune_args, fit_args = split_arguments([arg for arg in argv if arg != "--json"])
    if {"-h", "--help"} & set(fit_args):
        usage().print_help()
        return
    options = parse_options(tune_args)
    trainer, module, data = parse(fit_args, load(options.hardware) if options.hardware else None)
    figures = estimate_step(trainer, module, data, trainer.hardware)
    print(json.dumps(figures, indent=2) if as_json else report(figures), file=sys.stdout)
