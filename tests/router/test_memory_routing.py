"""cache_aware over HTTP when an engine's G1 is full: capacity from /metrics, reservations."""

from __future__ import annotations

import concurrent.futures as cf

from kvtier.engine.tokenizer import Tokenizer
from kvtier.router.index import prompt_keys
from kvtier.router.policy import Reservation
from kvtier.router.prompt import prompt_token_ids
from tests.router.fake_engine import FakeEngine
from tests.router.test_routing import (
    NS,
    chat_body,
    post,
    routed,
    router_samples,
    sample,
    tokenizer,  # noqa: F401 - the fixture
    wait_for,
)

ANSWER = 64


def test_a_prefix_is_not_followed_onto_an_engine_with_no_g1_room(tokenizer: Tokenizer) -> None:  # noqa: F811
    # b holds the prompt's prefix; a holds nothing; each G1 has room for one such request
    a = FakeEngine("a", namespace=NS)
    b = FakeEngine("b", namespace=NS, first_byte_delay_s=2.0)
    # ~600 tokens: computing them on a costs less than waiting for b's answer (64 x 16)
    doc = "the cache holds the prefix of this long document " * 18
    body = chat_body(doc + "question one", stream=True, max_tokens=ANSWER)
    ids = prompt_token_ids(tokenizer, "/v1/chat/completions", body)
    assert ids is not None and 400 < len(ids) < 1000
    capacity_blocks = (len(ids) + ANSWER) * 3 // 2 // 16  # one request fits, not two
    for f in (a, b):
        f.extra_metrics = (
            "# TYPE kvtier_engine_kv_blocks_total gauge\n"
            f"kvtier_engine_kv_blocks_total {capacity_blocks}\n"
        )
    b.publish("stored", prompt_keys(ids, NS, 16).boundary_keys)
    with routed([a, b], "cache_aware", tokenizer) as r:
        pool = r.state.pool
        assert pool is not None
        wait_for(lambda: pool.by_url[b.url].kv_capacity_tokens == capacity_blocks * 16)
        wait_for(lambda: r.state.index.g1_size(b.url) > 0)
        with cf.ThreadPoolExecutor(2) as ex:
            first = ex.submit(post, r.url, body)  # b's prefix: b, held 2 s before its first byte
            wait_for(lambda: b.running == 1)
            held = pool.by_url[b.url].reservations
            assert held == [Reservation(len(ids) + ANSWER, ANSWER, held[0].new_tokens)]
            assert held[0].new_tokens < len(ids) // 4  # most of it was a G1 hit
            # the same prefix again: b must finish the first answer before it has room
            second = ex.submit(post, r.url, body)
            assert second.result().headers["x-kvtier-engine"] == a.url
            assert first.result().headers["x-kvtier-engine"] == b.url
        wait_for(lambda: not pool.by_url[b.url].reservations)  # released when it ended
        samples = router_samples(r.url)
        assert (
            sample(samples, "kvtier_router_decisions_total", policy="cache_aware", reason="memory")
            == 1
        )
        # with room again, the prefix wins
        assert post(r.url, body).headers["x-kvtier-engine"] == b.url
