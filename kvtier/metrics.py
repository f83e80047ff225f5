"""Prometheus metrics of the store and its tiers.

Labels are bounded: ``tier`` takes the configured tier names, ``op`` and
``outcome`` take the fixed values listed below. The registry is passed in;
nothing registers globally unless the caller passes the global registry.

Hit rates (see ``docs/metrics.md``):

* **lookup hit rate** = ``kvtier_lookup_tokens_total{kind="hit"}`` /
  ``kvtier_lookup_tokens_total{kind="requested"}``: the share of prompt tokens
  the cache *said* it had (prefix semantics: stops at the first missing chunk).
* **load hit rate** = ``kvtier_load_tokens_total{outcome="loaded"}`` /
  ``kvtier_lookup_tokens_total{kind="requested"}``: the share actually placed
  in the engine. Lower than the lookup hit rate when a block vanished or was
  corrupt between lookup and load, or a load timed out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

OPS = ("contains", "get", "put", "delete")
OUTCOMES = ("hit", "miss", "ok", "dropped", "error", "corrupt", "skipped")
_LATENCY_BUCKETS = (
    1e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
)


class StoreMetrics:
    """Counters, gauges and histograms of one :class:`~kvtier.store.TieredStore`.

    Args:
        registry: Where to register; a fresh private registry if ``None``.
        namespace: Metric name prefix.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "kvtier"
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, ns = self.registry, namespace
        self.lookups = Counter(
            f"{ns}_lookups", "Prefix lookups by outcome (hit/partial/miss)", ["outcome"], registry=r
        )
        self.lookup_keys = Counter(
            f"{ns}_lookup_keys",
            "Chunks asked for in lookups and chunks found",
            ["kind"],
            registry=r,
        )
        self.lookup_tokens = Counter(
            f"{ns}_lookup_tokens",
            "Prompt tokens asked for in lookups and tokens found",
            ["kind"],
            registry=r,
        )
        self.load_tokens = Counter(
            f"{ns}_load_tokens",
            "Tokens the connector tried to load, by outcome (loaded/failed)",
            ["outcome"],
            registry=r,
        )
        self.tier_ops = Counter(
            f"{ns}_tier_ops",
            "Tier operations per key, by outcome",
            ["tier", "op", "outcome"],
            registry=r,
        )
        self.tier_bytes = Counter(
            f"{ns}_tier_bytes",
            "Bytes read (get) and written (put) per tier",
            ["tier", "op"],
            registry=r,
        )
        self.puts_skipped = Counter(
            f"{ns}_tier_puts_skipped",
            "Blocks a tier did not write because it already held the key (same key, same bytes)",
            ["tier"],
            registry=r,
        )
        self.put_bytes_skipped = Counter(
            f"{ns}_tier_put_skipped_bytes",
            "Bytes of the blocks counted in kvtier_tier_puts_skipped_total",
            ["tier"],
            registry=r,
        )
        self.tier_latency = Histogram(
            f"{ns}_tier_op_seconds",
            "Latency of one batched tier call",
            ["tier", "op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.evictions = Counter(
            f"{ns}_evictions", "Blocks evicted for capacity", ["tier"], registry=r
        )
        self.corrupt_blocks = Counter(
            f"{ns}_corrupt_blocks",
            "Blocks that failed validation (deleted, served as a miss)",
            ["tier"],
            registry=r,
        )
        self.corrupt_reasons = Counter(
            f"{ns}_corrupt_block_reasons",
            "Corrupt blocks by what was wrong: key_mismatch (a valid block of another key), "
            "version (another block format), checksum, length, shape, header, magic; "
            "tier 'load' counts blocks rejected while decoding for the engine",
            ["tier", "reason"],
            registry=r,
        )
        self.tier_errors = Counter(
            f"{ns}_tier_errors",
            "Tier failures by kind (transient/config/io/unavailable)",
            ["tier", "kind"],
            registry=r,
        )
        self.promotions = Counter(
            f"{ns}_promotions",
            "Blocks copied up into a faster tier after a hit",
            ["tier"],
            registry=r,
        )
        self.queue_depth = Gauge(
            f"{ns}_writer_queue_depth",
            "Blocks waiting in a background writer queue",
            ["tier"],
            registry=r,
        )
        self.queue_dropped = Counter(
            f"{ns}_writer_dropped",
            "Blocks dropped because a writer queue was full",
            ["tier"],
            registry=r,
        )
        self.used_bytes = Gauge(
            f"{ns}_tier_used_bytes", "Bytes held per tier", ["tier"], registry=r
        )
        self.capacity_bytes = Gauge(
            f"{ns}_tier_capacity_bytes",
            "Capacity per tier (absent if unknown)",
            ["tier"],
            registry=r,
        )
        self.stage_latency = Histogram(
            f"{ns}_stage_seconds",
            "Latency of connector stages (lookup/load/save/verify)",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.verify_checks = Counter(
            f"{ns}_verify_checks",
            "Loaded chunks recomputed and compared with their stored block (connector."
            "verify_fraction), by outcome: match, mismatch (key deleted and quarantined), "
            "missing (gone before the compare), error, dropped (verifier queue full)",
            ["outcome"],
            registry=r,
        )

    def observe_op(self, tier: str, op: str, outcome: str, n: int = 1) -> None:
        if n:
            self.tier_ops.labels(tier, op, outcome).inc(n)

    def put_skipped(self, tier: str, n: int, nbytes: int) -> None:
        """A tier skipped ``n`` puts of ``nbytes`` bytes in all: it already held those keys."""
        if n:
            self.puts_skipped.labels(tier).inc(n)
            self.put_bytes_skipped.labels(tier).inc(nbytes)

    def count_corrupt(self, tier: str, reason: str) -> None:
        """One corrupt block from ``tier`` (``kvtier_corrupt_blocks_total``), and why."""
        self.corrupt_blocks.labels(tier).inc()
        self.corrupt_reasons.labels(tier, reason).inc()

    @contextmanager
    def time_op(self, tier: str, op: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.tier_latency.labels(tier, op).observe(time.perf_counter() - start)

    @contextmanager
    def time_stage(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stage_latency.labels(stage).observe(time.perf_counter() - start)

    def track_usage(self, tier: str, used: Callable[[], float], capacity: float | None) -> None:
        """Report a tier's bytes used at scrape time (no polling thread)."""
        self.used_bytes.labels(tier).set_function(used)
        if capacity is not None:
            self.capacity_bytes.labels(tier).set(capacity)

    def track_queue(self, tier: str, depth: Callable[[], float]) -> None:
        self.queue_depth.labels(tier).set_function(depth)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Read one sample (for tests, the demo and ``kvtier stats``); 0 if absent."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v
