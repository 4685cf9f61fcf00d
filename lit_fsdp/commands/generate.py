"""``python -m lit_fsdp generate``: continue a prompt with a trained model, printing the text as it is produced.

A model fine-tuned on chat answers the prompt as the user's turn, rendered with the template of its training; a model
trained on plain text (or ``--raw``) continues the prompt as the start of a new document.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import torch
from transformers import TextStreamer

from lit_fsdp.commands.evaluate import end_of_turn, stop_tokens
from lit_fsdp.commands.trained import DType, Trained, load_trained
from lit_fsdp.data.chat import Sample

#: A conversation's turns so far, (role, content), as ``ChatRenderer.generation_ids`` takes them.
Turns = Sequence[tuple[str, str]]


class _Stream(TextStreamer):
    """Hands each piece of decoded text to ``write`` as soon as it forms whole words (TextStreamer prints it)."""

    def __init__(self, trained: Trained, write: Callable[[str], None]):
        super().__init__(trained.tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.write = write

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.write(text + ("\n" if stream_end else ""))


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """Fail on settings ``generate`` would reject or silently misread."""
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens {max_new_tokens} must be at least 1")
    if temperature < 0:
        raise ValueError(f"--temperature {temperature} must be >= 0 (0: always the most likely token)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top_p {top_p} must be in (0, 1] (1: no nucleus cut)")
    if top_k < 0:
        raise ValueError(f"--top_k {top_k} must be >= 0 (0: no top-k cut)")


def prompt_ids(trained: Trained, prompt: str, raw: bool = False, history: Turns = ()) -> list[int]:
    """The token ids generation starts from.

    For a chat fine-tune, ``prompt`` is the user's turn after ``history``, rendered with the training's template and
    followed by the assistant's header. Otherwise, or with ``raw``, it starts a new document: it follows the eos token
    that separates documents in training.
    """
    if trained.chat is not None and not raw:
        return trained.chat.generation_ids([*history, ("user", prompt)])
    tokenizer = trained.tokenizer
    return [tokenizer.eos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]


def continue_text(
    trained: Trained,
    prompt: str,
    write: Callable[[str], None],
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 50,
    seed: int = 1234,
    raw: bool = False,
    history: Turns = (),
) -> torch.Tensor:
    """Generate after ``prompt`` (and the conversation ``history`` of a chat fine-tune, see ``prompt_ids``), passing
    the text to ``write`` piece by piece; returns the new token ids, up to the end of the document or the answer."""
    tokenizer, model = trained.tokenizer, trained.model
    input_ids = torch.tensor([prompt_ids(trained, prompt, raw, history)], device=model.device)
    length = input_ids.shape[1] + max_new_tokens
    if trained.positions is not None and length > trained.positions:
        raise ValueError(
            f"the prompt's {input_ids.shape[1]} tokens and --max_new_tokens {max_new_tokens} exceed the model's "
            f"{trained.positions} positions; shorten the prompt or lower --max_new_tokens"
        )
    stops: int | list[int] = tokenizer.eos_token_id
    if trained.chat is not None and not raw:  # an answer also ends with its template's end of turn, read off an exchange
        exchange = Sample("an exchange", (("user", "?"), ("assistant", "!")))
        stops = sorted(stop_tokens(trained, end_of_turn(trained.chat, exchange)))
    sampling = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    torch.manual_seed(seed)  # the same seed, prompt and settings give the same text
    with torch.inference_mode():
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=stops,
            pad_token_id=tokenizer.eos_token_id,
            use_cache=True,
            streamer=_Stream(trained, write),
            **sampling,
        )
    return output[0, input_ids.shape[1] :]


def generate(
    checkpoint: str,
    prompt: str | None = None,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_p: float = 1.0,
    top_k: int = 50,
    seed: int = 1234,
    device: str = "auto",
    dtype: DType = "float32",
    tokenizer_path: str | None = None,
    raw: bool = False,
) -> None:
    """Continue a prompt with a trained model, printing the text as it comes; without --prompt, ask for prompts.

    A model fine-tuned on chat data answers each prompt as the user's turn, rendered with its training's chat
    template; asked for prompts, it keeps the conversation (every earlier turn is rendered before the new one).

    Args:
        checkpoint: A run folder (its checkpoints/last.ckpt), a checkpoint written by fit (a sharded folder is
            consolidated on load) or a Hugging Face folder with its tokenizer.
        prompt: Text to continue. Without it, prompts are read one per line until the end of input (Ctrl-D).
        max_new_tokens: Tokens to generate after the prompt (fewer if the model ends the document).
        temperature: Sampling temperature; 0 takes the most likely token every time (greedy).
        top_p: Sample from the most likely tokens whose probabilities add up to top_p (1: no cut).
        top_k: Sample from the top_k most likely tokens (0: no cut).
        seed: Seed of the sampling: the same seed, prompt and settings give the same text.
        device: auto (the GPU if there is one, else the CPU), cpu, cuda or cuda:N.
        dtype: Dtype of the weights on the device.
        tokenizer_path: Tokenizer folder to use instead of the one the run trained with.
        raw: Send the prompt as it is, after the document separator, as to a model trained on plain text (the default
            for one); without it, a model fine-tuned on chat gets each prompt as a user turn of its chat template.
    """
    check_sampling(max_new_tokens, temperature, top_p, top_k)
    trained = load_trained(checkpoint, device, dtype, tokenizer_path)
    settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    raw=raw)
    chat = trained.chat is not None and not raw
    if prompt is not None:
        _print(prompt + ("\n" if chat else ""))
        _timed(lambda: continue_text(trained, prompt, _print, **settings))
        return
    kind = "a message" if chat else "a prompt"
    print(f"{trained.source} on {trained.model.device}: type {kind} and press Enter; Ctrl-D ends", file=sys.stderr)
    history: list[tuple[str, str]] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        if line.strip():
            history = _fitting(trained, line, history, max_new_tokens)
            answer = _timed(lambda: continue_text(trained, line, _print, history=history, **settings))
            if chat:
                history += [("user", line), ("assistant", trained.tokenizer.decode(answer, skip_special_tokens=True))]


def _fitting(trained: Trained, line: str, history: list[tuple[str, str]], max_new_tokens: int) -> list[tuple[str, str]]:
    """``history`` without its oldest exchanges (a question and its answer) while ``line`` after it and the answer
    would not fit in the model's positions."""
    dropped, limit = 0, trained.positions
    while history and limit is not None and len(prompt_ids(trained, line, history=history)) + max_new_tokens > limit:
        history, dropped = history[2:], dropped + 1
    if dropped:
        print(f"[the {dropped} oldest exchanges left out: the conversation outgrew the model's {trained.positions} "
              "positions]", file=sys.stderr)
    return history


def _print(text: str) -> None:
    print(text, end="", flush=True)


def _timed(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    started = time.perf_counter()
    ids = run()
    seconds = time.perf_counter() - started
    print(f"[{len(ids)} tokens in {seconds:.2f} s, {len(ids) / seconds:.1f} tokens/s]", file=sys.stderr)
    return ids
