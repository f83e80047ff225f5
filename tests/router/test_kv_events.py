"""KV events of the bundled engine: the recorder, the log, and keys the router can match."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from kvtier.engine.block_manager import BlockManager
from kvtier.engine.config import EngineConfig
from kvtier.engine.kv_events import KvEvent, KvEventLog, KvEventRecorder
from kvtier.engine.models.loader import load_tokenizer
from kvtier.engine.process_engine import ProcessEngine
from kvtier.engine.request import Request
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.server.app import create_app
from kvtier.engine.server.runner import BackgroundServer
from kvtier.keys import CacheNamespace, PrefixKeys
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig
from kvtier.router.index import prompt_keys
from kvtier.router.prompt import prompt_token_ids
from tests.router.fake_engine import FakeEngine

NS = CacheNamespace("m", "fp", 2, 2, 8, "float32", chunk_size=64, tenant_salt=b"t")
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, GREEDY, None, None)  # type: ignore[arg-type]


def _compute(bm: BlockManager, req: Request) -> None:
    bm.allocate(req, bm.find_cached_prefix(req), req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_blocks(req)


def test_stored_and_evicted_blocks_are_named_by_their_prefix_keys() -> None:
    bm = BlockManager(num_blocks=4, block_size=16, namespace=NS)
    rec = KvEventRecorder(NS)
    bm.listener = rec
    a = _request("a", list(range(1, 41)))  # 40 tokens: 2 full blocks
    _compute(bm, a)
    keys = PrefixKeys(NS, 16)
    keys.extend(a.token_ids)
    assert rec.drain() == [KvEvent("stored", (keys.key(16), keys.key(32)))]
    # a block held by another request with the same prefix is not stored twice
    b = _request("b", list(range(1, 41)))
    _compute(bm, b)
    assert rec.drain() == []
    bm.free(a)
    bm.free(b)
    # a new request needs all 4 blocks: the cached ones are handed out again
    c = _request("c", list(range(100, 164)))
    _compute(bm, c)
    events = rec.drain()
    assert events[0].kind == "evicted"
    assert set(events[0].keys) == {keys.key(16), keys.key(32)}
    other = PrefixKeys(NS, 16)
    other.extend(c.token_ids)
    assert events[1] == KvEvent("stored", tuple(other.key(16 * i) for i in range(1, 5)))
    rec.saved(b"k" * 16)
    assert rec.drain() == [KvEvent("saved", (b"k" * 16,))]


def test_the_log_reads_with_a_cursor_and_snapshots_a_reader_that_fell_behind() -> None:
    log = KvEventLog(capacity=2, max_saved_keys=2)
    k = [bytes([i]) * 16 for i in range(6)]
    log.append([KvEvent("stored", (k[0], k[1])), KvEvent("saved", (k[2],))])
    page = log.read(0)
    assert not page.reset and page.last_seq == 2
    assert [(s, kind) for s, kind, _ in page.events] == [(1, "stored"), (2, "saved")]
    assert log.read(2).events == [] and log.read(2).last_seq == 2
    log.append([KvEvent("evicted", (k[0],)), KvEvent("saved", (k[3], k[4]))])
    page = log.read(0)  # batches 1-2 left the ring: a snapshot instead
    assert page.reset and page.last_seq == 4 and page.snapshot is not None
    assert set(page.snapshot["stored"]) == {k[1]}
    assert page.snapshot["saved"] == [k[3], k[4]]  # the oldest saved key is forgotten
    assert log.read(4, engine_id="another-run").reset  # a restarted engine is another log
    assert log.read(99).reset  # a cursor from the future
    body = page.to_json(NS, 16)
    assert CacheNamespace.from_json(body["namespace"]) == NS
    assert body["snapshot"]["stored"] == [k[1].hex()]


def test_a_long_poll_returns_when_an_event_arrives() -> None:
    log = KvEventLog()

    async def main() -> float:
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, log.append, [KvEvent("stored", (b"x" * 16,))])
        t0 = time.monotonic()
        await log.wait(0, 30.0)
        return time.monotonic() - t0

    assert asyncio.run(main()) < 29.0  # woken by the event, not by the timeout
    assert log.last_seq == 1


def test_namespace_json_round_trip() -> None:
    assert CacheNamespace.from_json(NS.to_json()) == NS


@pytest.fixture(scope="module")
def served_engine(tiny_model: Path):
    config = EngineConfig(
        model=str(tiny_model), dtype="float32", device="cpu", num_threads=1, num_kv_blocks=64
    )
    engine = ProcessEngine(config, start_timeout_s=120).start()
    server = BackgroundServer(create_app(engine, served_model_name="tiny")).start()
    yield engine, server
    server.close()
    engine.shutdown()


def test_the_router_matches_the_keys_a_real_engine_publishes(
    served_engine, tiny_model: Path
) -> None:
    engine, server = served_engine
    assert engine.kv_namespace is not None and engine.kv_namespace.chunk_size == 256
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "a document the engine reads once. " * 10}],
        "max_tokens": 2,
        "temperature": 0,
    }
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120, trust_env=False)
    assert r.status_code == 200
    page = httpx.get(
        server.url + "/kv_events", params={"after": 0}, timeout=60, trust_env=False
    ).json()
    assert page["reset"] is False and page["block_size"] == 16
    stored = {k for e in page["events"] if e["type"] == "stored" for k in e["keys"]}
    ids = prompt_token_ids(load_tokenizer(tiny_model), "/v1/chat/completions", body)
    assert ids is not None
    pk = prompt_keys(ids, CacheNamespace.from_json(page["namespace"]), 16)
    assert {k.hex() for k in pk.boundary_keys} <= stored and pk.boundary_keys
    # nothing new: a long poll waits, then answers empty
    again = httpx.get(server.url + "/kv_events", params={"after": page["last_seq"], "wait_s": 0.2},
                      timeout=60, trust_env=False).json()  # fmt: skip
    assert again["events"] == [] and again["last_seq"] == page["last_seq"]
    bad = httpx.get(server.url + "/kv_events", params={"after": "x"}, timeout=60, trust_env=False)
    assert bad.status_code == 400

    # a router in front of this engine and an idle fake one sends the prompt back here
    other = FakeEngine("other")
    other.extra_load = 0
    config = RouterConfig(
        engines=(EngineSpec(other.url), EngineSpec(server.url)),
        policy="cache_aware",
        health_interval_s=0.2,
        events_wait_s=0.5,
    )
    with BackgroundRouter(create_router_app(config, load_tokenizer(tiny_model))) as router:
        deadline = time.monotonic() + 60
        while router.state.index.g1_size(server.url) < len(pk.boundary_keys):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for _ in range(2):
            x = httpx.post(
                router.url + "/v1/chat/completions", json=body, timeout=120, trust_env=False
            )
            assert x.status_code == 200 and x.headers["x-kvtier-engine"] == server.url
        assert other.served() == 0
    other.close()
