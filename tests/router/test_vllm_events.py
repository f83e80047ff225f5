"""vLLM's KV events in the router: block hashes mapped to the router's keys, gaps, clears, replay."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry

from kvtier.cli import main
from kvtier.engine.models.loader import load_tokenizer
from kvtier.keys import CacheNamespace, PrefixKeys
from kvtier.router.app import BackgroundRouter, create_router_app
from kvtier.router.config import EngineSpec, RouterConfig, RouterConfigError, VllmEventSource
from kvtier.router.index import PrefixIndex, prompt_keys
from kvtier.router.metrics import RouterMetrics
from kvtier.router.prompt import prompt_token_ids
from kvtier.router.vllm_blocks import VllmBlockMap, VllmEventError, local_namespace
from kvtier.router.vllm_events import VllmEventFollower, decode_batch, parse_seq
from tests.router.fake_engine import FakeEngine
from tests.router.fake_vllm_events import (
    ALL_CLEARED,
    FakeVllmPublisher,
    block_removed,
    block_stored,
)

NS = CacheNamespace("m", "fp", 2, 2, 8, "float32", chunk_size=64)
B = 16
URL = "http://127.0.0.1:9"


def h(i: int) -> bytes:
    """A stand-in vLLM block hash (vLLM's are 32-byte SHA-256 digests)."""
    return i.to_bytes(32, "big")


def chain(tokens: list[int], first: int = 0, parent: bytes | None = None) -> dict:
    """One BlockStored event for ``tokens`` (whole blocks), hashes h(first), h(first + 1), ..."""
    n = len(tokens) // B
    return block_stored([h(first + i) for i in range(n)], parent, tokens, B)


def expected_keys(tokens: list[int], ns: CacheNamespace) -> list[bytes]:
    pk = PrefixKeys(ns, B)
    pk.extend(tokens)
    return [bytes(pk.key(e)) for e in pk.boundaries(len(tokens))]


# ---- the map ---------------------------------------------------------------------------------


def test_block_keys_are_the_keys_the_router_computes_from_a_prompt() -> None:
    tokens = list(range(1000, 1160))  # 10 blocks of 16, across chunks of 64 (ends 64, 128)
    m = VllmBlockMap(NS)
    first = m.apply([chain(tokens[:48])])  # 3 blocks from token 0
    second = m.apply([chain(tokens[48:], first=3, parent=h(2))])  # 7 more, chained on block 3
    want = expected_keys(tokens, NS)
    assert list(first.stored) + list(second.stored) == want
    assert [m.key_of(h(i)) for i in range(10)] == want
    # what the proxy compares them with: a prompt of these tokens and one more
    pk = prompt_keys([*tokens, 7], NS, B)
    index = PrefixIndex()
    index.stored(URL, want)
    assert index.g1_tokens(URL, pk) == 160
    # with no namespace given, the router's own (block-sized chunks) names G1 alike
    own = VllmBlockMap()
    got = own.apply([chain(tokens)])
    assert own.namespace == local_namespace(B) and own.block_size == B
    assert list(got.stored) == prompt_keys([*tokens, 7], local_namespace(B), B).boundary_keys


def test_removed_blocks_and_a_clear_leave_the_engine_g1() -> None:
    tokens = list(range(64))
    m = VllmBlockMap(NS)
    keys = list(m.apply([chain(tokens)]).stored)
    # the same hash cached in two blocks: one removal keeps it
    assert list(m.apply([chain(tokens[:16])]).stored) == []
    assert list(m.apply([block_removed([h(0)])]).evicted) == []
    out = m.apply([block_removed([h(0), h(1), h(99)])])  # h(99): never stored, ignored
    assert list(out.evicted) == keys[:2] and len(m) == 2
    # evicted then stored again in one batch: held at the end
    again = m.apply([block_removed([h(3)]), chain(tokens[48:], first=3, parent=h(2))])
    assert list(again.evicted) == [] and list(again.stored) == keys[3:]
    cleared = m.apply([ALL_CLEARED, chain(tokens[:16], first=50)])
    assert cleared.cleared and list(cleared.stored) == keys[:1] and len(m) == 1


def test_blocks_the_router_cannot_name_are_skipped_with_their_descendants() -> None:
    tokens = list(range(200, 232))
    m = VllmBlockMap(NS)
    assert m.apply([chain(tokens[:16], first=0, parent=h(77))]).skipped_blocks == 1
    salted = block_stored([h(1)], None, tokens[:16], B, extra_keys=[("salt",)])
    lora = block_stored([h(2)], None, tokens[:16], B, lora_name="adapter")
    offloaded = block_stored([h(3)], None, tokens[:16], B, medium="CPU")
    other_group = block_stored([h(4)], None, tokens[:16], B, group_idx=1)
    out = m.apply([salted, lora, offloaded, other_group])
    assert out.skipped_blocks == 4 and list(out.stored) == [] and len(m) == 0
    # a block chained on a skipped one cannot be named either
    assert m.apply([chain(tokens[16:], first=5, parent=h(1))]).skipped_blocks == 1
    # once the block size is known, a partial block (other size) is skipped
    m.apply([chain(tokens[:16], first=10)])
    assert m.apply([block_stored([h(11)], h(10), tokens[16:24], 8)]).skipped_blocks == 1
    # a block size that does not divide the namespace's chunk is refused loudly
    with pytest.raises(VllmEventError, match="does not divide"):
        VllmBlockMap(NS).apply([block_stored([h(1)], None, list(range(48)), 48)])


@pytest.mark.parametrize(
    "event, match",
    [
        ({"type": "BlockMoved"}, "unknown KV event type"),
        (block_stored([h(1), h(2)], None, list(range(16)), B), "16 token ids for 2 blocks"),
        (block_stored(["x"], None, list(range(16)), B), "bytes or an int"),  # type: ignore[list-item]
        (block_stored([h(1)], None, [-1] * 16, B), r"\[0, 2\*\*31 - 1\]"),
        (block_removed(None), "needs block_hashes"),  # type: ignore[arg-type]
        ([1, 2], "must be a map"),
    ],
)
def test_malformed_events_are_refused(event: object, match: str) -> None:
    with pytest.raises(VllmEventError, match=match):
        VllmBlockMap(NS).apply([event])  # type: ignore[list-item]


def test_the_wire_format_is_decoded_and_checked() -> None:
    events = [chain(list(range(16))), ALL_CLEARED]
    assert decode_batch(msgpack.packb([1.5, events, 0], use_bin_type=True)) == events
    for bad in (b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0])):
        with pytest.raises(VllmEventError):
            decode_batch(bad)
    assert parse_seq((5).to_bytes(8, "big")) == 5
    assert parse_seq((-1).to_bytes(8, "big", signed=True)) == -1
    with pytest.raises(VllmEventError, match="8 bytes"):
        parse_seq(b"\x00")


def test_sources_are_parsed_and_checked(tmp_path: Path) -> None:
    ns_file = tmp_path / "ns.json"
    ns_file.write_text(__import__("json").dumps(NS.to_json()))
    s = VllmEventSource.parse(
        f"http://127.0.0.1:8001/v1=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,"
        f"topic=kv,namespace={ns_file}"
    )
    assert (s.engine, s.endpoint, s.replay_endpoint, s.topic) == (
        "http://127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "kv"
    )  # fmt: skip
    assert s.namespace == NS
    for bad, match in [
        ("http://e:1", "expected URL=tcp"),
        ("http://e:1=tcp://*:5557", "to connect to"),
        ("http://e:1=tcp://h:1,color=red", "unknown KV events option"),
        (f"http://e:1=tcp://h:1,namespace={tmp_path / 'none.json'}", "namespace file"),
    ]:
        with pytest.raises(RouterConfigError, match=match):
            VllmEventSource.parse(bad)
    with pytest.raises(RouterConfigError, match="not listed"):
        RouterConfig(engines=(EngineSpec("http://a:1"),), vllm_events=(s,))


# ---- the follower: sequence numbers, gaps, replay -----------------------------------------------


class _Namespaces:
    def __init__(self) -> None:
        self.given: dict[str, tuple[CacheNamespace, int]] = {}

    def set_namespace(self, url: str, namespace: CacheNamespace, block_size: int) -> None:
        self.given[url] = (namespace, block_size)


def _follower(
    replay: str | None = None, endpoint: str = "tcp://127.0.0.1:1"
) -> tuple[VllmEventFollower, PrefixIndex, _Namespaces]:
    index = PrefixIndex()
    names = _Namespaces()
    source = VllmEventSource(URL, endpoint, replay, namespace=NS)
    f = VllmEventFollower((source,), index, RouterMetrics(CollectorRegistry()), names,
                          replay_timeout_s=2.0)  # fmt: skip
    return f, index, names


def _payload(events: list[dict]) -> bytes:
    return msgpack.packb([0.0, events, 0], use_bin_type=True)


def test_a_gap_or_a_restart_forgets_the_engine_g1_without_a_replay_socket() -> None:
    f, index, names = _follower()
    s = f.streams[URL]
    tokens = list(range(64))

    async def main() -> None:
        await f.deliver(s, 5, _payload([chain(tokens[:32])]))  # joining late: not a gap
        assert index.g1_size(URL) == 2 and names.given[URL] == (NS, B)
        assert "gap" not in s.counts
        await f.deliver(s, 7, _payload([chain(tokens[32:48], first=2, parent=h(1))]))
        # batch 6 is lost (it may have removed blocks): forgotten, and block 3 has no parent now
        assert s.counts["gap"] == 1 and index.g1_size(URL) == 0
        await f.deliver(s, 8, _payload([chain(tokens[:16], first=9)]))
        assert index.g1_size(URL) == 1
        await f.deliver(s, 0, _payload([chain(tokens[:32], first=20)]))  # the engine restarted
        assert s.counts["restart"] == 1 and index.g1_size(URL) == 2
        await f.deliver(s, 1, b"not msgpack")  # a batch that cannot be read is a gap
        assert s.counts["malformed"] == 1 and index.g1_size(URL) == 0
        f.engine_down(URL)
        assert s.next_seq is None and s.counts["engine_down"] == 1

    asyncio.run(main())


async def _until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_the_subscriber_fills_gaps_from_the_replay_socket() -> None:
    pub = FakeVllmPublisher()
    tokens = list(range(500, 564))
    keys = expected_keys(tokens, NS)
    early = pub.publish([chain(tokens[:16])])  # before the router subscribes
    f, index, _ = _follower(pub.replay_endpoint, pub.endpoint)
    s = f.streams[URL]

    async def main() -> None:
        f.start()
        try:
            # the first batch it hears of is not 0: what it missed is replayed first
            while s.next_seq is None:
                pub.publish([])
                await asyncio.sleep(0.05)
            await _until(lambda: index.g1_size(URL) == 1, "the replayed first block")
            assert early == 0 and s.counts.get("replayed", 0) >= 1
            pub.publish([chain(tokens[16:32], first=1, parent=h(0))], drop=True)  # lost on PUB
            pub.publish([block_removed([h(0)]), chain(tokens[32:48], first=2, parent=h(1))])
            await _until(lambda: index.g1_size(URL) == 2, "the gap filled")
            assert "gap" not in s.counts and pub.replays == 2
            pk = prompt_keys([*tokens, 1], NS, B)
            held = index._g1[URL]
            assert keys[0] not in held and {keys[1], keys[2]} <= held
            assert index.g1_tokens(URL, pk) == 0  # block 0 was removed: no prefix from token 0
            pub.publish([chain(tokens[:16], first=0)])
            await _until(lambda: index.g1_tokens(URL, pk) == 48, "blocks 0-2 held again")
        finally:
            await f.stop()

    try:
        asyncio.run(main())
    finally:
        pub.close()


def _chat_prompt(tiny_model: Path, content: str) -> tuple[Any, dict, list[int]]:
    """(tokenizer, a chat body, the token ids of the whole blocks vLLM caches of its prompt:
    not the last token's)."""
    tokenizer = load_tokenizer(tiny_model)
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    ids = prompt_token_ids(tokenizer, "/v1/chat/completions", body)
    assert ids is not None and len(ids) > 4 * B
    return tokenizer, body, ids[: (len(ids) - 1) // B * B]


def test_the_router_sends_a_prompt_to_the_vllm_engine_whose_events_hold_it(
    tiny_model: Path,
) -> None:
    tokenizer, body, whole = _chat_prompt(tiny_model, "a long document the vLLM engine read. " * 8)
    idle, vllm = FakeEngine("idle"), FakeEngine("vllm")
    pub = FakeVllmPublisher(topic="kv")
    source = VllmEventSource(vllm.url, pub.endpoint, pub.replay_endpoint, topic="kv")
    config = RouterConfig(
        engines=(EngineSpec(idle.url), EngineSpec(vllm.url)),
        policy="cache_aware",
        vllm_events=(source,),
        health_interval_s=0.2,
        events_wait_s=0.5,
    )
    try:
        with BackgroundRouter(create_router_app(config, tokenizer)) as router:
            index = router.state.index
            deadline = time.monotonic() + 30
            while router.state.vllm_events is None or (
                router.state.vllm_events.streams[vllm.url].next_seq is None
            ):
                assert time.monotonic() < deadline
                pub.publish([])
                time.sleep(0.05)
            pub.publish([block_stored([h(i) for i in range(len(whole) // B)], None, whole, B)])
            while index.g1_size(vllm.url) < len(whole) // B:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            for _ in range(3):
                r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30,
                               trust_env=False)  # fmt: skip
                assert r.status_code == 200 and r.headers["x-kvtier-engine"] == vllm.url
            assert idle.served() == 0
            pub.publish([ALL_CLEARED])
            while index.g1_size(vllm.url):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            metrics = httpx.get(router.url + "/metrics", timeout=10, trust_env=False).text
            assert f'kvtier_router_kv_events_total{{engine="{vllm.url}",type="cleared"}} 1.0' in (
                metrics
            )
    finally:
        pub.close()
        idle.close()
        vllm.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vllm-kv-events", "http://a:1=tcp://*:5557"], "to connect to"),
        (["--vllm-kv-events", "http://b:1=tcp://h:1"], "not listed"),
        (["--vllm-kv-events", "http://a:1=tcp://h:1,replay"], "unknown KV events option"),
        (["--tier-events", "a:9470"], "tier_events must start with http"),
    ],
)
def test_the_command_line_refuses_bad_event_sources(args: list[str], message: str) -> None:
    result = CliRunner().invoke(
        main, ["router", "--model", "none", "--engine", "http://a:1", *args]
    )
    assert result.exit_code == 2 and message in result.output


def test_a_vllm_engine_that_joins_at_runtime_is_followed_from_its_post_body(
    tiny_model: Path,
) -> None:
    tokenizer, body, whole = _chat_prompt(tiny_model, "a document only the joiner read. " * 8)
    idle, vllm = FakeEngine("idle"), FakeEngine("vllm")
    pub = FakeVllmPublisher(topic="kv")
    config = RouterConfig(
        engines=(EngineSpec(idle.url),), policy="cache_aware", health_interval_s=0.2,
        events_wait_s=0.5,
    )  # fmt: skip
    events = {"endpoint": pub.endpoint, "replay": pub.replay_endpoint, "topic": "kv"}
    try:
        with BackgroundRouter(create_router_app(config, tokenizer)) as router:
            for bad in ({"endpoint": "tcp://*:5557"}, {"endpoint": pub.endpoint, "x": 1}, "tcp://h:1",
                        {"endpoint": pub.endpoint, "namespace": {"model_id": "m"}}):  # fmt: skip
                r = httpx.post(router.url + "/engines", trust_env=False,
                               json={"url": vllm.url, "vllm_kv_events": bad})  # fmt: skip
                assert r.status_code == 400, (bad, r.text)
            assert router.state.vllm_events is None  # nothing followed for a refused join
            r = httpx.post(router.url + "/engines", trust_env=False,
                           json={"url": vllm.url, "warm": False, "vllm_kv_events": events})  # fmt: skip
            assert r.status_code == 201, r.text
            followed = router.state.vllm_events
            assert followed is not None and vllm.url in followed.streams
            deadline = time.monotonic() + 30
            while followed.streams[vllm.url].next_seq is None:
                assert time.monotonic() < deadline
                pub.publish([])
                time.sleep(0.05)
            pub.publish([block_stored([h(i) for i in range(len(whole) // B)], None, whole, B)])
            while router.state.index.g1_size(vllm.url) < len(whole) // B:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            for _ in range(3):
                r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30,
                               trust_env=False)  # fmt: skip
                assert r.status_code == 200 and r.headers["x-kvtier-engine"] == vllm.url
            assert idle.served() == 0
            r = httpx.post(router.url + "/engines", trust_env=False,
                           json={"url": vllm.url, "vllm_kv_events": events})  # fmt: skip
            assert r.status_code == 409
    finally:
        pub.close()
        idle.close()
        vllm.close()
