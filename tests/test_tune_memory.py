"""The tuner's memory estimate against its formulas on known shapes, its calibration, and the filter's verdicts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from compress.config import CompressionConfig
from lit_fsdp.diloco import OuterConfig
from lit_fsdp.presets import build_config
from lit_fsdp.commands.tune.hardware import Hardware
from lit_fsdp.commands.tune.memory import GIB, MemoryFilter, ModelShape, estimate
from lit_fsdp.commands.tune.space import Candidate, RunShape
from offload.host_memory import UnitSize, piece_capacity
from tests.helpers import BLOCK, HIDDEN, INNER, LAYERS, ROOT, TINY, VOCAB


def run_shape(world: int = 2, nodes: int = 1, accelerator: str = "cpu", batch: int = 8, clipping: bool = False) -> RunShape:
    return RunShape(world_size=world, nodes=nodes, accelerator=accelerator, seq_len=128, batch_per_process=batch,
                    clipping=clipping)


def test_model_shape_counts_gpt2_tiny_as_by_hand():
    assert ModelShape.of(build_config("gpt2-tiny", {"vocab_size": VOCAB})) == TINY
    llama = ModelShape.of(build_config("llama-tiny"))
    assert llama.gated_mlp and llama.intermediate == 176 and llama.layers == 2


@pytest.mark.parametrize("sharding, group, gathered_blocks", [
    ("FULL_SHARD", 2, 2), ("SHARD_GRAD_OP", 2, LAYERS), ("NO_SHARD", 1, LAYERS)])
def test_fsdp2_estimate_is_states_over_the_shard_group_plus_working_set_activations_and_logits(sharding, group, gathered_blocks):
    m, s, p = 4, 128, 4  # float32 on CPU
    e = estimate(Candidate(sharding=sharding, micro_batch=m), TINY, run_shape())
    assert e.model_states == 16 * TINY.parameters // group
    assert e.working_set == (gathered_blocks * BLOCK + ROOT) * p + (BLOCK + ROOT) * (p + 4)
    assert e.activations == LAYERS * m * s * (8 * HIDDEN + 2 * INNER) * p
    assert e.logits == m * s * VOCAB * (p + 8)
    assert (e.host_per_node, e.overhead) == (0, 0)
    assert e.device_total == e.model_states + e.working_set + e.activations + e.logits


def test_hybrid_shards_within_a_replica_and_bfloat16_halves_the_gathered_weights_on_gpus():
    run = run_shape(world=8, nodes=2, accelerator="cuda")
    e = estimate(Candidate(sharding="HYBRID_SHARD", replicate_size=2, prefetch=2, micro_batch=1), TINY, run)
    assert e.model_states == 16 * TINY.parameters // 4
    gathered = min(LAYERS * BLOCK, 3 * BLOCK)  # one unit computing, two prefetched, at most every block
    assert e.working_set == (gathered + ROOT) * 2 + (BLOCK + ROOT) * (2 + 4)
    assert e.logits == 128 * VOCAB * (2 + 8)


def test_the_chunked_loss_counts_one_chunk_of_logits_and_the_gradients_it_keeps():
    run = RunShape(world_size=2, nodes=1, accelerator="cpu", seq_len=128, batch_per_process=8, clipping=False,
                   loss_chunk_tokens=64)
    e = estimate(Candidate(micro_batch=4), TINY, run)
    assert e.logits == 64 * VOCAB * 8 + 4 * 128 * HIDDEN * 4 + VOCAB * HIDDEN * 4
    assert e.logits < estimate(Candidate(micro_batch=4), TINY, run_shape()).logits


def test_checkpointing_keeps_block_inputs_and_one_recompute():
    m, s, p = 2, 128, 4
    full = m * s * (8 * HIDDEN + 2 * INNER) * p
    every_block = estimate(Candidate(activation_checkpointing=1, micro_batch=m), TINY, run_shape())
    assert every_block.activations == LAYERS * m * s * HIDDEN * p + full
    every_other = estimate(Candidate(activation_checkpointing=2, micro_batch=m), TINY, run_shape())
    assert every_other.activations == (LAYERS - 1) * full + m * s * HIDDEN * p + full


def test_cpu_offload_moves_the_states_to_the_host():
    e = estimate(Candidate(cpu_offload=True, micro_batch=1), TINY, run_shape(accelerator="cuda"))
    assert e.model_states == 0 and e.host_per_node == 16 * TINY.parameters // 2 * 2 and e.host_share == 0


CAPACITY = piece_capacity([UnitSize.of(BLOCK, 2)], False, 2)  # a ring buffer: a block's shard (2 processes)
PIECES = LAYERS + math.ceil(math.ceil(ROOT / 2) / CAPACITY)  # one backward's gradient pieces: each block, the root in pieces


def ring(slots: int, itemsize: int) -> int:
    """The node's gradient ring: 2 processes x ``slots`` buffers of a block's shard and its flag."""
    return 2 * slots * (CAPACITY + 1) * itemsize


def test_slide_fsdp_keeps_a_window_on_the_device_and_14_to_20_bytes_per_parameter_and_a_ring_on_the_host():
    m, s = 2, 128
    slide = Candidate(strategy="slide_fsdp", window=2, activation_checkpointing=1, activation_offload="cpu", micro_batch=m)
    # bfloat16, no accumulation, no clipping; gradients reduced in float32 (the default, auto, reduces in bfloat16)
    gpu = estimate(slide, TINY, replace(run_shape(accelerator="cuda", batch=m), reduce_dtype="float32"))
    assert gpu.model_states == 0
    assert gpu.working_set == (2 * BLOCK + ROOT) * 2 + (ROOT + 2 * BLOCK) * 4
    assert gpu.activations == m * s * (8 * HIDDEN + 2 * INNER) * 2  # inputs on the host; one block recomputed
    offloaded_inputs = LAYERS * m * s * HIDDEN * 2 * 2  # per process, 2 processes
    # no kept gradient: a buffer per piece of a backward, so that the backward never waits for an update
    assert gpu.host_per_node == TINY.parameters * (4 + 8 + 2) + ring(PIECES, 4) + offloaded_inputs
    auto = estimate(slide, TINY, run_shape(accelerator="cuda", batch=m))  # the ring and in-flight gradients in bfloat16
    assert gpu.working_set - auto.working_set == (ROOT + 2 * BLOCK) * 2
    assert gpu.host_per_node - auto.host_per_node == ring(PIECES, 2)
    # clipping (update: auto, ordered after the norm): each piece waits in its buffer for the norm; no fp32 copy
    clipped = estimate(slide, TINY, replace(run_shape(accelerator="cuda", batch=m, clipping=True), reduce_dtype="float32"))
    assert clipped.host_per_node == gpu.host_per_node
    # float32 staging; 2 micro-batches summed on the device: each process's float32 sum of its shard there, no kept
    # gradient on the host
    cpu = estimate(slide, TINY, run_shape(accelerator="cpu", batch=4))
    assert cpu.model_states == 4 * TINY.parameters // 2
    assert cpu.host_per_node == TINY.parameters * (4 + 8 + 4) + ring(PIECES, 4) + LAYERS * m * s * HIDDEN * 4 * 2
    assert cpu.host_share == cpu.host_per_node // 2  # on a CPU the device is the host
    on_host = estimate(slide, TINY, replace(run_shape(accelerator="cpu", batch=4), accumulate_on="host"))
    assert on_host.model_states == 0  # a kept fp32 gradient takes each piece on arrival; max(2, window) buffers
    assert on_host.host_per_node == TINY.parameters * (4 + 8 + 4 + 4) + ring(2, 4) + LAYERS * m * s * HIDDEN * 4 * 2


def test_a_delayed_update_keeps_no_fp32_gradient_and_its_ring_holds_a_step_of_pieces_and_two_more():
    m = 2
    run = replace(run_shape(accelerator="cuda", batch=m, clipping=True), reduce_dtype="float32")
    exact = Candidate(strategy="slide_fsdp", window=2, micro_batch=m)
    delayed = exact.with_knobs({"update": "delayed"})
    kept = estimate(exact, TINY, run)
    held = estimate(delayed, TINY, run)
    assert kept.host_per_node == TINY.parameters * (4 + 8 + 2) + ring(PIECES, 4)  # a step's pieces until the norm
    assert held.host_per_node == TINY.parameters * (4 + 8 + 2) + ring(PIECES + 2, 4)  # a step's pieces + max(2, window)
    assert held.device_total == kept.device_total  # the delay changes the host's buffers only
    wide = estimate(delayed.with_knobs({"window": 3}), TINY, run)  # the next backward's first pieces: max(2, window)
    assert wide.host_per_node - held.host_per_node == ring(1, 4)


def test_calibration_makes_the_measured_trial_exact_and_shifts_the_others_by_the_same_constant():
    hardware = Hardware(accelerator="cpu", devices_per_node=1, device_memory_gb=2.0, host_memory_gb=2.0)
    memory = MemoryFilter(TINY, run_shape(), hardware, margin=0.1)
    small, large = Candidate(micro_batch=1), Candidate(micro_batch=8, sharding="NO_SHARD")
    memory.calibrate(small, measured_gb=0.5, trial=2)
    assert memory.estimate(small).device_total == pytest.approx(0.5 * GIB, abs=1)
    assert memory.estimate(large).device_total - memory.estimate(small).device_total == (
        estimate(large, TINY, run_shape()).analytic - estimate(small, TINY, run_shape()).analytic)
    assert memory.device_budget == int(2.0 / 2 * 0.9 * GIB)  # one CPU "device" shared by 2 processes, 10% margin
    assert memory.rejection(large) is None
    memory.calibrate(small, measured_gb=0.9, trial=2)  # the overhead alone now fills the 0.9 GB budget
    reason = memory.rejection(large)
    assert reason.startswith("needs ~") and "> 0.90 GB (2 GB per device less the 10% margin)" in reason


def test_the_filter_rejects_offloaded_state_that_does_not_fit_in_host_memory():
    hardware = Hardware(accelerator="cpu", device_memory_gb=16.0, host_memory_gb=0.002)
    memory = MemoryFilter(TINY, run_shape(clipping=True), hardware, margin=0.1)
    slide = Candidate(strategy="slide_fsdp", micro_batch=8)
    needed = (TINY.parameters * 16 + ring(PIECES, 4)) / GIB  # 16 B/param; a step's pieces wait in the float32 ring
    assert math.isclose(memory.estimate(slide).host_per_node / GIB, needed, rel_tol=1e-9)
    assert "of host memory per node for offloaded state" in memory.rejection(slide)
    assert memory.rejection(Candidate(micro_batch=8)) is None


def test_semi_synchronous_training_counts_the_outer_state_of_each_processs_shard_where_it_is_kept():
    """theta_outer and momentum (8 B), a 4-bit codec's error-feedback residual (4 B) per trained parameter of the
    process's shard, and one of 2 fragments' pseudo-gradient in flight (4 B over 2): on the host by default."""
    hybrid = Candidate(sharding="HYBRID_SHARD", replicate_size=2, micro_batch=1)
    plain = estimate(hybrid, TINY, run_shape(world=4))
    codec = CompressionConfig(method="int8", num_bits=4, error_feedback=True)
    shard = -(-TINY.trained // 2)
    on_host = estimate(hybrid, TINY, replace(run_shape(world=4), outer=OuterConfig(codec=codec, fragments=2)))
    assert on_host.host_per_node - plain.host_per_node == 4 * (12 * shard + 4 * -(-shard // 2))
    assert on_host.outer_state == 0 and on_host.model_states == plain.model_states
    on_device = estimate(hybrid, TINY, replace(run_shape(world=4, accelerator="cuda"),
                                               outer=OuterConfig(codec=codec, fragments=2, state_device="device")))
    assert on_device.outer_state == 12 * shard + 4 * -(-shard // 2) and on_device.host_per_node == 0
    assert on_device.device_total - estimate(hybrid, TINY, run_shape(world=4, accelerator="cuda")).device_total == on_device.outer_state
