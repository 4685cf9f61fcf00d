"""generate on a model fine-tuned on chat: a prompt is the user's turn rendered with the training's template
and the assistant's header, without the document separator; an interactive session keeps its turns; ``--raw`` sends
the text as before. A short LoRA fine-tune of configs/sft_lora.yaml on 2 processes gives the checkpoint."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_fsdp.commands.export import export_hf
from lit_fsdp.commands.generate import continue_text, prompt_ids
from lit_fsdp.commands.main import main
from lit_fsdp.commands.trained import load_trained
from lit_fsdp.data.chat import PLAIN_JINJA, PLAIN_TEMPLATE, ChatRenderer, Sample
from lit_fsdp.data.tokenizer import load_tokenizer, tokenizer_files, train_bpe
from tests.distributed import fit_in_process, run
from tests.helpers import REPO, SFT_SAMPLES, checkpoint_every, fit_arguments, save_sft_base

STEPS = 8
QUESTION = "reverse: king water light"
EOS = "<|endoftext|>"  # train_bpe's eos token


class SaveChatLogits(pl.Callback):
    """At the end of fit, rank 0 saves the logits the training module gives for ``input_ids`` (all ranks run it)."""

    def __init__(self, path: str, input_ids: list[int]):
        self.path, self.input_ids = path, input_ids

    def on_train_end(self, trainer, pl_module):
        pl_module.eval()
        input_ids = torch.tensor([self.input_ids], device=pl_module.device)
        with torch.no_grad():  # a packed sample's positions start at 0, as here
            logits = pl_module(input_ids, position_ids=torch.arange(input_ids.shape[1]).unsqueeze(0))
        if trainer.global_rank == 0:
            torch.save(logits.float().cpu(), self.path)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("chat_generate")
    base = save_sft_base(root / "base")
    # what training gives the model before an answer to QUESTION: the SFT rows are rendered by the same renderer
    trained_prompt = ChatRenderer(load_tokenizer(base)).prompt_ids(Sample("q", (("user", QUESTION), ("assistant", "?"))))
    folder = root / "run"
    logits = {"class_path": f"{__name__}.SaveChatLogits",
              "init_args": {"path": str(root / "logits.pt"), "input_ids": trained_prompt}}
    arguments = fit_arguments(
        folder, "--config", str(REPO / "configs" / "sft_lora.yaml"), "--model.pretrained_path", str(base),
        "--trainer.max_steps", str(STEPS), "--data.batch_size", "4", "--data.seq_len", "64",
        "--trainer.limit_val_batches", "0", "--data.train_path", str(SFT_SAMPLES / "train.jsonl"),
        "--data.val_path", str(SFT_SAMPLES / "val.jsonl"), "--data.cache_dir", str(root / "cache"),
        callbacks=[checkpoint_every(STEPS, folder / "checkpoints"), logits])
    run(fit_in_process, root, [arguments])
    return SimpleNamespace(root=root, base=base, run=folder, checkpoint=folder / "checkpoints" / "last.ckpt",
                           trained_prompt=trained_prompt, logits=torch.load(root / "logits.pt"))


def recording(trained, calls: list[list[int]]):
    """``trained`` with its model's generate recording the input ids of each call."""
    generate = trained.model.generate

    def record(input_ids, **kwargs):
        calls.append(input_ids[0].tolist())
        return generate(input_ids, **kwargs)

    trained.model.generate = record
    return trained


def test_a_chat_prompt_is_the_user_turn_as_training_rendered_it_without_the_document_separator(chat_run):
    trained = load_trained(str(chat_run.run), device="cpu")
    ids = prompt_ids(trained, QUESTION)
    assert ids == chat_run.trained_prompt
    assert trained.tokenizer.decode(ids) == f"<|user|>\n{QUESTION}\n<|assistant|>\n"  # the plain template, no eos first


def test_the_first_generated_token_is_the_argmax_of_the_training_forwards_logits(chat_run):
    trained = load_trained(str(chat_run.run), device="cpu")
    new = continue_text(trained, QUESTION, lambda _: None, max_new_tokens=6, temperature=0)
    assert new[0].item() == chat_run.logits[0, -1].argmax().item()


def test_the_checkpoint_and_its_merged_export_in_plain_transformers_answer_a_chat_prompt_alike(chat_run, tmp_path):
    trained = load_trained(str(chat_run.checkpoint), device="cpu")
    ours = continue_text(trained, QUESTION, lambda _: None, max_new_tokens=8, temperature=0).tolist()
    export_hf(str(chat_run.checkpoint), str(tmp_path / "merged"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           return_dict=True, return_tensors="pt")["input_ids"]
    assert prompt[0].tolist() == chat_run.trained_prompt
    with torch.no_grad():
        output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    assert output[0, prompt.shape[1]:].tolist() == ours
    exported = load_trained(str(tmp_path / "merged"), device="cpu")  # generate on the export: a chat model too
    assert continue_text(exported, QUESTION, lambda _: None, max_new_tokens=8, temperature=0).tolist() == ours


def test_an_interactive_session_renders_every_earlier_turn_before_the_new_one(chat_run, capsys, monkeypatch):
    calls: list[list[int]] = []
    trained = recording(load_trained(str(chat_run.run), device="cpu"), calls)
    monkeypatch.setattr("lit_fsdp.commands.generate.load_trained", lambda *args, **kwargs: trained)
    monkeypatch.setattr("sys.stdin", io.StringIO("reverse: old city\nreverse: king water\n"))
    main(["generate", str(chat_run.run), "--max_new_tokens", "6", "--temperature", "0"])
    assert len(calls) == 2 and "type a message" in capsys.readouterr().err
    first = trained.tokenizer.decode(calls[0])
    answer = trained.tokenizer.decode(calls[1][len(calls[0]):]).split(EOS)[0]  # the first answer, as rendered back
    assert first == "<|user|>\nreverse: old city\n<|assistant|>\n"
    assert trained.tokenizer.decode(calls[1]) == f"{first}{answer}{EOS}<|user|>\nreverse: king water\n<|assistant|>\n"


def test_a_conversation_longer_than_the_models_positions_leaves_out_its_oldest_exchanges(chat_run, capsys, monkeypatch):
    calls: list[list[int]] = []
    trained = recording(load_trained(str(chat_run.run), device="cpu"), calls)
    trained.model.config.n_positions = 40  # 28 tokens for a question alone, 64 for the second after the first exchange
    monkeypatch.setattr("lit_fsdp.commands.generate.load_trained", lambda *args, **kwargs: trained)
    monkeypatch.setattr("sys.stdin", io.StringIO("reverse: old city\nreverse: king water\n"))
    main(["generate", str(chat_run.run), "--max_new_tokens", "6", "--temperature", "0"])
    assert trained.tokenizer.decode(calls[1]) == "<|user|>\nreverse: king water\n<|assistant|>\n"
    assert "the 1 oldest exchanges left out: the conversation outgrew the model's 40 positions" in capsys.readouterr().err


def test_raw_sends_the_text_after_the_document_separator_as_before(chat_run, capsys, monkeypatch):
    calls: list[list[int]] = []
    trained = recording(load_trained(str(chat_run.run), device="cpu"), calls)
    monkeypatch.setattr("lit_fsdp.commands.generate.load_trained", lambda *args, **kwargs: trained)
    main(["generate", str(chat_run.run), "--prompt", QUESTION, "--raw", "--max_new_tokens", "4", "--temperature", "0"])
    tokens = trained.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    assert calls == [[trained.tokenizer.eos_token_id, *tokens]]
    assert capsys.readouterr().out.startswith(QUESTION)


def test_a_checkpoint_written_before_the_template_was_recorded_is_chat_if_its_run_fine_tuned_on_chat(chat_run, tmp_path):
    """Such a checkpoint has no ``chat_template``; its run folder's config.yaml says which data it trained on."""
    tokenizer = load_tokenizer(chat_run.base)
    model = AutoModelForCausalLM.from_pretrained(chat_run.base, local_files_only=True)
    checkpoint = {"hf_config": model.config.to_dict(), "tokenizer_files": tokenizer_files(tokenizer), "seq_len": 64,
                  "state_dict": {"model." + k: v for k, v in model.state_dict().items()}}
    runs = {"sft": "lit_fsdp.data.sft.SFTDataModule", "text": "lit_fsdp.data.wikipedia.WikipediaDataModule"}
    for name, data in runs.items():
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        (tmp_path / name / "config.yaml").write_text(f"data:\n  class_path: {data}\n")
        torch.save(checkpoint, tmp_path / name / "checkpoints" / "last.ckpt")
    assert prompt_ids(load_trained(str(tmp_path / "sft"), device="cpu"), QUESTION) == chat_run.trained_prompt
    plain = load_trained(str(tmp_path / "text"), device="cpu")
    assert plain.chat is None and prompt_ids(plain, QUESTION)[0] == tokenizer.eos_token_id


def test_the_plain_templates_jinja_renders_the_text_the_renderer_tokenises():
    """An export's tokenizer carries PLAIN_JINJA: apply_chat_template gives the pieces ChatRenderer tokenises, eos
    written where the renderer appends its id, for a conversation with a system turn and two answers."""
    tokenizer = train_bpe(["reverse: a b c d Reverse. <|system|> <|user|> <|assistant|>"] * 20, 300)
    sample = Sample("s", (("system", "Reverse."), ("user", "reverse: a b"), ("assistant", "b a"),
                          ("user", "reverse: c d"), ("assistant", "d c")))
    renderer = ChatRenderer(tokenizer)
    assert renderer.template_identity == PLAIN_TEMPLATE
    expected = "".join(text + (EOS if eos else "") for text, _, eos in renderer.pieces(sample))
    assert tokenizer.apply_chat_template(sample.messages(), chat_template=PLAIN_JINJA, tokenize=False) == expected
    prompt = tokenizer.apply_chat_template(sample.messages(4), chat_template=PLAIN_JINJA, tokenize=False,
                                           add_generation_prompt=True)
    assert tokenizer(prompt, add_special_tokens=False)["input_ids"] == renderer.prompt_ids(sample)

