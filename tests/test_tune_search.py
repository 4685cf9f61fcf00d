"""The search without subprocesses: the space's checks, the Judge's rules, the Coder's moves and the Controller's
budget, no-repeat and rejection rules, with a fake trial runner."""

from __future__ import annotations

import pytest

from lit_fsdp.commands.tune.coder import Coder
from lit_fsdp.commands.tune.controller import Budget, Controller, Search
from lit_fsdp.commands.tune.hardware import Hardware
from lit_fsdp.commands.tune.judge import Evidence, judge
from lit_fsdp.commands.tune.llm import AdviserError
from lit_fsdp.commands.tune.memory import GIB, MemoryFilter, estimate
from lit_fsdp.commands.tune.space import Candidate, RunShape, SearchSpace, outside
from lit_fsdp.commands.tune.trials import Trial
from tests.helpers import TINY

RUN = RunShape(world_size=2, nodes=1, accelerator="cpu", seq_len=128, batch_per_process=8, clipping=True)
DEFAULT = Candidate(micro_batch=8)


def measured(candidate: Candidate, **figures) -> Trial:
    base = dict(tokens_per_s=1000.0, peak_gb=0.5, profiled_step_ms=100.0, compute_time_ms=90.0, comm_exposed_ms=2.0,
                comm_ratio=0.05, check_loss=6.0, losses=[6.2, 6.1])
    return Trial(candidate, "test", "ok", **{**base, **figures})


REFERENCE = measured(DEFAULT, losses=[6.2, 6.1])
EVIDENCE = Evidence(reference=REFERENCE, loss_tolerance=0.02, memory_gb=4.0, budget_gb=3.6)


# --- space -----------------------------------------------------------------------------------------

def test_space_resolves_divisors_and_refuses_values_that_cannot_work():
    allowed = SearchSpace().resolve(RunShape(6, 1, "cpu", 128, 12, False))
    assert allowed["micro_batch"] == [1, 2, 3, 4, 6, 12] and allowed["replicate_size"] == [2, 3]
    for space, message in [
        (SearchSpace(replicate_size=[4]), "replicate_size 4 does not divide the world size 6"),
        (SearchSpace(micro_batch=[5]), "micro_batch 5 does not divide the batch per process 12"),
        (SearchSpace(compression=["zip"]), "'zip' is not a method"),
        (SearchSpace(prefetch=[-1]), "prefetch value -1 must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            space.resolve(RunShape(6, 1, "cpu", 128, 12, False))


def test_candidate_overlay_keeps_the_batch_per_process_and_knobs_of_the_other_strategy_do_not_count():
    overlay = Candidate(micro_batch=2, sharding="NO_SHARD").overlay(RUN)
    assert overlay["trainer"]["accumulate_grad_batches"] == 4 and overlay["data"]["init_args"]["batch_size"] == 2
    assert overlay["trainer"]["strategy"]["init_args"]["sharding"] == "NO_SHARD"
    slide = Candidate(strategy="slide_fsdp", micro_batch=8)
    assert slide.key() == slide.with_knobs({"sharding": "NO_SHARD", "prefetch": 2}).key()
    assert "sharding" not in slide.overlay(RUN)["trainer"]["strategy"]["init_args"]
    with pytest.raises(ValueError, match="unknown knob 'shards'"):
        DEFAULT.with_knobs({"shards": 2})
    allowed = SearchSpace().resolve(RUN)
    assert "outside the search space" in outside(DEFAULT.with_knobs({"sharding": "QUARTER"}), allowed, RUN)
    assert outside(Candidate(strategy="slide_fsdp", param_transfer="shard", micro_batch=8), allowed,
                   RunShape(2, 2, "cpu", 128, 8, False)) == "param_transfer=shard needs >= 2 processes per node"


# --- judge -----------------------------------------------------------------------------------------

def kinds(trial: Trial) -> list[str]:
    return [finding.kind for finding in judge(trial, EVIDENCE)]


def test_judge_names_exposed_communication_host_overhead_and_headroom_in_order():
    assert kinds(measured(DEFAULT, comm_exposed_ms=30.0, compute_time_ms=40.0)) == [
        "communication", "host_overhead", "memory_headroom", "compute"]
    assert kinds(measured(DEFAULT, peak_gb=3.0)) == ["compute"]  # 75% of 4 GB, compute 90% of the step


def test_judge_flags_numerics_and_memory_so_the_trial_cannot_be_best():
    drifted = measured(DEFAULT.with_knobs({"compression": "topk"}), check_loss=6.3)
    assert kinds(drifted)[0] == "numerics" and drifted.flags == ["numerics"] and not drifted.eligible
    assert "validation loss after the trial 6.3000 vs the default's 6.0000 (5.0% > 2.0% tolerance)" in drifted.findings[0]["evidence"]
    close = measured(DEFAULT.with_knobs({"prefetch": 1}), check_loss=6.05)  # 0.8%: within the tolerance
    assert "numerics" not in kinds(close) and close.eligible
    step = measured(DEFAULT.with_knobs({"param_dtype": "float16"}), losses=[6.2, 6.5])  # same micro-batch: steps compared
    assert kinds(step)[0] == "numerics" and "training loss of step 2" in step.findings[0]["evidence"]
    other_split = measured(DEFAULT.with_knobs({"micro_batch": 2}), losses=[6.2, 6.5])  # the last micro-batch's loss
    assert "numerics" not in kinds(other_split)
    nan = measured(DEFAULT, losses=[6.2, float("nan")])
    assert kinds(nan)[0] == "numerics" and not nan.eligible
    over = measured(DEFAULT, peak_gb=4.5)
    assert kinds(over)[0] == "memory_pressure" and over.flags == ["memory_pressure"]
    near = measured(DEFAULT, peak_gb=3.8)
    assert kinds(near)[0] == "memory_pressure" and near.eligible  # inside the filter's margin: a warning, not a flag
    assert "numerics" not in kinds(REFERENCE)  # the default is its own reference


def test_judge_on_failures_and_a_hidden_cpu_update_under_half():
    assert kinds(Trial(DEFAULT, "test", "oom", error="CUDA out of memory")) == ["memory_pressure"]
    assert kinds(Trial(DEFAULT, "test", "timeout", error="timed out after 9 s")) == ["failure"]
    slide = measured(Candidate(strategy="slide_fsdp", micro_batch=8), offload_cpu_update_hidden_share=0.2,
                     offload_cpu_update_ms=40.0)
    assert kinds(slide)[0] == "cpu_update"


# --- coder -----------------------------------------------------------------------------------------

def test_coder_moves_address_the_finding_within_the_space():
    allowed = SearchSpace(prefetch=[0, 1], compression=["none", "int8"]).resolve(RUN)
    coder = Coder(allowed, RUN)
    trial = measured(DEFAULT, comm_exposed_ms=30.0)
    proposals = coder.propose(judge(trial, EVIDENCE)[:1], DEFAULT)
    changes = [p.candidate.changes(DEFAULT) for p in proposals]
    assert changes[:3] == ["prefetch=1", "blocks_per_group=2", "sharding=SHARD_GRAD_OP"]
    assert "compression=int8" in changes and "micro_batch=16" not in changes  # 8 is the largest micro-batch
    assert all(p.reason.startswith("rules: communication:") for p in proposals)
    squeezed = coder.propose(judge(Trial(DEFAULT, "test", "oom", error="out of memory"), EVIDENCE), DEFAULT)
    moves = [p.candidate.changes(DEFAULT) for p in squeezed]
    assert moves[0] == "micro_batch=4" and "activation_checkpointing=1" in moves and "cpu_offload=True" in moves
    slide = next(p.candidate for p in squeezed if p.candidate.strategy == "slide_fsdp")
    assert (slide.activation_checkpointing, slide.activation_offload, slide.window) == (1, "cpu", 1)


# --- controller ------------------------------------------------------------------------------------

class FakeRunner:
    """Tokens/s from a table of knob changes; records what ran."""

    def __init__(self, speed: dict[str, float], fail: str | None = None):
        self.speed, self.fail, self.ran = speed, fail, []

    def __call__(self, candidate: Candidate, index: int, source: str, deadline_s: float) -> Trial:
        change = candidate.changes(DEFAULT)
        self.ran.append((change, deadline_s))
        if change == self.fail:
            return Trial(candidate, source, "failed", index=index, error="killed by SIGKILL")
        trial = measured(candidate, tokens_per_s=self.speed.get(change, 1000.0), comm_exposed_ms=30.0)
        trial.index, trial.source = index, source
        return trial


def controller(runner: FakeRunner, budget: Budget, memory_gb: float = 4.0, validate=lambda c: None, **kwargs) -> Controller:
    hardware = Hardware(accelerator="cpu", device_memory_gb=memory_gb * 2 / 0.9, host_memory_gb=64.0)
    allowed = SearchSpace(strategy=["fsdp2"], prefetch=[0, 1, 2]).resolve(RUN)
    search = Search(DEFAULT, allowed, RUN, MemoryFilter(TINY, RUN, hardware, 0.1), Coder(allowed, RUN), validate, runner,
                    loss_tolerance=0.02, trial_timeout_s=300.0)
    return Controller(search, budget, **kwargs)


def test_controller_keeps_the_trial_budget_never_repeats_and_follows_the_best():
    runner = FakeRunner({"prefetch=1": 1500.0, "prefetch=2": 1200.0})
    result = controller(runner, Budget(trials=5, patience=10)).run()
    ran = [change for change, _ in runner.ran]
    assert ran[:3] == ["same", "micro_batch=1", "prefetch=1"] and len(ran) == 5 == len(set(ran))
    assert result.best.candidate.changes(DEFAULT) == "prefetch=1" and result.stop_reason == "the trial budget (5) is spent"
    assert result.default.source == "default" and all(deadline == 300.0 for _, deadline in runner.ran)
    # After prefetch=1 became the best, proposals are moves from it.
    assert ran[3].startswith("prefetch=") or "prefetch=1" in ran[3]


def test_controller_stops_after_patience_and_records_a_failure_and_goes_on():
    runner = FakeRunner({}, fail="prefetch=1")
    result = controller(runner, Budget(trials=20, patience=3)).run()
    # default, calibration (not counted towards patience), then three trials without a gain
    assert [t.status for t in result.trials if t.index is not None] == ["ok", "ok", "failed", "ok", "ok"]
    assert result.stop_reason == "3 trials in a row without a 2% gain" and result.best is result.default


def test_controller_rejects_invalid_and_oversized_candidates_without_spending_trials():
    # Every trial measures 0.5 GB; the micro-batch-1 trial calibrates the filter to that. A process has just
    # enough memory for the default's other knobs at micro-batch 4: micro-batch 8 is over the budget.
    overhead = 0.5 * GIB - estimate(Candidate(micro_batch=1), TINY, RUN).analytic
    fits = (estimate(Candidate(micro_batch=4), TINY, RUN).analytic + overhead + 1024) / GIB
    validate = lambda c: "invalid: no such mesh" if c.sharding == "SHARD_GRAD_OP" else None  # noqa: E731
    search = controller(FakeRunner({}), Budget(trials=6, patience=10), memory_gb=fits, validate=validate)
    result = search.run()
    assert search.search.memory.calibrated_by == 2  # the micro-batch-1 trial replaced the default's calibration
    budget = search.search.memory.device_budget / GIB
    ran = [t for t in result.trials if t.index is not None]
    rejected = [t for t in result.trials if t.status == "rejected"]
    assert len(ran) <= 6 and [t.source for t in ran[:2]] == ["default", "calibration"]
    assert "invalid: no such mesh" in [t.error for t in rejected]
    by_memory = [t for t in rejected if t.error.startswith("memory filter: needs ~")]
    assert by_memory and all(t.estimate["device_total"] > budget for t in by_memory)
    assert all(t.estimate["device_total"] <= budget for t in ran[2:])
    assert any(t.candidate.micro_batch == 8 for t in by_memory)


def test_controller_gives_trials_the_time_left_and_stops_when_it_is_spent():
    now = [0.0]
    runner = FakeRunner({})

    def run_and_take_40_s(candidate, index, source, deadline_s):
        now[0] += 40.0
        return runner(candidate, index, source, deadline_s)

    search = controller(runner, Budget(trials=10, time_s=100.0, patience=10), clock=lambda: now[0])
    search.search.run_trial = run_and_take_40_s
    result = search.run()
    assert [round(d) for _, d in runner.ran] == [100, 60, 20] and result.stop_reason == "the time budget (100 s) is spent"


class Adviser:
    def __init__(self, answers):
        self.answers, self.calls = answers, 0

    def propose(self, situation):
        self.calls += 1
        self.situation = situation
        if isinstance(self.answers, Exception):
            raise self.answers
        return self.answers


def test_llm_proposals_run_first_are_checked_like_the_rules_and_a_failing_adviser_falls_back():
    adviser = Adviser([{"sharding": "QUARTER"}, {"shards": 4}, {"sharding": "NO_SHARD"}])
    runner = FakeRunner({})
    result = controller(runner, Budget(trials=3, patience=10), adviser=adviser).run()
    assert [c for c, _ in runner.ran] == ["same", "micro_batch=1", "sharding=NO_SHARD"]
    sources = {t.source for t in result.trials if t.index == 3}
    assert sources == {"llm"}
    rejected = [t.error for t in result.trials if t.status == "rejected"]
    assert any("unknown knob 'shards'" in e for e in rejected) and any("outside the search space" in e for e in rejected)
    assert adviser.situation["diagnosis"][0]["kind"] == "communication" and len(adviser.situation["history"]) == 2
    failing = Adviser(AdviserError("http://127.0.0.1:9/v1: connection refused"))
    result = controller(FakeRunner({}), Budget(trials=3, patience=10), adviser=failing).run()
    assert sum(t.index is not None for t in result.trials) == 3 and "connection refused" in result.notes[0]
    assert result.trials[2].source.startswith("rules:")


@pytest.mark.parametrize("peak_gb, finding", [
    # 2 processes share a device of 8.89 GB: each has 4.44 GB, less the filter's 10% margin a budget of 4.00 GB.
    (3.0, None),  # 67% of the process's memory: no headroom (it would be 34% of the whole device's)
    (1.0, ("memory_headroom", "peak 1.00 GB uses 22% of the 4.44 GB a process has")),
    (2.1, ("memory_headroom", "peak 2.10 GB uses 47% of the 4.44 GB a process has")),  # 52% of the 4.00 GB budget
    (4.2, ("memory_pressure", "peak 4.20 GB is inside the margin the memory filter keeps (budget 4.00 of 4.44 GB)")),
    (4.6, ("memory_pressure", "peak 4.60 GB is over the 4.44 GB a process has")),  # under the device's 8.89 GB
])
def test_memory_headroom_near_full_budget_is_judged_against_the_process_budget(peak_gb, finding):
    runner = FakeRunner({})

    def measured_at_peak(candidate, index, source, deadline_s):
        trial = runner(candidate, index, source, deadline_s)
        trial.peak_gb = peak_gb
        return trial

    search = controller(runner, Budget(trials=1))
    search.search.run_trial = measured_at_peak
    result = search.run()
    assert search.search.memory.device_budget / GIB == pytest.approx(4.0, rel=1e-6)
    memory = [(f["kind"], f["evidence"]) for f in result.default.findings if f["kind"].startswith("memory")]
    assert memory == ([finding] if finding else [])
    assert result.default.flags == (["memory_pressure"] if peak_gb > 4.44 else [])


def test_controller_stops_when_every_move_was_tried():
    space = SearchSpace(strategy=["fsdp2"], micro_batch=[1, 8], param_dtype=["auto"], activation_checkpointing=[0],
                        sharding=["FULL_SHARD"], blocks_per_group=[1], prefetch=[0, 1], compile_blocks=[False],
                        cpu_offload=[False])
    allowed = space.resolve(RUN)
    hardware = Hardware(accelerator="cpu", device_memory_gb=64.0, host_memory_gb=64.0)
    runner = FakeRunner({})
    search = Search(DEFAULT, allowed, RUN, MemoryFilter(TINY, RUN, hardware, 0.1), Coder(allowed, RUN), lambda c: None,
                    runner, loss_tolerance=0.02, trial_timeout_s=300.0)
    result = Controller(search, Budget(trials=50, patience=50)).run()
    assert [c for c, _ in runner.ran] == ["same", "micro_batch=1", "prefetch=1"]
    assert result.stop_reason == "no untried candidate is left"


def test_ctrl_c_ends_the_search_with_what_ran():
    runner = FakeRunner({})

    def interrupted_third(candidate, index, source, deadline_s):
        if index == 3:
            raise KeyboardInterrupt
        return runner(candidate, index, source, deadline_s)

    search = controller(runner, Budget(trials=10, patience=10))
    search.search.run_trial = interrupted_third
    result = search.run()
    assert result.stop_reason.startswith("interrupted") and [t.index for t in result.trials] == [1, 2]
    assert result.best is result.default
