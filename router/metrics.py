"""The router's Prometheus metrics (the registry is passed in).

Labels are bounded: ``engine`` is one of the configured URLs, ``reason``,
``kind``, ``leg`` and ``outcome`` come from fixed sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """Everything ``/metrics`` of the router shows."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "kvtier_router_requests",
            "Requests answered, by the engine that answered (or 'none') and outcome",
            ["engine", "outcome"],
            registry=registry,
        )
        self.decisions = Counter(
            "kvtier_router_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=registry,
        )
        self.upstream_errors = Counter(
            "kvtier_router_upstream_errors",
            "Failed attempts at an engine, by kind (connect, status, dropped, timeout)",
            ["engine", "kind"],
            registry=registry,
        )
        self.retries = Counter(
            "kvtier_router_retries",
            "Requests sent to another engine after an attempt failed before the first byte",
            registry=registry,
        )
        self.in_flight = Gauge(
            "kvtier_router_in_flight",
            "Requests in flight per engine",
            ["engine"],
            registry=registry,
        )
        self.healthy = Gauge(
            "kvtier_router_engine_healthy",
            "1 while the engine passes health checks",
            ["engine"],
            registry=registry,
        )
        self.legs = Histogram(
            "kvtier_router_leg_seconds",
            "Time of each leg: prefill (P/D's first leg, to its answer), decode_first_byte / "
            "decode (P/D's second leg), direct_first_byte / direct (no P/D)",
            ["leg"],
            buckets=LEG_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvtier_router_prompt_tokens",
            "Prompt tokens of routed requests",
            registry=registry,
        )
        self.matched_tokens = Counter(
            "kvtier_router_matched_tokens",
            "Prompt tokens the picked engine was believed to hold, by where (g1, shared)",
            ["source"],
            registry=registry,
        )
        self.kv_events = Counter(
            "kvtier_router_kv_events",
            "KV event keys applied, by engine and type (stored, evicted, saved, snapshot)",
            ["engine", "type"],
            registry=registry,
        )
