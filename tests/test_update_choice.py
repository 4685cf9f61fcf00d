"""SlideFSDP's choice of update on the host it runs on: the reserve kept free, the split taken at placement as the
preflight takes it, and ``update: auto`` chosen by the step model (``offload.auto_update``); no process started."""

from __future__ import annotations

import types

import pytest
import torch
import yaml

from lit_fsdp.model import CausalLM
from offload import preflight
from offload.auto_update import FIRST_DECISION, AutoUpdate, StepRates
from offload.host_memory import GIB, UnitSize, with_runtime
from offload.strategy import SlideFSDPStrategy
from tests.helpers import REPO

HOST_PLAN = {"host": 1, "recompute": 31}  # the 8B's first block's activations in pinned host memory (11 GiB)


def _llama_8b(**knobs):
    """configs/llama_8b_offload.yaml's strategy (with ``knobs``), trainer fields, model and data on one GPU."""
    config = yaml.safe_load((REPO / "configs" / "llama_8b_offload.yaml").read_text())
    strategy = SlideFSDPStrategy(**{**config["trainer"]["strategy"]["init_args"], **knobs})
    strategy.parallel_devices = [torch.device("cuda", 0)]
    data = types.SimpleNamespace(vocab_size=128_256, tokenizer=None, **{
        key: config["data"]["init_args"][key] for key in ("batch_size", "seq_len")})
    trainer = types.SimpleNamespace(num_devices=1, num_nodes=1, gradient_clip_val=config["trainer"]["gradient_clip_val"],
                                    accumulate_grad_batches=1, datamodule=data, strategy=strategy)
    module = CausalLM(**config["model"])
    module.trainer = trainer
    return strategy, trainer, module, data


def test_the_reserve_is_a_sixteenth_of_the_host_or_the_knob_and_the_budget_says_so(monkeypatch):
    assert preflight.host_reserve_bytes(128 * GIB, None) == 8 * GIB
    assert preflight.host_reserve_bytes(128 * GIB, 20.0) == 20 * GIB and preflight.host_reserve_bytes(None, 0) == 0
    budget, source = preflight.host_memory_budget(64.0)
    assert budget == 60 * GIB and source == "allowed by host_memory_gb (64 GiB, less a reserve of 4.0 GiB: host_reserve_gb)"
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: 32 * GIB)
    assert preflight.host_memory_budget(None, 1.5) == (
        int(30.5 * GIB), "available (MemAvailable 32.0 GiB; set host_memory_gb on a VM that grows its memory on demand, "
                         "less a reserve of 1.5 GiB: host_reserve_gb)")
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: None)
    assert preflight.host_memory_budget(None)[0] is None
    with pytest.raises(ValueError, match=r"^SlideFSDP host_reserve_gb=-1 must be >= 0 GiB, or null for 1/16"):
        SlideFSDPStrategy(host_reserve_gb=-1)


def test_the_split_taken_at_placement_counts_the_host_activations_as_the_preflight_does():
    """The 8B with a block's activations (11 GiB) on a 128 GiB host (no reserve): the preflight's split takes 11
    blocks and needs 126.4 GiB with the activations; placement takes the same (without them it took 18: 137.8 GiB)."""
    strategy, trainer, module, data = _llama_8b(activation_plan=HOST_PLAN, host_memory_gb=128.0, host_reserve_gb=0,
                                                update="split")
    units = strategy.model_units(module, data, 1)
    preflight_plan = strategy.split_plan(trainer, module, data, units, host_bytes=128 * GIB)
    placed = strategy.placed_split(module, units)
    assert preflight_plan.split_blocks == placed.split_blocks == 11
    activations = placed.activation_bytes(units, module, data)
    needed = sum(with_runtime(placed.host_buffers(units, activations), 1).values())
    assert round(needed / GIB, 1) == 126.4 and needed <= 128 * GIB
    assert strategy.plan(trainer).split(units, 128 * GIB).split_blocks == 18  # the activations left out


def test_the_preflight_and_placement_keep_the_reserve():
    """With the default reserve (1/16 of 128 GiB: 8 GiB) the same run's split is smaller, and a run that fits 128 GiB
    only by eating into the reserve is refused, naming it."""
    strategy, trainer, module, data = _llama_8b(activation_plan=HOST_PLAN, host_memory_gb=128.0, update="split")
    units = strategy.model_units(module, data, 1)
    placed = strategy.placed_split(module, units)
    activations = placed.activation_bytes(units, module, data)
    needed = sum(with_runtime(placed.host_buffers(units, activations), 1).values())
    assert placed.split_blocks < 11 and needed <= 120 * GIB
    big = _llama_8b(activation_plan={"host": 3, "recompute": 29}, host_memory_gb=128.0, update="forward")
    with pytest.raises(ValueError, match=r"but 120.0 GiB are allowed by host_memory_gb \(128 GiB, less a reserve of "
                                         r"8.0 GiB: host_reserve_gb\); put fewer blocks on the host"):
        big[0].preflight_host(*big[1:])


def _units(blocks: int = 8) -> list[UnitSize]:
    return [*(UnitSize(1000, 1000) for _ in range(blocks)), UnitSize(2000, 2000, (1000, 1000), leading_parts=1)]


def _auto(clipping: bool = True, allocated: int = 4):
    from offload.plan import SlidePlan, SlideRun

    plan = SlidePlan(window=2, param_transfer="full", grad_sync="gpu_reduce", activation_offload="none",
                     activation_checkpointing=1, optimizer_state_dtype=torch.float32, update="auto", gradient_slots=None,
                     on_nonfinite="stop", run=SlideRun(1, 1, 1, clipping, "cuda"), compute_dtype=torch.bfloat16,
                     reduce_dtype=torch.bfloat16, split_blocks=allocated)
    return AutoUpdate(plan, _units(), backup_share=0.5, clipping=clipping)


def test_auto_takes_forward_when_clipping_fires_often_and_the_head_side_when_it_does_not():
    """The model with the run's rates: a forward that outruns the ordered chain exposes the root's update; the split's
    head side hides that part. Clipping on every step exposes the undo and redo of the speculated units in the chain,
    and forward wins; without clipping the head side's split wins, and more blocks buy nothing (the fewest are taken)."""
    auto = _auto()
    assert not any(auto.observe(StepRates(1.0, 2.0, 1.0, clipped=True)) for _ in range(FIRST_DECISION - 1))
    assert auto.observe(StepRates(1.0, 2.0, 1.0, clipped=True))  # the 4th step: a choice is due
    assert auto.clip_rate() == 1.0 and auto.decide() is None  # forward: 0.3 s exposed, the head side's split 0.35
    assert auto.reason.startswith("by the step model with this run's rates over steps 2-4 (forward 1.000 s, backward "
                                  "2.000 s, CPU update 1.000 s, clip rate 100% of 4 steps): 3.300 s a step against split of the head side's 3.350 s")
    calm = _auto()
    for _ in range(FIRST_DECISION):
        calm.observe(StepRates(1.0, 2.0, 1.0, clipped=False))
    assert calm.clip_rate() == 0.0 and calm.decide() == 0
    assert calm.step_s(0) < calm.step_s(None) and calm.step_s(4) == calm.step_s(0)
    later = [calm.observe(StepRates(1.0, 2.0, 1.0, clipped=False)) for _ in range(60)]
    assert later.index(True) == 49 and later.count(True) == 1  # again every 50 steps
    unclipped = _auto(clipping=False)
    for _ in range(FIRST_DECISION):
        unclipped.observe(StepRates(1.0, 2.0, 1.0, clipped=True))  # the guard cannot fire: nothing is redone
    assert unclipped.clip_rate() == 0.0
