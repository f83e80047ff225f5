"""Warm-up beyond ``POST /engines``: an engine given at start that comes up late, or any
engine that comes back, is warmed before traffic; a cold join stays cold; the prefixes
handed over fit the engine's G1 as its ``/metrics`` reports it (fake engines)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from tests.router.fake_engine import FakeEngine

HOT = list(range(1000, 1048))  # a 48-token prefix the fleet hit


def _wait(what: str, ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _warm_ups(fake: FakeEngine) -> list[list[int]]:
    """The prompts of the warm-up requests ``fake`` received (1 token each, ids)."""
    with fake.lock:
        return [r["prompt"] for r in fake.requests if r.get("max_tokens") == 1]


def _router(engines: list[FakeEngine]) -> BackgroundRouter:
    rc = RouterConfig(engines=tuple(EngineSpec(e.url) for e in engines), health_interval_s=0.1)
    return BackgroundRouter(create_router_app(rc))


def test_a_start_engine_that_comes_up_late_and_one_that_comes_back_are_warmed() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    b.healthy = False  # given at start, not up yet (still loading its model)
    try:
        with _router([a, b]) as router:
            warmer = router.state.warmer
            assert warmer is not None and router.state.proxy is not None
            assert warmer.runs == {}  # at start: no statistics, nothing warmed
            router.state.proxy.hot.observe(HOT, len(HOT))
            b.healthy = True
            _wait("b's warm-up", lambda: warmer.runs.get(b.url, None) is not None
                  and warmer.runs[b.url].state == "done")  # fmt: skip
            assert _warm_ups(b) == [HOT]
            with b.lock:
                assert b.requests[0]["max_tokens"] == 1  # warmed before any traffic
            b.kill()  # its process restarts: G1 lost
            pool = router.state.pool
            assert pool is not None
            _wait("b out", lambda: not pool.by_url[b.url].healthy)
            b.restart()
            _wait("b warmed again", lambda: len(_warm_ups(b)) == 2)
            _wait("b serving", lambda: not pool.by_url[b.url].warming)
            assert _warm_ups(a) == []  # a never went down
    finally:
        a.close()
        b.close()


def test_a_cold_join_stays_cold_and_a_warm_one_gets_what_fits_its_g1() -> None:
    a, cold, small = FakeEngine("a"), FakeEngine("cold"), FakeEngine("small")
    small.extra_metrics = "kvtier_engine_kv_blocks_total 4\n"  # 64 tokens: warm-up fills 32
    try:
        with _router([a]) as router:
            warmer = router.state.warmer
            assert warmer is not None and router.state.proxy is not None
            router.state.proxy.hot.observe(HOT, len(HOT))
            short = list(range(2000, 2032))
            router.state.proxy.hot.observe(short, len(short))
            r = httpx.post(router.url + "/engines", json={"url": cold.url, "warm": False},
                           trust_env=False)  # fmt: skip
            assert r.status_code == 201 and r.json()["warming"] is False
            r = httpx.post(router.url + "/engines", json={"url": small.url}, trust_env=False)
            assert r.status_code == 201 and r.json()["warming"] is True
            _wait("small's warm-up", lambda: warmer.runs[small.url].state == "done")
            assert _warm_ups(small) == [short]  # the 48-token prefix does not fit 32 tokens
            assert warmer.runs[small.url].budget_tokens == 32
            time.sleep(0.5)  # several health checks of the cold engine
            assert _warm_ups(cold) == [] and cold.url not in warmer.runs
    finally:
        for e in (a, cold, small):
            e.close()


def test_a_hot_prefix_that_extends_a_chosen_one_takes_its_place() -> None:
    from kvtier.router.warmup import HotPrefixes

    hot = HotPrefixes(capacity=8)
    doc = list(range(3000, 3100))
    for _ in range(3):
        hot.observe(doc, 64)  # the G1 hit: whole blocks of the document
    hot.observe(doc, 96)  # the shared tier's hit of the same document: longer
    other = list(range(5000, 5040))
    hot.observe(other, 40)
    assert hot.hottest(None, 8) == [doc[:96], other]  # one request per document
    assert hot.hottest(136, 8) == [doc[:96], other]  # 96 + 40 tokens, not 64 + 96 + 40
    assert hot.hottest(100, 8) == [doc[:96]]
