"""The router's scaling signals over HTTP: ``GET /scaling`` and the gauges of ``/metrics``."""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine.models.loader import load_tokenizer
from kvtier.engine.tokenizer import Tokenizer
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from tests.router.fake_engine import FakeEngine

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Tokenizer:
    return load_tokenizer(tiny_model)


def engine_metrics(hits: int, queries: int, shared: int) -> str:
    return (
        "# TYPE kvtier_engine_requests_waiting gauge\nkvtier_engine_requests_waiting 2\n"
        "# TYPE kvtier_engine_kv_blocks_used gauge\nkvtier_engine_kv_blocks_used 30\n"
        "# TYPE kvtier_engine_kv_blocks_total gauge\nkvtier_engine_kv_blocks_total 120\n"
        "# TYPE kvtier_engine_prefix_cache_hit_tokens counter\n"
        f"kvtier_engine_prefix_cache_hit_tokens_total {hits}\n"
        "# TYPE kvtier_engine_prefix_cache_queries_tokens counter\n"
        f"kvtier_engine_prefix_cache_queries_tokens_total {queries}\n"
        "# TYPE kvtier_engine_external_loaded_tokens counter\n"
        f"kvtier_engine_external_loaded_tokens_total {shared}\n"
    )


def wait_for(fn: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def body(i: int, stream: bool) -> dict[str, Any]:
    text = f"request {i}: " + "tell me about the scaling of fleets " * 8
    return {"model": "fake", "messages": [{"role": "user", "content": text}],
            "max_tokens": 3, "stream": stream}  # fmt: skip


def test_scaling_signals_per_engine_and_fleet(tokenizer: Tokenizer) -> None:
    fakes = [FakeEngine("a", first_byte_delay_s=0.15), FakeEngine("b", first_byte_delay_s=0.15)]
    for f in fakes:
        f.extra_metrics = engine_metrics(0, 0, 0)
    config = RouterConfig(
        engines=tuple(EngineSpec(f.url) for f in fakes),
        policy="round_robin",
        health_interval_s=0.1,
        kv_events=False,
        signals_window_s=60.0,
        ttft_target_s=0.05,
        max_replicas=9,
    )
    router = BackgroundRouter(create_router_app(config, tokenizer)).start()
    try:
        with httpx.Client(base_url=router.url, timeout=TIMEOUT) as client:
            before = client.get("/scaling").json()
            assert before["fleet"]["ttft_samples"] == 0
            assert before["recommendation"]["by_capacity"] is None  # nothing answered yet
            # a slow request in flight shows in the queue of its engine
            fakes[0].first_byte_delay_s = fakes[1].first_byte_delay_s = 1.0
            with cf.ThreadPoolExecutor(1) as pool:
                slow = pool.submit(client.post, "/v1/chat/completions", json=body(0, False))
                queued = wait_for(lambda: client.get("/scaling").json()["fleet"]["queue_depth"])
                assert queued == 1
                report = client.get("/scaling").json()
                busy = [u for u, e in report["engines"].items() if e["queue_depth"] == 1]
                assert (
                    len(busy) == 1 and report["engines"][busy[0]]["prefill_tokens_in_flight"] > 50
                )
                assert slow.result().status_code == 200
            fakes[0].first_byte_delay_s = fakes[1].first_byte_delay_s = 0.15
            for i in range(1, 17):  # 8 per engine: over a second busy, capacity is measured
                r = client.post("/v1/chat/completions", json=body(i, stream=i % 2 == 0))
                assert r.status_code == 200
            for f in fakes:  # the engines' own counters grow: 300 of 1,000 tokens hit G1
                f.extra_metrics = engine_metrics(300, 1000, 100)
            time.sleep(0.4)  # a few health checks scrape them
            report = client.get("/scaling").json()
            text = client.get("/metrics").text
    finally:
        router.close()
        for f in fakes:
            f.close()

    fleet = report["fleet"]
    assert fleet["ttft_samples"] == 17 and fleet["queue_depth"] == 0
    assert 0.15 <= fleet["ttft_p50_s"] <= fleet["ttft_p99_s"]
    assert fleet["ttft_p99_s"] >= 1.0  # the slow one
    assert fleet["demand_tokens_per_s"] > 0 and fleet["capacity_tokens_per_s"] > 0
    assert fleet["kv_usage"] == pytest.approx(0.25)
    assert fleet["ready_replicas"] == 2
    assert not any(e["warming"] for e in report["engines"].values())
    for f in fakes:
        e = report["engines"][f.url]
        assert e["ttft_samples"] >= 8 and e["ttft_p50_s"] >= 0.15
        assert e["capacity_tokens_per_s"] > 0 and e["busy_fraction"] > 0
        assert e["engine_waiting"] == 2 and e["kv_usage"] == pytest.approx(0.25)
        assert e["hit_rate"]["g1"] == pytest.approx(0.3)
        assert e["hit_rate"]["shared"] == pytest.approx(0.1)
    rec = report["recommendation"]
    # no queue at the end: capacity against demand, and KV usage (ceil(2 x 0.25 / 0.8))
    assert rec["current"] == 2 and rec["by_ttft"] is None and rec["by_kv"] == 1
    assert rec["by_capacity"] is not None
    assert rec["replicas"] == min(9, max(1, rec["by_capacity"], rec["by_kv"]))
    assert rec["target"]["ttft_target_s"] == 0.05

    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("kvtier_router_recommended_replicas", ())] == rec["replicas"]
    assert samples[("kvtier_router_fleet_ttft_seconds", (("quantile", "0.99"),))] == pytest.approx(
        fleet["ttft_p99_s"]
    )
    assert samples[("kvtier_router_ready_replicas", ())] == 2
    for f in fakes:
        assert samples[("kvtier_router_engine_queue_depth", (("engine", f.url),))] == 0
        assert (
            "kvtier_router_engine_ttft_seconds",
            (("engine", f.url), ("quantile", "0.5")),
        ) in samples
        assert samples[("kvtier_router_engine_kv_usage", (("engine", f.url),))] == pytest.approx(
            0.25
        )
        assert samples[
            ("kvtier_router_engine_hit_rate", (("engine", f.url), ("source", "g1")))
        ] == pytest.approx(0.3)
        assert samples[("kvtier_router_engine_prefill_capacity_tokens_per_second",
                        (("engine", f.url),))] > 0  # fmt: skip


def test_only_successful_first_bytes_are_ttft_samples() -> None:
    """The middleware times a request's first byte to the client; errors are no samples."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from kvtier.router.metrics import RouterMetrics
    from kvtier.router.scaling_report import RouterSignals, SignalsMiddleware

    url = "http://127.0.0.1:1"
    now = [100.0]
    signals = RouterSignals(
        RouterConfig(engines=(EngineSpec(url),)),
        RouterMetrics(CollectorRegistry()),
        clock=lambda: now[0],
    )

    def engine_app(status: int) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            signals.begin(url, 500)  # what EnginePool.begin / first_byte do in the proxy
            now[0] += 0.5
            signals.first_byte(url)
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"data", "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        return app

    async def call(status: int, method: str = "POST") -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Any) -> None:
            pass

        scope = {"type": "http", "method": method, "path": "/v1/completions"}
        await SignalsMiddleware(engine_app(status), signals)(scope, receive, send)

    asyncio.run(call(502))
    asyncio.run(call(200))
    asyncio.run(call(200, method="GET"))  # not a generation request: not timed
    report = signals.report([])
    assert report["fleet"]["ttft_samples"] == 1
    assert report["fleet"]["ttft_p50_s"] == pytest.approx(0.5)
    assert report["fleet"]["queue_depth"] == 0  # every attempt's prefill ended
    assert report["fleet"]["demand_tokens_per_s"] > 0
    signals.begin(url, 500)  # outside a request: not tracked
    assert signals.report([])["fleet"]["queue_depth"] == 0


def test_the_bundled_engines_metrics_give_every_engine_figure(tiny_model: Path) -> None:
    """What a real ``kvtier engine serve`` exports is what ``parse_engine_stats`` reads."""
    from kvtier.router.engine_stats import CounterWindow, parse_engine_stats
    from tests.engine.test_server import start_stack

    stack = start_stack(tiny_model)
    try:
        before = parse_engine_stats(stack.client.get("/metrics").text)
        prompt = "the same long prompt, twice over: " * 6
        for _ in range(2):  # the second finds the first's blocks in G1
            body = {"prompt": prompt, "max_tokens": 2}
            assert stack.client.post("/v1/completions", json=body).status_code == 200
        after = parse_engine_stats(stack.client.get("/metrics").text)
    finally:
        stack.close()
    assert before is not None and after is not None
    assert after.waiting == 0 and after.running == 0
    assert after.kv_usage is not None and 0.0 <= after.kv_usage <= 1.0
    assert set(after.counters) == {"prefix_hits", "prefix_queries", "shared_hits"}
    window = CounterWindow(60.0)
    window.add(0.0, before.counters)
    window.add(1.0, after.counters)
    g1 = window.ratio(1.0, "prefix_hits", "prefix_queries")
    assert g1 is not None and 0.2 < g1 < 1.0  # the second request's prefix hit
    assert window.ratio(1.0, "shared_hits", "prefix_queries") == 0.0  # no connector


def test_under_pd_the_answer_is_timed_on_the_decode_engine(tokenizer: Tokenizer) -> None:
    prefill, decode = FakeEngine("p", first_byte_delay_s=0.2), FakeEngine("d")
    config = RouterConfig(
        engines=(EngineSpec(prefill.url, "prefill"), EngineSpec(decode.url, "decode")),
        health_interval_s=0.1,
        kv_events=False,
    )
    router = BackgroundRouter(create_router_app(config, tokenizer)).start()
    try:
        with httpx.Client(base_url=router.url, timeout=TIMEOUT) as client:
            for i in range(3):
                assert client.post("/v1/chat/completions", json=body(i, True)).status_code == 200
            report = client.get("/scaling").json()
    finally:
        router.close()
        prefill.close()
        decode.close()
    p, d = report["engines"][prefill.url], report["engines"][decode.url]
    assert d["ttft_samples"] == 3 and p["ttft_samples"] == 0  # the client's answer came from d
    assert p["busy_fraction"] > 0 and p["queue_depth"] == d["queue_depth"] == 0
    assert report["fleet"]["ttft_p50_s"] >= 0.2  # the prefill leg is part of the client's TTFT
    assert report["fleet"]["ready_replicas"] == 1  # the recommendation counts prefilling engines


def test_a_warming_engine_is_no_ready_replica() -> None:
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from kvtier.router.metrics import RouterMetrics
    from kvtier.router.scaling_report import RouterSignals

    urls = ("http://127.0.0.1:1", "http://127.0.0.1:2")
    signals = RouterSignals(
        RouterConfig(engines=tuple(EngineSpec(u) for u in urls)), RouterMetrics(CollectorRegistry())
    )
    engines = [
        SimpleNamespace(url=urls[0], role="both", healthy=True, warming=False, in_flight=0),
        SimpleNamespace(url=urls[1], role="both", healthy=True, warming=True, in_flight=0),
    ]
    report = signals.report(engines)
    assert report["fleet"]["ready_replicas"] == 1
    assert report["recommendation"]["current"] == 1
    assert report["engines"][urls[1]]["warming"] is True
