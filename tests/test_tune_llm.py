"""The LLM adviser against a local stub of the chat-completions endpoint: what it sends, what it accepts, how it fails."""

from __future__ import annotations

import json

import pytest

from lit_fsdp.commands.tune.llm import AdviserError, LLMAdviser, LLMOptions, parse_candidates
from tests.distributed import free_port
from tests.llm_stub import StubLLM

SITUATION = {"diagnosis": [{"kind": "communication", "evidence": "30 ms exposed"}], "history": [], "best": {"prefetch": 0}}


def adviser(base_url: str, **options) -> LLMAdviser:
    return LLMAdviser(LLMOptions(base_url=base_url, model="stub-model", **options))


def test_adviser_posts_the_situation_and_reads_candidates_from_the_answer(monkeypatch):
    monkeypatch.setenv("TUNE_TEST_KEY", "secret")
    answer = 'Here you go:\n```json\n{"candidates": [{"prefetch": 1}, {"sharding": "NO_SHARD"}], "why": "overlap"}\n```'
    with StubLLM(answer) as stub:
        proposals = adviser(stub.base_url, api_key_env="TUNE_TEST_KEY", max_candidates=1).propose(SITUATION)
    assert proposals == [{"prefetch": 1}]  # at most max_candidates
    request = stub.requests[0]
    assert request["path"] == "/v1/chat/completions" and request["headers"]["Authorization"] == "Bearer secret"
    body = request["body"]
    assert body["model"] == "stub-model" and body["temperature"] == 0 and body["messages"][0]["role"] == "system"
    assert "30 ms exposed" in body["messages"][1]["content"] and "at most 1 candidates" in body["messages"][1]["content"]


def test_no_key_no_authorization_header(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with StubLLM('{"candidates": []}') as stub:
        assert adviser(stub.base_url).propose(SITUATION) == []
    assert "Authorization" not in stub.requests[0]["headers"]


@pytest.mark.parametrize("content, message", [
    ("I would try more prefetch.", "not JSON"),
    ('{"ideas": [1, 2]}', "no list of knob objects"),
    ('{"candidates": ["prefetch=1"]}', "no list of knob objects"),
])
def test_answers_that_are_not_candidates_raise_adviser_error(content, message):
    with pytest.raises(AdviserError, match=message):
        parse_candidates(content)


def test_an_http_error_or_an_unreachable_endpoint_raises_adviser_error_quickly():
    with StubLLM(status=500) as stub:
        with pytest.raises(AdviserError, match="500"):
            adviser(stub.base_url).propose(SITUATION)
    port = free_port()  # a port nobody listens on
    with pytest.raises(AdviserError, match=f"127.0.0.1:{port}"):
        adviser(f"http://127.0.0.1:{port}/v1", timeout_s=5).propose(SITUATION)


def test_options_need_url_and_model_together():
    with pytest.raises(ValueError, match="go together"):
        LLMOptions(base_url="http://localhost:8000/v1").check()
    with pytest.raises(ValueError, match="not an http"):
        LLMOptions(base_url="localhost:8000", model="m").check()
    LLMOptions().check()
    assert json.loads(adviser("http://x/v1").request(SITUATION))["model"] == "stub-model"
