"""Scaling signals and the recommended replica count, as pure functions of time and events."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.router.engine_stats import CounterWindow, hit_rates, parse_engine_stats
from kvtier.router.scaling import ScalingTarget, recommend_replicas
from kvtier.router.signals import FleetSignals, SampleWindow, SignalTracker, SumWindow, percentile

# ---- windows ------------------------------------------------------------------------------------


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        percentile(values, 0)


def test_sample_window_forgets_old_samples_and_bounds_memory() -> None:
    w = SampleWindow(window_s=10.0, max_samples=5)
    for t in range(8):
        w.add(float(t), float(t))
    assert w.values(7.0) == [3.0, 4.0, 5.0, 6.0, 7.0]  # only the newest 5 kept
    assert w.values(14.5) == [5.0, 6.0, 7.0]  # samples at t <= 4.5 left the window
    assert w.percentile(14.5, 99) == 7.0
    assert w.percentile(100.0, 50) is None


def test_sum_window_counts_only_the_window() -> None:
    w = SumWindow(window_s=3.0, bucket_s=1.0)
    w.add(0.2, 5)
    w.add(1.5, 7)
    w.add(2.9, 1)
    assert w.total(2.9) == 13
    assert w.total(3.1) == 8  # the bucket [0, 1) is out
    assert w.total(10.0) == 0
    with pytest.raises(ValueError):
        SumWindow(window_s=1.0, bucket_s=2.0)


# ---- the tracker --------------------------------------------------------------------------------


def test_queue_depth_and_in_flight_tokens_follow_attempts() -> None:
    t = SignalTracker(window_s=10.0)
    a = t.begin("e1", 300, now=0.0)
    b = t.begin("e1", 200, now=0.5)
    c = t.begin("e2", 100, now=0.5)
    s = t.snapshot(1.0)
    assert s.engines["e1"].queue_depth == 2 and s.engines["e1"].prefill_tokens_in_flight == 500
    assert s.queue_depth == 3 and s.prefill_tokens_in_flight == 600
    t.prefill_done(a, 1.0)
    t.prefill_done(a, 1.5)  # idempotent
    t.answered(b, 1.2, 1.7)  # answered implies the prefill is done
    s = t.snapshot(2.0)
    assert s.engines["e1"].queue_depth == 0 and s.engines["e1"].prefill_tokens_in_flight == 0
    assert s.engines["e2"].queue_depth == 1
    t.answered(c, 0.5, 2.0)
    assert t.snapshot(2.0).queue_depth == 0


def test_ttft_percentiles_are_over_the_window_per_engine_and_fleet() -> None:
    t = SignalTracker(window_s=10.0)
    for i in range(99):
        a = t.begin("fast", 10, now=float(i) * 0.01)
        t.answered(a, 0.1, float(i) * 0.01 + 0.1)
    slow = t.begin("slow", 10, now=1.0)
    t.answered(slow, 5.0, 6.0)
    s = t.snapshot(6.0)
    assert s.engines["fast"].ttft_p99_s == pytest.approx(0.1)
    assert s.engines["slow"].ttft_p50_s == 5.0
    assert s.ttft_samples == 100
    assert s.ttft_p50_s == pytest.approx(0.1) and s.ttft_p99_s == pytest.approx(0.1)
    a = t.begin("slow", 10, now=6.0)
    t.answered(a, 5.0, 6.0)
    assert t.snapshot(6.0).ttft_p99_s == 5.0  # 2 of 101 samples are slow
    late = t.snapshot(15.5)  # the fast ones (t <= 1.1) left the window
    assert late.ttft_samples == 2 and late.engines["fast"].ttft_p50_s is None


def test_capacity_is_tokens_per_busy_second_even_when_requests_queue() -> None:
    t = SignalTracker(window_s=30.0, min_busy_s=1.0)
    # an engine computing 1,000 tokens/s, three 2,000-token prompts sent at once:
    # they finish at 2, 4 and 6 s (TTFTs 2, 4, 6 s: tokens/TTFT would say 500 on average)
    attempts = [t.begin("e", 2000, now=0.0) for _ in range(3)]
    for i, a in enumerate(attempts):
        t.answered(a, 2.0 * (i + 1), 2.0 * (i + 1))
    s = t.snapshot(10.0)
    assert s.engines["e"].capacity_tokens_per_s == pytest.approx(1000.0)
    assert s.capacity_tokens_per_s == pytest.approx(1000.0)
    assert s.engines["e"].busy_fraction == pytest.approx(0.6)
    assert s.engines["e"].demand_tokens_per_s == pytest.approx(600.0)  # 6,000 tokens / 10 s
    # quiet for a whole window: the last capacity measured is kept, demand falls to 0
    later = t.snapshot(100.0)
    assert later.engines["e"].capacity_tokens_per_s == pytest.approx(1000.0)
    assert later.demand_tokens_per_s == 0.0


def test_capacity_needs_enough_busy_time_and_answered_tokens() -> None:
    t = SignalTracker(window_s=30.0, min_busy_s=1.0)
    a = t.begin("e", 500, now=0.0)
    t.answered(a, 0.2, 0.2)  # 0.2 busy seconds: too little to measure
    assert t.snapshot(1.0).engines["e"].capacity_tokens_per_s is None
    failed = t.begin("e", 5000, now=1.0)
    t.prefill_done(failed, 3.0)  # failed: busy, but no tokens answered
    assert t.snapshot(3.0).engines["e"].capacity_tokens_per_s == pytest.approx(500 / 2.2)


def test_an_engine_that_leaves_keeps_its_demand_in_the_fleet_window() -> None:
    t = SignalTracker(window_s=10.0)
    t.add_engine("idle")
    a = t.begin("gone", 1000, now=0.0)
    t.answered(a, 1.0, 1.0)
    t.remove_engine("gone")
    s = t.snapshot(5.0)
    assert list(s.engines) == ["idle"]
    assert s.demand_tokens_per_s == pytest.approx(200.0)


# ---- the recommendation -------------------------------------------------------------------------


def fleet(**kw: object) -> FleetSignals:
    base = {
        "engines": {},
        "queue_depth": 0,
        "prefill_tokens_in_flight": 0,
        "ttft_p50_s": 0.5,
        "ttft_p99_s": 1.0,
        "ttft_samples": 100,
        "demand_tokens_per_s": 7000.0,
        "capacity_tokens_per_s": 1000.0,
        "window_s": 30.0,
    }
    base.update(kw)
    return FleetSignals(**base)  # type: ignore[arg-type]


TARGET = ScalingTarget(ttft_target_s=2.0, min_replicas=1, max_replicas=20, target_utilization=0.7)


def test_replicas_follow_demand_over_measured_capacity() -> None:
    r = recommend_replicas(fleet(), current=4, target=TARGET)
    assert (r.replicas, r.reason, r.by_capacity, r.by_kv, r.by_ttft) == (
        10,
        "capacity",
        10,
        None,
        None,
    )
    assert recommend_replicas(fleet(demand_tokens_per_s=700.0), 4, TARGET).replicas == 1


def test_replicas_rise_with_the_queue() -> None:
    counts = [
        recommend_replicas(fleet(prefill_tokens_in_flight=q), 4, TARGET).replicas
        for q in (0, 2800, 14000)
    ]
    assert counts == [10, 12, 20]  # (7000 + q / 2) / 700


def test_replicas_rise_when_ttft_p99_misses_the_target_with_requests_queued() -> None:
    low = fleet(demand_tokens_per_s=1400.0, queue_depth=5)  # capacity alone: 2
    assert recommend_replicas(low, 4, TARGET).replicas == 2
    r = recommend_replicas(dataclasses.replace(low, ttft_p99_s=2.5), 4, TARGET)
    assert (r.replicas, r.reason, r.by_ttft) == (5, "ttft", 5)  # 4 x 2.5 / 2
    r = recommend_replicas(dataclasses.replace(low, ttft_p99_s=30.0), 4, TARGET)
    assert r.replicas == 6  # at most max_step_up (1.5x) at once
    # no more requests awaiting a first byte than engines: the slow answers are history
    r = recommend_replicas(dataclasses.replace(low, ttft_p99_s=30.0, queue_depth=4), 4, TARGET)
    assert (r.replicas, r.by_ttft) == (2, None)


def test_replicas_rise_when_kv_memory_fills() -> None:
    low = fleet(demand_tokens_per_s=1400.0)  # capacity alone: 2
    r = recommend_replicas(low, 4, TARGET, kv_usage=0.96)
    assert (r.replicas, r.reason, r.by_kv) == (5, "kv", 5)  # ceil(4 x 0.96 / 0.8)
    r = recommend_replicas(low, 4, TARGET, kv_usage=0.3)
    assert (r.replicas, r.reason, r.by_kv) == (2, "capacity", 2)


def test_bounds_and_no_measurement() -> None:
    assert recommend_replicas(fleet(demand_tokens_per_s=1e6), 4, TARGET).replicas == 20
    assert recommend_replicas(fleet(demand_tokens_per_s=1e6), 4, TARGET).reason == "max"
    idle = fleet(demand_tokens_per_s=0.0, ttft_p99_s=None)
    r = recommend_replicas(idle, 4, TARGET)
    assert (r.replicas, r.reason) == (1, "min")
    unknown = fleet(capacity_tokens_per_s=None, ttft_p99_s=None)
    r = recommend_replicas(unknown, 3, TARGET)
    assert (r.replicas, r.reason) == (3, "hold")
    assert recommend_replicas(unknown, 0, TARGET).replicas == 1
    with pytest.raises(ValueError, match="min_replicas"):
        ScalingTarget(min_replicas=5, max_replicas=2)
    with pytest.raises(ValueError, match="target_utilization"):
        ScalingTarget(target_utilization=0.0)
    with pytest.raises(ValueError, match="kv_target"):
        ScalingTarget(kv_target=1.5)
    with pytest.raises(ValueError, match="current"):
        recommend_replicas(idle, -1, TARGET)


def test_the_tracker_feeds_the_recommendation() -> None:
    t = SignalTracker(window_s=10.0)
    now = 0.0
    for _ in range(20):  # one engine, 1,000 tokens every 0.5 s, each done in 0.25 s
        a = t.begin("e", 1000, now=now)
        t.answered(a, 0.25, now + 0.25)
        now += 0.5
    r = recommend_replicas(t.snapshot(now), 1, TARGET)
    # capacity 4,000 tokens/s, demand 2,000 tokens/s: one engine at 50 % of capacity
    assert r.by_capacity == 1 and r.replicas == 1
    for _ in range(20):  # four times the arrivals, queueing: TTFT grows past the target
        for _ in range(4):
            t.begin("e", 1000, now=now)
        now += 0.5
    r = recommend_replicas(t.snapshot(now), 1, TARGET)
    assert r.replicas > 3 and r.by_capacity is not None and r.by_capacity > 3


# ---- what engines report ------------------------------------------------------------------------


def test_engine_stats_from_the_bundled_engine_and_from_vllm() -> None:
    kvtier = (
        "# TYPE kvtier_engine_requests_waiting gauge\nkvtier_engine_requests_waiting 3\n"
        "# TYPE kvtier_engine_kv_blocks_used gauge\nkvtier_engine_kv_blocks_used 25\n"
        "# TYPE kvtier_engine_kv_blocks_total gauge\nkvtier_engine_kv_blocks_total 100\n"
        "# TYPE kvtier_engine_prefix_cache_hit_tokens counter\n"
        "kvtier_engine_prefix_cache_hit_tokens_total 40\n"
    )
    s = parse_engine_stats(kvtier)
    assert s is not None and s.waiting == 3 and s.kv_usage == 0.25
    assert s.counters == {"prefix_hits": 40}
    vllm = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000\n'
        "# TYPE vllm:external_prefix_cache_hits counter\n"
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 300\n'
    )
    s = parse_engine_stats(vllm)
    assert s is not None and s.waiting == 3 and s.kv_usage == 0.5 and s.running is None
    assert s.counters == {"prefix_queries": 1000, "shared_hits": 300}
    # vLLM without prefix caching counts no G1 queries: shared over the tokens queried externally
    w = CounterWindow(window_s=10.0)
    w.add(0.0, {"prefix_queries": 0, "shared_hits": 0, "shared_queries": 0})
    w.add(1.0, {"prefix_queries": 0, "shared_hits": 300, "shared_queries": 1200})
    assert hit_rates(w, 1.0) == {"g1": None, "shared": 0.25}
    w.add(2.0, {"prefix_queries": 2000, "prefix_hits": 500, "shared_hits": 800,
                "shared_queries": 1700})  # fmt: skip
    assert hit_rates(w, 2.0)["shared"] == pytest.approx(0.4)  # 800 / 2000 G1 queries
    assert parse_engine_stats("not { prometheus") is None


def test_counter_window_rates_are_increases_within_the_window() -> None:
    w = CounterWindow(window_s=10.0)
    assert w.ratio(0.0, "hits", "queries") is None
    w.add(0.0, {"hits": 0, "queries": 0})
    w.add(5.0, {"hits": 50, "queries": 100})
    assert w.ratio(5.0, "hits", "queries") == 0.5
    w.add(20.0, {"hits": 60, "queries": 200})
    assert w.increase(20.0, "queries") == 100  # the sample at 5 s is the window's base
    assert w.ratio(20.0, "hits", "queries") == pytest.approx(0.1)
    w.add(21.0, {"hits": 0, "queries": 0})  # the engine restarted
    assert w.increase(21.0, "hits") is None
