"""LoRA under SlideFSDP: the frozen base is kept once on the host in the compute dtype (no float32 master, no
moments) and streamed; the adapters have a master, moments and gradients and are updated by the CPU AdamW.

It takes FSDP2's steps, resumes exactly from adapter-only checkpoints, refuses another base, exports merged, and
allocates on the host what the preflight, ``estimate`` and the tuner count. One spawn of 2 gloo processes runs the
real CLI in-process, run after run (as tests/test_lora.py does), on a pretrained gpt2-tiny folder: window 1 (a block
with frozen weights must leave its slot only when its backward is over) and block 0 checkpointed (its input, from the
frozen embeddings, has no graph), copies asynchronous.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from lit_fsdp.commands.estimate import estimate_step, parse
from lit_fsdp.commands.tune.hardware import load
from lit_fsdp.commands.tune.memory import GIB, MemoryFilter, ModelShape, estimate
from lit_fsdp.commands.tune.space import Candidate, RunShape
from lit_fsdp.lora import adapter_parameters
from lit_fsdp.presets import build_config
from offload.host_memory import RUNTIME_BYTES_PER_PROCESS
from offload.transfers import EMULATED_DELAY_VARIABLE
from tests.distributed import in_process_cli, run
from tests.helpers import REPO, fit_arguments, read_metrics

STEPS, STOP = 4, 2
LORA = ["--model.lora", json.dumps({"rank": 4})]
# the split pinned: update: auto would choose it by the run's own rates, which estimate's hardware file does not know
SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--trainer.strategy.init_args.window", "1",
         "--trainer.strategy.init_args.activation_checkpointing", "2", "--trainer.strategy.init_args.update", "split",
         "--trainer.strategy.init_args.speculated_blocks", "1"]
SHORT = ["--data.seq_len", "64", "--model.warmup_steps", "1"]
H100 = load(REPO / "configs" / "hardware" / "h100_128g.json")
LLAMA_8B_SLIDE = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--config",
                  str(REPO / "configs" / "llama_8b_offload.yaml")]


def arguments(folder: Path, base: Path, *extra: str, callbacks: list[dict] = ()) -> list[str]:
    """A short LoRA fine-tune of the gpt2-tiny folder ``base`` on 2 processes (clipping on: the quickstart's)."""
    return fit_arguments(folder, "--model.pretrained_path", str(base), *LORA, *SHORT, *extra, steps=STEPS,
                         callbacks=list(callbacks))


def fine_tune(rank: int, world: int, root: Path) -> str:
    """Every run, in the same order on both ranks; returns the refusal of a resume on another base."""
    from lit_fsdp.errors import error_line

    cli = in_process_cli(rank, world)
    cli(arguments(root / "fsdp2", root / "base"))
    os.environ[EMULATED_DELAY_VARIABLE] = "3"  # SlideFSDP's copies on threads, after random delays (offload.transfers)
    saved = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(root / "ckpt"), "every_n_train_steps": STOP, "save_top_k": -1}}
    logits = {"class_path": "tests.probes.SaveLogits", "init_args": {"path": str(root / "logits.pt")}}
    stats = {"class_path": "callbacks.OffloadStats"}
    cli(arguments(root / "slide", root / "base", *SLIDE, callbacks=[saved, logits, stats]))
    middle = str(next((root / "ckpt").glob(f"*-step={STOP}.ckpt")))
    cli(arguments(root / "resumed", root / "base", *SLIDE, "--ckpt_path", middle))
    try:
        cli(arguments(root / "other_base", root / "other_base", *SLIDE, "--ckpt_path", middle))
    except Exception as error:  # noqa: BLE001 - the refusal is what the test reads
        return error_line(error)
    return "not refused"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("slide_lora")
    for name, seed in (("base", 0), ("other_base", 1)):  # pretrained gpt2-tiny folders
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(build_config("gpt2-tiny")).save_pretrained(root / name)
    refusal = run(fine_tune, root, root)[0]
    return SimpleNamespace(root=root, refusal=refusal, metrics={
        name: read_metrics(max((root / name).glob("lightning_logs/version_*/metrics.csv")))
        for name in ("fsdp2", "slide", "resumed")})


def test_lora_under_slide_fsdp_takes_fsdp2s_steps(runs):
    slide, fsdp2 = runs.metrics["slide"], runs.metrics["fsdp2"]
    assert len(slide["train/loss"]) == STEPS and slide["train/loss"][-1] < slide["train/loss"][0]
    for key in ("train/loss", "train/grad_norm"):
        assert slide[key] == pytest.approx(fsdp2[key], rel=1e-5), key


def test_a_resume_from_an_adapter_checkpoint_continues_exactly_and_another_base_is_refused(runs):
    import torch.distributed.checkpoint as dcp

    assert runs.metrics["resumed"]["train/loss"] == runs.metrics["slide"]["train/loss"][STOP:]  # bit for bit
    checkpoint = next((runs.root / "ckpt").glob(f"*-step={STOP}.ckpt"))
    entries = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    weights = [key for key in entries if key.startswith("state_dict.") and hasattr(entries[key], "chunks")]
    assert weights and all(key.rpartition(".")[2] in ("lora_A", "lora_B") for key in weights), weights
    other = runs.refusal
    assert "trained on another base" in other and str((runs.root / "base").resolve()) in other and "\n" not in other


def test_the_merged_export_of_a_slide_fsdp_adapter_checkpoint_gives_the_fine_tuned_logits(runs, tmp_path):
    from lit_fsdp.commands.export import export_hf

    export_hf(str(next((runs.root / "ckpt").glob(f"*-step={STEPS}.ckpt"))), str(tmp_path / "hf"))
    saved = torch.load(runs.root / "logits.pt")
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
        logits = merged(input_ids=saved["input_ids"]).logits
    torch.testing.assert_close(logits, saved["logits"], rtol=1e-5, atol=1e-5)


def test_the_host_holds_what_the_preflight_and_estimate_count_the_base_once_and_no_master_for_it(runs):
    slide = runs.metrics["slide"]
    allocated, counted = slide["offload/host_state_gb_per_node"][-1], slide["offload/host_estimate_gb_per_node"][-1]
    assert allocated == pytest.approx(counted, rel=1e-4)
    hardware = replace(H100, accelerator="cpu", devices_per_node=2)  # the quickstart trains on 2 CPU processes
    args = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--model.pretrained_path", str(runs.root / "base"),
            *LORA, *SHORT, *SLIDE]
    figures = estimate_step(*parse(args, hardware), hardware)
    host = figures["host_by_buffer"]
    assert (figures["host_bytes"] - host["runtime"]) / 1e9 == pytest.approx(counted, rel=1e-9)
    adapters = figures["trained_parameters"]
    assert adapters == adapter_parameters(build_config("gpt2-tiny"), {"rank": 4}) < figures["parameters"] / 10
    assert host["master"] == 4 * adapters and host["kept_gradients"] == 0  # float32 on CPU; clipping holds the pieces
    assert host["adam_moments"] == 8 * adapters
    assert host["staging"] == 4 * figures["parameters"]  # every parameter once, in the compute dtype (float32 here)
    assert host["runtime"] == 2 * RUNTIME_BYTES_PER_PROCESS
    # per step the blocks come from the host and the adapters' gradients go back; the frozen root stays on the device
    assert slide["offload/h2d_gb"][1:] == pytest.approx([figures["h2d_bytes"] / 1e9] * (STEPS - 1), rel=1e-9)
    assert slide["offload/d2h_gb"] == pytest.approx([figures["d2h_bytes"] / 1e9] * STEPS, rel=1e-9)


def test_estimate_and_the_tuner_count_an_8b_lora_on_one_h100_as_its_base_in_bfloat16_and_its_adapters():
    """The shipped 8B config (bfloat16 moments, delayed update with clipping, 64k tokens, no offloaded activations)
    with LoRA r16: the base has only its bfloat16 copy; the adapters the master, the moments and the gradients."""
    lora = estimate_step(*parse([*LLAMA_8B_SLIDE, "--model.lora", "{rank: 16, alpha: 32}"], H100), H100)
    adapters, parameters = lora["trained_parameters"], lora["parameters"]
    assert adapters == 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432) and parameters == 8_030_261_248 + adapters
    host = lora["host_by_buffer"]
    assert host["staging"] == 2 * parameters and host["master"] == 4 * adapters
    assert host["adam_moments"] == 4 * adapters and host["kept_gradients"] == 0  # no fp32 copy for clipping
    assert lora["host_bytes"] < 19 * GIB and lora["fits"]  # full training: 126.8 GiB (tests/test_offload_host.py)
    # AdamW's master 8 B and bfloat16 moments 8, the bfloat16 gradient 2 and once more for its norm 2, the staging row 2
    assert lora["cpu_update_bytes"] == 22 * adapters
    assert host["activations"] == 0 and lora["d2h_bytes"] == pytest.approx(2 * adapters, rel=1e-5)  # the adapters' alone
    # the tuner's filter admits it and counts the same host bytes, from element counts (rows are not padded there)
    shape = ModelShape.of(build_config("llama-8b", {"vocab_size": 128256}), lora={"rank": 16, "alpha": 32})
    run_shape = RunShape(world_size=1, nodes=1, accelerator="cuda", seq_len=2048, batch_per_process=32, clipping=True,
                         loss_chunk_tokens=1024, optimizer_state_dtype="bfloat16")  # the model's chunked loss
    candidate = Candidate(strategy="slide_fsdp", micro_batch=32, param_dtype="bfloat16", activation_checkpointing=1)
    assert MemoryFilter(shape, run_shape, H100, margin=0.1).rejection(candidate) is None
    tuned = estimate(candidate, shape, run_shape).host_per_node
    # the split's backup of the adapters' rows is not the filter's: it takes only the room left
    assert tuned == pytest.approx(lora["host_bytes"] - host["runtime"] - host["speculation_backup"], rel=1e-2)


def test_lora_is_admitted_on_slide_fsdp_and_refused_in_one_line_on_ddp_and_with_a_float16_base():
    from lit_fsdp.ddp import DDPStrategy
    from lit_fsdp.errors import RunError
    from lit_fsdp.model import CausalLM
    from offload.strategy import SlideFSDPStrategy

    module = CausalLM(lora={"rank": 4})
    module._trainer = SimpleNamespace(strategy=SlideFSDPStrategy())
    module._check_lora_strategy()
    module._trainer = SimpleNamespace(strategy=DDPStrategy())
    with pytest.raises(RunError, match="^--model.lora needs .*SlideFSDPStrategy.*; DDPStrategy does not") as refused:
        module._check_lora_strategy()
    assert "\n" not in str(refused.value)
    strategy = SlideFSDPStrategy(param_dtype="float16")
    strategy.parallel_devices = [torch.device("cpu")]
    with pytest.raises(ValueError, match=r"^SlideFSDP keeps LoRA's frozen base .*param_dtype bfloat16 \(or float32\)$"):
        strategy.check_lora(module)
    strategy.check_lora(CausalLM())  # float16 without LoRA: a master keeps the weights


def test_a_bfloat16_copy_of_the_base_has_the_fingerprint_of_its_float32_original():
    """SlideFSDP keeps the frozen base in bfloat16 alone, FSDP2 and ``export`` in float32: the fingerprint a LoRA
    checkpoint records of its base must be the same for both, or resuming and exporting would be refused."""
    from lit_fsdp import lora

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("gpt2-tiny"))
    config = lora.LoraConfig(rank=4)
    lora.attach(model, config, device="cpu")
    original = lora.base_record(model, config, "preset gpt2-tiny", 0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16())  # what the bfloat16 copy holds
    copy = lora.base_record(model, config, "preset gpt2-tiny", 0)
    assert copy["weight_sums"] != original["weight_sums"]  # the rounding shows in the float32 sums
    lora.check_same_base(copy, original, "checkpoint")
    lora.check_same_base(original, copy, "checkpoint")
