"""Replicas that start warm: an engine joining the router loads the fleet's hottest prefixes
from the shared tier into its G1 before it takes traffic (real engines), within a deadline,
and gives up when traffic needs it (fake engines)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry

from kvtier.engine.models.loader import load_tokenizer
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.engines import EnginePool
from kvtier.router.metrics import RouterMetrics
from kvtier.router.warmup import HotPrefixes, Warmer, WarmMetrics
from tests.router.fake_engine import FakeEngine
from tests.router.test_failover import CHUNK, engine_process
from tests.router.test_pd import counter
from tests.server.helpers import running_server

SYSTEMS = [
    "You are a careful assistant for the kvtier project; answer in one line. " * 2,
    "Summarize the following document about shared KV tiers in three words. " * 2,
]


def _wait(what: str, ok: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_a_joining_engine_holds_the_hot_prefixes_in_g1_before_its_first_request(
    tiny_model: Path, tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(tiny_model)
    with running_server() as cache, ExitStack() as stack:
        config = tmp_path / "kvtier.yaml"
        config.write_text(yaml.safe_dump({
            "chunk_size": CHUNK,
            "tiers": [{"type": "remote", "address": cache.address}],
            "connector": {"min_load_tokens": 16, "verify_fraction": 0},
        }))  # fmt: skip
        a = stack.enter_context(engine_process(tiny_model, config, tmp_path / "a.log"))
        rc = RouterConfig(engines=(EngineSpec(a.url),), policy="cache_aware",
                          health_interval_s=0.2, events_wait_s=0.2)  # fmt: skip
        with BackgroundRouter(create_router_app(rc, tokenizer)) as router:
            client = httpx.Client(base_url=router.url, timeout=120, trust_env=False)
            # traffic on the fleet: each system prompt three times (the 2nd and 3rd hit G1)
            for i in range(3):
                for system in SYSTEMS:
                    body = {"prompt": system + f"Question {i}?", "max_tokens": 2,
                            "temperature": 0}  # fmt: skip
                    assert client.post("/v1/completions", json=body).status_code == 200
                    time.sleep(0.4)  # its KV events reach the router
            assert len(router.state.proxy.hot) >= len(SYSTEMS)  # type: ignore[union-attr]

            b = stack.enter_context(engine_process(tiny_model, config, tmp_path / "b.log"))
            r = client.post("/engines", json={"url": b.url, "warm": True})
            assert r.status_code == 201, r.text
            assert r.json()["warming"] is True
            assert client.get("/health").json()["engines"][b.url]["warming"] is True
            _wait("the warm-up", lambda: client.get("/warm_start").json()["engines"][b.url]
                  ["state"] not in ("waiting", "warming"))  # fmt: skip
            run = client.get("/warm_start").json()["engines"][b.url]
            assert run["state"] == "done", run
            assert run["prefixes"] == len(SYSTEMS), run
            assert run["loaded_tokens"] >= CHUNK * len(SYSTEMS), run  # from the shared tier
            assert client.get("/health").json()["engines"][b.url]["warming"] is False
            assert client.post("/engines", json={"url": b.url}).status_code == 409

            # B's first request: its prompt's hot prefix is found in B's own G1
            loaded_before = counter(b.url, "kvtier_engine_external_loaded_tokens")
            g1_before = counter(b.url, "kvtier_engine_prefix_cache_hit_tokens")
            body = {"prompt": SYSTEMS[0] + "A new question?", "max_tokens": 2, "temperature": 0}
            first = httpx.post(b.url + "/v1/completions", json=body, timeout=120, trust_env=False)
            cached = first.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            prefix = len(tokenizer.encode(SYSTEMS[0]))
            assert cached >= prefix - 16, (cached, prefix)
            g1_hits = counter(b.url, "kvtier_engine_prefix_cache_hit_tokens") - g1_before
            assert g1_hits >= prefix - 16
            assert counter(b.url, "kvtier_engine_external_loaded_tokens") == loaded_before
            metrics = client.get("/metrics").text
            assert f"kvtier_router_warm_prefixes_total {float(len(SYSTEMS))}" in metrics
            assert 'kvtier_router_warm_runs_total{outcome="done"} 1.0' in metrics


def test_a_bad_join_is_refused(tiny_model: Path) -> None:
    fake = FakeEngine("a")
    try:
        rc = RouterConfig(engines=(EngineSpec(fake.url),), health_interval_s=0.2)
        with BackgroundRouter(create_router_app(rc, load_tokenizer(tiny_model))) as router:
            for body in ({"url": "ftp://x"}, {"nope": 1}, {"url": fake.url + "/", "warm": "yes"}):
                r = httpx.post(router.url + "/engines", json=body, trust_env=False)
                assert r.status_code == 400, r.text
            r = httpx.post(router.url + "/engines", json={"url": fake.url}, trust_env=False)
            assert r.status_code == 409
    finally:
        fake.close()


@pytest.fixture
def fakes() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    serving, joining = FakeEngine("a"), FakeEngine("b", first_byte_delay_s=0.3)
    yield serving, joining
    serving.close()
    joining.close()


def _warm(
    fakes: tuple[FakeEngine, FakeEngine], deadline_s: float, saturate: bool
) -> tuple[str, int, bool]:
    """Warms ``joining`` with 5 prefixes (0.3 s each); returns its outcome, prefixes
    warmed, and whether it was left out of ``serving`` while it warmed."""
    serving, joining = fakes

    async def run() -> tuple[str, int, bool]:
        async with httpx.AsyncClient(trust_env=False) as client:
            metrics = RouterMetrics(CollectorRegistry())
            pool = EnginePool((EngineSpec(serving.url),), client, metrics, interval_s=1.0,
                              timeout_s=5.0)  # fmt: skip
            await pool.check_all()
            engine = await pool.add(EngineSpec(joining.url), warming=True)
            hot = HotPrefixes(16)
            for i in range(5):
                hot.observe(list(range(i * 100, i * 100 + 40)), 32)
            warmer = Warmer(pool, hot, client, WarmMetrics(CollectorRegistry()), max_prefixes=8,
                            fraction=0.5, deadline_s=deadline_s, cancel_load=2)  # fmt: skip
            w = warmer.start(engine)
            await asyncio.sleep(0.1)
            left_out = engine not in pool.serving(("both",))
            if saturate:
                pool.by_url[serving.url].in_flight = 5  # every other engine is busy
            while engine.warming:
                await asyncio.sleep(0.05)
            await warmer.stop()
            return w.state, w.prefixes, left_out

    return asyncio.run(run())


def test_warm_up_hands_over_every_hot_prefix_and_ends(fakes: tuple[FakeEngine, FakeEngine]) -> None:
    state, prefixes, left_out = _warm(fakes, deadline_s=30, saturate=False)
    assert (state, prefixes, left_out) == ("done", 5, True)
    assert [len(r["prompt"]) for r in fakes[1].requests] == [32] * 5
    assert all(r["max_tokens"] == 1 for r in fakes[1].requests)


def test_warm_up_stops_at_its_deadline(fakes: tuple[FakeEngine, FakeEngine]) -> None:
    state, prefixes, _ = _warm(fakes, deadline_s=0.7, saturate=False)
    assert state == "deadline" and 1 <= prefixes < 5


def test_warm_up_is_cancelled_when_traffic_needs_the_engine(
    fakes: tuple[FakeEngine, FakeEngine],
) -> None:
    state, prefixes, _ = _warm(fakes, deadline_s=30, saturate=True)
    assert state == "cancelled" and prefixes < 5


def test_hottest_prefixes_rank_by_tokens_saved_within_a_budget() -> None:
    hot = HotPrefixes(capacity=3)
    system = list(range(100))
    for _ in range(3):
        hot.observe(system + [7] * 50, 128)  # a conversation: its 128-token prefix, 3 hits
    hot.observe(system, 64)  # contained in the one above: comes with it
    hot.observe(list(range(500, 600)), 96)  # 96 tokens, one hit
    hot.observe(list(range(900, 920)), 8)  # too short to count
    assert len(hot) == 3
    assert hot.hottest(None, 8) == [(system + [7] * 50)[:128], list(range(500, 596))]
    assert hot.hottest(100, 8) == [list(range(500, 596))]  # the first does not fit
    assert hot.hottest(None, 1) == [(system + [7] * 50)[:128]]
    for i in range(3):
        hot.observe(list(range(1000 + 100 * i, 1100 + 100 * i)), 32)
    assert len(hot) == 3  # bounded: the least recently hit were forgotten


def test_a_prefix_asked_again_is_hot_before_any_engine_holds_it() -> None:
    hot = HotPrefixes(capacity=8)
    doc = list(range(1000, 1100))  # 100 tokens: 6 whole blocks of 16
    assert hot.repeats([*doc, 1, 2, 3]) == 0  # the first time: nothing to repeat
    assert hot.repeats([*doc, 4, 5, 6]) == 96  # queued behind the first: no engine holds it
    assert hot.repeats(doc[:40] + [9] * 30) == 32  # the blocks it shares
    assert hot.repeats([7] * 16 + doc) == 0  # the same tokens after others are no prefix
    for question in ([4, 5, 6], [8, 8, 8]):
        hot.observe(doc + question, hot.repeats(doc + question))
    assert hot.hottest(None, 8) == [doc[:96]]  # two requests share it: handed to a joiner
