"""SlideFSDP with ``compile_blocks``: the same losses as eager, compiled once although blocks move between slots."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_fsdp.errors import error_line
from offload.compile import CompileUnavailableError, compile_forwards
from tests.distributed import in_process_cli, run
from tests.helpers import fit_arguments, read_metrics

STEPS = 4
LLAMA = ["--model.preset", "llama-tiny", "--model.config_overrides", "{num_hidden_layers: 4}",
         "--trainer.strategy.class_path", "offload.SlideFSDPStrategy", "--trainer.gradient_clip_val", "0"]
# window 1: every block in the one slot; window 2: blocks alternate between two slots, and the last one stays for the
# backward. activation_checkpointing 2 checkpoints blocks 0 and 2 (recomputed: a graph without grad, then one with)
# and marks 1 and 3 with BeforeBackward (their saved tensors view their slot).
CASES = {"window1_checkpoint2": dict(window=1, activation_checkpointing=2),
         "window2_checkpoint0": dict(window=2, activation_checkpointing=0)}
# window2_checkpoint0's plan (every block kept on the device) with its first two blocks' saved tensors on the host
HOST_BLOCKS = dict(window=2, activation_checkpointing=0, activation_plan="{host: 2}", compile_blocks=True)


class CountGraphs(pl.Callback):
    """Writes to ``path`` the graphs dynamo compiled and its graph breaks since the run began, after each training step,
    and how many blocks have a compiled ``forward``."""

    def __init__(self, path: str):
        self.path = path
        self.before: dict[str, int] = {}
        self.after_step: list[dict[str, int]] = []

    @staticmethod
    def counts() -> dict[str, int]:
        from torch._dynamo.utils import counters

        return {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values())}

    def on_train_start(self, trainer, pl_module):
        self.before = self.counts()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_step.append({key: value - self.before[key] for key, value in self.counts().items()})

    def on_train_end(self, trainer, pl_module):
        from lit_fsdp.parallelize import find_blocks

        compiled = sum(hasattr(block.forward, "_torchdynamo_orig_callable") for _, block in find_blocks(pl_module.model))
        Path(self.path).write_text(json.dumps({"steps": self.after_step, "compiled_blocks": compiled}))


def slide_runs(rank: int, world: int, root: Path) -> None:
    """Each case eager, then compiled, in this one process: the compiled cases share dynamo's cache, as the blocks do;
    then the compiled host blocks."""
    cli = in_process_cli(rank, world)
    runs = {f"{name}-{'compiled' if compiled else 'eager'}": {**knobs, "compile_blocks": compiled}
            for name, knobs in CASES.items() for compiled in (False, True)}
    for name, knobs in {**runs, "window2_host2-compiled": HOST_BLOCKS}.items():
        folder = root / name
        settings = [arg for key, value in knobs.items() for arg in (f"--trainer.strategy.init_args.{key}", str(value))]
        probe = {"class_path": f"{__name__}.CountGraphs", "init_args": {"path": str(folder / "graphs.json")}}
        cli(fit_arguments(folder, *LLAMA, *settings, devices=1, batch_size=4, steps=STEPS, callbacks=[probe]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slide_compile")
    run(slide_runs, root, root, world=1)
    return root


def losses(folder: Path) -> list[float]:
    return read_metrics(max(folder.glob("lightning_logs/version_*/metrics.csv")))["train/loss"]


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_give_eager_losses_and_do_not_recompile_after_the_first_step(runs, case):
    eager, compiled = losses(runs / f"{case}-eager"), losses(runs / f"{case}-compiled")
    assert len(compiled) == STEPS and compiled[-1] < compiled[0]
    # float32 compute; inductor's fused kernels reorder the sums, so not bit for bit: within 1e-5 relative. A block
    # computing with a slot's stale weights (the last block there, or the step before) would be off by far more.
    assert compiled == pytest.approx(eager, rel=1e-5)
    graphs = json.loads((runs / f"{case}-compiled" / "graphs.json").read_text())
    assert graphs["compiled_blocks"] == 4
    steps = graphs["steps"]
    assert all(after == steps[0] for after in steps[1:]), steps  # no recompilation after the first step
    assert steps[-1]["breaks"] == 0  # each block's forward is one graph: the engine's hooks stay outside it
    if case == next(iter(CASES)):  # the first compiled run compiles (the training graph, and one without grad for
        assert steps[0]["graphs"] == 2  # the recomputation's forward); the second reuses them with its new model


def test_compiled_host_blocks_get_their_saved_tensors_back_with_their_strides_and_the_kept_plans_losses(runs):
    """Inductor's compiled backward asserts the size and strides of every tensor its forward saved: host blocks give
    them back as they were (a copy made contiguous fails there), and train as the same blocks kept on the device."""
    kept, host = losses(runs / "window2_checkpoint0-compiled"), losses(runs / "window2_host2-compiled")
    assert len(host) == STEPS
    assert host == pytest.approx(kept, rel=1e-6)
    steps = json.loads((runs / "window2_host2-compiled" / "graphs.json").read_text())["steps"]
    assert all(after == steps[0] for after in steps[1:]) and steps[-1]["breaks"] == 0, steps


def test_compile_blocks_where_inductor_has_no_compiler_is_refused_in_one_line():
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    block = nn.Linear(2, 2)
    forward = block.forward
    cpp_compiler_search.cache_clear()  # it remembers the compiler it found
    try:
        with config.patch({"cpp.cxx": ("no-such-c++",)}), pytest.raises(CompileUnavailableError) as caught:
            compile_forwards([("0", block)], torch.device("cpu"))
    finally:
        cpp_compiler_search.cache_clear()
    assert error_line(caught.value) == str(caught.value)
    assert "No working C++ compiler" in str(caught.value) and "compile_blocks false" in str(caught.value)
    assert block.forward == forward  # nothing was compiled


def test_compile_blocks_with_inductor_freezing_is_refused_since_it_would_keep_the_first_slots_weights():
    from torch._inductor import config

    with config.patch(freezing=True), pytest.raises(CompileUnavailableError, match="TORCHINDUCTOR_FREEZING=1"):
        compile_forwards([("0", nn.Linear(2, 2))], torch.device("cpu"))
