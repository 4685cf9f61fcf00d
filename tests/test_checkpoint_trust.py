"""A checkpoint is read with ``weights_only=True``: one that would run code when unpickled is refused in one line by
every command, before any of it runs, and lit_fsdp's own checkpoints of every kind still load."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from lit_fsdp import checkpoints
from tests.corpus import articles, write_lines
from tests.distributed import fit_in_process, run
from tests.helpers import REPO, checkpoint_every, cli_in_process, fit_arguments, read_metrics


class Touch:
    """Unpickled, it creates ``marker``: what a hostile checkpoint could do with any other call."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def hostile(path: pathlib.Path, marker: pathlib.Path, layout: str) -> pathlib.Path:
    """A checkpoint that looks like fit's (manifest, hf_config) and creates ``marker`` when unpickled."""
    manifest = {"format": checkpoints.FORMAT, "step": 4, "world_size": 1, "num_nodes": 1, "batch_size": 2,
                "accumulate_grad_batches": 1, "global_batch": 2, "samples_consumed": 8}
    content = {"hf_config": {"model_type": "gpt2"}, "state_dict": {}, "global_step": 4, "payload": Touch(marker)}
    if layout == "file":
        torch.save({**content, checkpoints.MANIFEST_KEY: {**manifest, "layout": "full"}}, path)
    else:
        path.mkdir()
        torch.save(content, path / "meta.pt")
        files = {"meta.pt": (path / "meta.pt").stat().st_size}
        (path / checkpoints.MANIFEST).write_text(json.dumps({**manifest, "layout": "sharded", "files": files}))
    return path


def test_the_crafted_checkpoint_runs_code_when_unpickled_without_weights_only(tmp_path):
    marker = tmp_path / "ran"
    torch.load(hostile(tmp_path / "x.ckpt", marker, "file"), weights_only=False)
    assert marker.exists()  # so that its absence below means the refusal came first


def _commands(tmp_path: pathlib.Path, checkpoint: pathlib.Path) -> dict[str, list[str]]:
    corpus = write_lines(tmp_path / "valid.jsonl", articles(3))
    fit = ["fit", "--config", "configs/quickstart.yaml", "--trainer.devices", "1",
           "--trainer.default_root_dir", str(tmp_path / "run")]
    return {
        "fit --ckpt_path X": [*fit, "--ckpt_path", str(checkpoint)],
        "fit --ckpt_path last": [*fit, "--ckpt_path", "last"],
        "export": ["export", str(checkpoint), str(tmp_path / "hf")],
        "generate": ["generate", str(checkpoint), "--prompt", "the cat", "--device", "cpu"],
        "evaluate": ["evaluate", str(checkpoint), "--data.path", str(corpus), "--device", "cpu"],
    }


@pytest.mark.parametrize("layout, command", [
    ("file", "fit --ckpt_path X"), ("file", "fit --ckpt_path last"), ("file", "export"), ("file", "generate"),
    ("file", "evaluate"), ("folder", "fit --ckpt_path X"), ("folder", "export"),
])
def test_a_checkpoint_that_runs_code_when_unpickled_is_refused_in_one_line(tmp_path, layout, command):
    marker = tmp_path / "ran"
    # --ckpt_path last looks in <run folder>/checkpoints, the others are given the path
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    checkpoint = hostile(folder / "last.ckpt", marker, layout)
    result = cli_in_process(*_commands(tmp_path, checkpoint)[command], cwd=REPO)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and str(checkpoint) in errors[0], result.stderr[-3000:]
    assert "objects a checkpoint written by lit_fsdp never holds" in errors[0] and "could run code" in errors[0]
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut short"])
def test_an_empty_or_truncated_checkpoint_file_is_refused_in_one_line_before_it_is_read(tmp_path, content):
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.write_bytes(content)
    result = cli_in_process("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--ckpt_path",
                            str(checkpoint), cwd=REPO)
    errors = [line for line in result.stderr.splitlines() if line.startswith("lit_fsdp: error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr and "EOFError" not in result.stderr
    assert len(errors) == 1 and errors[0].startswith(
        f"lit_fsdp: error: checkpoint {checkpoint} cannot be resumed: it cannot be read (File is not a zip file); pass "
        "another one, or --ckpt_path last for the newest complete checkpoint of the run"), result.stderr[-2000:]


@pytest.mark.parametrize("strategy", ["lit_fsdp.strategy.FSDP2Strategy", "lit_fsdp.ddp.DDPStrategy",
                                      "offload.SlideFSDPStrategy"])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_each_strategy_refuses_such_a_checkpoint_when_asked_to_load_it_without_the_cli(tmp_path, strategy, layout):
    from importlib import import_module

    module, name = strategy.rsplit(".", 1)
    marker = tmp_path / "ran"
    checkpoint = hostile(tmp_path / "last.ckpt", marker, layout)
    with pytest.raises(checkpoints.UntrustedCheckpointError, match="could run code"):
        getattr(import_module(module), name)().load_checkpoint(checkpoint)
    assert not marker.exists()


COMPRESSION = "--trainer.strategy.init_args.compression"
FULL_FILE = ["--trainer.strategy.init_args.save_distributed_checkpoint", "false"]
KINDS = {
    "fsdp2-sharded-zero_one_adam": [COMPRESSION, "{method: zero_one_adam, var_freeze_step: 1, local_step_scaler: 1, "
                                                 "local_step_clipper: 2, chunk_size: 128}"],
    "fsdp2-file-onebit_adam": [COMPRESSION, "{method: onebit_adam, freeze_step: 1, chunk_size: 128}", *FULL_FILE],
    "slide_fsdp": ["--trainer.strategy.class_path", "offload.SlideFSDPStrategy"],
    "ddp-file": ["--trainer.strategy.class_path", "lit_fsdp.ddp.DDPStrategy"],
}


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> pathlib.Path:
    """For each kind: 2 steps with a checkpoint at step 2, then resumed from it to step 3 (one spawn, the CLI in-process)."""
    root = tmp_path_factory.mktemp("kinds")
    arguments = []
    for kind, extra in KINDS.items():
        arguments += [fit_arguments(root / kind, *extra, steps=2, callbacks=[checkpoint_every(2, root / kind / "ckpt")]),
                      fit_arguments(root / kind, *extra, "--ckpt_path", str(root / kind / "ckpt" / "last.ckpt"), steps=3)]
    run(fit_in_process, root, arguments)
    return root


@pytest.mark.parametrize("kind", list(KINDS))
def test_checkpoints_of_every_kind_load_with_weights_only(kinds, kind, tmp_path):
    """Each is read by the CLI's checks, by the strategy that resumes from it and by export."""
    from transformers import AutoModelForCausalLM

    from lit_fsdp.commands.export import export_hf

    ckpts = kinds / kind / "ckpt"
    assert checkpoints.inspect(ckpts / "last.ckpt").manifest["step"] == 2
    resumed = read_metrics(kinds / kind / "lightning_logs" / "version_1" / "metrics.csv")
    assert len(resumed["train/loss"]) == 1  # step 3 only: it started from the checkpoint
    export_hf(str(ckpts / "last.ckpt"), str(tmp_path / "hf"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
