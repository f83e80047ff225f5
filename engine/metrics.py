"""Prometheus metrics of one engine, registered on a registry the caller passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.engine.outputs import EngineStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# EngineStats counter field -> (metric name, help)
_COUNTERS = {
    "prefix_cache_queries_tokens": (
        "kvtier_engine_prefix_cache_queries_tokens",
        "Prompt tokens looked up in the engine's own (G1) prefix cache",
    ),
    "prefix_cache_hit_tokens": (
        "kvtier_engine_prefix_cache_hit_tokens",
        "Prompt tokens found in the engine's own (G1) prefix cache",
    ),
    "prompt_tokens_computed": (
        "kvtier_engine_prompt_tokens",
        "Prompt tokens computed by the model (not cached, not loaded)",
    ),
    "generation_tokens": ("kvtier_engine_generation_tokens", "Generated tokens"),
    "external_loaded_tokens": (
        "kvtier_engine_external_loaded_tokens",
        "Prompt tokens whose KV was loaded through the KV connector",
    ),
    "load_failures": (
        "kvtier_engine_load_failures",
        "Requests whose KV connector lookup or load failed (recomputed instead)",
    ),
    "recomputed_after_load_failure_tokens": (
        "kvtier_engine_recomputed_after_load_failure_tokens",
        "Tokens recomputed because a KV connector load failed",
    ),
    "num_preemptions": ("kvtier_engine_preemptions", "Requests preempted for lack of KV blocks"),
}


class EngineMetrics:
    """TTFT / inter-token latency histograms, queue gauges and token counters.

    Args:
        registry: Where the metrics are registered (never the global default
            unless the caller passes it).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "kvtier_engine_time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "kvtier_engine_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.waiting = Gauge(
            "kvtier_engine_requests_waiting", "Requests in the waiting queue", registry=registry
        )
        self.running = Gauge(
            "kvtier_engine_requests_running", "Requests in the running batch", registry=registry
        )
        self.kv_blocks_used = Gauge(
            "kvtier_engine_kv_blocks_used", "KV blocks referenced by requests", registry=registry
        )
        self.kv_blocks_total = Gauge(
            "kvtier_engine_kv_blocks_total", "KV blocks in the cache", registry=registry
        )
        self._counters = {
            field: Counter(name, doc, registry=registry) for field, (name, doc) in _COUNTERS.items()
        }
        self._last = {field: 0 for field in _COUNTERS}

    def observe_ttft(self, seconds: float) -> None:
        """Records one time-to-first-token."""
        self.ttft.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        """Records one inter-token latency."""
        self.itl.observe(seconds)

    def update(self, stats: EngineStats) -> None:
        """Sets gauges and advances counters to the engine's cumulative ``stats``."""
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        for field, counter in self._counters.items():
            value = int(getattr(stats, field))
            delta = value - self._last[field]
            if delta > 0:
                counter.inc(delta)
                self._last[field] = value
