"""The optional LLM adviser: the Judge's diagnosis and the trial history go to an OpenAI-compatible chat-completions
endpoint, which answers with candidate knobs as JSON.

Nothing is sent unless ``--tune.llm.base_url`` is set. The request is ``POST <base_url>/chat/completions``
with ``{"model", "messages", "temperature": 0}`` and, only when the user names the environment variable
that holds it (``--tune.llm.api_key_env``: no variable is read by default), ``Authorization: Bearer <key>``,
which is not forwarded on a redirect. Plain http is refused except to this machine (localhost, 127.0.0.1,
::1): the situation and the key would cross the network unencrypted. The answer is read from
``choices[0].message.content``, which must hold ``{"candidates": [{knob: value, ...}, ...]}`` (a fenced JSON
block is accepted). Each candidate is the best trial's knobs with the given ones changed, and goes through
the same checks as the rules' proposals; an unreachable endpoint, a timeout or an answer that is not that JSON raises
``AdviserError`` and the search goes on with the rules alone.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

SYSTEM_PROMPT = (
    "You tune the distributed training of a causal language model for throughput (tokens/s). A rule-based judge "
    "has named the bottlenecks of the best trial so far. Propose the next candidates to try: each a JSON object of "
    "knobs to change from the best trial's, using only the knobs and values of the search space. Do not repeat a "
    "tried candidate. Answer with JSON only: {\"candidates\": [{\"knob\": value, ...}, ...], \"why\": \"...\"}."
)


#: the hosts plain http may go to: this machine
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


@dataclass
class LLMOptions:
    """An OpenAI-compatible chat-completions endpoint asked for candidates before the rules'; off unless ``base_url`` is set."""

    base_url: str | None = None
    """e.g. http://localhost:8000/v1: requests go to <base_url>/chat/completions; nothing is sent without it"""
    model: str | None = None
    """the model name the endpoint serves"""
    api_key_env: str | None = None
    """environment variable that holds the API key, sent as a Bearer token (default: none; no key is sent)"""
    timeout_s: float = 60.0
    """seconds to wait for an answer before going on with the rules"""
    max_candidates: int = 3
    """candidates asked for each time"""

    def check(self) -> None:
        if (self.base_url is None) != (self.model is None):
            raise ValueError("--tune.llm.base_url and --tune.llm.model go together: give both or neither")
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--tune.llm.base_url {self.base_url!r} is not an http(s) URL")
        if self.base_url is not None and self.base_url.startswith("http://"):
            host = urllib.parse.urlsplit(self.base_url).hostname
            if host not in LOCAL_HOSTS:
                raise ValueError(f"--tune.llm.base_url {self.base_url!r} is plain http to {host}: the run's details and any "
                                 f"key would cross the network unencrypted; use https://, or http:// to "
                                 f"{', '.join(LOCAL_HOSTS)} only")
        if self.base_url is not None and self.api_key_env is not None and not os.environ.get(self.api_key_env):
            raise ValueError(f"--tune.llm.api_key_env {self.api_key_env}: that environment variable is not set or empty; "
                             "set it to the key, or leave api_key_env out to send no key")
        if self.timeout_s <= 0 or self.max_candidates < 1:
            raise ValueError("--tune.llm.timeout_s must be > 0 and --tune.llm.max_candidates >= 1")


class AdviserError(Exception):
    """The endpoint could not be reached or did not answer with candidates."""


def parse_candidates(content: str) -> list[dict[str, Any]]:
    """The ``candidates`` list of an answer's JSON (bare or in a fenced block)."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", content, re.DOTALL)
    text = fenced.group(1) if fenced else content[content.find("{"): content.rfind("}") + 1]
    try:
        answer = json.loads(text)
    except json.JSONDecodeError as error:
        raise AdviserError(f"the answer is not JSON ({error}): {content[:200]!r}") from None
    candidates = answer.get("candidates") if isinstance(answer, dict) else None
    if not isinstance(candidates, list) or not all(isinstance(c, dict) for c in candidates):
        raise AdviserError(f"the answer has no list of knob objects under 'candidates': {content[:200]!r}")
    return candidates


class LLMAdviser:
    """Asks the endpoint of ``options`` for candidates."""

    def __init__(self, options: LLMOptions):
        self.options = options

    def request(self, situation: dict[str, Any]) -> bytes:
        question = (f"Situation (JSON):\n{json.dumps(situation, indent=1, default=str)}\n\n"
                    f"Propose at most {self.options.max_candidates} candidates.")
        return json.dumps({
            "model": self.options.model, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        }).encode()

    def propose(self, situation: dict[str, Any]) -> list[dict[str, Any]]:
        """Knob changes for the next trials, from ``situation`` (hardware, model, space, history, diagnosis)."""
        url = self.options.base_url.rstrip("/") + "/chat/completions"
        request = urllib.request.Request(url, data=self.request(situation), headers={"Content-Type": "application/json"},
                                         method="POST")
        key = os.environ.get(self.options.api_key_env) if self.options.api_key_env else None
        if key:  # unredirected: urllib copies other headers to wherever a redirect points
            request.add_unredirected_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=self.options.timeout_s) as response:
                body = json.loads(response.read())
            content = body["choices"][0]["message"]["content"]
        except OSError as error:  # URLError, HTTPError and timeouts among them
            raise AdviserError(f"{url}: {error}") from None
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as error:
            raise AdviserError(f"{url} did not answer in the chat-completions format ({type(error).__name__}: {error})") from None
        return parse_candidates(content or "")[: self.options.max_candidates]
