"""What the tuner trusts its LLM adviser with, and what it trusts from it: no key unless the user names its variable,
no plain http off this machine, no key forwarded on a redirect, and an answer's knobs checked by name and type
before anything is built from them."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lit_fsdp.commands.tune.command import parse_options
from lit_fsdp.commands.tune.controller import Budget
from lit_fsdp.commands.tune.llm import AdviserError, LLMAdviser, LLMOptions
from tests.llm_stub import StubLLM
from tests.test_tune_search import Adviser, FakeRunner, controller

SITUATION = {"diagnosis": [], "history": [], "best": {"prefetch": 0}}


# --- what the adviser sends, and where -----------------------------------------------------------------------

def test_no_key_is_read_from_the_environment_unless_the_user_names_its_variable(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "a key meant for another service")
    options = LLMOptions(base_url="http://127.0.0.1:1/v1", model="m")
    options.check()
    assert options.api_key_env is None
    with StubLLM('{"candidates": []}') as stub:
        LLMAdviser(LLMOptions(base_url=stub.base_url, model="m")).propose(SITUATION)
    assert "Authorization" not in stub.requests[0]["headers"]


def test_a_named_key_variable_that_is_unset_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("TUNE_TRUST_KEY", raising=False)
    with pytest.raises(ValueError) as error:
        parse_options(["--tune.llm.base_url", "https://llm.example/v1", "--tune.llm.model", "m",
                       "--tune.llm.api_key_env", "TUNE_TRUST_KEY"])
    assert "\n" not in str(error.value) and "TUNE_TRUST_KEY" in str(error.value) and "not set" in str(error.value)


@pytest.mark.parametrize("url", ["http://llm.example/v1", "http://10.0.0.5:8000/v1", "http://localhost.example/v1",
                                 "http://127.0.0.1@llm.example/v1"])
def test_plain_http_off_this_machine_is_refused_in_one_line_before_anything_is_sent(url):
    with pytest.raises(ValueError) as error:
        parse_options(["--tune.llm.base_url", url, "--tune.llm.model", "m"])
    message = str(error.value)
    assert "\n" not in message and url in message and "https://" in message and "127.0.0.1" in message


@pytest.mark.parametrize("url", ["http://localhost:8000/v1", "http://127.0.0.1:8000/v1", "http://[::1]:8000/v1",
                                 "https://llm.example/v1"])
def test_https_anywhere_and_http_to_this_machine_are_accepted(url):
    assert parse_options(["--tune.llm.base_url", url, "--tune.llm.model", "m"]).llm.base_url == url


class _Redirect:
    """A server that answers every POST with 302 to ``target``, and one that records the request the redirect makes."""

    def __init__(self, target: str | None = None):
        self.seen: list[dict[str, str]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(302)
                self.send_header("Location", target)
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                server.seen.append(dict(self.headers))
                self.send_response(404)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def test_the_key_is_not_forwarded_where_a_redirect_points(monkeypatch):
    monkeypatch.setenv("TUNE_TRUST_KEY", "secret")
    elsewhere = _Redirect()
    redirecting = _Redirect(target=elsewhere.url + "/stolen")
    try:
        with pytest.raises(AdviserError):
            LLMAdviser(LLMOptions(base_url=redirecting.url, model="m", api_key_env="TUNE_TRUST_KEY")).propose(SITUATION)
    finally:
        redirecting.close()
        elsewhere.close()
    assert len(elsewhere.seen) == 1 and "Authorization" not in elsewhere.seen[0]


# --- what the adviser answers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("knobs, message", [
    ({"strategy": "ddp"}, "strategy='ddp' is not accepted: strategy takes one of 'fsdp2', 'slide_fsdp'"),
    ({"micro_batch": 2.0}, "micro_batch=2.0 is not accepted: micro_batch takes an integer"),
    ({"micro_batch": True}, "micro_batch=True is not accepted: micro_batch takes an integer"),
    ({"cpu_offload": "true"}, "cpu_offload='true' is not accepted: cpu_offload takes true or false"),
    ({"prefetch": "1"}, "prefetch='1' is not accepted: prefetch takes an integer"),
    ({"replicate_size": 1.5}, "replicate_size=1.5 is not accepted: replicate_size takes an integer or null"),
    ({"sharding": None}, "sharding=None is not accepted: sharding takes one of 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', "
                         "'HYBRID_SHARD'"),
], ids=["unknown-strategy", "float-micro-batch", "bool-micro-batch", "string-flag", "string-int", "float-or-null",
        "null-literal"])
def test_an_answer_of_the_wrong_name_or_type_is_rejected_in_one_line_and_the_search_goes_on(knobs, message):
    adviser = Adviser([knobs, {"sharding": "NO_SHARD"}])
    runner = FakeRunner({})
    result = controller(runner, Budget(trials=3, patience=10), adviser=adviser).run()
    assert [change for change, _ in runner.ran] == ["same", "micro_batch=1", "sharding=NO_SHARD"]  # the good one ran
    (rejected,) = [t for t in result.trials if t.status == "rejected"]
    assert rejected.source == "llm" and "\n" not in rejected.error and rejected.error.endswith(message), rejected.error
    assert result.stop_reason == "the trial budget (3) is spent"
