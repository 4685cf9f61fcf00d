"""The tuner and SlideFSDP's CPU update: the ``update`` knob and where it cannot run, the strategy's own check
with a candidate's accumulation, the Judge's ``cpu_update`` finding and the Coder's moves for it, and a whole default
search for the 8B on the H100 hardware file with trials simulated by ``estimate``'s step model, which reaches the
shipped ``configs/llama_8b_offload.yaml``."""

from __future__ import annotations

import copy
from dataclasses import replace
from importlib import import_module

import pytest
import yaml

from lit_fsdp.commands.cli import run as parse_fit
from lit_fsdp.commands.estimate import estimate_step, parse
from lit_fsdp.commands.tune.coder import Coder
from lit_fsdp.commands.tune.command import default_candidate, run_shape, strategy_config, strategy_validator
from lit_fsdp.commands.tune.controller import Budget, Controller, Search
from lit_fsdp.commands.tune.hardware import Hardware, load
from lit_fsdp.commands.tune.judge import Evidence, judge
from lit_fsdp.commands.tune.memory import GIB, MemoryFilter, ModelShape
from lit_fsdp.commands.tune.space import STRATEGY_CLASSES, Candidate, RunShape, SearchSpace, outside
from lit_fsdp.commands.tune.trials import Trial
from tests.helpers import REPO, gpu_run_result

RUN = RunShape(world_size=1, nodes=1, accelerator="cuda", seq_len=2048, batch_per_process=32, clipping=True)
HOST_RUN = replace(RUN, accumulate_on="host")
#: The space with the delayed update searched beside the exact ones (opt in: the default searches exact updates only)
WITH_DELAYED = {"update": ["auto", "delayed"]}
ACCUMULATING = Candidate(strategy="slide_fsdp", micro_batch=8, param_dtype="bfloat16", activation_checkpointing=1)
EVIDENCE = Evidence(reference=None, loss_tolerance=0.02, memory_gb=79.1, budget_gb=71.2)


def slide_trial(candidate: Candidate, **figures) -> Trial:
    """A measured SlideFSDP trial: a 10 s step whose 6 s CPU update is hidden unless ``figures`` say otherwise."""
    base = dict(tokens_per_s=6500.0, step_time_ms_p50=10_000.0, peak_gb=60.0, offload_cpu_update_ms=6000.0,
                offload_cpu_update_hidden_share=0.95, offload_cpu_update_hideable_share=1.0,
                offload_device_backward_ms=6000.0, offload_device_idle_ms=0.0, offload_update_wait_ms=0.0)
    return Trial(candidate, "test", "ok", **{**base, **figures})


# --- the knob and where it cannot run --------------------------------------------------------------

def test_a_delayed_update_accumulating_on_the_host_is_refused_and_an_accumulating_space_drops_it():
    """Accumulating on the host, a delayed update would rewrite the staging rows between a step's micro-batches; on
    the device (the default) it accumulates."""
    assert outside(ACCUMULATING.with_knobs({"update": "delayed"}), SearchSpace(**WITH_DELAYED).resolve(RUN), RUN) is None
    assert SearchSpace(micro_batch=[4, 8], **WITH_DELAYED).resolve(RUN)["update"] == ["auto", "delayed"]
    allowed = SearchSpace(**WITH_DELAYED).resolve(HOST_RUN)
    assert allowed["update"] == ["auto", "delayed"]
    delayed = ACCUMULATING.with_knobs({"update": "delayed"})
    assert outside(delayed, allowed, HOST_RUN) == (
        "update=delayed cannot accumulate gradients on the host: micro_batch=8 is under the batch per process 32; "
        "use micro_batch=32, update=auto or accumulate_on: device")
    assert outside(delayed.with_knobs({"micro_batch": 32}), allowed, HOST_RUN) is None
    overlay = delayed.with_knobs({"micro_batch": 32}).overlay(HOST_RUN)
    assert overlay["trainer"]["strategy"]["init_args"]["update"] == "delayed"
    assert overlay["trainer"]["accumulate_grad_batches"] == 1
    assert "update" not in Candidate(micro_batch=8).overlay(HOST_RUN)["trainer"]["strategy"]["init_args"]  # FSDP2's
    # the whole batch is not a micro-batch the space allows: every candidate accumulates, so no delayed update
    assert SearchSpace(micro_batch=[4, 8], **WITH_DELAYED).resolve(HOST_RUN)["update"] == ["auto"]
    with pytest.raises(ValueError, match=r"update \[delayed\] needs the batch per process 32 in one micro-batch"):
        SearchSpace(micro_batch=[4, 8], update=["delayed"]).resolve(HOST_RUN)


def test_a_smaller_micro_batch_from_a_delayed_update_turns_it_off_accumulating_on_the_host_and_keeps_it_on_the_device():
    delayed = ACCUMULATING.with_knobs({"micro_batch": 32, "update": "delayed"})
    oom = judge(Trial(delayed, "test", "oom", error="out of memory"), EVIDENCE)
    on_device = Coder(SearchSpace(**WITH_DELAYED).resolve(RUN), RUN).propose(oom, delayed)
    assert (on_device[0].candidate.micro_batch, on_device[0].candidate.update) == (16, "delayed")
    allowed = SearchSpace(**WITH_DELAYED).resolve(HOST_RUN)
    squeezed = Coder(allowed, HOST_RUN).propose(oom, delayed)
    smaller = squeezed[0].candidate
    assert (smaller.micro_batch, smaller.update) == (16, "auto")
    assert squeezed[0].reason == "rules: memory_pressure: micro_batch 32 -> 16, update delayed -> auto"
    assert all(outside(p.candidate, allowed, HOST_RUN) is None for p in squeezed)


@pytest.mark.parametrize("accumulate_on", ["device", "host"])
def test_the_strategys_own_check_sees_the_candidates_accumulation_not_the_configs(tmp_path, accumulate_on):
    """Configs of micro-batches of 2 accumulated 4 times: a delayed update with the 8 sequences in one micro-batch is
    what SlideFSDP accepts; one with the configs' micro-batch accumulates on the device, and is refused by SlideFSDP
    itself accumulating on the host."""
    cli = parse_fit(["--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.default_root_dir", str(tmp_path),
                     "--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--data.init_args.batch_size", "2",
                     "--trainer.strategy.init_args.accumulate_on", accumulate_on,
                     "--trainer.accumulate_grad_batches", "4"], run=False)
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    run = run_shape(trainer, module, data, Hardware(accelerator="cpu", device_memory_gb=64.0, host_memory_gb=64.0))
    assert run.accumulate_on == accumulate_on
    validate = strategy_validator(trainer, module, strategy_config(cli.config), run)
    delayed = default_candidate(trainer, data).with_knobs({"update": "delayed"})
    assert validate(delayed.with_knobs({"micro_batch": 8})) is None
    if accumulate_on == "device":
        assert validate(delayed) is None
    else:
        assert validate(delayed).startswith("invalid: SlideFSDP update: delayed with accumulate_on: host would rewrite")
    assert trainer.accumulate_grad_batches == 4  # the configs' trainer is left as it was


# --- judge and coder -------------------------------------------------------------------------------

def test_judge_names_a_cpu_update_the_device_waits_for_and_not_one_it_hides():
    assert [f.kind for f in judge(slide_trial(ACCUMULATING), EVIDENCE)] == ["compute"]
    # hidden by most of its time, but the device idles for a gradient buffer 1.5 s of the 10 s step
    idle = judge(slide_trial(ACCUMULATING, offload_device_idle_ms=1000.0, offload_update_wait_ms=500.0), EVIDENCE)
    assert idle[0].kind == "cpu_update"
    assert idle[0].evidence == (
        "the CPU AdamW update (6000 ms, 95% of it hidden, at most 100% hideable under the device's backward) gates the "
        "device; the device waits for it 1500 ms of the 10000 ms step (15%: idle in the backward 1000 ms, at the "
        "optimizer step 500 ms)")
    after = judge(slide_trial(ACCUMULATING, offload_cpu_update_hidden_share=0.0), EVIDENCE)  # clipping: after the backward
    assert after[0].kind == "cpu_update" and "0% of it hidden" in after[0].evidence
    short_wait = slide_trial(ACCUMULATING, offload_update_wait_ms=500.0)  # 5% of the step: not worth a trial
    assert "cpu_update" not in [f.kind for f in judge(short_wait, EVIDENCE)]
    fsdp2 = slide_trial(Candidate(micro_batch=8), offload_cpu_update_hidden_share=0.0)  # no CPU update to judge
    assert "cpu_update" not in [f.kind for f in judge(fsdp2, EVIDENCE)]


def test_an_exposed_cpu_update_moves_to_the_delayed_update_then_a_bigger_micro_batch_then_the_transfer_paths():
    allowed = SearchSpace(**WITH_DELAYED).resolve(RUN)
    coder = Coder(allowed, RUN)
    exposed = slide_trial(ACCUMULATING, offload_cpu_update_hidden_share=0.0, offload_update_wait_ms=6000.0)
    findings = [f for f in judge(exposed, EVIDENCE) if f.kind == "cpu_update"]
    changes = [p.candidate.changes(ACCUMULATING) for p in coder.propose(findings, ACCUMULATING)]
    # the device sums the micro-batches: the delayed update accumulates
    assert changes == ["update=delayed", "micro_batch=16", "window=3", "param_transfer=shard", "grad_sync=cpu_reduce"]
    on_host = [p.candidate.changes(ACCUMULATING)
               for p in Coder(SearchSpace(**WITH_DELAYED).resolve(HOST_RUN), HOST_RUN).propose(findings, ACCUMULATING)]
    # accumulating on the host it cannot: the whole batch in one micro-batch comes with it
    assert on_host == ["micro_batch=32 update=delayed", "micro_batch=16", "window=3", "param_transfer=shard",
                       "grad_sync=cpu_reduce"]
    synchronous = ACCUMULATING.with_knobs({"micro_batch": 16})
    whole = RunShape(1, 1, "cuda", 2048, 16, True)  # the batch per process is the micro-batch: one knob moves
    moves = Coder(SearchSpace(**WITH_DELAYED).resolve(whole), whole).propose(findings, synchronous)
    assert [p.candidate.changes(synchronous) for p in moves][:2] == ["update=delayed", "window=3"]
    already = ACCUMULATING.with_knobs({"micro_batch": 16, "update": "delayed"})
    later = [p.candidate.changes(already) for p in coder.propose(findings, already)]
    assert later[0] == "micro_batch=32"  # delayed already: more tokens per step amortise the update


# --- the 8B on the H100 hardware file, trials simulated by estimate's step model ---------------------

SHIPPED = REPO / "configs" / "llama_8b_offload.yaml"
CONFIGS = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--config", str(SHIPPED)]
# The search's starting point: the run the shipped config trains (32 x 2048 tokens a step per process) with the knobs the
# tuner should find turned off: micro-batches of 8 accumulated 4 times, the CPU update after the clipped backward, eager
# blocks.
BEFORE = [*CONFIGS, "--data.init_args.batch_size", "8", "--trainer.accumulate_grad_batches", "4",
          "--trainer.strategy.init_args.update", "synchronous", "--trainer.strategy.init_args.compile_blocks", "false"]
CONTEXT_GB = 2.0  # the CUDA context and allocator caches a real trial's peak would add to the estimate


class EstimatedTrials:
    """A trial runner that measures nothing: each candidate's figures are ``estimate``'s for the configs with its knobs,
    on the hardware file's rates (``offload.step_time``; compiled blocks at its ``compiled_efficiency``): tokens/s from
    the step time, the update's exposed time as the optimizer step's wait
    for it (enough gradient slots: the backward never idles), the device peak plus a context."""

    def __init__(self, trainer, module, data, hardware, base_init_args):
        self.trainer, self.module, self.data, self.hardware, self.base = trainer, module, data, hardware, base_init_args
        self.ran: list[Candidate] = []

    def __call__(self, candidate: Candidate, index: int, source: str, deadline_s: float) -> Trial:
        self.ran.append(candidate)
        module_name, class_name = STRATEGY_CLASSES[candidate.strategy].rsplit(".", 1)
        base = self.base if candidate.strategy == "slide_fsdp" else {}
        strategy = getattr(import_module(module_name), class_name)(**{**base, **candidate.strategy_init_args()})
        strategy.parallel_devices = self.trainer.strategy.parallel_devices
        batch = self.trainer.accumulate_grad_batches * self.data.batch_size
        data = copy.copy(self.data)
        data.batch_size = candidate.micro_batch
        trainer = replace(self.trainer, strategy=strategy, accumulate_grad_batches=batch // candidate.micro_batch)
        figures = estimate_step(trainer, self.module, data, self.hardware)
        if not figures["fits"]:
            return Trial(candidate, source, "oom", index=index, error="estimate: does not fit")
        step_s = figures["step_time_s"]
        trial = Trial(candidate, source, "ok", index=index, tokens_per_s=figures["tokens_per_process"] / step_s,
                      step_time_ms_p50=step_s * 1e3, mfu=figures["mfu"],
                      peak_gb=figures["device_peak_bytes"] / GIB + CONTEXT_GB)
        if figures["step_model"] is not None:
            model = figures["step_model"]
            update, exposed = model["update_s"], min(max(model["exposed_update_s"], 0.0), model["update_s"])
            trial.offload_cpu_update_ms, trial.offload_update_wait_ms = update * 1e3, exposed * 1e3
            trial.offload_cpu_update_hidden_share = 1 - exposed / update
            trial.offload_device_backward_ms, trial.offload_device_idle_ms = model["backward_s"] * 1e3, 0.0
            trial.offload_cpu_update_hideable_share = min(1.0, model["backward_s"] / update)
        return trial


def test_the_default_search_for_the_8b_on_an_h100_comes_within_2_percent_of_the_shipped_knobs():
    hardware = load(str(REPO / "configs" / "hardware" / "h100_128g.json"))
    shipped_trainer, _, shipped_data = parse(CONFIGS, hardware)
    shipped = default_candidate(shipped_trainer, shipped_data)
    trainer, module, data = parse(BEFORE, hardware)
    run, default = run_shape(trainer, module, data, hardware), default_candidate(trainer, data)
    assert (default.micro_batch, default.update, run.batch_per_process) == (8, "synchronous", 32)
    allowed = SearchSpace().resolve(run)
    model = ModelShape.of(module.hf_config(datamodule=data), trainer.strategy.block_class)
    base_init_args = yaml.safe_load(SHIPPED.read_text())["trainer"]["strategy"]["init_args"]
    runner = EstimatedTrials(trainer, module, data, hardware, base_init_args)
    search = Search(default, allowed, run, MemoryFilter(model, run, hardware, margin=0.1), Coder(allowed, run),
                    lambda candidate: None, runner, loss_tolerance=0.02, trial_timeout_s=900.0)
    result = Controller(search, Budget()).run()  # tune's default budget: 12 trials, patience 4

    # the exact update (auto) in place of the synchronous one first, then compiled blocks, then the activation plan
    # at micro-batches of 8: within 2% of the shipped knobs (the configs' whole batch of 32 in one micro-batch, every
    # block recomputed), which the greedy search does not reach from there (16 per micro-batch is slower)
    shipped_trial = runner(shipped, 99, "shipped", 900.0)
    assert result.best.tokens_per_s > 0.98 * shipped_trial.tokens_per_s
    assert result.best.candidate.update == shipped.update == "auto" and result.best.candidate.compile_blocks
    first = result.trials[2]  # after the default and its calibration: the Judge's cpu_update, the Coder's first move
    assert first.source == "rules: cpu_update: update synchronous -> auto"
    assert result.default.findings[0]["kind"] == "cpu_update"
    ran = [trial for trial in result.trials if trial.index is not None]  # a trial the memory filter refused never ran
    assert ran[2].tokens_per_s > ran[0].tokens_per_s  # the update hidden behind the next forward
    assert ran[3].source == "rules: compute: compile_blocks False -> True" and ran[3].tokens_per_s > ran[2].tokens_per_s
    assert result.best.tokens_per_s > 1.25 * result.default.tokens_per_s  # 1.29x
    assert result.best.mfu > 0.40  # estimate: 40.4% (40.8% for the shipped knobs)
    # the plan decides the recompute: no trial of it drops activation_checkpointing as well
    assert not any(t.candidate.activation_plan == "auto" and t.candidate.activation_checkpointing == 0
                   for t in result.trials)
    # none ran that could not: nothing the memory filter refused
    assert all(t.status == "ok" for t in result.trials if t.index is not None)
