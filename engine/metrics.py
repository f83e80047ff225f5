"""Prometheus metrics of one engine, registered on a registry the caller passes in."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.engine.outputs import EngineStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
# Where an engine step's time goes (``LLMEngine.step``), and, in the engine-core
# process, the loop around it.
STEP_PHASES = ("schedule", "load", "forward", "finish")
CORE_PARTS = ("commands", "publish")

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
        self.loading = Gauge(
            "kvtier_engine_requests_loading",
            "Requests waiting for their external KV (asynchronous connector loads)",
            registry=registry,
        )
        self.kv_blocks_used = Gauge(
            "kvtier_engine_kv_blocks_used", "KV blocks referenced by requests", registry=registry
        )
        self.kv_blocks_total = Gauge(
            "kvtier_engine_kv_blocks_total", "KV blocks in the cache", registry=registry
        )
        self.step_duration = Histogram(
            "kvtier_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, load, forward, finish)",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self.step_batch_tokens = Counter(
            "kvtier_engine_step_tokens",
            "Tokens computed by engine steps, by kind (prefill or decode)",
            ["kind"],
            registry=registry,
        )
        self.step_phase = Counter(
            "kvtier_engine_step_phase_seconds",
            "Time spent in each phase of engine steps; in the engine-core process also "
            "draining commands and publishing outputs",
            ["phase"],
            registry=registry,
        )
        self._phases = {p: self.step_phase.labels(p) for p in (*STEP_PHASES, *CORE_PARTS)}
        self._kinds = {k: self.step_batch_tokens.labels(k) for k in ("prefill", "decode")}
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

    def observe_step(
        self, phases: dict[str, float], prefill_tokens: int, decode_tokens: int
    ) -> None:
        """Records one step: seconds per phase (``STEP_PHASES``) and tokens computed."""
        self.step_duration.observe(sum(phases.values()))
        for phase, seconds in phases.items():
            self._phases[phase].inc(seconds)
        if prefill_tokens:
            self._kinds["prefill"].inc(prefill_tokens)
        if decode_tokens:
            self._kinds["decode"].inc(decode_tokens)

    def observe_core(self, part: str, seconds: float) -> None:
        """Records time the engine-core loop spent outside steps (``CORE_PARTS``)."""
        self._phases[part].inc(seconds)

    def update(self, stats: EngineStats) -> None:
        """Sets gauges and advances counters to the engine's cumulative ``stats``."""
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.loading.set(stats.num_loading)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        for field, counter in self._counters.items():
            value = int(getattr(stats, field))
            delta = value - self._last[field]
            if delta > 0:
                counter.inc(delta)
                self._last[field] = value
