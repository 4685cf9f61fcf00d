"""Chat samples for supervised fine-tuning: read from a JSON Lines file or a JSON array, rendered to token ids
with a mask of the tokens the model learns to produce.

A sample is ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}`` or
``{"prompt": "...", "completion": "..."}`` (one user turn, then one assistant turn); other keys are ignored.

Rendering uses the tokenizer's own chat template when it has one, else this plain template (the byte-level
BPEs lit_fsdp trains have none)::

    <|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{assistant}<eos><|user|>\\n...

where ``<eos>`` is the tokenizer's eos token id, appended as an id. The targets are each assistant turn's
answer: its content and eos (plain), or whatever the template writes after the generation prompt up to the
next turn (its content and end-of-turn marker). A conversation is rendered turn by turn and each piece is
tokenised on its own, so a target span is exact whatever the tokenizer merges across a turn's boundary, and
``prompt_ids`` (for generation) is a true prefix of what training saw.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from lit_fsdp.data.corpus import first_char

ROLES = ("system", "user", "assistant")
#: The template used when the tokenizer has no chat template; part of the token cache's key.
PLAIN_TEMPLATE = "plain-v1: <|role|>\\n{content}\\n per turn; assistant: <|assistant|>\\n{content}<eos>"
#: The plain template as a Jinja chat template, for the Hugging Face export of a run rendered with it:
#: ``apply_chat_template`` then renders the text ``ChatRenderer`` renders, each answer followed by the eos token.
PLAIN_JINJA = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '<|assistant|>\\n' + message['content'] + eos_token }}"
    "{%- else -%}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class Sample:
    """One conversation: ``(role, content)`` turns, and where it was read (``path: line 12``)."""

    where: str
    turns: tuple[tuple[str, str], ...]

    @property
    def has_answer(self) -> bool:
        return any(role == "assistant" for role, _ in self.turns)

    @property
    def reference(self) -> str:
        """The last assistant turn's content: the answer an evaluation compares a generation with."""
        answers = [content for role, content in self.turns if role == "assistant"]
        if not answers:
            raise ValueError(f"{self.where}: the sample has no assistant turn, so no reference answer")
        return answers[-1]

    def messages(self, count: int | None = None) -> list[dict[str, str]]:
        """The first ``count`` turns (all by default) as ``apply_chat_template`` takes them."""
        return [{"role": role, "content": content} for role, content in self.turns[:count]]


# ---------------------------------------------------------------------------------------------------- reading


def read_samples(path: Path) -> Iterator[tuple[Sample, int]]:
    """Each sample of ``path`` with the bytes of the file read so far (for progress), in file order.

    Raises a one-line ``ValueError`` naming the file and line of the first malformed sample.
    """
    records = _array_records(path) if first_char(path) == "[" else _line_records(path)
    for line, record, bytes_read in records:
        yield parse_sample(record, f"{path}: line {line}"), bytes_read


def _line_records(path: Path) -> Iterator[tuple[int, Any, int]]:
    with open(path, "rb") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():  # blank, or a lone "\r" of a CRLF file
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{path}: line {number} is not JSON ({_reason(error)}); JSON Lines needs one "
                                 "sample object per line") from None
            yield number, record, file.tell()


def _array_records(path: Path) -> Iterator[tuple[int, Any, int]]:
    # Fine-tuning sets are small enough to read whole; decoding record by record gives each one's line.
    text = path.read_bytes().decode("utf-8-sig")
    total, decoder, line, counted = path.stat().st_size, json.JSONDecoder(), 1, 0
    at = _skip_space(text, text.index("[") + 1)
    if text.startswith("]", at):
        return
    while True:
        line, counted = line + text.count("\n", counted, at), at
        try:
            record, at = decoder.raw_decode(text, at)
        except ValueError as error:
            raise ValueError(f"{path}: line {getattr(error, 'lineno', line)} is not JSON ({_reason(error)}); "
                             "give a JSON array of sample objects") from None
        yield line, record, round(total * at / max(len(text), 1))
        at = _skip_space(text, at)
        if text.startswith("]", at) and not text[at + 1 :].strip():
            return
        if not text.startswith(",", at):
            where = line + text.count("\n", counted, at)
            raise ValueError(f"{path}: line {where} is not JSON (expected ',' or ']' after a sample); "
                             "give a JSON array of sample objects")
        at = _skip_space(text, at + 1)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _reason(error: Exception) -> str:
    """The decoder's whole first line: a ``JSONDecodeError``'s ``msg`` alone ends in "at", its position cut off."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def parse_sample(record: Any, where: str) -> Sample:
    """The ``Sample`` of one JSON record read at ``where``, or a one-line ``ValueError`` saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a sample is a JSON object, found {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ValueError(f"{where}: 'messages' is a {type(messages).__name__}; give a list of "
                             '{"role", "content"} objects')
        turns = []
        for number, message in enumerate(messages):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise ValueError(f"{where}: message {number} has role {role!r}; a role is one of {', '.join(ROLES)}")
            content = message.get("content")
            if not isinstance(content, str):
                raise ValueError(f"{where}: message {number} ({role}) has content of type {type(content).__name__}; "
                                 "content must be a string")
            turns.append((role, content))
        return Sample(where, tuple(turns))
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise ValueError(f"{where}: '{key}' is {type(record.get(key)).__name__}, not a string; a prompt/completion "
                                 "sample needs both as strings")
        return Sample(where, (("user", record["prompt"]), ("assistant", record["completion"])))
    raise ValueError(f"{where}: the sample has neither 'messages' nor 'prompt' and 'completion' "
                     f"(keys: {', '.join(map(str, record)) or 'none'}); give one of the two formats")


# ---------------------------------------------------------------------------------------------------- rendering

#: One piece of a rendered conversation: its text, whether its tokens are targets, whether eos follows it.
Piece = tuple[str, bool, bool]


class ChatRenderer:
    """Token ids and target masks of samples, through ``tokenizer``'s chat template or the plain template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; a plain-template answer ends with it, so use one that defines it")
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.template: str | None = template if isinstance(template, str) and template else None

    @property
    def template_identity(self) -> str:
        """What identifies the rendering, for cache keys."""
        return self.template or PLAIN_TEMPLATE

    def pieces(self, sample: Sample) -> list[Piece]:
        """The conversation as pieces, consecutive non-target ones merged; an answer is one target piece."""
        pieces = self._template_pieces(sample) if self.template else self._plain_pieces(sample)
        merged: list[Piece] = []
        for text, target, eos in pieces:
            if merged and not target and not merged[-1][1] and not merged[-1][2]:
                merged[-1] = (merged[-1][0] + text, False, eos)
            else:
                merged.append((text, target, eos))
        return merged

    @staticmethod
    def _plain_pieces(sample: Sample) -> list[Piece]:
        pieces = []
        for role, content in sample.turns:
            if role == "assistant":
                pieces += [("<|assistant|>\n", False, False), (content, True, True)]
            else:
                pieces.append((f"<|{role}|>\n{content}\n", False, False))
        return pieces

    def _template_pieces(self, sample: Sample) -> list[Piece]:
        pieces, done = [], ""
        for count, (role, _) in enumerate(sample.turns, start=1):
            if role == "assistant":
                if count == 1:
                    raise ValueError(f"{sample.where}: the conversation starts with an assistant turn, which the "
                                     "tokenizer's chat template cannot render as an answer; start it with a user turn")
                header = self._apply(sample, count - 1, generation_prompt=True)
                pieces.append((self._after(done, header, sample), False, False))
                done = header
            rendered = self._apply(sample, count, generation_prompt=False)
            pieces.append((self._after(done, rendered, sample), role == "assistant", False))
            done = rendered
        return pieces

    def _apply(self, sample: Sample, count: int, generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                sample.messages(count), tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as error:  # jinja's TemplateError, or whatever the template raises
            reason = " ".join(str(error).split())
            raise ValueError(f"{sample.where}: the tokenizer's chat template refused the conversation: {reason}") from None

    @staticmethod
    def _after(prefix: str, text: str, sample: Sample) -> str:
        if not text.startswith(prefix):
            raise ValueError(
                f"{sample.where}: the tokenizer's chat template is not prefix-stable (rendering the first turns does not "
                "begin the rendering of more turns), so answer tokens cannot be told apart; use a tokenizer whose "
                "template renders a conversation as its turns in order, or one without a template"
            )
        return text[len(prefix) :]

    def encode(self, samples: list[Sample]) -> list[tuple[list[int], list[bool]]]:
        """``(token ids, target mask)`` of each sample; the pieces of all samples are tokenised in one batch."""
        out = []
        for pieces in self._piece_ids(samples):
            ids = [token for piece, _ in pieces for token in piece]
            mask = [target for piece, target in pieces for _ in piece]
            out.append((ids, mask))
        return out

    def _piece_ids(self, samples: list[Sample]) -> list[list[tuple[list[int], bool]]]:
        """Each sample's pieces as ``(token ids, is target)``."""
        pieces = [self.pieces(sample) for sample in samples]
        texts = [text for sample_pieces in pieces for text, _, _ in sample_pieces]
        # verbose=False: a long conversation is not an error here, the packer truncates or drops it.
        encoded = iter(self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
                       if texts else [])
        eos = self.tokenizer.eos_token_id
        return [[(next(encoded) + ([eos] if with_eos else []), target) for _, target, with_eos in sample_pieces]
                for sample_pieces in pieces]

    def render(self, sample: Sample) -> tuple[list[int], list[bool]]:
        """The token ids of ``sample`` and which of them are targets (the assistant's answers)."""
        return self.encode([sample])[0]

    def generation_ids(self, turns: Sequence[tuple[str, str]]) -> list[int]:
        """The tokens a model answering the conversation ``turns`` ((role, content), the last the user's) is given:
        the turns token for token as training rendered them, then the assistant's header (the generation prompt)."""
        return self.prompt_ids(Sample("the conversation", (*turns, ("assistant", ""))))

    def prompt_ids(self, sample: Sample) -> list[int]:
        """The tokens before the last assistant answer (its header included): what a model is given to generate that
        answer, token for token what training saw before it. ``sample.reference`` is the answer's text."""
        pieces = self._piece_ids([sample])[0]
        targets = [number for number, (_, target) in enumerate(pieces) if target]
        if not targets:
            raise ValueError(f"{sample.where}: the sample has no assistant turn to generate")
        return [token for piece, _ in pieces[: targets[-1]] for token in piece]


def recorded_renderer(tokenizer: PreTrainedTokenizerBase, template: str) -> ChatRenderer:
    """The renderer of a run whose samples were rendered with ``template`` (its ``template_identity``, which a
    checkpoint records); ``tokenizer`` is given that template, or none for the plain one."""
    tokenizer.chat_template = None if template == PLAIN_TEMPLATE else template
    return ChatRenderer(tokenizer)


def jinja_template(template: str) -> str:
    """The Jinja chat template an export's tokenizer carries for a run rendered with ``template`` (its identity)."""
    return PLAIN_JINJA if template == PLAIN_TEMPLATE else template
