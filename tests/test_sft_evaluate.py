"""evaluate on chat samples: the format is told by the first record, the loss is over the answer tokens only,
exact match compares greedy answers with the references, and the result is recorded in the run folder."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from lit_fsdp.commands import evaluate as evaluate_module
from lit_fsdp.commands.evaluate import EvaluationData, detect_format, evaluate, greedy_answers
from lit_fsdp.commands.main import main
from lit_fsdp.commands.trained import Trained, load_trained
from lit_fsdp.data.chat import ChatRenderer, read_samples
from lit_fsdp.data.sft import SFTDataModule
from lit_fsdp.data.tokenizer import tokenizer_files, train_bpe
from lit_fsdp.presets import build_config
from tests.corpus import write_parquet

WORDS = "apple river stone house city music king water light north south green old new small".split()
# the end of an answer is the eos token (one token, so generation stops there) or a marker of several tokens
TEMPLATES = {
    "eos": "{% for m in messages %}{{ '### ' + m['role'] + ':\\n' + m['content'] }}"
           "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}",
    "marker": "{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + ' <|end|>\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}",
}


def chat_records(count: int) -> list[dict]:
    """Word-reversal samples in both formats, every third with a system turn."""
    records = []
    for i in range(count):
        words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(2 + i % 5)]
        prompt, answer = "reverse: " + " ".join(words), " ".join(reversed(words))
        if i % 2:
            records.append({"prompt": prompt, "completion": answer})
        else:
            system = [{"role": "system", "content": "Reverse."}] if i % 3 == 0 else []
            records.append({"messages": system + [{"role": "user", "content": prompt},
                                                  {"role": "assistant", "content": answer}]})
    return records


def write_lines(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> dict[str, Path]:
    """A chat file; one tiny random GPT-2 as Hugging Face folders whose tokenizer has no chat template ("plain") or
    one of TEMPLATES, and as a run folder holding a checkpoint fit could have written."""
    root = tmp_path_factory.mktemp("sft_evaluate")
    tokenizer = train_bpe([json.dumps(r) for r in chat_records(60)] + ["<|user|> <|assistant|> <|end|> ### [user]"], 400)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_config("gpt2-tiny", {"vocab_size": len(tokenizer)}))
    folders = {"root": root, "chat": write_lines(root / "chat.jsonl", chat_records(12))}
    for name, template in {"plain": None, **TEMPLATES}.items():
        tokenizer.chat_template = template
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        folders[name] = root / name
    tokenizer.chat_template = None
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed_everything: 0\n")
    torch.save({"hf_config": model.config.to_dict(), "tokenizer_files": tokenizer_files(tokenizer), "seq_len": 64,
                "global_step": 7, "state_dict": {"model." + k: v for k, v in model.state_dict().items()}},
               run / "checkpoints" / "last.ckpt")
    folders["run"] = run
    return folders


def chat(place, **overrides) -> EvaluationData:
    return EvaluationData(path=str(place["chat"]), **overrides)


def test_the_format_is_told_by_the_first_record_and_other_keys_are_refused_in_one_line(place, tmp_path, capsys):
    root = place["root"]
    array = root / "chat.json"
    array.write_text(json.dumps(chat_records(3), indent=1))
    assert detect_format(place["chat"]) == detect_format(array) == "chat"
    assert detect_format(write_lines(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])) == "chat"
    assert detect_format(write_lines(tmp_path / "wiki.jsonl", [{"id": "1", "title": "T", "text": "body"}])) == "text"
    (tmp_path / "wiki.json").write_text('[{"id": "1", "text": "body"}, {"id": "2", "text": ')  # read lazily
    assert detect_format(tmp_path / "wiki.json") == "text"
    (tmp_path / "broken.jsonl").write_text('{"messages": [\n')
    assert detect_format(tmp_path / "broken.jsonl") == "text"  # whose reader names the malformed line

    other = write_lines(tmp_path / "other.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", str(place["plain"]), "--data.path", str(other)])
    errors = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(errors) == 1, errors
    assert str(other) in errors[0] and "keys question, answer" in errors[0], errors
    assert all(key in errors[0] for key in ("'text'", "'messages'", "'prompt'")), errors


def test_the_loss_is_the_mean_cross_entropy_over_the_answer_tokens_only(place):
    for name in ("plain", "eos"):
        result = evaluate(str(place[name]), chat(place), batch_size=5, device="cpu")
        trained = load_trained(str(place[name]), device="cpu")
        renderer = ChatRenderer(trained.tokenizer)
        total, count, every_token = 0.0, 0, 0.0
        with torch.no_grad():
            for sample, _ in read_samples(place["chat"]):
                ids, mask = renderer.render(sample)
                logits = trained.model(torch.tensor([ids])).logits[0, :-1]
                losses = F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")
                answer = torch.tensor(mask[1:])
                total, count = total + losses[answer].sum().item(), count + int(answer.sum())
                every_token += losses.mean().item() / 12
        assert result["samples"] == 12 and result["target_tokens"] == count
        assert result["loss"] == pytest.approx(total / count, rel=1e-5)
        assert result["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
        assert abs(result["loss"] - every_token) > 1e-3  # the prompt tokens are left out


def test_the_loss_uses_the_labels_fine_tuning_trains_on(place, tmp_path):
    """SFTDataModule's validation rows (one sample each) give the same targets and mean loss."""
    data = SFTDataModule(str(place["chat"]), val_path=str(place["chat"]), tokenizer_path=str(place["eos"]), seq_len=64,
                         batch_size=4, packing=False, cache_dir=str(tmp_path / "cache"))
    data.setup("validate")
    model = load_trained(str(place["eos"]), device="cpu").model
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            total += F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum").item()
            count += int((batch["labels"] != -100).sum())
    result = evaluate(str(place["eos"]), chat(place), seq_len=64, device="cpu")
    assert result["target_tokens"] == count and result["loss"] == pytest.approx(total / count, rel=1e-5)


def forcing(trained: Trained, answer: dict[tuple[int, ...], list[int]]) -> Trained:
    """``trained`` whose model, when generating, puts all probability on the tokens ``answer`` gives for its prompt
    (after them, eos): the real batched generation runs, with a known outcome."""
    original, eos = trained.model.forward, trained.tokenizer.eos_token_id
    state: dict = {}

    @functools.wraps(original)  # generate reads the signature
    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        input_ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if mask is None:  # not generating: the loss pass
            return out
        if input_ids.shape[1] == mask.shape[1]:  # the prompts, left-padded
            state["width"] = mask.shape[1]
            state["rows"] = [answer[tuple(row[keep.bool()].tolist())] for row, keep in zip(input_ids, mask)]
        made = mask.shape[1] - state["width"]
        out.logits[:, -1] = -1e4
        for row, tokens in enumerate(state["rows"]):
            out.logits[row, -1, tokens[made] if made < len(tokens) else eos] = 1e4
        return out

    trained.model.forward = forward
    return trained


@pytest.mark.parametrize("name", ["plain", "eos", "marker"])
def test_exact_match_is_1_when_the_model_gives_the_references_and_0_when_it_does_not(place, monkeypatch, name):
    tokenizer = load_trained(str(place[name]), device="cpu").tokenizer
    renderer = ChatRenderer(tokenizer)
    samples = [sample for sample, _ in read_samples(place["chat"])]
    closing = " <|end|> [user] more" if name == "marker" else ""  # text after the turn's end is not the answer

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    cases = {
        1.0: {tuple(renderer.prompt_ids(s)): ids(" " + s.reference + closing) for s in samples},
        0.0: {tuple(renderer.prompt_ids(s)): ids(s.reference + " extra") for s in samples},
    }
    for expected, answers in cases.items():
        monkeypatch.setattr(evaluate_module, "load_trained", lambda *a, answers=answers: forcing(load_trained(*a), answers))
        result = evaluate(str(place[name]), chat(place), batch_size=5, device="cpu")
        assert result["exact_match"] == expected and result["samples"] == len(samples)


@pytest.mark.parametrize("preset", ["gpt2-tiny", "llama-tiny"])
def test_batched_greedy_answers_are_each_prompts_own_greedy_continuation(place, preset):
    """Left-padded batches with budgets and stop tokens give what a plain greedy loop gives each prompt alone."""
    tokenizer = load_trained(str(place["plain"]), device="cpu").tokenizer
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(build_config(preset, {"vocab_size": len(tokenizer)})).eval()
    trained = Trained(model, tokenizer, place["plain"], None, None, None)
    renderer = ChatRenderer(tokenizer)
    prompts = [renderer.prompt_ids(sample) for sample, _ in read_samples(place["chat"])]
    budgets = [3 + i % 6 for i in range(len(prompts))]
    with torch.no_grad():  # the stop token: the one a prompt is most likely to produce third, so some stop early
        stop = {int(model(torch.tensor([prompts[0]])).logits[0, -1].argmax())}
        expected = []
        for prompt, budget in zip(prompts, budgets):
            tokens = list(prompt)
            while len(tokens) < len(prompt) + budget:
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
                if tokens[-1] in stop:
                    break
            expected.append([token for token in tokens[len(prompt) :] if token not in stop])
    assert greedy_answers(trained, prompts, budgets, stop, batch_size=5) == expected
    assert any(len(answer) < budget for answer, budget in zip(expected, budgets))


def test_a_chat_evaluation_is_recorded_in_the_run_folder_and_prints_examples(place, capsys):
    records = place["run"] / "evaluations.jsonl"
    before = records.read_text().count("\n") if records.exists() else 0
    main(["evaluate", str(place["run"]), "--data.path", str(place["chat"]), "--data.format", "chat",
          "--max_documents", "5", "--device", "cpu"])
    lines = records.read_text().splitlines()
    assert len(lines) == before + 1
    record = json.loads(lines[-1])
    assert {"loss", "perplexity", "target_tokens", "exact_match", "samples"} <= set(record)
    assert record["samples"] == 5 and record["step"] == 7 and record["seq_len"] == 64 and record["format"] == "chat"
    assert 0 <= record["exact_match"] <= 1 and record["perplexity"] == pytest.approx(math.exp(record["loss"]))
    assert not any("example" in key or "generated" in key for key in record)
    printed = capsys.readouterr().out
    assert printed.count("example ") == 3 and printed.count("  generated  ") == 3
    first = next(read_samples(place["chat"]))[0]
    assert f"  reference  {first.reference}" in printed and "<|assistant|>\\n" in printed
    assert f"exact match {record['exact_match']:.4f} (" in printed and f"recorded in {records}" in printed


def test_a_text_file_is_not_read_as_chat_when_told_text(place, tmp_path):
    with pytest.raises(ValueError, match="has no string 'text' field"):
        evaluate(str(place["run"]), chat(place, format="text", cache_dir=str(tmp_path)), device="cpu")


def test_chat_samples_in_parquet_give_the_json_lines_files_evaluation(place, tmp_path):
    records = [json.loads(line) for line in place["chat"].read_text().splitlines()]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_parquet(shards / "part-0.parquet", records[:5])
    write_parquet(shards / "part-1.parquet", records[5:])
    on_json = evaluate(str(place["plain"]), chat(place), batch_size=5, device="cpu")
    on_parquet = evaluate(str(place["plain"]), EvaluationData(path=str(shards)), batch_size=5, device="cpu")
    assert detect_format(shards) == "chat"
    assert {key: on_parquet[key] for key in ("samples", "target_tokens", "exact_match")} == \
        {key: on_json[key] for key in ("samples", "target_tokens", "exact_match")}
    assert on_parquet["loss"] == pytest.approx(on_json["loss"], rel=1e-6)
