"""Files go where they belong: names read from a run, a manifest or an index stay inside their folder, the run's JSON
files are whole or absent, a checkpoint carries its tokenizer, and export writes a folder or says why not."""

from __future__ import annotations

import json
import resource
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from callbacks.comm_profiler import CommProfiler
from callbacks.run_folder import write_json
from lit_fsdp import checkpoints
from lit_fsdp.commands.main import main
from lit_fsdp.commands.export import export_hf
from lit_fsdp.lightning_compat import METADATA_FILENAME
from lit_fsdp.presets import build_config
from lit_fsdp.commands.trained import load_trained
from lit_fsdp.weights import load_by_shard
from tests.corpus import articles, write_array
from tests.helpers import fit


class Named(pl.Callback):
    """Gives the run its name, as ``Results(run_name=...)`` does."""

    def __init__(self, run_name: str):
        self.run_name = run_name


@pytest.mark.parametrize("name", ["../../escaped", "a/../../../escaped", "..", "ABSOLUTE"])
def test_a_run_name_with_slashes_or_dots_keeps_profiler_traces_inside_the_run_folder(tmp_path, name):
    from lightning.pytorch.demos.boring_classes import BoringModel

    name = str(tmp_path / "escaped") if name == "ABSOLUTE" else name
    run = tmp_path / "deep" / "run"
    trainer = pl.Trainer(default_root_dir=run, max_steps=3, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Named(name), CommProfiler(wait=0, warmup=1, active=1)])
    trainer.fit(BoringModel())
    traces = list(tmp_path.rglob("*.pt.trace.json"))
    assert traces and all(trace.is_relative_to(run / "profiler") for trace in traces), traces
    assert len({trace.parent for trace in traces}) == 1 and traces[0].parent.parent == run / "profiler"


@pytest.mark.parametrize("name", ["../outside.bin", "ABSOLUTE"])
def test_a_manifest_that_names_a_file_outside_its_checkpoint_is_not_a_complete_checkpoint(tmp_path, name):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"0123")
    name = str(outside) if name == "ABSOLUTE" else name
    checkpoint = tmp_path / "last.ckpt"
    checkpoint.mkdir()
    (checkpoint / checkpoints.MANIFEST).write_text(json.dumps({"format": checkpoints.FORMAT, "step": 1, "files": {name: 4}}))
    found = checkpoints.inspect(checkpoint)
    assert found.manifest is None and f"names {name!r}, which is not a file inside the checkpoint" in found.problem


@pytest.mark.parametrize("name", ["../weights/model.safetensors", "ABSOLUTE"])
def test_a_safetensors_index_that_names_a_file_outside_its_folder_is_refused(tmp_path, name):
    from transformers import AutoModelForCausalLM

    config = build_config("gpt2-tiny")
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "weights", safe_serialization=True)
    folder = tmp_path / "pretrained"
    folder.mkdir()
    name = str(tmp_path / "weights" / "model.safetensors") if name == "ABSOLUTE" else name
    model = AutoModelForCausalLM.from_config(config)
    index = {"weight_map": {key: name for key in model.state_dict()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"maps .* to '{name}', which is not a file inside {folder}"):
        load_by_shard(model, folder)


def test_a_run_json_that_cannot_be_written_whole_leaves_the_previous_one(tmp_path):
    trainer = SimpleNamespace(is_global_zero=True, default_root_dir=str(tmp_path))
    write_json(trainer, "throughput.json", {"tokens_per_s": 1.0})
    before = (tmp_path / "throughput.json").read_text()
    # A file size limit makes the write fail part way, as a full disk or a killed process would.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(OSError):
            write_json(trainer, "throughput.json", {"per_step": list(range(10_000))})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert (tmp_path / "throughput.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["throughput.json"]  # nothing half-written left beside it


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    """One process trains gpt2-tiny for 2 steps with a BPE trained into its own cache folder."""
    root = tmp_path_factory.mktemp("file_places")
    corpus = write_array(root / "wiki.json", articles())
    fit(root / "run", "--data", "lit_fsdp.data.wikipedia.WikipediaDataModule", "--data.train_path", str(corpus),
        "--data.cache_dir", str(root / "cache"), "--data.vocab_size", "300", "--data.seq_len", "32",
        devices=1, batch_size=1, steps=2,
        callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}])
    (tokenizer,) = (root / "cache").glob("tokenizer-*")
    return {"root": root, "run": root / "run", "checkpoint": root / "run" / "checkpoints" / "last.ckpt",
            "tokenizer": tokenizer}


def test_a_checkpoint_carries_its_tokenizer_to_a_machine_without_the_tokenizer_folder(run, tmp_path):
    from lit_fsdp.data.tokenizer import load_tokenizer

    text = "the cat sat on a mat"
    expected = load_tokenizer(run["tokenizer"]).encode(text)
    moved = shutil.copytree(run["run"], tmp_path / "elsewhere")
    hidden = run["tokenizer"].rename(run["tokenizer"].with_name("hidden"))  # not on this "machine"
    try:
        assert load_trained(str(moved), device="cpu").tokenizer.encode(text) == expected
        export_hf(str(moved / "checkpoints" / "last.ckpt"), str(tmp_path / "hf"))
    finally:
        hidden.rename(run["tokenizer"])
    assert load_tokenizer(tmp_path / "hf").encode(text) == expected
    assert str(run["tokenizer"]) not in (run["checkpoint"] / METADATA_FILENAME).read_bytes().decode("latin-1")


def test_a_checkpoint_of_an_older_lit_fsdp_still_finds_its_tokenizer_by_its_absolute_path(run, tmp_path):
    old = shutil.copytree(run["checkpoint"], tmp_path / "old.ckpt")
    meta = torch.load(old / METADATA_FILENAME, weights_only=True)
    meta = {key: value for key, value in meta.items() if not key.startswith("tokenizer")}
    torch.save({**meta, "tokenizer_path": str(run["tokenizer"].absolute())}, old / METADATA_FILENAME)
    trained = load_trained(str(old), device="cpu")
    assert len(trained.tokenizer) == 300 and Path(trained.tokenizer.name_or_path) == run["tokenizer"].absolute()


def test_export_to_an_existing_file_is_one_error_line_and_writes_nothing(run, tmp_path, capsys):
    target = tmp_path / "model.bin"
    target.write_text("keep")
    with pytest.raises(SystemExit) as exit:
        main(["export", str(run["checkpoint"]), str(target)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and line.startswith(f"lit_fsdp: error: {target} is a file")
    assert target.read_text() == "keep" and [p.name for p in tmp_path.iterdir()] == ["model.bin"]
