"""The router's view of the shared tier follows the cache server's own events (``--tier-events``)."""

from __future__ import annotations

import time

import httpx
from prometheus_client import CollectorRegistry

from kvtier.config import CpuTierConfig, KvtierConfig
from kvtier.connectors.kvtier_connector import KvtierConnector
from kvtier.engine.kv_events import KvEvent, KvEventLog, KvEventRecorder
from kvtier.keys import CacheNamespace
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.events import EventCursor, apply_page
from kvtier.router.index import PrefixIndex, prompt_keys
from kvtier.router.metrics import RouterMetrics
from tests.router.fake_engine import FakeEngine
from tests.server.helpers import block, cpu_store_config, key, remote, running_server, server_config

NS = CacheNamespace("m", "fp", 2, 2, 8, "float32", chunk_size=32)


def _until(cond, what: str, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_shared_tier_eviction_removes_the_key_from_the_router_index() -> None:
    pk = prompt_keys(list(range(300, 364)), NS, 16)  # 64 tokens: two chunks of 32
    chunk_keys = [bytes(pk.keys.key(32)), bytes(pk.keys.key(64))]
    size = len(block(0))
    # room for about three blocks: five puts evict the two oldest
    with running_server(server_config(), cpu_store_config(capacity=3 * size + 3 * 256)) as server:
        engine = FakeEngine("e")
        config = RouterConfig(
            engines=(EngineSpec(engine.url),),
            tier_events=f"http://127.0.0.1:{server.http_port}",
            health_interval_s=0.2,
            events_wait_s=0.5,
        )
        tier = remote(server)
        try:
            with BackgroundRouter(create_router_app(config)) as router:
                index = router.state.index
                tier.put([(k, block(i, bound=k)) for i, k in enumerate(chunk_keys)])
                _until(lambda: index.shared_tokens(pk) == 64, "the stored prompt")
                for i in range(10, 20):  # other blocks until the prompt's have been evicted
                    tier.put([(key(i), block(i))])
                    if not any(tier.contains(chunk_keys)):
                        break
                assert not any(tier.contains(chunk_keys))
                _until(lambda: index.shared_tokens(pk) == 0, "the evictions")
                # the router's shared set is what the tier holds, not what was ever put
                held = server.store.usage()["cpu"].num_blocks
                _until(lambda: index.saved_size == held, "the tier's block count")
                metrics = httpx.get(router.url + "/metrics", timeout=10, trust_env=False).text
                assert "tier_removed" in metrics
        finally:
            tier.close()
            engine.close()


def test_an_engine_reports_what_its_own_store_evicts_and_the_router_forgets_it() -> None:
    """A tier the engine's process evicts from (a CPU pool, a disk directory): ``unsaved``."""
    size = len(block(0))
    config = KvtierConfig(tiers=[CpuTierConfig(capacity=3 * size + size // 2)])
    conn = KvtierConnector(config=config)
    recorder = KvEventRecorder(NS)
    conn.on_saved, conn.on_evicted = recorder.saved, recorder.unsaved
    log = KvEventLog()
    index = PrefixIndex()
    try:
        keys = [key(i) for i in range(5)]
        for k in keys:
            recorder.saved(k)  # what the connector reports when it queues a save
            conn.store.put([(k, block(keys.index(k), bound=k))])
        events = recorder.drain()
        assert events[-1] == KvEvent("unsaved", (keys[0], keys[1]))  # the two oldest
        log.append(events)
        page = log.read(0).to_json(NS, 16)
        apply_page(index, "http://e", EventCursor(), page, RouterMetrics(CollectorRegistry()))
        assert index.saved_size == 3
        assert log.read(99).snapshot == {"stored": [], "saved": keys[2:]}
        conn.on_evicted = None
        conn.store.put([(key(9), block(9))])
        assert recorder.drain() == []
    finally:
        conn.shutdown()
