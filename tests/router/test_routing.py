"""The router over HTTP in front of fake engines: each policy, failover, disconnects, P/D legs."""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine.models.loader import load_tokenizer
from kvtier.engine.tokenizer import Tokenizer
from kvtier.keys import CacheNamespace
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, Policy, RouterConfig
from kvtier.router.index import prompt_keys
from kvtier.router.prompt import prompt_token_ids
from tests.router.fake_engine import FakeEngine

NS = CacheNamespace("tiny", "fp", 2, 2, 8, "float32", chunk_size=64)
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return load_tokenizer(tiny_model)


@contextmanager
def routed(
    fakes: list[FakeEngine],
    policy: Policy = "round_robin",
    tokenizer: Tokenizer | None = None,
    **kw: Any,
) -> Iterator[BackgroundRouter]:
    specs = tuple(EngineSpec(f.url, kw.pop(f"role_{f.name}", "both")) for f in fakes)
    config = RouterConfig(
        engines=specs, policy=policy, health_interval_s=0.2, events_wait_s=0.5, **kw
    )
    router = BackgroundRouter(create_router_app(config, tokenizer)).start()
    try:
        yield router
    finally:
        router.close()
        for f in fakes:
            f.close()


def chat_body(text: str, stream: bool = False, max_tokens: int = 3) -> dict[str, Any]:
    return {
        "model": "fake",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=TIMEOUT, trust_env=False)


def wait_for(cond: Callable[[], bool], timeout_s: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def router_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT, trust_env=False).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def sample(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_round_robin_alternates_engines() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    with routed([a, b]) as r:
        answers = [post(r.url, chat_body(f"hello {i}")) for i in range(4)]
        assert all(x.status_code == 200 for x in answers)
        assert [x.headers["x-kvtier-engine"] for x in answers] == [a.url, b.url] * 2
        assert a.served() == b.served() == 2
        samples = router_samples(r.url)
        assert (
            sample(
                samples, "kvtier_router_decisions_total", policy="round_robin", reason="round_robin"
            )
            == 4
        )
        assert sample(samples, "kvtier_router_requests_total", engine=a.url, outcome="ok") == 2


def test_least_loaded_avoids_an_engine_that_reports_a_queue() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    a.extra_load = 5
    with routed([a, b], "least_loaded") as r:
        wait_for(lambda: r.state.pool is not None and r.state.pool.by_url[a.url].reported_load == 5)
        for i in range(4):
            assert post(r.url, chat_body(f"q{i}")).headers["x-kvtier-engine"] == b.url
        assert a.served() == 0


def test_cache_aware_sends_a_prompt_to_the_engine_holding_its_prefix(tokenizer: Tokenizer) -> None:
    a, b = FakeEngine("a", namespace=NS), FakeEngine("b", namespace=NS)
    doc = "the cache holds the prefix of this long document " * 12
    body = chat_body(doc + "question one")
    ids = prompt_token_ids(tokenizer, "/v1/chat/completions", body)
    assert ids is not None and len(ids) > 64
    keys = prompt_keys(ids, NS, 16).boundary_keys
    b.publish("stored", keys)  # b holds the whole prompt but its last block
    with routed([a, b], "cache_aware", tokenizer) as r:
        wait_for(lambda: r.state.index.g1_size(b.url) == len(keys))
        for _ in range(3):
            assert post(r.url, body).headers["x-kvtier-engine"] == b.url
        samples = router_samples(r.url)
        assert (
            sample(samples, "kvtier_router_decisions_total", policy="cache_aware", reason="g1_hit")
            == 3
        )
        assert sample(samples, "kvtier_router_matched_tokens_total", source="g1") == 3 * 16 * len(
            keys
        )
        # the engine evicts it: the router no longer prefers b
        b.publish("evicted", keys)
        wait_for(lambda: r.state.index.g1_size(b.url) == 0)
        b.extra_load = 3
        wait_for(lambda: r.state.pool is not None and r.state.pool.by_url[b.url].reported_load == 3)
        assert post(r.url, body).headers["x-kvtier-engine"] == a.url


def test_an_engine_killed_mid_run_is_routed_around_with_no_failed_request() -> None:
    a, b = FakeEngine("a", first_byte_delay_s=3.0), FakeEngine("b", first_byte_delay_s=3.0)
    with routed([a, b]) as r:
        bodies = [chat_body(f"r{i}", stream=i % 2 == 0) for i in range(8)]
        with cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(post, r.url, body) for body in bodies]
            wait_for(lambda: a.running >= 2)
            waiting_on_a = a.running
            a.kill()  # requests waiting on a lose their connection before the first byte
            answers = [f.result() for f in futures]
        assert [x.status_code for x in answers] == [200] * 8  # no request failed
        for body, x in zip(bodies, answers, strict=True):
            name = "a" if x.headers["x-kvtier-engine"] == a.url else "b"
            assert (
                ("[DONE]" in x.text) if body["stream"] else (f"{name}0 {name}1 {name}2" in x.text)
            )
        assert sum(1 for x in answers if x.headers["x-kvtier-engine"] == b.url) >= waiting_on_a
        assert router_samples(r.url)[("kvtier_router_retries_total", ())] >= waiting_on_a
        # while a is down everything goes to b; /health says which engine is out
        assert post(r.url, chat_body("next")).headers["x-kvtier-engine"] == b.url
        health = httpx.get(r.url + "/health", timeout=TIMEOUT, trust_env=False).json()
        assert health["engines"][a.url]["healthy"] is False
        a.restart()  # a health check puts it back
        wait_for(lambda: r.state.pool is not None and r.state.pool.by_url[a.url].healthy)
        used = {post(r.url, chat_body(f"back {i}")).headers["x-kvtier-engine"] for i in range(2)}
        assert used == {a.url, b.url}


def test_no_engine_left_is_a_503() -> None:
    a = FakeEngine("a")
    with routed([a]) as r:
        a.kill()
        x = post(r.url, chat_body("anyone?"))
        assert x.status_code in (502, 503)
        assert x.json()["error"]["code"] in ("upstream_error", "no_engine_available")
        wait_for(
            lambda: (
                httpx.get(r.url + "/health", timeout=TIMEOUT, trust_env=False).status_code == 503
            )
        )
        assert post(r.url, chat_body("still?")).status_code == 503


def test_a_client_that_disconnects_aborts_the_engine_request() -> None:
    a = FakeEngine("a", tokens=40, token_delay_s=0.1)
    with routed([a]) as r:
        with httpx.stream("POST", r.url + "/v1/chat/completions", json=chat_body("long", True, 40),
                          timeout=TIMEOUT, trust_env=False) as resp:  # fmt: skip
            assert resp.status_code == 200
            next(resp.iter_raw())
        wait_for(lambda: a.aborted == 1)  # the engine saw the connection close mid-stream
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                r.url + "/v1/chat/completions",
                json=chat_body("long", False, 40),
                timeout=0.5,
                trust_env=False,
            )
        wait_for(lambda: a.aborted == 2)


def test_pd_sends_the_prompt_to_prefill_then_the_request_to_decode() -> None:
    p, d = FakeEngine("p"), FakeEngine("d")
    with routed([p, d], role_p="prefill", role_d="decode") as r:
        body = chat_body("a prompt", stream=True, max_tokens=3)
        body["stream_options"] = {"include_usage": True}
        x = post(r.url, body)
        assert x.status_code == 200
        assert (
            x.headers["x-kvtier-engine"] == d.url and x.headers["x-kvtier-prefill-engine"] == p.url
        )
        assert "d0" in x.text and "[DONE]" in x.text
        (leg1,), (leg2,) = p.requests, d.requests
        assert leg1["max_tokens"] == 1 and "stream" not in leg1 and "stream_options" not in leg1
        assert leg2 == body
        samples = router_samples(r.url)
        assert samples[("kvtier_router_leg_seconds_count", (("leg", "prefill"),))] == 1
        assert samples[("kvtier_router_leg_seconds_count", (("leg", "decode"),))] == 1
        assert samples[("kvtier_router_leg_seconds_count", (("leg", "decode_first_byte"),))] == 1
        # without a prefill engine the decode engine computes the prompt itself
        p.kill()
        y = post(r.url, chat_body("another", max_tokens=2))
        assert y.status_code == 200 and "x-kvtier-prefill-engine" not in y.headers


def test_engine_keys_the_router_sends_or_passes_on(tokenizer: Tokenizer) -> None:
    a = FakeEngine("a", namespace=NS)
    a.api_key = "engine-key"
    a.publish("stored", [b"k" * 16])
    with routed([a], "cache_aware", tokenizer, engine_api_key="engine-key") as r:
        wait_for(lambda: r.state.index.g1_size(a.url) == 1)  # /kv_events read with the key
        assert post(r.url, chat_body("keyed")).status_code == 200
        models = httpx.get(r.url + "/v1/models", timeout=TIMEOUT, trust_env=False)
        assert models.status_code == 200
    b = FakeEngine("b")
    b.api_key = "client-key"
    with routed([b]) as r:  # no engine key: the client's Authorization is passed on
        url = r.url + "/v1/chat/completions"
        assert post(r.url, chat_body("no key")).status_code == 401
        ok = httpx.post(url, json=chat_body("key"), headers={"Authorization": "Bearer client-key"},
                        timeout=TIMEOUT, trust_env=False)  # fmt: skip
        assert ok.status_code == 200


def test_with_an_api_key_the_router_refuses_callers_without_it() -> None:
    a = FakeEngine("a")
    a.api_key = "engine-key-456"  # the engine takes only its own key, which callers never see
    with routed([a], api_key="router-key-123", engine_api_key="engine-key-456") as r:
        url = r.url + "/v1/chat/completions"
        refused = [
            httpx.post(url, json=chat_body("hi"), headers=h, timeout=TIMEOUT, trust_env=False)
            for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"})
        ]
        assert [x.status_code for x in refused] == [401, 401, 401]
        assert a.served() == 0  # nothing reached the engine
        ok = httpx.post(
            url,
            json=chat_body("hi"),
            headers={"Authorization": "Bearer router-key-123"},
            timeout=TIMEOUT,
            trust_env=False,
        )
        assert ok.status_code == 200 and a.served() == 1
        for path in ("/health", "/metrics"):  # probes and scrapes stay open, as the engine's
            assert httpx.get(r.url + path, timeout=TIMEOUT, trust_env=False).status_code == 200
