"""Mixture-of-experts gradients under compression: a fused expert tensor (experts x out x in) is compressed by the
low-rank methods one expert matrix at a time, its bytes counted per matrix, and every method and DiLoCo trains the
tiny Qwen3-MoE preset on 2 processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from transformers import AutoModelForCausalLM

from compress.communicator import CommStats
from compress.communicators import LOWRANK
from compress.config import METHODS, CompressionConfig
from compress.layout import MatrixStack, UnitLayout
from compress.lowrank import LowRank
from compress.powersgd import PowerSGD, PowerSGDAllReduce, PowerSGDReduceScatter, compressed_fraction
from lit_fsdp.presets import build_config
from tests.distributed import fit_in_process, run
from tests.helpers import REPO, fit_arguments, read_metrics

EXPERTS, ROWS, COLS, RANK = 3, 16, 12, 2


def experts(seed: int = 0) -> torch.Tensor:
    return torch.randn(EXPERTS, ROWS, COLS, generator=torch.Generator().manual_seed(seed))


class TwinRanks:
    """A group of two ranks that hold the same gradients, in this process: an all-reduce doubles (``twin_ranks``)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@pytest.fixture
def twin_ranks(monkeypatch) -> TwinRanks:
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None, group=None: tensor.mul_(2))
    return TwinRanks()


# ------------------------------------------------------------------------------------------------ PowerSGD


def test_powersgd_on_a_stack_of_experts_equals_powersgd_on_each_expert_and_sends_each_ones_factors(twin_ranks):
    stacked, stats = PowerSGD(rank=RANK, start_step=0, min_compression=1.0), CommStats()
    start = stacked.initial_q("experts", EXPERTS, COLS, RANK, torch.device("cpu"))  # the Qs its first call starts from
    (together,) = stacked.average([experts()], ["experts"], twin_ranks, stats)
    sent = stats.take()["bytes_sent"]
    for index in range(EXPERTS):
        alone = PowerSGD(rank=RANK, start_step=0, min_compression=1.0)
        alone.q["expert"] = start[index : index + 1]
        (result,) = alone.average([experts()[index : index + 1]], ["expert"], twin_ranks, CommStats())
        torch.testing.assert_close(together[index], result[0], rtol=1e-5, atol=1e-6)
    # a ring all-reduce of 2 ranks sends 4 bytes a value: P (ROWS x RANK) and Q (COLS x RANK) per expert; the stack
    # flattened to one (EXPERTS * ROWS) x COLS matrix would send 4 * (EXPERTS * ROWS + COLS) * RANK
    assert sent == 4 * EXPERTS * (ROWS + COLS) * RANK


def expert_layout(rank: int) -> UnitLayout:
    """A unit of one expert tensor over 2 ranks, from ``rank``'s side: rank 0 holds experts 0 and 1, rank 1 expert 2
    and a padding row."""
    return UnitLayout.build("block", [(("experts",), nn.Parameter(torch.empty(EXPERTS, ROWS, COLS)))], 2, rank)


def test_powersgd_reduce_scatter_of_experts_that_do_not_divide_by_the_ranks_sends_no_padding(twin_ranks):
    layout = expert_layout(0)
    state, stats = PowerSGD(rank=RANK, start_step=0, min_compression=1.0), CommStats()
    hook = PowerSGDReduceScatter(state, stats, "unit", layout)
    rank_major = torch.zeros(2, 2, ROWS * COLS)
    rank_major.view(4, ROWS, COLS)[:EXPERTS] = experts()
    output = torch.empty(layout.shard_numel)
    hook(output, rank_major.view(-1), twin_ranks, torch.distributed.ReduceOp.AVG)

    (expected,) = PowerSGD(rank=RANK, start_step=0, min_compression=1.0).average(
        [experts()], ["unit/experts"], twin_ranks, CommStats())
    torch.testing.assert_close(output.view(2, ROWS, COLS), expected[:2])
    assert stats.take()["bytes_sent"] == 4 * EXPERTS * (ROWS + COLS) * RANK
    # against FSDP2's padded reduce-scatter input: 4 rows of ROWS x COLS
    assert compressed_fraction(state, layout, world=2) == EXPERTS * (ROWS + COLS) * RANK / (4 * ROWS * COLS)


def test_powersgd_replicate_all_reduce_compresses_the_experts_of_this_ranks_shard(twin_ranks):
    state, stats = PowerSGD(rank=RANK, start_step=0, min_compression=1.0), CommStats()
    hook = PowerSGDAllReduce(state, stats, "unit/ar", expert_layout(1), twin_ranks)
    shard = torch.zeros(2, ROWS, COLS)
    shard[0] = experts()[2]
    hook(shard)

    (expected,) = PowerSGD(rank=RANK, start_step=0, min_compression=1.0).average(
        [experts()[2:]], ["unit/ar/experts"], twin_ranks, CommStats())
    torch.testing.assert_close(shard[0], expected[0])
    assert torch.equal(shard[1], torch.zeros(ROWS, COLS))  # the padding row stays empty
    assert stats.take()["bytes_sent"] == 4 * (ROWS + COLS) * RANK  # one expert's P and Q


# ------------------------------------------------------------------------------------------------ lowrank


CHUNK = 50 + EXPERTS * ROWS * COLS + 30  # 50 values of other parameters, the experts, 30 more
STACK = MatrixStack(offset=50, count=EXPERTS, rows=ROWS, cols=COLS)


def chunk() -> torch.Tensor:
    values = torch.randn(CHUNK, generator=torch.Generator().manual_seed(1))
    values[STACK.offset : STACK.end] = experts().flatten()
    return values


def test_lowrank_compresses_declared_experts_one_matrix_at_a_time():
    stacked = LowRank(rank=RANK)
    stacked.stacks["row"] = (STACK,)
    stacked.compress(chunk(), "row", seed=3)  # warm: the next call starts from these Qs
    warm = {key: q.clone() for key, q in stacked.state_dict().items()}
    payload = stacked.compress(chunk(), "row", seed=3)
    decoded = stacked.decompress(payload)

    for index in range(EXPERTS):
        alone = LowRank(rank=RANK, cols=COLS)
        alone.load_state_dict({"q/expert": warm["q/row/0"][index]})
        expected = alone.decompress(alone.compress(experts()[index].flatten(), "expert", seed=3))
        torch.testing.assert_close(decoded[STACK.offset:STACK.end].view(EXPERTS, -1)[index], expected)
    rest = LowRank(rank=RANK)
    rest.load_state_dict({"q/rest": warm["q/row"]})
    others = torch.cat([chunk()[: STACK.offset], chunk()[STACK.end :]])
    torch.testing.assert_close(torch.cat([decoded[: STACK.offset], decoded[STACK.end :]]),
                               rest.decompress(rest.compress(others, "rest", seed=3)))
    # bytes: P and Q per expert, and the other 80 values as a 9 x 9 matrix's
    assert payload.tensors["p.0"].shape == (EXPERTS, ROWS, RANK) and payload.tensors["q.0"].shape == (EXPERTS, COLS, RANK)
    assert payload.nbytes == 4 * RANK * (EXPERTS * (ROWS + COLS) + 9 + 9)


def test_lowrank_is_exact_on_experts_of_low_rank_where_the_flattened_stack_is_not():
    generator = torch.Generator().manual_seed(2)
    low = torch.randn(EXPERTS, ROWS, RANK, generator=generator) @ torch.randn(EXPERTS, RANK, COLS, generator=generator)
    values = chunk()
    values[STACK.offset : STACK.end] = low.flatten()
    per_expert, flattened = LowRank(rank=RANK), LowRank(rank=RANK)
    per_expert.stacks["row"] = (STACK,)
    errors = []
    for compressor in (per_expert, flattened):
        decoded = compressor.decompress(compressor.compress(values, "row", seed=0))
        errors.append((decoded[STACK.offset : STACK.end] - low.flatten()).norm() / low.norm())
    assert errors[0] < 1e-5 < 0.1 < errors[1]


def test_lowrank_hooks_declare_each_rows_experts_to_the_codec(twin_ranks):
    compressor = LowRank(rank=RANK)
    reduce_scatter = LOWRANK.reduce_scatter(compressor, CommStats(), "unit", layout=expert_layout(0))
    all_reduce = LOWRANK.all_reduce(compressor, CommStats(), "unit", group=twin_ranks, layout=expert_layout(1))
    assert [compressor.stacks[reduce_scatter.key(d)] for d in range(2)] == [
        (MatrixStack(0, 2, ROWS, COLS),), (MatrixStack(0, 1, ROWS, COLS),)]
    assert compressor.stacks[all_reduce.key] == (MatrixStack(0, 1, ROWS, COLS),)


def test_lowrank_rank_above_an_expert_matrix_is_that_matrix_rank():
    compressor = LowRank(rank=20)
    compressor.stacks["row"] = (MatrixStack(offset=0, count=2, rows=5, cols=40),)
    payload = compressor.compress(torch.randn(2 * 5 * 40 + 900), "row", seed=0)
    assert payload.tensors["p.0"].shape == (2, 5, 5) and payload.tensors["q.0"].shape == (2, 40, 5)


# ------------------------------------------------------------------------------------------------ training


STEPS = 2
DILOCO_STEPS = 3  # sync_every 3: one synchronisation, of each of streaming's 3 fragments
KNOB = "--trainer.strategy.init_args.compression"
STRATEGY = "--trainer.strategy.init_args"
MOE = ["--model.preset", "qwen3-moe-tiny"]
NO_CHECKPOINT = ["--trainer.enable_checkpointing", "false"]
# Settings that make each method compress within STEPS (the defaults warm up for 10 to 100 steps).
WARMED = {
    "powersgd": "{method: powersgd, rank: 2, start_step: 1}",
    "onebit_adam": "{method: onebit_adam, freeze_step: 1}",
    "zero_one_adam": "{method: zero_one_adam, var_freeze_step: 1, local_step_clipper: 2}",  # an exact round, a sync
}
DILOCO = ("diloco", "diloco_streaming", "diloco_sparseloco")
STATS = [{"class_path": "callbacks.CompressionStats"}]
COUNTED = ("powersgd", "lowrank")  # their bytes are checked against E matrices' factors


def method_arguments(method: str) -> list[str]:
    return [KNOB, WARMED.get(method, f"{{method: {method}}}")]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> Path:
    """Every method (STEPS steps) and each DiLoCo config (DILOCO_STEPS) of the tiny Qwen3-MoE, one
    after another in one spawn of 2 processes (the CLI in-process, no checkpoint written)."""
    root = tmp_path_factory.mktemp("moe")
    runs = [fit_arguments(root / method, *MOE, *method_arguments(method), *NO_CHECKPOINT, steps=STEPS,
                          callbacks=STATS if method in COUNTED else None) for method in METHODS]
    runs += [fit_arguments(root / config, *MOE, "--config", str(REPO / "configs" / f"{config}.yaml"),
                           f"{STRATEGY}.sync_every", str(DILOCO_STEPS), *NO_CHECKPOINT, steps=DILOCO_STEPS)
             for config in DILOCO]
    run(fit_in_process, root, runs)
    return root


@pytest.mark.parametrize("name", [*METHODS, *DILOCO])
def test_each_method_and_diloco_trains_the_moe_preset_with_finite_losses(moe_runs, name):
    losses = read_metrics(max((moe_runs / name).glob("lightning_logs/version_*/metrics.csv")))["train/loss"]
    assert len(losses) == (DILOCO_STEPS if name in DILOCO else STEPS), losses
    assert all(math.isfinite(loss) for loss in losses), losses


def moe_units(world: int = 2) -> list[UnitLayout]:
    """The tiny Qwen3-MoE's units as FSDP2 reduce-scatters them (each decoder layer, the root), from rank 0's side."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config("qwen3-moe-tiny"))
    units: dict[str, list] = {}
    for name, param in model.named_parameters():
        units.setdefault(name.split(".")[2] if name.startswith("model.layers.") else "root", []).append(((name,), param))
    return [UnitLayout.build(unit, params, world, 0) for unit, params in units.items()]


def implied_ratio(method: str) -> float:
    """fp32 bytes over the bytes ``method`` sends once compressing (2 ranks, every expert a matrix): what a rank
    sends of one unit's reduce-scatter is its shard, of PowerSGD's ring all-reduces each value of P and Q, of
    lowrank's all-to-all the other rank's payload."""
    parameters = CompressionConfig(**yaml.safe_load(WARMED.get(method, f"{{method: {method}}}"))).parameters()
    raw = sent = 0
    for layout in moe_units():
        raw += 4 * layout.shard_numel
        if method == "powersgd":
            sent += 4 * 2 * layout.shard_numel * compressed_fraction(PowerSGD(**parameters), layout, world=2)
            continue
        stacks, rank = layout.stacks(1), parameters["rank"]  # rank 1's row; rank 4 fits every expert matrix
        rest = layout.shard_numel - sum(stack.end - stack.offset for stack in stacks)
        cols = math.ceil(math.sqrt(rest))
        factors = sum(stack.count * (stack.rows + stack.cols) for stack in stacks) + math.ceil(rest / cols) + cols
        sent += 4 * rank * factors
    return raw / sent


@pytest.mark.parametrize("method", COUNTED)
def test_low_rank_methods_send_the_factors_of_every_expert_matrix_in_training(moe_runs, method):
    metrics = read_metrics(max((moe_runs / method).glob("lightning_logs/version_*/metrics.csv")))
    assert metrics["compress/ratio_vs_fp32"][-1] == pytest.approx(implied_ratio(method), rel=1e-9)
