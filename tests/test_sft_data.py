"""SFTDataModule: both sample formats, rendering with and without a chat template, answer-only labels, packing,
step_targets across processes and accumulation, exact resume, the cache, bad input, and the sample task."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_fsdp.data import sft
from lit_fsdp.data.blocks import ResumableSampler
from lit_fsdp.data.chat import ChatRenderer, Sample, read_samples
from lit_fsdp.data.sft import SFTDataModule, StepTargetSampler, first_fit
from lit_fsdp.data.tokenizer import EOS_TOKEN, load_tokenizer, train_bpe

REPO = Path(__file__).resolve().parents[1]
WORDS = "apple river stone house city music king water light north south green old new small".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '### ' + m['role'] + ':\\n' + m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)


def samples(count: int, seed: int = 0) -> list[dict]:
    """Word-reversal samples of 2 to 9 words in both formats, some with a system turn."""
    rng, out = random.Random(seed), []
    for i in range(count):
        words = rng.choices(WORDS, k=rng.randint(2, 9))
        prompt, answer = "reverse: " + " ".join(words), " ".join(reversed(words))
        if i % 3 == 0:
            out.append({"prompt": prompt, "completion": answer, "id": i})
        else:
            system = [{"role": "system", "content": "Reverse."}] if i % 3 == 1 else []
            out.append({"messages": system + [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return out


def write_lines(path: Path, records: list, newline: str = "\n") -> Path:
    path.write_bytes("".join(json.dumps(record) + newline for record in records).encode())
    return path


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    """A tiny byte-level BPE without a chat template ("plain") and the same BPE with one ("chat"), as folders."""
    root = tmp_path_factory.mktemp("tokenizers")
    texts = [json.dumps(record) for record in samples(200)] + ["<|user|> <|assistant|> <|system|> ### user: assistant:"]
    tokenizer = train_bpe(texts, 400)
    tokenizer.save_pretrained(root / "plain")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "chat")
    return {"plain": root / "plain", "chat": root / "chat"}


@pytest.fixture
def train_file(tmp_path) -> Path:
    return write_lines(tmp_path / "train.jsonl", samples(120))


def fake_trainer(world: int = 1, rank: int = 0, accumulate: int = 1, pretrained_path: str | None = None,
                 limit_train_batches: int | float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(
        world_size=world, global_rank=rank, local_rank=0, accumulate_grad_batches=accumulate, training=True,
        current_epoch=0, limit_train_batches=limit_train_batches,
        lightning_module=SimpleNamespace(hparams={"pretrained_path": pretrained_path}),
    )


def datamodule(train_file: Path, tokenizer: Path | None, tmp_path: Path, trainer=None, **overrides) -> SFTDataModule:
    kwargs = dict(seq_len=64, batch_size=4, cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    dm = SFTDataModule(str(train_file), tokenizer_path=None if tokenizer is None else str(tokenizer), **{**kwargs, **overrides})
    dm.trainer = trainer
    dm.setup("fit")
    return dm


def rows(dataset) -> list[dict[str, torch.Tensor]]:
    return [dataset[i] for i in range(len(dataset))]


def segments(row: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    out = []
    for segment in range(1, int(row["segment_ids"].max()) + 1):
        where = row["segment_ids"] == segment
        out.append({key: value[where] for key, value in row.items() if value.dim()})
    return out


# ---------------------------------------------------------------------------------------------------- reading


def test_both_formats_crlf_blank_lines_and_json_arrays_read_the_same_samples(tmp_path):
    records = samples(9)
    lines = tmp_path / "a.jsonl"
    lines.write_bytes(b"\r\n".join(json.dumps(record).encode() for record in records).replace(b"}\r\n{", b"}\r\n\r\n  \r\n{")
                      + b"\r\n\r\n")
    array = tmp_path / "b.json"
    array.write_text(json.dumps(records, indent=2))
    from_lines = [sample for sample, _ in read_samples(lines)]
    from_array = [sample for sample, _ in read_samples(array)]
    assert [s.turns for s in from_lines] == [s.turns for s in from_array]
    assert from_lines[0].turns == (("user", records[0]["prompt"]), ("assistant", records[0]["completion"]))  # "id" ignored
    assert from_lines[1].turns[0] == ("system", "Reverse.") and from_lines[2].turns[0][0] == "user"
    assert from_lines[1].where == f"{lines}: line 4"  # the blank lines still count
    assert from_array[1].where.endswith(f"line {json.dumps(records, indent=2).splitlines().index('  {', 2) + 1}")


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"prompt": "a", "completion": "b"}\n\n{not json\n', r"\.jsonl: line 3 is not JSON"),
        ('{"prompt": "a", "completion": "b"}\n{"messages": [{"role": "bot", "content": "x"}]}\n',
         r"line 2: message 0 has role 'bot'; a role is one of system, user, assistant"),
        ('{"messages": [{"role": "user", "content": ["x"]}]}\n', r"line 1: message 0 \(user\) has content of type list"),
        ('{"text": "x"}\n', r"line 1: the sample has neither 'messages' nor 'prompt' and 'completion' \(keys: text\)"),
        ('{"prompt": "a"}\n', r"line 1: 'completion' is NoneType, not a string"),
        ('[\n  {"prompt": "a", "completion": "b"},\n\n  {"messages": [{"role": "bot", "content": "x"}]}\n]',
         r"\.jsonl: line 4: message 0 has role 'bot'"),
        ('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": oops}\n]', r"\.jsonl: line 3 is not JSON"),
    ],
    ids=["not-json", "role", "content", "no-format", "no-completion", "array-role", "array-not-json"],
)
def test_bad_input_is_one_error_line_naming_file_and_line(tmp_path, tokenizers, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as error:
        list(read_samples(path))
    assert "\n" not in str(error.value) and str(path) in str(error.value)
    with pytest.raises(ValueError, match=match):  # and setup fails with it
        datamodule(path, tokenizers["plain"], tmp_path)


def test_a_file_without_any_target_token_is_an_error_and_answerless_samples_are_skipped(tmp_path, tokenizers):
    question = {"messages": [{"role": "user", "content": "hello"}]}
    with pytest.raises(ValueError, match=r"no sample has a target token \(2 read, 2 without an assistant turn"):
        datamodule(write_lines(tmp_path / "none.jsonl", [question, question]), tokenizers["plain"], tmp_path)
    dm = datamodule(write_lines(tmp_path / "some.jsonl", samples(60) + [question] * 3), tokenizers["plain"], tmp_path)
    stats = dm.stats[str(dm.train_path)]
    assert stats["without_answer"] == 3 and stats["samples"] == 60


# ---------------------------------------------------------------------------------------------------- rendering


def test_plain_template_targets_are_each_answer_and_eos_only(tokenizers):
    tokenizer = load_tokenizer(tokenizers["plain"])
    renderer = ChatRenderer(tokenizer)
    sample = Sample("x", (("system", "Reverse."), ("user", "reverse: a b"), ("assistant", "b a"),
                          ("user", "reverse: c d"), ("assistant", "d c")))
    ids, mask = renderer.render(sample)
    assert renderer.template is None
    assert tokenizer.decode(ids) == (f"<|system|>\nReverse.\n<|user|>\nreverse: a b\n<|assistant|>\nb a{EOS_TOKEN}"
                                     f"<|user|>\nreverse: c d\n<|assistant|>\nd c{EOS_TOKEN}")
    assert tokenizer.decode([token for token, target in zip(ids, mask) if target]) == f"b a{EOS_TOKEN}d c{EOS_TOKEN}"
    prompt = renderer.prompt_ids(sample)
    assert ids[: len(prompt)] == prompt and tokenizer.decode(ids[len(prompt) :]) == f"d c{EOS_TOKEN}"
    assert tokenizer.decode(prompt).endswith("<|assistant|>\n") and sample.reference == "d c"


def test_chat_template_of_the_tokenizer_renders_and_marks_its_answer_span(tokenizers):
    tokenizer = load_tokenizer(tokenizers["chat"])
    renderer = ChatRenderer(tokenizer)
    sample = Sample("x", (("user", "reverse: apple river"), ("assistant", "river apple")))
    ids, mask = renderer.render(sample)
    assert renderer.template == CHAT_TEMPLATE
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(sample.messages(), tokenize=False)
    assert tokenizer.decode([token for token, target in zip(ids, mask) if target]) == f"river apple{EOS_TOKEN}\n"
    prompt = tokenizer.decode(renderer.prompt_ids(sample))
    assert prompt == tokenizer.apply_chat_template(sample.messages(1), tokenize=False, add_generation_prompt=True)


def test_a_chat_template_that_is_not_prefix_stable_is_refused(tokenizers):
    tokenizer = load_tokenizer(tokenizers["chat"])
    tokenizer.chat_template = "{% for m in messages|reverse %}{{ m['content'] }}\n{% endfor %}"
    sample = Sample("f.jsonl: line 7", (("user", "a b"), ("assistant", "b a")))
    with pytest.raises(ValueError, match=r"f.jsonl: line 7: the tokenizer's chat template is not prefix-stable"):
        ChatRenderer(tokenizer).render(sample)


def test_loader_labels_are_shifted_answer_tokens_and_train_on_prompt_targets_every_position(train_file, tokenizers, tmp_path):
    for tokenizer in ("plain", "chat"):
        dm = datamodule(train_file, tokenizers[tokenizer], tmp_path)
        eos = dm.tokenizer.eos_token_id
        batch = next(iter(dm.train_dataloader()))
        assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids", "step_targets"}
        assert all(value.dtype == torch.int64 for value in batch.values())
        assert batch["input_ids"].shape == (4, 64) and batch["step_targets"].shape == (4,)
        for row in (dict(zip(batch, values)) for values in zip(*batch.values())):
            for segment in segments(row):
                labels, inputs = segment["labels"], segment["input_ids"]
                targets = labels != -100
                assert targets[-1] and not targets[0]  # the answer ends the sample; the prompt is not learnt
                assert torch.equal(labels[:-1][targets[:-1]], inputs[1:][targets[:-1]])
                answer = dm.tokenizer.decode(labels[targets])
                assert answer.endswith(EOS_TOKEN if tokenizer == "plain" else EOS_TOKEN + "\n")
                assert answer.count(EOS_TOKEN) == 1 and "reverse" not in answer
        everything = datamodule(train_file, tokenizers["plain"], tmp_path, train_on_prompt=True)
        for segment in segments(everything.train_set[0]):
            assert (segment["labels"] != -100).all() and torch.equal(segment["labels"][:-1], segment["input_ids"][1:])
            assert segment["labels"][-1] == eos


# ---------------------------------------------------------------------------------------------------- packing


def test_first_fit_puts_each_sample_in_the_first_row_with_room():
    assert first_fit([5, 3, 4, 2, 1], 6) == [[0, 4], [1, 3], [2]]
    with pytest.raises(ValueError, match="cannot hold"):
        first_fit([7], 6)


def test_packing_keeps_samples_whole_with_restarting_positions_and_distinct_segments(train_file, tokenizers, tmp_path):
    dm = datamodule(train_file, tokenizers["plain"], tmp_path)
    renderer = ChatRenderer(dm.tokenizer)
    expected = sorted(tuple(renderer.render(sample)[0][:-1]) for sample, _ in read_samples(train_file))
    packed = []
    all_rows = rows(dm.train_set) + rows(dm.val_set)
    for row in all_rows:
        count = int(row["segment_ids"].max())
        used = int((row["segment_ids"] > 0).sum())
        assert row["segment_ids"][:used].tolist() == sorted(row["segment_ids"][:used].tolist())  # contiguous 1, 2, ...
        assert (row["segment_ids"][used:] == 0).all() and (row["labels"][used:] == -100).all()
        assert (row["input_ids"][used:] == dm.tokenizer.eos_token_id).all() and (row["position_ids"][used:] == 0).all()
        assert [int(s) for s in row["segment_ids"][:used].unique()] == list(range(1, count + 1))
        for segment in segments(row):
            assert segment["position_ids"].tolist() == list(range(len(segment["position_ids"])))
            packed.append(tuple(segment["input_ids"].tolist()))
    assert sorted(packed) == expected  # every sample exactly once, whole
    assert len(all_rows) < len(expected) / 2


def test_without_packing_each_row_is_one_padded_sample(train_file, tokenizers, tmp_path):
    dm = datamodule(train_file, tokenizers["plain"], tmp_path, packing=False)
    all_rows = rows(dm.train_set) + rows(dm.val_set)
    assert len(all_rows) == 120
    for row in all_rows:
        length = int((row["segment_ids"] == 1).sum())
        assert row["segment_ids"].max() == 1 and row["segment_ids"][:length].eq(1).all()
        assert row["position_ids"][:length].tolist() == list(range(length)) and (row["labels"][length:] == -100).all()


def test_too_long_samples_are_truncated_or_dropped_counted_and_reported_once(tmp_path, tokenizers, monkeypatch):
    reported = []
    monkeypatch.setattr(sft, "rank_zero_info", reported.append)
    long = {"prompt": "reverse: " + " ".join(WORDS[:4]), "completion": " ".join(WORDS * 4)}
    late = {"prompt": "reverse: " + " ".join(WORDS * 6), "completion": "apple"}  # its answer starts past seq_len
    path = write_lines(tmp_path / "long.jsonl", samples(40) + [long, late])
    truncated = datamodule(path, tokenizers["plain"], tmp_path, seq_len=48)
    stats = truncated.stats[str(path)]
    assert (stats["truncated"], stats["dropped"], stats["samples"]) == (1, 1, 41)
    assert [line for line in reported if line.startswith("long.jsonl:")] == [
        f"long.jsonl: 41 samples in {stats['rows']} rows of 48 ({stats['positions'] / stats['rows'] / 48:.0%} filled, "
        f"{stats['targets']} targets); 0 without an assistant turn skipped, 1 longer than --data.seq_len truncated, 1 dropped"
    ]
    long_sample = Sample("x", (("user", long["prompt"]), ("assistant", long["completion"])))
    cut = ChatRenderer(truncated.tokenizer).render(long_sample)[0][:48]
    full_rows = [row for row in rows(truncated.train_set) + rows(truncated.val_set) if (row["segment_ids"] > 0).all()]
    assert any(row["input_ids"].tolist() == cut and row["segment_ids"].eq(1).all() for row in full_rows)  # its start kept
    dropped = datamodule(path, tokenizers["plain"], tmp_path, seq_len=48, too_long="drop").stats[str(path)]
    assert (dropped["truncated"], dropped["dropped"], dropped["samples"]) == (0, 2, 40)


# ---------------------------------------------------------------------------------------------------- step targets


def micro_batches(dm: SFTDataModule) -> list[dict[str, torch.Tensor]]:
    return list(dm.train_dataloader())


def test_sampler_order_is_the_resumable_samplers(train_file, tokenizers, tmp_path):
    dataset = datamodule(train_file, tokenizers["plain"], tmp_path).train_set
    for world, shuffle, epoch in ((1, True, 0), (3, True, 2), (2, False, 1)):
        for rank in range(world):
            plain = ResumableSampler(dataset, world, rank, seed=5, shuffle=shuffle)
            ours = StepTargetSampler(dataset, world, rank, 5, shuffle, batch_size=2, accumulate=1)
            plain.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert [index for index, _ in ours] == list(plain) and len(ours) == len(plain)


def test_step_targets_are_the_same_on_one_and_two_processes_and_count_the_global_batch(train_file, tokenizers, tmp_path):
    one = micro_batches(datamodule(train_file, tokenizers["plain"], tmp_path, batch_size=8, trainer=fake_trainer()))
    ranks = [micro_batches(datamodule(train_file, tokenizers["plain"], tmp_path, trainer=fake_trainer(2, rank)))
             for rank in range(2)]
    assert len(one) == len(ranks[0]) == len(ranks[1]) > 3
    for single, *pair in zip(one, *ranks):
        targets = int((single["labels"] != -100).sum())
        assert targets == sum(int((batch["labels"] != -100).sum()) for batch in pair)
        assert single["step_targets"].tolist() == [targets] * 8
        assert all(batch["step_targets"].tolist() == [targets] * 4 for batch in pair)
        assert sorted(map(tuple, single["input_ids"].tolist())) == sorted(
            tuple(row) for batch in pair for row in batch["input_ids"].tolist())


@pytest.mark.parametrize("limit", [1.0, 5])
def test_step_targets_sum_over_the_accumulated_micro_batches_of_all_ranks(train_file, tokenizers, tmp_path, limit):
    ranks = [micro_batches(datamodule(train_file, tokenizers["plain"], tmp_path, batch_size=2,
                                      trainer=fake_trainer(2, rank, accumulate=4, limit_train_batches=limit)))
             for rank in range(2)]
    run = len(ranks[0]) if limit == 1.0 else limit
    assert run % 4  # the epoch ends with a shorter step
    for step in range(0, run, 4):
        group = [batch for rank in ranks for batch in rank[step : min(step + 4, run)]]
        total = sum(int((batch["labels"] != -100).sum()) for batch in group)
        assert all(batch["step_targets"].tolist() == [total] * 2 for batch in group)
    val = list(datamodule(train_file, tokenizers["plain"], tmp_path, batch_size=2,
                          trainer=fake_trainer(1, 0, accumulate=4)).val_dataloader())
    assert all(batch["step_targets"].tolist() == [int((batch["labels"] != -100).sum())] * 2 for batch in val)


def test_resume_mid_epoch_yields_the_same_remaining_batches_with_workers(train_file, tokenizers, tmp_path):
    def build(**overrides):
        return datamodule(train_file, tokenizers["plain"], tmp_path, batch_size=2,
                          trainer=fake_trainer(1, 0, accumulate=2), **overrides)

    full = micro_batches(build())
    first = build()
    for batch in full[:6]:
        first.on_after_batch_transfer(batch, 0)
    resumed = build(num_workers=2)
    resumed.load_state_dict(first.state_dict())
    rest = micro_batches(resumed)
    assert len(rest) == len(full) - 6
    for expected, got in zip(full[6:], rest):
        assert all(torch.equal(expected[key], got[key]) for key in expected)


# ---------------------------------------------------------------------------------------------------- cache, tokenizer


def test_second_setup_reuses_the_cache_without_rendering_again(train_file, tokenizers, tmp_path, monkeypatch):
    first = datamodule(train_file, tokenizers["plain"], tmp_path)

    def no_render(*args, **kwargs):
        raise AssertionError("rendered again")

    monkeypatch.setattr(ChatRenderer, "encode", no_render)
    again = datamodule(train_file, tokenizers["plain"], tmp_path)
    assert again.train_set.directory == first.train_set.directory
    assert torch.equal(again.train_set[3]["input_ids"], first.train_set[3]["input_ids"])
    with pytest.raises(AssertionError, match="rendered again"):  # another seq_len is another cache
        datamodule(train_file, tokenizers["plain"], tmp_path, seq_len=80)
    with pytest.raises(AssertionError, match="rendered again"):  # and so is a chat template
        datamodule(train_file, tokenizers["chat"], tmp_path)


def test_tokenizer_defaults_to_the_models_pretrained_folder_and_is_required_without_one(train_file, tokenizers, tmp_path):
    dm = datamodule(train_file, None, tmp_path, trainer=fake_trainer(pretrained_path=str(tokenizers["chat"])))
    assert dm.tokenizer.chat_template == CHAT_TEMPLATE and dm.vocab_size == len(dm.tokenizer)
    with pytest.raises(ValueError, match="--data.tokenizer_path is not set and there is no --model.pretrained_path"):
        datamodule(train_file, None, tmp_path, trainer=fake_trainer())


# ---------------------------------------------------------------------------------------------------- the sample task


def make_sft_data():
    spec = importlib.util.spec_from_file_location("make_sft_data", REPO / "scripts" / "make_sft_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reverse_words_task_is_deterministic_exact_and_mixes_both_formats(tmp_path):
    script = make_sft_data()
    script.main(["--out", str(tmp_path / "a")])
    shipped = REPO / "lit_fsdp" / "data" / "samples" / "reverse_words"
    for name, count in (("train.jsonl", 4000), ("val.jsonl", 200)):
        assert (tmp_path / "a" / name).read_bytes() == (shipped / name).read_bytes()  # the shipped files, regenerated
        read = [sample for sample, _ in read_samples(shipped / name)]
        assert len(read) == count
        for sample in read:
            words = sample.turns[-2][1].removeprefix("reverse: ").split()
            assert 3 <= len(words) <= 6 and sample.reference == " ".join(reversed(words))
    lines = (shipped / "train.jsonl").read_text().splitlines()
    assert any('"prompt"' in line for line in lines) and any('"system"' in line for line in lines)
    assert any('"messages":[{"role":"user"' in line for line in lines)
    train_prompts = {sample.turns[-2][1] for sample, _ in read_samples(shipped / "train.jsonl")}
    assert not train_prompts & {sample.turns[-2][1] for sample, _ in read_samples(shipped / "val.jsonl")}
    script.main(["--out", str(tmp_path / "b"), "--train", "30", "--val", "5", "--seed", "3"])
    assert (tmp_path / "b" / "train.jsonl").read_bytes() != (tmp_path / "a" / "train.jsonl").read_bytes()
