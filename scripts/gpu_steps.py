"""The GPU check's steps, one row each in ``STEPS``: what a step runs, its deadline, what it records and what it
needs to have passed before it. A training run is a ``Fit`` row (shipped configs and the overlay laid over them per
device); the few steps that are more than one fit (the probe, tests, parity, resume, tune, benchmarks) are functions.
Adding a fit step is adding a row.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from gpu_fit import (HOST_MEMORY_VARIABLE, ROOT, Record, command, fit, fit_arguments, measuring, warmup_steps,
                     write_estimate, write_yaml)
from gpu_overlays import (AUTO_PLAN, BF16_MASTER, DEVICE_SUMS, EAGER, FIRST_BLOCKS, HOST_BLOCKS, LORA, ACCUMULATED_DELAYED,
                          DELAYED, FORWARD, ROLLBACK, SPECULATIVE, SYNCHRONOUS, accelerator, as_shipped, eight_b_before,
                          float8, fsdp2_moe, merge, moe, offload_strategy, one_b, onebit, onebit_callbacks, slide_fsdp_syncs,
                          tiny, tuned)
from gpu_probe import probe

#: A step that is a function: it runs in the step's process and writes what it measured into the record.
StepFunction = Callable[[Record, str, Path], None]

QUICKSTART = "configs/quickstart.yaml"
ONE_B = (QUICKSTART, "configs/llama_1b.yaml")
EIGHT_B = (QUICKSTART, "configs/llama_8b_offload.yaml")
EIGHT_B_8K = (*EIGHT_B, "configs/llama_8b_offload_8k.yaml")
QWEN_32B_LORA = (QUICKSTART, "configs/qwen_32b_lora.yaml")
QWEN_14B_FULL = (QUICKSTART, "configs/qwen_14b_full.yaml")
MOE_LORA = ("configs/qwen3_30b_a3b_lora.yaml",)  # complete on its own: no quickstart before it
#: The largest MoE that trains every parameter on the H100 box by estimate: Qwen3-30B-A3B's block, 29 of its 48
#: (docs/offload.md#mixtures-of-experts); moe_tokens measures 8 of them, quicker to build on the host
MOE_FULL_BLOCKS = 29


#: The CPU mode's fit runs by what they run (configs, overlay, steps, callbacks): a step whose CPU run equals an
#: earlier step's takes that run's record under its own name, beside its own estimate.
CPU_RUNS: dict[str, tuple[str, dict[str, Any]]] = {}


@dataclass(frozen=True)
class Fit:
    """A measured ``python -m lit_fsdp fit`` run: ``configs`` in order, then ``overlay(device)`` (written as
    ``<work>/<step>_shape.yaml``); the warm-up, then ``steps`` measured steps (``cpu_steps`` in the CPU mode). The
    step's record holds the run under the step's name and ``summary``: its figures (``gpu_fit.figures``) with
    results.jsonl's figures whose names start with one of ``result_keys``."""

    configs: tuple[str, ...]
    overlay: Callable[[str], dict[str, Any]]
    steps: int
    cpu_steps: int = 1
    offload: bool = False  # SlideFSDP: OffloadStats' figures too
    callbacks: Callable[[], list[dict[str, Any]]] = list  # more callbacks, before the measuring ones
    result_keys: tuple[str, ...] = ()

    def run(self, name: str, record: Record, device: str, work: Path) -> None:
        overlay, steps, measure = self.overlay(device), self.steps if device == "cuda" else self.cpu_steps, \
            measuring(offload=self.offload, extra=self.callbacks())
        shape = write_yaml(work / f"{name}_shape.yaml", overlay)
        same = json.dumps([self.configs, overlay, steps, measure], sort_keys=True)
        if device == "cpu" and same in CPU_RUNS:  # float8 without torchao: the run of the step it equals, again
            arguments = fit_arguments(name, work, [*self.configs, str(shape)], steps, measure=measure)
            done = {**CPU_RUNS[same][1], "estimate": write_estimate(name, work, arguments), "same_run_as": CPU_RUNS[same][0]}
            record.put(**{name: done})
        else:
            done = fit(name, work, [*self.configs, str(shape)], record, steps, measure=measure)
            CPU_RUNS[same] = (name, done)
        extra = {key: value for key, value in done["result"].items() if key.startswith(self.result_keys)}
        record.put(summary={**done["figures"], **extra})


@dataclass(frozen=True)
class Step:
    """One step of the check. ``deadline``: seconds on one H100, about 1.25x the longest time the records in
    docs/gpu_runs/ give the step (and ``estimate``'s few seconds), or for a step no record has timed, its set-up
    and steps counted from the nearest record. ``requires``: a step that must have passed when it ran before this
    one in the same call. ``default``: in the default plan."""

    name: str
    runs: Fit | StepFunction
    deadline: int
    records: str  # what it runs and records, for --help
    requires: str | None = None
    default: bool = False

    def run(self, record: Record, device: str, work: Path) -> None:
        if isinstance(self.runs, Fit):
            self.runs.run(self.name, record, device, work)
        else:
            self.runs(record, device, work)


# --- fit rows: a shipped config and the overlays laid over it -----------------------------------------------------


def eight_b(overlay: Callable[[str], dict[str, Any]]) -> Fit:
    """configs/llama_8b_offload.yaml's 8B (llama-tiny on the CPU) with ``overlay``, 10 steps measured after the
    warm-up on the GPU (each step's time recorded), 3 on the CPU."""
    return Fit(EIGHT_B, overlay, steps=10, cpu_steps=3, offload=True)


Overlay = dict[str, Any] | Callable[[str], dict[str, Any]]  # a callable is given the device


def laid_over(base: Callable[[str], dict[str, Any]], overlays: tuple[Overlay, ...]) -> Callable[[str], dict[str, Any]]:
    """The overlay ``base(device)`` with ``overlays`` laid over it in order."""
    def overlay(device: str) -> dict[str, Any]:
        merged = base(device)
        for extra in overlays:
            merged = merge(merged, extra(device) if callable(extra) else extra)
        return merged
    return overlay


def eight_b_8k(*overlays: Overlay) -> Fit:
    """configs/llama_8b_offload_8k.yaml with ``overlays`` laid over it in order."""
    return Fit(EIGHT_B_8K, laid_over(as_shipped, overlays), steps=10, cpu_steps=3, offload=True)


def first_window(*overlays: Overlay) -> Fit:
    """configs/llama_8b_offload.yaml on ``FIRST_BLOCKS`` blocks at 4 x 2048 with ``overlays`` laid over it in order; 3
    steps measured after the warm-up."""
    four_sequences = {"data": {"init_args": {"batch_size": 4}}}
    small = laid_over(partial(as_shipped, layers=FIRST_BLOCKS),
                      (lambda device: four_sequences if device == "cuda" else {},))
    return Fit(EIGHT_B, laid_over(small, overlays), steps=3, cpu_steps=3, offload=True)


def fsdp2_1b(**settings: Any) -> Fit:
    """configs/llama_1b.yaml with ``one_b``'s ``settings``, 28 steps measured after the warm-up."""
    return Fit(ONE_B, partial(one_b, **settings), steps=28)


# --- the steps that are not one fit --------------------------------------------------------------------------------

CUDA_TESTS = ["tests/test_quantizers.py", "tests/test_sparsifiers.py", "tests/test_generate_and_evaluate.py"]


def cuda_tests(record: Record, device: str, work: Path) -> None:
    """The tests named ``cuda`` of ``CUDA_TESTS``, 4 workers on a GPU; the record lists what failed."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "-k", "cuda", *CUDA_TESTS]
    try:
        command("cuda_tests", argv + (["-n", "4"] if device == "cuda" else []), work, record)
    finally:
        lines = (work / "cuda_tests.txt").read_text().splitlines()
        record.put(failed=[line for line in lines if line.startswith(("FAILED", "ERROR"))][:30])


def parity(record: Record, device: str, work: Path) -> None:
    """Two float32 fits of 4 Llama-1B-shaped blocks (llama-tiny on the CPU), 15 steps (4): their losses compared."""
    steps = 15 if device == "cuda" else 4
    shape = ({"model": {"preset": "llama-1b", "config_overrides": {"num_hidden_layers": 4}},
              "data": {"init_args": {"vocab_size": 128256, "seq_len": 2048, "batch_size": 2}}}
             if device == "cuda" else tiny(4))
    runs = {}
    for name, strategy in (
        ("parity_fsdp2", {"class_path": "lit_fsdp.strategy.FSDP2Strategy",
                          "init_args": {"sharding": "FULL_SHARD", "param_dtype": "float32", "reduce_dtype": "float32",
                                        "activation_checkpointing": 1}}),
        ("parity_slide_fsdp", offload_strategy(device, "float32")),
    ):
        overrides = {**shape, "trainer": {**accelerator(device), "gradient_clip_val": None, "strategy": strategy,
                                          "callbacks": [{"class_path": "callbacks.Results"}]}}
        config = write_yaml(work / f"{name}_shape.yaml", overrides)
        runs[name] = fit(name, work, [QUICKSTART, str(config)], record, steps)["losses"]
    a, b = runs["parity_fsdp2"], runs["parity_slide_fsdp"]
    if len(a) != steps or len(b) != steps:
        raise RuntimeError(f"parity: {len(a)} and {len(b)} losses logged, {steps} expected")
    relative = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    record.put(relative_first=relative[0], relative_max=max(relative), passed=relative[0] < 1e-5 and max(relative) < 1e-3)
    if not record["passed"]:
        raise RuntimeError(f"parity: relative loss difference {relative[0]:.2e} at step 1, {max(relative):.2e} at most")


def codecs(record: Record, device: str, work: Path) -> None:
    """scripts/bench_codecs.py, 64M values on a GPU; on the CPU, three codecs: the step's code path (bench_codecs
    times each until its spread settles, up to 10 s)."""
    sizes = ["--numel", str(64 * 2**20)] if device == "cuda" else ["--numel", str(2**20), "--methods", "fp16", "int8", "topk"]
    lines = command("codecs", [sys.executable, "scripts/bench_codecs.py", "--device", device, *sizes, "--repeats", "5",
                               "--warmup", str(warmup_steps())], work, record)
    record.put(table=[line for line in lines if line.startswith("|")])


def bench_offload(record: Record, device: str, work: Path) -> None:
    """scripts/bench_offload.py: the 1B at 8 x 2048 on a GPU, every strategy; gpt2-tiny under SlideFSDP on the CPU."""
    warmup = warmup_steps()
    gpu = ["--accelerator", "gpu", "--devices", "1", "--param-dtype", "bfloat16", "--presets", "llama-1b",
           "--seq-len", "2048", "--batch-size", "8", "--steps", str(warmup + 8)]
    cpu = ["--devices", "1", "--presets", "gpt2-tiny", "--seq-len", "64", "--batch-size", "2", "--steps", str(warmup + 1),
           "--strategies", "slide_fsdp"]
    command("bench_offload", [sys.executable, "scripts/bench_offload.py", *(gpu if device == "cuda" else cpu),
                              "--warmup", str(warmup), "--repeats", "1", "--out", str(work / "bench_offload")], work, record)
    record.put(table=(work / "bench_offload" / "table.md").read_text().splitlines())


def resume_export(record: Record, device: str, work: Path) -> None:
    """The quickstart stopped at step 4 of 8 and resumed against the uninterrupted run; then ``export``."""
    shape = write_yaml(work / "resume_shape.yaml", {"trainer": {**accelerator(device), "callbacks": [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"save_last": True, "every_n_train_steps": 4, "save_top_k": -1}}]}})
    configs = [QUICKSTART, str(shape)]
    whole = fit("resume_whole", work, configs, record, 8, checkpoints=True)["losses"]
    first = fit("resume_first", work, configs, record, 4, checkpoints=True)
    checkpoint = work / "resume_first" / "checkpoints" / "last.ckpt"
    rest = fit("resume_rest", work, configs, record, 8, checkpoints=True, ckpt_path=str(checkpoint),
               folder=work / "resume_first")
    resumed = first["losses"] + rest["losses"][len(first["losses"]):]
    record.put(whole=whole, resumed=resumed, exact=whole == resumed)
    command("export", [sys.executable, "-m", "lit_fsdp", "export", str(checkpoint), str(work / "exported")], work, record)
    if whole != resumed:
        raise RuntimeError(f"resume: {resumed} differs from the uninterrupted {whole}")


def tune(record: Record, device: str, work: Path) -> None:
    """``tune`` on configs/llama_1b.yaml with 4 trials (the quickstart with 1 on the CPU); the record has its report."""
    configs = ["--config", QUICKSTART] + (["--config", "configs/llama_1b.yaml", "--trainer.devices", "1"]
                                          if device == "cuda" else ["--trainer.devices", "1"])
    trials = "4" if device == "cuda" else "1"
    lines = command("tune", [sys.executable, "-m", "lit_fsdp", "tune", *configs, "--tune.trials", trials,
                             "--tune.out", str(work / "tune")], work, record)
    record.put(report=lines[-30:])


SFT_SAMPLES = ROOT / "lit_fsdp" / "data" / "samples" / "reverse_words"


def sft_base(device: str, folder: Path) -> Path:
    """A pretrained folder as ``export`` writes one: Llama-1B's blocks (llama-tiny on the CPU) and a BPE trained on the
    sample task's text, whose vocabulary the model takes."""
    import torch
    from transformers import AutoModelForCausalLM

    from lit_fsdp.data.chat import read_samples
    from lit_fsdp.data.tokenizer import train_bpe
    from lit_fsdp.presets import build_config

    texts = [" ".join(content for _, content in sample.turns) for sample, _ in read_samples(SFT_SAMPLES / "train.jsonl")]
    tokenizer = train_bpe(texts[:1000], 400)
    tokenizer.save_pretrained(folder)
    config = build_config("llama-1b" if device == "cuda" else "llama-tiny", {"vocab_size": len(tokenizer)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.to(torch.bfloat16 if device == "cuda" else torch.float32).save_pretrained(folder, safe_serialization=True)
    return folder


def sft(record: Record, device: str, work: Path) -> None:
    """configs/sft_full.yaml, then configs/sft_lora.yaml, from ``sft_base``'s folder on the sample task, packed at
    4 x 2048 with 18 steps measured (2 x 64 and 1 on the CPU); each must end with a lower loss than it began."""
    base = sft_base(device, work / "sft_base")
    shape = {"seq_len": 2048, "batch_size": 4} if device == "cuda" else {"seq_len": 64, "batch_size": 2}
    steps = 18 if device == "cuda" else 1
    for config in ("sft_full", "sft_lora"):
        override = write_yaml(work / f"{config}_shape.yaml", {
            "trainer": accelerator(device),
            "model": {"pretrained_path": str(base)},
            "data": {"init_args": {**shape, "train_path": str(SFT_SAMPLES / "train.jsonl"),
                                   "val_path": str(SFT_SAMPLES / "val.jsonl")}}})
        run = fit(config, work, [f"configs/{config}.yaml", str(override)], record, steps, measure=measuring(offload=False))
        losses = run["losses"]
        record.put(**{f"{config}_summary": {**run["figures"], "first_loss": losses[0], "last_loss": losses[-1]}})
        if not losses[-1] < losses[0]:
            raise RuntimeError(f"{config}: the loss did not fall ({losses[0]:.4f} to {losses[-1]:.4f})")


#: The peers step's seconds on a GPU, within its deadline and the default --budget (PLAN_BUDGET): its calls end inside
#: them, so no run the bench started outlives a kill of the step (torchrun's ranks run in sessions of their own).
PEERS_SECONDS = 460


def peers(record: Record, device: str, work: Path) -> None:
    """scripts/bench_peers.py, a call per peer and the record's rows grown as each ends: on a GPU, the 8B's refusals
    (each offloading peer's host state against --host-memory-gb), then every peer on 8 of its 32 blocks at 32 x 2048
    tokens, SlideFSDP first, 2 steps measured, each call's deadline within PEERS_SECONDS; on the CPU, FSDP2's
    CPUOffloadPolicy alone: the step's code path (tests/test_bench_peers.py runs every peer's where deepspeed is
    installed)."""
    import time

    from peers_table import PEERS, table

    warmup, out, end = warmup_steps(), work / "peers.jsonl", time.monotonic() + PEERS_SECONDS
    out.unlink(missing_ok=True)
    common = [sys.executable, "scripts/bench_peers.py", "--device", device, "--out", str(out), "--work",
              str(work / "peers"), "--warmup", str(warmup), "--steps", str(warmup + (2 if device == "cuda" else 1))]
    calls = [("2", ["fsdp2_cpu_offload"])]
    if device == "cuda":
        common += ["--host-memory-gb", os.environ[HOST_MEMORY_VARIABLE]]
        calls = [("32", [name for name, peer in PEERS.items() if peer.host_bytes_per_param]),
                 *[("8", [name]) for name in sorted(PEERS, key=lambda name: name != "slide_fsdp")]]
    for layers, names in calls:
        left = end - time.monotonic() - 15  # the bench's start and its kill of a run past its deadline
        if left < 30:
            record.put(no_time=[*record.get("no_time", []), *names])
            continue
        timeout = ["--timeout", str(round(min(left, 200)))] if device == "cuda" else []
        command(f"peers_{layers}_{names[0]}", [*common, *timeout, "--layers", layers, "--peers", *names], work, record)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        record.put(rows=rows, table=table(rows).splitlines())


def moe_full_largest(device: str) -> dict[str, Any]:
    """``MOE_FULL_BLOCKS`` of Qwen3-30B-A3B's blocks, eager, every parameter trained, with the preflight counting on
    the recorded box's host memory (configs/hardware/h100_128g.json's, as estimate did: 116.7 of the 118.0 GiB its
    reserve leaves), not --host-memory-gb's 120 GiB, under which it is refused."""
    from lit_fsdp.commands.tune.hardware import load

    box = {"trainer": {"strategy": {"init_args": {"host_memory_gb": load(ROOT / "configs" / "hardware" /
                                                                         "h100_128g.json").host_memory_gb}}}}
    return merge(merge(moe(device, layers=MOE_FULL_BLOCKS), EAGER), box if device == "cuda" else {})


# --- the table ---------------------------------------------------------------------------------------------------

#: Every step, in the order ``--steps`` lists them; the default plan's come first.
STEPS: dict[str, Step] = {step.name: step for step in (
    Step("probe", probe, 60, default=True,
         records="versions, device, host memory, cores; an 8 GiB registration; copy, GEMM and CPU update rates; a "
                 "Llama-8B-shaped step's share of the GEMM peak; hardware.json from them"),
    Step("eight_b", eight_b(as_shipped), 310, requires="slide_fsdp",
         default=True,
         records="configs/llama_8b_offload.yaml as shipped (update: auto, exact: the split it takes in the record): "
                 "tokens/s, MFU, each step's time and p10/p50/p90, the CPU update's ms and GB/s, the forward's waits "
                 "for the updates, the device's idle time, the hidden and hideable shares, peaks, the lowest "
                 "MemAvailable"),
    Step("fsdp2_1b", fsdp2_1b(), 110, default=True,
         records="configs/llama_1b.yaml as shipped with its 128k vocabulary: tokens/s, MFU, device peak"),
    Step("first_host_blocks_compiled", first_window(HOST_BLOCKS), 120,
         records="the first window: 2 of the 8B's blocks with their activations saved in pinned host memory, compiled "
                 "blocks (saved tensors' strides, one registered region per block): the losses and step times"),
    Step("first_host_blocks_eager", first_window(HOST_BLOCKS, EAGER), 50,
         records="the first window: the same host blocks with eager blocks (the attention backend's saved layout)"),
    Step("first_device_sums", first_window(DEVICE_SUMS), 60,
         records="the first window: 2 micro-batches summed on the device in one buffer allocated at placement"),
    Step("first_bf16_master", first_window(BF16_MASTER), 50,
         records="the first window: the bfloat16 master in the staging copy, rounded stochastically"),
    Step("first_float8", first_window(lambda device: float8(device)), 60,
         records="the first window: --model.float8 tensorwise on the blocks' linear layers (torchao as a wheel)"),
    Step("first_split_rollback", first_window(ROLLBACK), 50,
         records="the first window: a split of the last block with clipping that fires every step: each speculated "
                 "update rolled back and applied again behind the next forward, the other block's after the norm"),
    Step("first_auto_plan", first_window(AUTO_PLAN), 60,
         records="the first window: activation_plan auto on the placed run (the host's room counted once): the plan "
                 "taken"),
    Step("eight_b_delayed", eight_b(lambda device: merge(as_shipped(device), DELAYED)), 310, requires="slide_fsdp",
         records="the shipped 8B with the delayed update from its first step (stale by one step): eight_b's figures, "
                 "the step eight_b's exact update is measured against"),
    Step("eight_b_forward", eight_b(lambda device: merge(as_shipped(device), FORWARD)), 320, requires="slide_fsdp",
         records="the shipped 8B with update: forward (after the norm in forward order, nothing speculated): "
                 "eight_b's figures, what the split's speculation buys"),
    Step("eight_b_synchronous", eight_b(lambda device: merge(as_shipped(device), SYNCHRONOUS)), 320,
         requires="slide_fsdp",
         records="the shipped 8B with the synchronous update (after the norm, waited for): eight_b's figures, what "
                 "the forward order buys"),
    Step("eight_b_speculative", eight_b(lambda device: merge(as_shipped(device), SPECULATIVE)), 310,
         requires="slide_fsdp",
         records="the shipped 8B with the speculative update (exact, validated after the backward): eight_b's "
                 "figures with its rollbacks, or the preflight's refusal where its backup does not fit the host"),
    Step("cuda_tests", cuda_tests, 70,
         records="the tests that skip without CUDA: codecs on the device, generate/evaluate on CPU against GPU"),
    Step("eight_b_control", eight_b(eight_b_before), 200, requires="slide_fsdp",
         records="the 8B with EIGHT_B_BEFORE laid over the shipped config (8 x 2048, float32 moments, no delayed "
                 "update, 2 gradient slots, no clipping): eight_b's figures"),
    Step("eight_b_eager", eight_b(lambda device: merge(as_shipped(device), EAGER)), 290,
         requires="slide_fsdp",
         records="the 8B as shipped with eager blocks: what compiling is worth to SlideFSDP's step"),
    Step("slide_fsdp", Fit(EIGHT_B, lambda device: as_shipped(device, layers=8), steps=8,
                           offload=True, callbacks=slide_fsdp_syncs),
         180, records="configs/llama_8b_offload.yaml with 8 of its 32 blocks (Throughput "
                      "leaves those steps out): the 8B's figures, host syncs per step"),
    Step("parity", parity, 130,
         records="float32 FSDP2 against SlideFSDP (window 2, activations checkpointed and offloaded, overlapped "
                 "update): relative loss difference under 1e-5 at step 1 and 1e-3 throughout"),
    Step("onebit", Fit((QUICKSTART,), onebit, steps=10, cpu_steps=10, callbacks=onebit_callbacks,
                       result_keys=("host_syncs", "comm_")), 70,
         records="FSDP2 + 1-bit Adam across its freeze: host syncs per step by call site, the communication profile"),
    Step("codecs", codecs, 45, records="scripts/bench_codecs.py on the device: GB/s per codec"),
    Step("fsdp2_1b_no_ac", fsdp2_1b(batch=4, model={"loss_chunk_tokens": 1024}, activation_checkpointing=0,
                                    compile_blocks=False), 75,
         records="configs/llama_1b_low_memory.yaml's setting without activation checkpointing: the recompute's cost"),
    Step("fsdp2_1b_compiled", fsdp2_1b(batch=4, model={"loss_chunk_tokens": 0}, activation_checkpointing=0,
                                       compile_blocks=True), 90,
         records="the 1B at 4 x 2048 with compiled blocks, the plain loss, no activation checkpointing"),
    Step("fsdp2_1b_fast", fsdp2_1b(batch=8, model={"loss_chunk_tokens": 0}, activation_checkpointing=0,
                                   compile_blocks=True), 120,
         records="the 1B at 8 x 2048 with compiled blocks, the plain loss, no activation checkpointing"),
    Step("bench_offload", bench_offload, 240,
         records="scripts/bench_offload.py: SlideFSDP against torch's CPUOffloadPolicy and plain FSDP2"),
    Step("resume_export", resume_export, 120,
         records="exact resume on the device (stopped at step 4 of 8, resumed, against the whole run), then export"),
    Step("tune", tune, 300, records="tune with 4 trials: its memory filter and trial runner on a real GPU"),
    Step("sft", sft, 170,
         records="configs/sft_full.yaml against configs/sft_lora.yaml from a Llama-1B-shaped base: tokens/s, device "
                 "peak, the loss falling"),
    Step("eight_b_lora", eight_b(lambda device: merge(eight_b_before(device), LORA)), 230, requires="slide_fsdp",
         records="LoRA rank 16 on the 8B with the control's settings: host and device peaks against estimate's"),
    Step("peers", peers, 480,
         records="scripts/bench_peers.py: the 8B's refusals, then 8 of its 32 blocks under DeepSpeed ZeRO-3 and ZeRO-2 "
                 "with CPU offload, FSDP2's CPUOffloadPolicy, Lightning's FSDP with cpu_offload and SlideFSDP: "
                 "tokens/s, MFU, peaks, every step's time"),
    Step("eight_b_auto", eight_b(lambda device: merge(as_shipped(device), AUTO_PLAN)), 320,
         requires="slide_fsdp",
         records="the shipped 8B with activation_plan: auto: eight_b's figures and the plan taken"),
    Step("eight_b_tuned", eight_b(tuned), 330, requires="slide_fsdp",
         records="the shipped 8B with tune's pick (activation_plan: auto, 4 micro-batches of 8 summed on the device): "
                 "eight_b's figures against the 42.3% MFU estimate predicts"),
    Step("eight_b_8k", eight_b_8k(), 360, requires="slide_fsdp",
         records="configs/llama_8b_offload_8k.yaml (one micro-batch of 8 x 8192 tokens, activation_plan: auto, the "
                 "exact update): eight_b's figures at ml_dataflow's sequence length"),
    Step("eight_b_8k_delayed", eight_b_8k(lambda device: ACCUMULATED_DELAYED), 360, requires="slide_fsdp",
         records="the 8k config's 65,536 tokens in 4 micro-batches of 2 summed on the device, delayed: the setting "
                 "the exact single micro-batch is measured against (estimate: 15% faster)"),
    Step("eight_b_float8", eight_b(lambda device: merge(as_shipped(device), float8(device))), 330,
         requires="slide_fsdp",
         records="the shipped 8B with --model.float8 tensorwise (torchao as a wheel): eight_b's "
                 "figures, MFU against the bf16 peak"),
    Step("eight_b_8k_float8", eight_b_8k(float8), 380, requires="slide_fsdp",
         records="the 8k config with --model.float8 tensorwise: eight_b's figures, MFU against the bf16 peak"),
    Step("qwen_32b_lora", Fit(QWEN_32B_LORA, as_shipped, steps=8, cpu_steps=3, offload=True), 480,
         records="configs/qwen_32b_lora.yaml as shipped (its base built on the host with random weights, nothing "
                 "downloaded): tokens/s, MFU (4N for the frozen base), device peak, the lowest MemAvailable"),
    Step("qwen_14b_full", Fit(QWEN_14B_FULL, as_shipped, steps=8, cpu_steps=3, offload=True), 420,
         records="configs/qwen_14b_full.yaml as shipped (bfloat16 master in the staging copy, random weights): "
                 "tokens/s, MFU, the CPU update, device peak, the lowest MemAvailable"),
    Step("moe_fsdp2", Fit((QUICKSTART, "configs/moe.yaml"), fsdp2_moe, steps=4, cpu_steps=1, result_keys=("moe_",)),
         90, records="a mixture of experts under FSDP2 on one GPU, the path's first run (configs/moe.yaml with 2 of "
                     "Qwen3-30B-A3B's blocks, bfloat16): grouped_mm on CUDA, the router's loss and tokens per expert, "
                     "tokens/s and MFU by active parameters"),
    Step("moe_30b_a3b_lora", Fit(MOE_LORA, moe, steps=6, cpu_steps=3, offload=True), 480,
         records="configs/qwen3_30b_a3b_lora.yaml (LoRA on the attention and every expert's tensors, the frozen base "
                 "in bfloat16 on the host) on Qwen3-30B-A3B's shape with random weights and synthetic data of its "
                 "vocabulary, 32 x 2048: tokens/s, MFU by active parameters, device peak, the lowest MemAvailable, the "
                 "experts' load"),
    Step("moe_tokens", Fit(QWEN_14B_FULL, lambda device: merge(moe(device, layers=8), EAGER), steps=8, cpu_steps=3,
                           offload=True), 240,
         records="every parameter of Qwen3-30B-A3B's shape on 8 of its 48 blocks (5.6B parameters, 1.3B active) "
                 "with configs/qwen_14b_full.yaml's settings, eager: tokens/s and MFU by active parameters against "
                 "estimate's, the CPU update of all parameters"),
    Step("moe_full_largest", Fit(QWEN_14B_FULL, moe_full_largest, steps=4, cpu_steps=3, offload=True), 360,
         records="the largest MoE estimate fits on the box training every parameter: Qwen3-30B-A3B's shape on 29 of "
                 "its 48 blocks (18.7B parameters), configs/qwen_14b_full.yaml's settings: whether it fits the host "
                 "(the lowest MemAvailable beside estimate's 116.7 GiB), tokens/s, MFU by active parameters"),
)}
#: The default plan: the probe (its hardware.json is what every estimate uses), the 8B and the 1B as shipped. Their
#: deadlines add up to PLAN_SECONDS at most, so the plan fits one device call; the other steps (the 8B's other update
#: modes first) are named with --steps.
PLAN = tuple(name for name, step in STEPS.items() if step.default)
#: The first window after code no GPU has run: the probe and each new path once at small scale, before the 8B's
#: steps (``--steps first_window``); its deadlines add up to PLAN_SECONDS at most too.
FIRST_WINDOW = ("probe", *(name for name in STEPS if name.startswith("first_")))
#: Plans ``--steps`` takes by name.
PLANS = {"default": PLAN, "first_window": FIRST_WINDOW}
PLAN_SECONDS = 540  # a device call's 10 minutes, less a minute for the wheels' install, Python's start and the copy back
PLAN_BUDGET = sum(STEPS[name].deadline for name in PLAN)  # --budget's default
