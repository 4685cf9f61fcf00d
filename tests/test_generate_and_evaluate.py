"""generate and evaluate on a tiny trained run: its run folder, its sharded checkpoint and the exported folder agree."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from lit_fsdp.commands.main import main
from lit_fsdp.commands.evaluate import EvaluationData, evaluate
from lit_fsdp.commands.export import export_hf
from lit_fsdp.commands.generate import continue_text
from lit_fsdp.presets import build_config
from lit_fsdp.commands.trained import load_trained
from tests.corpus import articles, wikimedia_rows, write_array, write_lines, write_parquet, write_shards
from tests.helpers import fit

STEPS, SEQ_LEN = 12, 32


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    """One process trains gpt2-tiny with a 300-token BPE on a tiny corpus, validating on valid.jsonl at the last step."""
    root = tmp_path_factory.mktemp("generate_evaluate")
    corpus = write_array(root / "wiki.json", articles())
    valid = write_lines(root / "valid.jsonl", articles(5)[2:])
    cache = root / "cache"
    metrics = fit(
        root / "run",
        "--data", "lit_fsdp.data.wikipedia.WikipediaDataModule",
        "--data.train_path", str(corpus), "--data.val_path", str(valid), "--data.cache_dir", str(cache),
        "--data.vocab_size", "300", "--data.seq_len", str(SEQ_LEN),
        "--trainer.limit_val_batches", "1.0", "--trainer.val_check_interval", str(STEPS),
        devices=1, batch_size=1, steps=STEPS,  # batch 1: validation drops no block, as evaluate does not
        callbacks=[{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"save_last": True}}],
    )
    export_hf(str(root / "run" / "checkpoints" / "last.ckpt"), str(root / "hf"))
    return {"root": root, "run": root / "run", "hf": root / "hf", "valid": valid, "cache": cache,
            "val_loss": metrics["val/loss"][-1]}


def data(run, **overrides) -> EvaluationData:
    return EvaluationData(**{"path": str(run["valid"]), "cache_dir": str(run["cache"]), **overrides})


def evaluations(run) -> list[dict]:
    path = run["run"] / "evaluations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_evaluate_gives_the_validation_loss_fit_logged(run):
    assert (run["run"] / "checkpoints" / "last.ckpt" / "meta.pt").is_file()  # sharded: consolidated on load
    result = evaluate(str(run["run"]), data(run), batch_size=3)  # seq_len: the run's, read from the checkpoint
    assert result["seq_len"] == SEQ_LEN and result["step"] == STEPS
    assert result["loss"] == pytest.approx(run["val_loss"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(torch.tensor(run["val_loss"]).exp().item(), rel=1e-5)


def test_checkpoint_and_exported_folder_give_the_same_perplexity(run, capsys):
    from_checkpoint = evaluate(str(run["run"] / "checkpoints" / "last.ckpt"), data(run), seq_len=16)
    from_export = evaluate(str(run["hf"]), data(run), seq_len=16)
    assert from_checkpoint["tokens"] == from_export["tokens"] > 0 and from_export["tokens"] % 16 == 0
    assert from_export["loss"] == pytest.approx(from_checkpoint["loss"], rel=1e-6)
    printed = capsys.readouterr().out
    assert printed.count(f"perplexity  {from_export['perplexity']:.2f}") == 2
    assert f"tokens      {from_export['tokens']:,} ({from_export['tokens'] // 16:,} blocks of 16) from valid.jsonl" in printed


def test_an_evaluation_is_recorded_in_the_run_folder_not_beside_an_exported_folder(run):
    before = len(evaluations(run))
    evaluate(str(run["run"]), data(run), max_documents=2)
    evaluate(str(run["hf"]), data(run), seq_len=SEQ_LEN)
    records = evaluations(run)
    assert len(records) == before + 1 and not (run["hf"] / "evaluations.jsonl").exists()
    assert records[-1]["max_documents"] == 2 and records[-1]["step"] == STEPS
    assert records[-1]["checkpoint"] == str((run["run"] / "checkpoints" / "last.ckpt").absolute())


def test_greedy_text_streams_and_is_the_same_from_checkpoint_and_exported_folder(run):
    texts = {}
    for name in ("run", "hf"):
        trained = load_trained(str(run[name]), device="cpu")
        pieces: list[str] = []
        ids = continue_text(trained, "Article 3", pieces.append, max_new_tokens=24, temperature=0)
        texts[name] = ids.tolist()
        assert len(pieces) > 2  # handed on while generating, not once at the end
        assert "".join(pieces) == trained.tokenizer.decode(ids, skip_special_tokens=True) + "\n"
    assert texts["run"] == texts["hf"]


def test_sampling_follows_the_seed_and_top_k_1_is_greedy(run):
    trained = load_trained(str(run["hf"]), device="cpu")

    def sample(**settings) -> list[int]:
        return continue_text(trained, "the cat", lambda _: None, max_new_tokens=20, **settings).tolist()

    assert sample(seed=1) == sample(seed=1) != sample(seed=2)
    assert sample(top_k=1, seed=1) == sample(top_k=1, seed=2) == sample(temperature=0)


def test_generate_prints_the_prompt_and_its_continuation(run, capsys):
    main(["generate", str(run["run"]), "--prompt", "Article 1", "--max_new_tokens", "8", "--device", "cpu"])
    captured = capsys.readouterr()
    assert captured.out.startswith("Article 1") and len(captured.out) > len("Article 1\n")
    assert "tokens/s]" in captured.err


def test_without_a_prompt_generate_answers_each_line_until_end_of_input(run, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("the cat\n\nold red\n"))
    main(["generate", str(run["hf"]), "--max_new_tokens", "6", "--temperature", "0"])
    captured = capsys.readouterr()
    assert captured.out.count("> ") == 4  # two prompts, one blank line skipped, then end of input
    assert captured.err.count("tokens/s]") == 2


def synthetic_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint's metadata as fit writes it for token-id data (no tokenizer); no weights are needed to fail."""
    path = tmp_path / "synthetic.ckpt"
    torch.save({"hf_config": build_config("gpt2-tiny").to_dict(), "tokenizer_path": None, "state_dict": {}}, path)
    return path


@pytest.mark.parametrize(
    "command, message",
    [
        (["generate", "{root}/missing"], "missing does not exist"),
        (["generate", "{root}/cache"], "is neither a run folder"),
        (["evaluate", "{root}/wiki.json", "--data.path", "{valid}"], "is not a checkpoint written by fit"),
        (["generate", "{synthetic}"], "trained on token ids without a tokenizer"),
        (["evaluate", "{run}", "--data.path", "{root}/bad.json"], "bad.json: malformed JSON in record 1"),
        (["evaluate", "{run}", "--data.path", "{root}/missing.json"], "--data.path"),
        (["evaluate", "{hf}", "--data.path", "{valid}"], "--seq_len is needed"),
        (["evaluate", "{run}", "--data.path", "{valid}", "--seq_len", "5000"], "longer than the model's 512 positions"),
        (["generate", "{run}", "--prompt", "a", "--max_new_tokens", "600"], "exceed the model's 512 positions"),
        (["generate", "{run}", "--top_p", "0"], "--top_p 0.0 must be in (0, 1]"),
        (["generate", "{run}", "--device", "cuda:0"], "this machine has no CUDA device"),
    ],
    ids=["missing", "not-a-checkpoint-folder", "not-a-checkpoint-file", "no-tokenizer", "malformed-json",
         "missing-data", "hf-without-seq-len", "seq-len-too-long", "too-many-tokens", "top-p", "no-gpu"],
)
def test_bad_input_fails_with_one_line(run, tmp_path, capsys, command, message):
    if any(part.startswith("cuda") for part in command) and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    (run["root"] / "bad.json").write_text('[{"id": "0", "text": "fine"}, {"id": "1", "text": }]')
    places = {key: str(value) for key, value in run.items()} | {"synthetic": str(synthetic_checkpoint(tmp_path))}
    with pytest.raises(SystemExit) as exit_info:
        main([part.format(**places) for part in command])
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("lit_fsdp: error: ") and message in errors[0], errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_gives_the_cpu_perplexity_and_greedy_text(run):
    on_cpu = evaluate(str(run["run"]), data(run), device="cpu")
    on_gpu = evaluate(str(run["run"]), data(run), device="cuda")
    assert on_gpu["device"].startswith("cuda") and on_gpu["loss"] == pytest.approx(on_cpu["loss"], rel=1e-4)
    texts = [continue_text(load_trained(str(run["hf"]), device=device), "the cat", lambda _: None, max_new_tokens=8,
                           temperature=0).tolist() for device in ("cpu", "cuda")]
    assert texts[0] == texts[1]


def test_evaluate_reads_parquet_files_folders_and_globs_of_shards_as_fit_does(run, tmp_path):
    """The validation articles as one Parquet file, as a folder of shards and as a glob of them give the JSON Lines
    file's tokens and loss; a text column of another name is read with --data.text_field."""
    records = [json.loads(line) for line in run["valid"].read_text().splitlines()]
    on_json = evaluate(str(run["run"]), data(run), batch_size=3)
    shards = write_shards(tmp_path / "shards", records, shards=2)
    renamed = write_parquet(tmp_path / "body.parquet", [{"title": r["title"], "body": r["text"]} for r in records])
    for path, field in ((write_parquet(tmp_path / "valid.parquet", wikimedia_rows(records)), "text"), (shards, "text"),
                        (shards / "train-*.parquet", "text"), (renamed, "body")):
        result = evaluate(str(run["run"]), data(run, path=str(path), text_field=field), batch_size=3)
        assert (result["tokens"], result["loss"]) == (on_json["tokens"], pytest.approx(on_json["loss"], rel=1e-6)), path
    with pytest.raises(ValueError, match="body.parquet.*text"):  # the column checked before the model is loaded
        evaluate(str(run["run"]), data(run, path=str(renamed), format="text"), batch_size=3)
