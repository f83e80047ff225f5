"""The HTTP server's own Prometheus metrics (the engine and connector have theirs)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# Bounded label values: anything else is counted as "other".
ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/health",
    "/metrics",
)


class ServerMetrics:
    """Request counts by endpoint and status class, and requests in flight.

    Args:
        registry: Where the metrics are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvtier_engine_http_requests",
            "HTTP requests answered, by endpoint and status class (2xx, 4xx, 5xx)",
            ["endpoint", "status"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "kvtier_engine_http_requests_in_flight",
            "Generation requests being served (streams included)",
            registry=registry,
        )

    def observe(self, path: str, status: int) -> None:
        """Counts one answered request."""
        endpoint = path if path in ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=f"{status // 100}xx").inc()
