"""Prometheus metrics of the cache server itself (the store's are in :mod:`kvtier.metrics`).

Labels are bounded: ``tenant`` takes the first ``metrics_max_tenants``
configured names, ``anonymous``, ``unauthenticated`` and ``other``;
``method`` the seven RPC names and the data plane's ``data.Connect``,
``data.Get``, ``data.Put`` (``data.Unknown`` for an unknown op); ``code`` the gRPC status names; ``kind`` and
``direction`` fixed values.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

METHODS = ("Lookup", "Exists", "Get", "Put", "Delete", "Stats", "Health")

_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


class ServerMetrics:
    """Request, traffic and limit counters of one server, in the given registry.

    Args:
        registry: Shared with the store's :class:`~kvtier.metrics.StoreMetrics`
            so that ``/metrics`` serves both.
        namespace: Metric name prefix.
    """

    def __init__(self, registry: CollectorRegistry, namespace: str = "kvtier_server") -> None:
        ns, r = namespace, registry
        self.requests = Counter(
            f"{ns}_requests",
            "Calls by tenant, method and gRPC status code",
            ["tenant", "method", "code"],
            registry=r,
        )
        self.bytes = Counter(
            f"{ns}_block_bytes",
            "Block bytes received (in: Put) and sent (out: Get) by tenant",
            ["tenant", "direction"],
            registry=r,
        )
        self.keys = Counter(
            f"{ns}_keys",
            "Keys asked for and found, by tenant and op (lookup: prefix hits; get: blocks sent)",
            ["tenant", "op", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            f"{ns}_request_seconds",
            "Duration of a call, by method",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(f"{ns}_inflight_requests", "Calls being served", registry=r)
        self.inflight_put_bytes = Gauge(
            f"{ns}_inflight_put_bytes",
            "Block bytes reserved by Put streams being received",
            registry=r,
        )
        self.rejected = Counter(
            f"{ns}_rejected",
            "Requests refused, by reason (invalid, unauthenticated, denied, limit, draining)",
            ["reason"],
            registry=r,
        )
        self.incomplete_puts = Counter(
            f"{ns}_incomplete_puts",
            "Blocks discarded because their Put stream ended or broke before they were complete",
            registry=r,
        )
        self.data_connections = Gauge(
            f"{ns}_data_connections", "Data-plane connections open", registry=r
        )
        self.bad_blocks = Counter(
            f"{ns}_bad_blocks",
            "Blocks reported wrong by a reader's verification (deleted), by the tenant that "
            "wrote them (unknown: unstamped)",
            ["writer"],
            registry=r,
        )
        self.bad_block_reports = Counter(
            f"{ns}_bad_block_reports",
            "Keys reported wrong, by the reporting tenant (found or not)",
            ["tenant"],
            registry=r,
        )
        self.withheld_blocks = Counter(
            f"{ns}_withheld_blocks",
            "Stored blocks not served to a reader, by reason (untrusted: its writer is not "
            "one the reader trusts; provenance: its stamp did not verify)",
            ["reason"],
            registry=r,
        )
        self.cancelled_calls = Counter(
            f"{ns}_cancelled_calls",
            "Calls and data-plane requests ended by the server, by reason (idle: no progress "
            "for stream_idle_timeout_s; deadline: past call_timeout_s)",
            ["reason"],
            registry=r,
        )
        self.ready = Gauge(
            f"{ns}_ready", "1 while serving, 0 while starting or draining", registry=r
        )
