"""The model summary a fit starts with counts the parameters under every strategy: FSDP2 (sharded DTensors),
SlideFSDP (parameters empty while their block is not loaded, where Lightning's own counted 0), and LoRA under both;
and it has no FLOPs line (Lightning's said ``Total FLOPs: 0`` for a module without an ``example_input_array``); nor
does the console carry Lightning's advertisement for litlogger."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from tests.distributed import in_process_cli, run
from tests.helpers import fit_arguments

SLIDE = ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"]
LORA = ["--model.lora", "{rank: 4, alpha: 8}"]
CASES = {"fsdp2": [], "slide_fsdp": SLIDE, "fsdp2_lora": LORA, "slide_fsdp_lora": [*SLIDE, *LORA]}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(record.getMessage())


def summaries_and_counts(rank: int, world: int, root: Path) -> dict[str, tuple[str, int, int]]:
    """Each case's one-step fit on this process: what the run logged, and the counts of an unsharded model: the
    Hugging Face model of its config (every parameter) and the trained parameters FSDP2's DTensors hold."""
    from transformers import AutoModelForCausalLM

    cli, lines = in_process_cli(rank, world), Lines()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).addHandler(lines)
    found = {}
    for case, extra in CASES.items():
        lines.text.clear()
        fitted = cli(fit_arguments(root / case, *extra, "--trainer.enable_model_summary", "true", devices=world, steps=1))
        with torch.device("meta"):
            whole = sum(p.numel() for p in AutoModelForCausalLM.from_config(fitted.model.hf_config()).parameters())
        trained = sum(p.numel() for p in fitted.model.parameters() if p.requires_grad)  # DTensors: the whole size
        found[case] = ("\n".join(lines.text), whole, trained)
    return found


@pytest.fixture(scope="module")
def summaries(tmp_path_factory) -> dict[str, tuple[str, int, int]]:
    root = tmp_path_factory.mktemp("summary")
    return run(summaries_and_counts, root, root, world=1)[0]


def figure(summary: str, what: str) -> str:
    return next(line[: len(line) - len(what)].strip() for line in summary.splitlines() if line.endswith(what))


def test_the_summary_counts_every_parameter_under_fsdp2_and_slide_fsdp_and_the_adapters_with_lora(summaries):
    full_text, whole, _ = summaries["fsdp2"]
    lora_text, _, adapters = summaries["fsdp2_lora"]
    assert 0 < adapters < whole
    for case, (total, trained) in {"fsdp2": (whole, whole), "slide_fsdp": (whole, whole),
                                   "fsdp2_lora": (whole + adapters, adapters),
                                   "slide_fsdp_lora": (whole + adapters, adapters)}.items():
        summary = summaries[case][0]
        shown = [figure(summary, what) for what in ("Trainable params", "Non-trainable params", "Total params")]
        assert shown == [get_human_readable_count(n).strip() for n in (trained, total - trained, total)], (case, summary)
        assert "FLOPs" not in summary and "Flops" not in summary, summary
        assert "Tip:" not in summary and "litlogger" not in summary, summary
