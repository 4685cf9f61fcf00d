"""Progress shown to a user: the token-cache build and the BPE training (lines in a log, a bar on a terminal,
silence off rank 0), and the training progress bar in the quickstart's first run."""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import pytest

from callbacks.progress_bar import RichBar, shown_metrics
from callbacks.throughput import RUNNING_KEY
from lit_fsdp.data import progress, token_cache
from lit_fsdp.data.corpus import read_documents, read_documents_with_offsets
from lit_fsdp.data.progress import CorpusProgress, duration
from lit_fsdp.data.token_cache import build_token_cache
from lit_fsdp.data.tokenizer import train_bpe
from tests.corpus import articles, datamodule, write_array, write_lines
from tests.helpers import REPO, run_cli


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """A stand-in for time.monotonic that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    return clock


@pytest.fixture
def corpus(tmp_path):
    return write_array(tmp_path / "wiki.json", articles())


def test_rate_and_time_left_follow_the_bytes_read(tmp_path, clock):
    source = tmp_path / "big.bin"
    source.write_bytes(b"x" * 4_000_000)
    log = io.StringIO()
    shown = CorpusProgress("Tokenizing big.bin", source, tokens=0, stream=log)
    clock.now += 10
    shown.update(documents=250, bytes_read=1_000_000, tokens=300_000)
    assert log.getvalue() == (
        "Tokenizing big.bin: 250 documents, 300,000 tokens, 1.0/4.0 MB (25%), 0.1 MB/s, 30s left\n"
    )
    clock.now += 1  # within the interval: nothing written
    shown.update(documents=300, bytes_read=1_100_000, tokens=330_000)
    assert log.getvalue().count("\n") == 1
    clock.now += progress.LINE_INTERVAL_S
    shown.update(documents=1000, bytes_read=4_000_000, tokens=1_200_000)
    assert log.getvalue().splitlines()[-1].endswith("4.0/4.0 MB (100%), 0.2 MB/s, 0s left")
    shown.close()
    assert log.getvalue().splitlines()[-1] == "Tokenizing big.bin: done, 1,000 documents, 1,200,000 tokens, 4.0 MB in 16s"


def test_max_documents_counts_when_it_is_reached_before_the_end_of_the_file(tmp_path, clock):
    source = tmp_path / "big.bin"
    source.write_bytes(b"x" * 10_000_000)
    shown = CorpusProgress("Training the BPE on big.bin", source, max_documents=100, stream=io.StringIO())
    shown.update(documents=50, bytes_read=1_000_000)
    assert shown.fraction() == 0.5
    assert "tokens" not in shown.status()  # a BPE pass makes none


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (59, "59s"), (250, "4m10s"), (3720, "1h02m")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_token_cache_build_writes_lines_with_documents_and_tokens_and_a_final_line(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(progress, "LINE_INTERVAL_S", 0.0)  # a line per chunk
    monkeypatch.setattr(token_cache, "CHARACTERS_PER_CHUNK", 1)  # a chunk per document
    tokenizer = train_bpe(read_documents(corpus), 300)
    meta = build_token_cache(tmp_path / "cache", corpus, tokenizer)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Tokenizing wiki.json:")]
    assert len(lines) == len(articles()) + 1
    documents = [int(re.search(r": ([\d,]+) documents", line).group(1)) for line in lines[:-1]]
    assert documents == list(range(1, len(articles()) + 1))
    assert lines[-2].endswith(("0s left", "1s left")) and "(100%)" in lines[-2]
    assert re.fullmatch(rf"Tokenizing wiki\.json: done, 12 documents, {meta['tokens']:,} tokens, 0\.0 MB in \d+s", lines[-1])


def test_json_lines_offsets_grow_to_the_file_size(tmp_path):
    path = write_lines(tmp_path / "wiki.jsonl", articles(3))
    offsets = [offset for _, offset in read_documents_with_offsets(path)]
    assert offsets == sorted(offsets) and offsets[-1] == path.stat().st_size


def test_a_terminal_gets_a_bar_instead_of_lines(corpus, tmp_path, clock):
    terminal = Terminal()
    shown = CorpusProgress("Tokenizing wiki.json", corpus, tokens=0, stream=terminal)
    clock.now += 1
    shown.update(documents=6, bytes_read=corpus.stat().st_size // 2, tokens=1000)
    drawn = terminal.getvalue()
    assert "\r" in drawn and "Tokenizing wiki.json: 6 documents, 1,000 tokens" in drawn and "|" in drawn
    assert "\n" not in drawn.rstrip("\n")  # redrawn in place, not one line per update
    shown.close()
    assert terminal.getvalue().splitlines()[-1].startswith("Tokenizing wiki.json: done, 6 documents")


def test_bpe_training_and_tokenizing_report_on_rank_zero_only(corpus, tmp_path, monkeypatch, capsys):
    datamodule(corpus, tmp_path / "cache").setup("fit")
    err = capsys.readouterr().err
    assert re.search(r"Training the BPE on wiki\.json: done, 12 documents, 0\.0 MB in \d+s", err)
    tokens = json.loads(next((tmp_path / "cache").glob("tokens-*/meta.json")).read_text())["tokens"]
    assert f"Tokenizing wiki.json: done, 12 documents, {tokens:,} tokens" in err

    monkeypatch.setattr(progress.rank_zero_only, "rank", 1)
    datamodule(corpus, tmp_path / "other-cache").setup("fit")
    assert "wiki.json: done" not in capsys.readouterr().err


def test_training_bar_shows_the_step_short_names_and_tokens_per_s_as_an_integer():
    trainer = SimpleNamespace(global_step=130, max_steps=300)
    logged = {"v_num": "1tc7", "train/loss": 1.21749, RUNNING_KEY: 12013.49, "val/loss": 1.2114, "val/ppl": 3.3571,
              "other/x": 0.12345}
    assert shown_metrics(trainer, logged) == {
        "step": "130/300", "loss": "1.217", "tok/s": "12013", "val_loss": "1.211", "val_ppl": "3.36", "other/x": "0.123",
    }
    assert shown_metrics(SimpleNamespace(global_step=5, max_steps=-1), {}) == {}  # an epochs run: no step total


def test_a_max_steps_run_shows_the_epoch_without_a_negative_total():
    pytest.importorskip("rich")
    bar = RichBar()
    bar._trainer = SimpleNamespace(max_epochs=-1)  # what Lightning sets when max_steps ends the run
    assert bar._get_train_description(2).strip() == "Epoch 2"
    bar._trainer = SimpleNamespace(max_epochs=5)
    assert bar._get_train_description(2).strip() == "Epoch 2/4"


def test_the_quickstart_logs_a_line_every_n_steps_and_ends_with_its_summary_without_warnings(tmp_path, monkeypatch):
    # stdout a pipe, as under nohup or SLURM: lines as the run goes, not a bar drawn once at the end
    result = run_cli("fit", "--config", str(REPO / "configs" / "quickstart.yaml"), "--trainer.max_steps", "3",
                     "--trainer.log_every_n_steps", "2", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "1",
                     "--trainer.default_root_dir", str(tmp_path), cwd=tmp_path)
    output = result.stdout + result.stderr
    # Lightning prints warnings from its own files as "<file>.py:<line>: <message>", without the category.
    warned = [line for line in output.splitlines() if re.search(r"warning|\.py:\d+: ", line, re.IGNORECASE)]
    assert not warned, "\n".join(warned)
    assert output.count("Throughput: MFU is null: no peak for 'cpu'") == 1  # rank 0, once, as information
    assert "give one device's peak TFLOPS with --peak_tflops on fit's command line" in output
    steps = [line for line in result.stdout.splitlines() if line.startswith("step=")]
    assert [line.split()[0] for line in steps] == ["step=2/3", "step=3/3"], result.stdout[-2000:]
    assert all(re.fullmatch(r"step=\d/3 loss=\d+\.\d{3} tok/s=\d+ elapsed=\d+s eta=\d+s", line) for line in steps), steps
    assert re.search(r"^val step=3/3 val_loss=\d+\.\d{3} val_ppl=[\d.]+$", result.stdout, re.MULTILINE), result.stdout
    assert "/-2" not in output and "tokens_per_s_running" not in output and "v_num" not in output
    assert "\r" not in result.stdout  # no bar redrawn in the log
    summary = result.stdout.splitlines()[-3:]
    assert re.fullmatch(r"run \S+ done: 3 steps; train loss \d+\.\d{4}, val loss \d+\.\d{4} \(ppl [\d.]+\); "
                        r"[\d,]+ tokens/s, MFU unknown \(no peak TFLOPS for this device\)", summary[0]), summary
    assert summary[1].startswith(f"run folder {tmp_path.resolve()}: results.jsonl, history.jsonl, throughput.json"), summary
    assert summary[2] == f"checkpoints in {tmp_path.resolve() / 'checkpoints'} (resume with --ckpt_path last)", summary


def test_the_summary_names_mfu_where_known_and_a_failed_run_says_why(tmp_path):
    from callbacks.run_summary import summary_lines

    (tmp_path / "results.jsonl").write_text("{}\n")
    record = {"run_name": "r", "steps": 50, "train_loss": 2.0, "val_loss": None, "tokens_per_s": 8493.2, "mfu": 0.414}
    assert summary_lines(record, tmp_path) == ["run r done: 50 steps; train loss 2.0000; 8,493 tokens/s, MFU 41.4%",
                                               f"run folder {tmp_path.resolve()}: results.jsonl"]
    failed = summary_lines({**record, "status": "failed", "error": "out of memory"}, tmp_path)[0]
    assert failed.startswith("run r failed (out of memory): 50 steps")
