"""Routing decisions of each policy, and the prefix index they rely on (no HTTP)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvtier.keys import CacheNamespace
from kvtier.router.config import EngineSpec, RouterConfig, RouterConfigError
from kvtier.router.engines import Engine, EnginePool, parse_kv_capacity, parse_load
from kvtier.router.index import PrefixIndex, prompt_keys
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Candidate, Reservation, Router, Weights, memory_wait

NS = CacheNamespace("m", "fp", 2, 2, 8, "float32", chunk_size=64)


def engines(n: int) -> list[Engine]:
    return [Engine(f"http://e{i}", "both", healthy=True) for i in range(n)]


def test_round_robin_takes_turns() -> None:
    es = engines(3)
    r = Router("round_robin")
    picked = [r.pick([Candidate(e) for e in es], 100).engine.url for _ in range(6)]
    assert picked == ["http://e0", "http://e1", "http://e2"] * 2


def test_least_loaded_picks_the_idlest_and_rotates_ties() -> None:
    es = engines(3)
    es[0].in_flight, es[1].in_flight, es[2].in_flight = 3, 1, 2
    r = Router("least_loaded")
    assert r.pick([Candidate(e) for e in es], 10).engine is es[1]
    es[1].reported_load = 5  # the engine says it is busier than the router knows
    assert r.pick([Candidate(e) for e in es], 10).engine is es[2]
    for e in es:
        e.in_flight, e.reported_load = 0, 0
    seen = {r.pick([Candidate(e) for e in es], 10).engine.url for _ in range(3)}
    assert len(seen) == 3


def test_cache_aware_follows_the_longest_g1_prefix() -> None:
    es = engines(3)
    r = Router("cache_aware")
    cands = [Candidate(es[0], 0), Candidate(es[1], 512), Candidate(es[2], 128)]
    d = r.pick(cands, 600)
    assert d.engine is es[1] and d.reason == "g1_hit" and d.hit_tokens == 512


def test_cache_aware_without_any_prefix_is_least_loaded() -> None:
    es = engines(2)
    es[0].in_flight = 2
    d = Router("cache_aware").pick([Candidate(es[0]), Candidate(es[1])], 600)
    assert d.engine is es[1] and d.reason == "least_loaded"


def test_a_hot_prefix_spills_over_when_its_engine_is_too_busy() -> None:
    es = engines(2)
    r = Router("cache_aware", Weights(decode_cost_tokens=256, max_imbalance=4))
    # every request shares a 1,000-token prefix that only e0 holds
    picks = []
    for _ in range(12):
        d = r.pick([Candidate(es[0], 1000), Candidate(es[1], 0)], 1024)
        d.engine.in_flight += 1  # requests stay in flight: the hot engine fills up
        picks.append(d)
    on_hot = sum(1 for d in picks if d.engine is es[0])
    assert 0 < on_hot < 12
    assert any(d.reason == "load" for d in picks)
    assert es[0].in_flight - es[1].in_flight <= 4 + 1


def test_a_shared_tier_prefix_lowers_the_pull_of_g1() -> None:
    es = engines(2)
    es[0].in_flight = 2  # holds the prefix in G1 but is busier
    r = Router("cache_aware", Weights(decode_cost_tokens=256, shared_hit_weight=1.0))
    # G1 only on e0: worth waiting for
    assert r.pick([Candidate(es[0], 960, 0), Candidate(es[1], 0, 0)], 1000).engine is es[0]
    # the shared tier holds it too: e1 loads it and is idle
    d = r.pick([Candidate(es[0], 960, 960), Candidate(es[1], 0, 960)], 1000)
    assert d.engine is es[1] and d.reason == "load"


def test_cache_aware_counts_prefills_queued_on_an_engine() -> None:
    es = engines(2)
    es[0].pending_prefill_tokens = 4000
    es[0].in_flight = es[1].in_flight = 1
    d = Router("cache_aware").pick([Candidate(es[0], 320), Candidate(es[1], 0)], 400)
    assert d.engine is es[1]


def test_pick_needs_a_candidate() -> None:
    with pytest.raises(ValueError):
        Router("cache_aware").pick([], 10)


def test_g1_prefix_stops_at_the_first_missing_block() -> None:
    ids = list(range(1, 201))  # 200 tokens: 12 full blocks before the last token
    pk = prompt_keys(ids, NS, 16)
    assert len(pk.boundary_keys) == 12
    index = PrefixIndex()
    index.stored("a", pk.boundary_keys[:5])
    index.stored("a", pk.boundary_keys[6:])  # block 5 evicted: later blocks do not count
    assert index.g1_tokens("a", pk) == 80
    index.stored("a", [pk.boundary_keys[5]])
    assert index.g1_tokens("a", pk) == 192
    index.evicted("a", [pk.boundary_keys[0]])
    assert index.g1_tokens("a", pk) == 0
    assert index.g1_tokens("b", pk) == 0


def test_shared_prefix_is_full_chunks_then_a_tail() -> None:
    ids = list(range(1, 201))
    pk = prompt_keys(ids, NS, 16)
    index = PrefixIndex(max_saved_keys=10)
    keys = pk.keys
    index.add_saved([keys.key(64), keys.key(128), keys.key(160)])  # two chunks and a tail
    assert index.shared_tokens(pk) == 160
    index.add_saved([keys.key(200)])  # the prompt's exact end: a tail of chunk 3 ...
    assert index.shared_tokens(pk) == 160  # ... found only after the full chunk 2
    index.add_saved([keys.key(192)])
    assert index.shared_tokens(pk) == 200
    other = prompt_keys([9, *ids[1:]], NS, 16)  # another first token: another chain
    assert index.shared_tokens(other) == 0
    index.add_saved([bytes([i]) * 16 for i in range(10)])  # the oldest keys are forgotten
    assert index.saved_size == 10 and index.shared_tokens(pk) == 0


def test_load_is_parsed_from_engine_metrics() -> None:
    text = (
        "# TYPE kvtier_engine_requests_running gauge\nkvtier_engine_requests_running 3.0\n"
        "# TYPE kvtier_engine_requests_waiting gauge\nkvtier_engine_requests_waiting 2.0\n"
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 1.0\n'
    )
    assert parse_load(text) == 6
    assert parse_load("# TYPE x counter\nx_total 1.0\n") is None


# ---- G1 memory (cache_aware) -------------------------------------------------------------


def test_a_prefix_is_not_chased_onto_an_engine_whose_g1_is_full() -> None:
    es = engines(2)
    for e in es:
        e.kv_capacity_tokens = 2400
    # e0 holds 1,000 tokens of the prompt but its G1 is reserved by a request answering 64 tokens
    es[0].in_flight, es[0].reservations = 1, [Reservation(1400, 64)]
    es[1].in_flight, es[1].reservations = 1, [Reservation(800, 64)]
    r = Router("cache_aware")
    d = r.pick([Candidate(es[0], 1000), Candidate(es[1], 0)], 1200, answer_tokens=16)
    assert d.engine is es[1] and d.reason == "memory"
    # the same engines, capacity unknown: the prefix wins, as before
    for e in es:
        e.kv_capacity_tokens = 0
    d = r.pick([Candidate(es[0], 1000), Candidate(es[1], 0)], 1200, answer_tokens=16)
    assert d.engine is es[0] and d.reason == "g1_hit"


def test_memory_wait_is_the_answers_of_the_oldest_requests_that_must_end() -> None:
    e = engines(1)[0]
    e.kv_capacity_tokens = 3000
    e.reservations = [Reservation(1000, 10), Reservation(1000, 20), Reservation(500, 30)]
    assert memory_wait(e, 500, 500, 100) == (0, 0)  # fits in what is left
    assert memory_wait(e, 1200, 1200, 100)[0] == 1000  # the oldest must end first
    assert memory_wait(e, 2000, 2000, 100)[0] == 3000  # the two oldest
    e.kv_capacity_tokens = 0
    assert memory_wait(e, 10**6, 10**6, 100)[0] == 0  # unknown capacity: no wait


def test_under_memory_pressure_a_g1_prefix_counts_only_if_it_can_survive() -> None:
    es = engines(2)
    for e in es:
        e.kv_capacity_tokens = 2000
        e.in_flight = 1
    r = Router("cache_aware")
    cands = [Candidate(es[0], 1200), Candidate(es[1], 0)]
    # before it on each engine, a request that computes 1,600 new tokens: both must wait
    # for it, and it evicts the least recently used blocks: at most 2000 - 1600 - 116 of
    # what G1 holds now is still there when this one is admitted
    es[0].reservations = [Reservation(1600, 16)]
    es[1].reservations = [Reservation(1600, 16)]
    d = r.pick(cands, 1300, True, 16)
    assert d.engine is es[0] and d.g1_tokens == 284 and d.hit_tokens == 284
    # the request before it found 1,400 of its tokens in G1 (a user's next round):
    # it writes only 200 new ones, the prefix survives and counts whole
    es[0].reservations = [Reservation(1600, 16, new_tokens=200)]
    d = r.pick(cands, 1300, True, 16)
    assert d.engine is es[0] and d.g1_tokens == 1200


def test_a_roomy_g1_changes_nothing() -> None:
    es = engines(2)
    for e in es:
        e.kv_capacity_tokens = 100_000
    es[0].in_flight, es[0].reservations = 2, [Reservation(1400, 64), Reservation(1400, 64)]
    d = Router("cache_aware").pick([Candidate(es[0], 1000), Candidate(es[1], 0)], 1200, True, 16)
    assert d.engine is es[0] and d.g1_tokens == 1000 and d.reason == "g1_hit"


def test_kv_capacity_is_parsed_from_engine_metrics() -> None:
    kvtier = "# TYPE kvtier_engine_kv_blocks_total gauge\nkvtier_engine_kv_blocks_total 225.0\n"
    assert parse_kv_capacity(kvtier) == 225 * 16
    vllm = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",num_gpu_blocks="28",cache_dtype="auto"} 1.0\n'
    )
    assert parse_kv_capacity(vllm) == 28 * 128
    assert parse_kv_capacity("# TYPE x counter\nx_total 1.0\n") is None


def test_the_pool_counts_reservations_until_each_request_ends() -> None:
    client = httpx.AsyncClient()  # never used: begin and end do no I/O
    metrics = RouterMetrics(CollectorRegistry())
    pool = EnginePool([EngineSpec("http://e0")], client, metrics, interval_s=1.0, timeout_s=1.0)
    e = pool.engines[0]
    a, b = Reservation(100, 8), Reservation(100, 8)  # equal values, two requests
    pool.begin(e, 100, a)
    pool.begin(e, 100, b)
    pool.end(e, b)
    assert e.reservations == [a] and e.reservations[0] is a
    pool.end(e, a)
    assert e.reservations == [] and e.in_flight == 0


def test_memory_wait_tokens_zero_leaves_memory_unweighed() -> None:
    es = engines(2)
    for e in es:
        e.kv_capacity_tokens = 2400
    es[0].in_flight, es[0].reservations = 1, [Reservation(1400, 64)]
    d = Router("cache_aware", Weights(memory_wait_tokens=0)).pick(
        [Candidate(es[0], 1000), Candidate(es[1], 0)], 1200, answer_tokens=16
    )
    assert d.engine is es[0] and d.g1_tokens == 1000  # as before issue 21
    with pytest.raises(RouterConfigError):
        RouterConfig(engines=(EngineSpec("http://e0"),), memory_wait_tokens=-1)
