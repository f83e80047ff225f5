"""Clients that go away, a busy server, oversized bodies, and shutdown (in-process and by SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.engine.server import ServerLimits
from kvtier.engine.server.runner import bind_listener
from tests.engine.test_server import Stack, sse_events, start_stack
from tests.engine.tiny_models import write_tiny_model

LONG_CONTEXT = 4096
PROMPT_70 = "Paged attention stores keys and values in fixed-size blocks. " * 6
# Long enough that a request cut off after its first chunk is certainly still running.
LONG_REPLY = 4000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(
        tmp_path_factory.mktemp("lifecycle") / "tiny",
        "llama",
        seed=7,
        max_position_embeddings=LONG_CONTEXT,
    )
    return path


@pytest.fixture(scope="module")
def stack(tiny: Path) -> Iterator[Stack]:
    s = start_stack(
        tiny,
        num_kv_blocks=LONG_CONTEXT // 16 + 16,
        max_model_len=LONG_CONTEXT,
        limits=ServerLimits(max_concurrent_requests=2, max_body_bytes=64 * 1024),
    )
    yield s
    s.close()


def _open(stack: Stack, path: str, body: dict[str, Any]) -> socket.socket:
    """Sends a request on a raw connection (so the test decides when it closes)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection((stack.server.host, stack.server.port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    data = b""
    while marker not in data:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed before {marker!r}: {data[:300]!r}"
        data += chunk
        assert len(data) < limit
    return data


def _long(stream: bool) -> dict[str, Any]:
    return {
        "prompt": "The quick brown fox",
        "max_tokens": LONG_REPLY,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _wait_running(stack: Stack, n: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.engine.stats().num_running < n:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.02)


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(stack: Stack) -> None:
    before = stack.wait_idle()
    sock = _open(stack, "/v1/completions", _long(stream=True))
    head = _read_until(sock, b"data: ")
    assert head.startswith(b"HTTP/1.1 200")
    sock.close()  # the client goes away after the first chunk
    after = stack.wait_idle()
    assert (after.num_running, after.num_waiting, after.kv_blocks_used) == (0, 0, 0)
    assert after.num_aborted == before.num_aborted + 1
    assert after.generation_tokens - before.generation_tokens < LONG_REPLY
    assert stack.server.state.in_flight == 0
    ok = stack.client.post("/v1/completions", json={"prompt": "still up?", "max_tokens": 2})
    assert ok.status_code == 200


def test_client_disconnect_while_waiting_for_a_whole_reply(stack: Stack) -> None:
    before = stack.wait_idle()
    body = {k: v for k, v in _long(stream=False).items() if k != "prompt"}
    body["messages"] = [{"role": "user", "content": "tell me a long story"}]
    sock = _open(stack, "/v1/chat/completions", body)
    _wait_running(stack, 1)
    sock.close()
    after = stack.wait_idle()
    assert (after.num_running, after.kv_blocks_used) == (0, 0)
    assert after.num_aborted == before.num_aborted + 1
    assert stack.server.state.in_flight == 0


def test_busy_server_answers_429_then_recovers(stack: Stack) -> None:
    stack.wait_idle()
    socks = [_open(stack, "/v1/completions", _long(stream=True)) for _ in range(2)]
    try:
        for s in socks:
            _read_until(s, b"data: ")
        r = stack.client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "server_busy"
        assert stack.client.get("/health").status_code == 200  # not a generation request
    finally:
        for s in socks:
            s.close()
    stack.wait_idle()
    assert stack.server.state.in_flight == 0
    r = stack.client.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
    assert r.status_code == 200


def test_oversized_body_is_413(stack: Stack) -> None:
    r = stack.client.post("/v1/completions", json={"prompt": "x" * 70_000})
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "too_large" and "65536" in err["message"]
    assert stack.server.state.in_flight == 0


def test_shutdown_aborts_what_outlives_the_grace_period(tiny: Path) -> None:
    """``close()`` waits for in-flight streams, then cancels them; the engine frees their blocks."""
    s = start_stack(
        tiny,
        graceful_timeout_s=1,
        num_kv_blocks=LONG_CONTEXT // 16 + 16,
        max_model_len=LONG_CONTEXT,
    )
    try:
        sock = _open(s, "/v1/completions", _long(stream=True))
        _read_until(sock, b"data: ")
        s.server.close()
        after = s.wait_idle()
        assert (after.num_running, after.kv_blocks_used) == (0, 0)
        assert after.num_aborted == 1
        sock.close()
    finally:
        s.close()


def test_a_stopped_engine_is_503(tiny: Path) -> None:
    s = start_stack(tiny)
    try:
        assert s.client.get("/health").json() == {"status": "ok"}
        s.engine.shutdown()
        health = s.client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "engine_stopped"})
        r = s.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        s.close()


def test_sigterm_finishes_in_flight_requests_then_exits(tiny: Path, tmp_path: Path) -> None:
    """``kvtier engine serve`` with the kvtier connector (CPU + disk): SIGTERM lets the
    stream finish, shuts the engine down (the connector writes its chunks to disk) and exits 0."""
    blocks = tmp_path / "blocks"
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "chunk_size: 32\n"
        "tiers:\n"
        "  - {type: cpu, capacity: 16MiB}\n"
        f"  - {{type: disk, path: {blocks}, capacity: 64MiB}}\n"
        "connector: {min_load_tokens: 32}\n"
    )
    cmd = [
        sys.executable, "-m", "kvtier.cli", "engine", "serve", "-m", str(tiny),
        "--port", "0", "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
        "--kv-cache-memory", "8MiB", "--threads", "1",
        "--kv-connector", "kvtier", "--kvtier-config", str(config),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert proc.stderr is not None
        url = None
        announced = []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "server exited before serving"
            announced.append(line)
            if " on http://" in line:
                url = line.split(" on ", 1)[1].split()[0]
        assert url is not None
        # the KV capacity in tokens and the concurrency it allows, as vLLM prints them
        capacity = next(x for x in announced if x.startswith("KV cache: "))
        m = re.search(r"([\d,]+) tokens .* for ([\d,]+) tokens per request: ([\d.]+)x", capacity)
        assert m is not None, capacity
        tokens, max_len = (int(g.replace(",", "")) for g in m.groups()[:2])
        assert tokens % 16 == 0 and max_len <= tokens
        assert float(m.group(3)) == pytest.approx(tokens / max_len, abs=0.01)
        events: list[Any] = []
        first = threading.Event()

        def consume() -> None:
            body = {"prompt": PROMPT_70, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line:
                        first.set()
                        events.extend(sse_events(iter([line])))
                        break
                events.extend(sse_events(lines))

        reader = threading.Thread(target=consume)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert not reader.is_alive()
        assert proc.wait(60) == 0
        rest = proc.stderr.read()
        assert "shutting the engine down" in rest
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) > 1
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
        # the prompt's two full 32-token chunks reached the disk tier
        saved = [
            p for p in blocks.rglob("*") if p.is_file() and p.relative_to(blocks).parts[0] != "tmp"
        ]
        assert len(saved) >= 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_announced_address_takes_connections_before_the_server_accepts() -> None:
    """``engine serve`` prints its address before uvicorn starts: a client that connects
    in between waits in the backlog instead of being refused (a CI failure)."""
    sock = bind_listener("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass
    finally:
        sock.close()
