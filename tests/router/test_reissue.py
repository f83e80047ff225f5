"""A non-streamed request whose engine drops, or stays out of the pool, while answering is
re-issued whole on another engine (fake engines); a stream from an engine that sends no
token ids cannot be continued and ends with an error event, counted as failed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.engine.models.loader import load_tokenizer
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from tests.router.fake_engine import FakeEngine


@pytest.fixture
def pair() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    slow, other = FakeEngine("slow", tokens=40, token_delay_s=0.05), FakeEngine("other")
    yield slow, other
    slow.close()
    other.close()


def _router(pair: tuple[FakeEngine, FakeEngine], tiny_model: Path) -> BackgroundRouter:
    rc = RouterConfig(engines=tuple(EngineSpec(e.url) for e in pair), policy="round_robin",
                      health_interval_s=0.1, stall_timeout_s=0.5)  # fmt: skip
    return BackgroundRouter(create_router_app(rc, load_tokenizer(tiny_model)))


def _first_to_slow(router: BackgroundRouter, slow: FakeEngine) -> None:
    """Round robin: make the next request go to ``slow``."""
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   trust_env=False)  # fmt: skip
    if r.headers["x-kvtier-engine"] == slow.url:
        httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   trust_env=False)  # fmt: skip


@pytest.mark.parametrize("lost", ["dropped", "out_of_the_pool"])
def test_a_whole_answer_is_reissued_when_its_engine_is_lost(
    pair: tuple[FakeEngine, FakeEngine], tiny_model: Path, lost: str
) -> None:
    slow, other = pair
    with _router(pair, tiny_model) as router:
        _first_to_slow(router, slow)

        def lose() -> None:
            time.sleep(0.5)
            if lost == "dropped":
                slow.kill()
            else:
                slow.healthy = False  # answers nothing for 2 s, and fails its health checks

        threading.Thread(target=lose, daemon=True).start()
        r = httpx.post(router.url + "/v1/completions",
                       json={"prompt": "a question", "max_tokens": 40}, timeout=30,
                       trust_env=False)  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["x-kvtier-engine"] == other.url
        counts = httpx.get(router.url + "/failover", trust_env=False).json()
        assert counts["requests_reissued"] == 1 and counts["failed_requests"] == 0, counts


def test_a_stream_without_token_ids_ends_with_an_error_and_counts_as_failed(
    pair: tuple[FakeEngine, FakeEngine], tiny_model: Path
) -> None:
    slow, _ = pair
    with _router(pair, tiny_model) as router:
        _first_to_slow(router, slow)
        body = {"prompt": "a question", "max_tokens": 40, "stream": True}
        lines = []
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30,
                          trust_env=False) as r:  # fmt: skip
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    slow.kill()
        assert '"upstream_error"' in lines[-2] and lines[-1] == "data: [DONE]"
        counts = httpx.get(router.url + "/failover", trust_env=False).json()
        assert counts["streams_interrupted"] == 1 and counts["failed_requests"] == 1, counts
        assert counts["streams_completed"] == 0


@pytest.mark.parametrize("keep_alive", [True, False], ids=["keep_alive", "silent"])
def test_an_engine_that_sends_keep_alives_between_slow_tokens_is_not_taken_for_stalled(
    pair: tuple[FakeEngine, FakeEngine], tiny_model: Path, keep_alive: bool
) -> None:
    slow, _ = pair
    slow.tokens, slow.token_delay_s = 3, 1.5  # 3x the router's stall timeout between tokens
    slow.keep_alive_s = 0.2 if keep_alive else 0.0
    with _router(pair, tiny_model) as router:
        _first_to_slow(router, slow)
        body = {"prompt": "a question", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30,
                          trust_env=False) as r:  # fmt: skip
            lines = [line for line in r.iter_lines() if line]
        counts = httpx.get(router.url + "/failover", trust_env=False).json()
    assert r.headers["x-kvtier-engine"] == slow.url
    texts = [line for line in lines if "slow" in line]
    if keep_alive:  # one stream from the slow engine, the comments not relayed
        assert len(texts) == 3 and lines[-1] == "data: [DONE]", lines
        assert not any(line.startswith(":") for line in lines)
        assert counts["streams_interrupted"] == 0, counts
    else:  # the same silence without them is a stall
        assert counts["streams_interrupted"] == 1, counts
