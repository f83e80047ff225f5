"""A fake OpenAI-compatible engine for the router's tests (a thread, a free 127.0.0.1 port).

``POST /v1/chat/completions`` and ``/v1/completions`` answer ``tokens``
tokens (streamed as SSE or as one JSON body), after ``first_byte_delay_s``
and ``token_delay_s`` between tokens (a stream gets an SSE comment, ``:
keep-alive``, every ``keep_alive_s`` of that wait, when set). ``GET /health`` answers 200 unless
``healthy`` is False; ``/metrics`` reports ``running`` requests;
``/kv_events`` serves the batches added with ``publish`` (the engine's
format, docs/router.md). ``kill()`` closes the listener and every open
connection (a crashed engine); ``restart()`` listens again on the same port.
What each request asked and whether its client went away is recorded.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from kvtier.keys import CacheNamespace


class FakeEngine:
    def __init__(
        self,
        name: str,
        *,
        tokens: int = 3,
        first_byte_delay_s: float = 0.0,
        token_delay_s: float = 0.0,
        namespace: CacheNamespace | None = None,
        port: int = 0,
    ) -> None:
        self.name = name
        self.tokens = tokens
        self.first_byte_delay_s = first_byte_delay_s
        self.token_delay_s = token_delay_s
        self.keep_alive_s = 0.0
        self.namespace = namespace
        self.healthy = True
        self.api_key: str | None = None  # every route but /health and /metrics needs it
        self.requests: list[dict[str, Any]] = []
        self.aborted = 0  # streams whose client went away before the end
        self.running = 0
        self.extra_load = 0  # added to the running count /metrics reports
        self.extra_metrics = ""  # more Prometheus text /metrics reports
        self.engine_id = uuid.uuid4().hex
        self.events: list[dict[str, Any]] = []  # {"seq", "type", "keys"}
        self.lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._port = port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> None:
        httpd = ThreadingHTTPServer(("127.0.0.1", self._port), _handler(self))
        httpd.daemon_threads = True
        self._port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def kill(self) -> None:
        """Stops listening and resets every open connection."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        with self.lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._httpd = None

    def restart(self) -> None:
        """Listens again on the same port (a new engine run: new engine id, no events)."""
        self.engine_id = uuid.uuid4().hex
        with self.lock:
            self.events = []
        self.start()

    def close(self) -> None:
        self.kill()

    def publish(self, kind: str, keys: list[bytes]) -> None:
        with self.lock:
            self.events.append(
                {"seq": len(self.events) + 1, "type": kind, "keys": [k.hex() for k in keys]}
            )

    def served(self) -> int:
        with self.lock:
            return len(self.requests)

    def kv_page(self, after: int, engine_id: str | None) -> dict[str, Any]:
        with self.lock:
            events = list(self.events)
        reset = engine_id not in (None, self.engine_id) or after > len(events)
        page: dict[str, Any] = {
            "engine_id": self.engine_id,
            "namespace": self.namespace.to_json() if self.namespace else None,
            "block_size": 16,
            "reset": reset,
            "last_seq": len(events),
            "events": [] if reset else events[after:],
        }
        if reset:
            stored: set[str] = set()
            for e in events:
                if e["type"] == "stored":
                    stored.update(e["keys"])
                elif e["type"] == "evicted":
                    stored.difference_update(e["keys"])
            page["snapshot"] = {"stored": sorted(stored), "saved": []}
        return page


def _handler(fake: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            with fake.lock:
                fake._conns.add(self.connection)

        def finish(self) -> None:
            with fake.lock:
                fake._conns.discard(self.connection)
            with contextlib.suppress(OSError):
                super().finish()

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _client_gone(self) -> bool:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            try:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _wait(self, s: float) -> None:
            end = time.monotonic() + s
            while fake.keep_alive_s > 0 and end - time.monotonic() > fake.keep_alive_s:
                time.sleep(fake.keep_alive_s)
                self._write(b": keep-alive\n\n")
            time.sleep(max(0.0, end - time.monotonic()))

        def _write(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _refused(self, path: str) -> bool:
            if fake.api_key is None or path in ("/health", "/metrics"):
                return False
            if self.headers.get("Authorization") == f"Bearer {fake.api_key}":
                return False
            if self.command == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(401, b'{"error": {"message": "bad key", "code": "invalid_api_key"}}')
            return True

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if self._refused(url.path):
                return
            if url.path == "/health":
                ok = fake.healthy
                self._send(
                    200 if ok else 503, json.dumps({"status": "ok" if ok else "down"}).encode()
                )
            elif url.path == "/metrics":
                load = fake.running + fake.extra_load
                text = f"# TYPE kvtier_engine_requests_running gauge\nkvtier_engine_requests_running {load}\n"
                text += fake.extra_metrics
                self._send(200, text.encode(), "text/plain; version=0.0.4")
            elif url.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode())
            elif url.path == "/kv_events":
                if fake.namespace is None:
                    self._send(404, b'{"error": {"message": "no events"}}')
                    return
                q = parse_qs(url.query)
                page = fake.kv_page(int(q.get("after", ["0"])[0]), q.get("engine_id", [None])[0])
                if not page["events"] and not page["reset"]:
                    time.sleep(min(0.2, float(q.get("wait_s", ["0"])[0])))
                    page = fake.kv_page(
                        int(q.get("after", ["0"])[0]), q.get("engine_id", [None])[0]
                    )
                self._send(200, json.dumps(page).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            if self._refused(urlparse(self.path).path):
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.requests.append(body)
                fake.running += 1
            try:
                self._answer(body)
            except OSError:
                with fake.lock:
                    fake.aborted += 1
            finally:
                with fake.lock:
                    fake.running -= 1

        def _answer(self, body: dict[str, Any]) -> None:
            time.sleep(fake.first_byte_delay_s)
            n = int(body.get("max_tokens") or fake.tokens)
            n = min(n, fake.tokens)
            chat = "messages" in body
            if not body.get("stream"):
                for _ in range(n):
                    time.sleep(fake.token_delay_s)
                    if self._client_gone():
                        raise OSError("the client closed the connection")
                text = "".join(f" {fake.name}{i}" for i in range(n))
                choice = {"index": 0, "finish_reason": "length"}
                choice.update(
                    {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
                )
                self._send(200, json.dumps({"choices": [choice], "engine": fake.name}).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(n):
                if i:
                    self._wait(fake.token_delay_s)
                delta = {"content": f" {fake.name}{i}"} if chat else None
                choice = (
                    {"index": 0, "delta": delta}
                    if chat
                    else {"index": 0, "text": f" {fake.name}{i}"}
                )
                self._write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self._write(b"data: [DONE]\n\n")
            self._write(b"")

    return Handler
