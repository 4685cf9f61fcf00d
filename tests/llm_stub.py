"""A local stand-in for an OpenAI-compatible chat-completions endpoint: an http.server thread on 127.0.0.1."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class StubLLM:
    """Answers every ``POST /v1/chat/completions`` with ``content`` as the assistant's message (or ``status`` with no body).

    ``requests`` holds each request's headers and JSON body. Use as a context manager; ``base_url`` is what
    ``--tune.llm.base_url`` takes.
    """

    def __init__(self, content: str = "", status: int = 200):
        self.content, self.status = content, status
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if stub.status != 200:
                    self.send_response(stub.status)
                    self.end_headers()
                    return
                answer = json.dumps({"id": "stub", "object": "chat.completion", "model": body.get("model"),
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": stub.content}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubLLM:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
