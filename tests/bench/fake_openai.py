"""A fake OpenAI-compatible streaming server for the load generator's tests.

It streams ``chat.completion.chunk`` events over chunked HTTP/1.1 on a free
127.0.0.1 port, in a thread. What a request gets is chosen by a marker
``behaviour=<name>`` in its last message, else by its ``model``:

* ``ok``: a role chunk, ``tokens`` content chunks of one token each
  (``delay_s`` apart), the last with ``finish_reason``, a usage chunk, ``[DONE]``;
* ``packed``: the same tokens, two per chunk;
* ``http500``: a 500 JSON error before any stream;
* ``drop``: three content chunks, then the connection closes mid-body;
* ``error_event``: one content chunk, an ``error`` event, ``[DONE]``;
* ``slow``: sleeps ``slow_s`` before answering.

Usage: ``prompt_tokens`` = characters of all message contents (a stand-in
for a tokenizer), ``cached_tokens`` = ``cached_fraction`` of it, rounded
down. ``GET /metrics`` serves kvtier-style counters advanced by every
completed ``ok``/``packed`` request (queries = prompt, G1 hits = cached,
external = 0), ``GET /v1/models`` lists ``fake``. Every request body is kept
in ``requests``.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAI:
    """The server; use as a context manager (``url`` is its base URL)."""

    def __init__(
        self,
        *,
        tokens: int = 5,
        delay_s: float = 0.005,
        cached_fraction: float = 0.5,
        slow_s: float = 5.0,
    ) -> None:
        self.tokens = tokens
        self.delay_s = delay_s
        self.cached_fraction = cached_fraction
        self.slow_s = slow_s
        self.requests: list[dict[str, Any]] = []
        self.queried = 0
        self.hits = 0
        self.lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def metrics_text(self) -> str:
        with self.lock:
            q, h = self.queried, self.hits
        return (
            "# HELP kvtier_engine_prefix_cache_queries_tokens_total q\n"
            "# TYPE kvtier_engine_prefix_cache_queries_tokens_total counter\n"
            f"kvtier_engine_prefix_cache_queries_tokens_total {q}.0\n"
            "# HELP kvtier_engine_prefix_cache_hit_tokens_total h\n"
            "# TYPE kvtier_engine_prefix_cache_hit_tokens_total counter\n"
            f"kvtier_engine_prefix_cache_hit_tokens_total {h}.0\n"
            "# HELP kvtier_engine_external_loaded_tokens_total e\n"
            "# TYPE kvtier_engine_external_loaded_tokens_total counter\n"
            "kvtier_engine_external_loaded_tokens_total 0.0\n"
        )


def _chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
    body = {"object": "chat.completion.chunk", "model": "fake", "choices": choices, "usage": usage}
    return f"data: {json.dumps(body)}\n\n".encode()


def _delta(content: str, finish: str | None = None) -> bytes:
    return _chunk([{"index": 0, "delta": {"content": content}, "finish_reason": finish}])


def _handler(fake: FakeOpenAI) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _write(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, fake.metrics_text().encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": "fake"}]}).encode(), "application/json")
            elif self.path == "/health":
                self._send(200, b'{"status": "ok"}', "application/json")
            else:
                self._send(404, b"{}", "application/json")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.requests.append(body)
            messages = body["messages"]
            last = messages[-1]["content"]
            behaviour = body.get("model", "ok")
            if "behaviour=" in last:
                behaviour = last.split("behaviour=", 1)[1].split()[0]
            if behaviour == "http500":
                err = {"error": {"message": "boom", "type": "server_error", "code": "engine_error"}}
                self._send(500, json.dumps(err).encode(), "application/json")
                return
            if behaviour == "slow":
                time.sleep(fake.slow_s)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._write(_chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}}]))
            if behaviour == "drop":
                for i in range(3):
                    self._write(_delta(f" t{i}"))
                self.close_connection = True
                return  # no terminating chunk: the body is cut short
            if behaviour == "error_event":
                self._write(_delta(" t0"))
                self._write(b'data: {"error": {"message": "engine stopped"}}\n\n')
                self._write(b"data: [DONE]\n\n")
                self._write(b"")
                return
            n = fake.tokens
            per_chunk = 2 if behaviour == "packed" else 1
            sent = 0
            while sent < n:
                k = min(per_chunk, n - sent)
                time.sleep(fake.delay_s)
                text = "".join(f" t{sent + j}" for j in range(k))
                sent += k
                self._write(_delta(text, "length" if sent == n else None))
            prompt = sum(len(m["content"]) for m in messages)
            cached = int(prompt * fake.cached_fraction)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": n,
                "total_tokens": prompt + n,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            with fake.lock:  # before [DONE]: a client that scrapes after it sees the counts
                fake.queried += prompt
                fake.hits += cached
            self._write(_chunk([], usage))
            self._write(b"data: [DONE]\n\n")
            self._write(b"")

    return Handler
