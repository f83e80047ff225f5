"""What the Aerospike tier counts beyond the store's per-tier metrics.

The :class:`~kvtier.store.TieredStore` already counts every tier call's keys
by outcome, bytes and latency (``kvtier_tier_*``). The Aerospike tier adds
what only it can see, in two forms:

* :class:`AerospikeStats` — plain counters on the tier (``tier.stats()``),
  always on; benchmarks read ``round_trips`` to report round trips per block.
* :class:`AerospikeMetrics` — the same as Prometheus series with a ``tier``
  label, registered on the store's registry when the tier is given a
  :class:`~kvtier.metrics.StoreMetrics`.

Series (all labelled ``tier``):

* ``kvtier_aerospike_round_trips_total{op}`` — client calls that went to the
  network (op: contains, get, get_segments, put_check, put_check_segments,
  put, put_manifests, delete, cleanup, touch, info). Retries are round trips
  too.
* ``kvtier_aerospike_retries_total`` — retried transient failures.
* ``kvtier_aerospike_failures_total{kind}`` — transient, config, skipped
  (breaker open, no I/O), row (one key of a batch failed), connect,
  deadline (a read given up because the caller's deadline had passed before
  its next round trip could start).
* ``kvtier_aerospike_stop_writes_drops_total`` — blocks not written because
  the namespace is in stop-writes.
* ``kvtier_aerospike_segmented_blocks_total{op}`` — blocks written / read as
  segments plus manifest.
* ``kvtier_aerospike_broken_manifests_total`` — manifests whose segments were
  missing or wrong (served as misses and cleaned up).
* ``kvtier_aerospike_orphan_cleanups_total`` — segment records deleted by a
  writer that lost a race or failed before committing.
* ``kvtier_aerospike_breaker_open`` — 1 while the breaker is open or half-open.
* ``kvtier_aerospike_breaker_opens_total`` — times the breaker opened.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass
class AerospikeStats:
    """A snapshot of the tier's own counters."""

    round_trips: int = 0
    retries: int = 0
    transient_errors: int = 0
    config_errors: int = 0
    skipped_calls: int = 0
    deadline_skips: int = 0
    row_errors: int = 0
    stop_writes_drops: int = 0
    segmented_writes: int = 0
    segmented_reads: int = 0
    broken_manifests: int = 0
    orphan_cleanups: int = 0
    breaker_opens: int = 0
    skipped_puts: int = 0


class AerospikeMetrics:
    """Prometheus series of Aerospike tiers; one instance per registry, shared by its tiers.

    Args:
        registry: Where to register (the store's ``StoreMetrics.registry``).
        namespace: Metric name prefix.
    """

    def __init__(self, registry: CollectorRegistry, namespace: str = "kvtier") -> None:
        p, r = f"{namespace}_aerospike", registry
        self.round_trips = Counter(
            f"{p}_round_trips",
            "Aerospike client calls that went to the network",
            ["tier", "op"],
            registry=r,
        )
        self.retries = Counter(
            f"{p}_retries", "Transient Aerospike failures that were retried", ["tier"], registry=r
        )
        self.failures = Counter(
            f"{p}_failures", "Aerospike tier failures by kind", ["tier", "kind"], registry=r
        )
        self.stop_writes_drops = Counter(
            f"{p}_stop_writes_drops", "Blocks dropped because of stop-writes", ["tier"], registry=r
        )
        self.segmented_blocks = Counter(
            f"{p}_segmented_blocks",
            "Blocks written or read as segments",
            ["tier", "op"],
            registry=r,
        )
        self.broken_manifests = Counter(
            f"{p}_broken_manifests",
            "Manifests with missing or wrong segments",
            ["tier"],
            registry=r,
        )
        self.orphan_cleanups = Counter(
            f"{p}_orphan_cleanups", "Orphan segment records deleted", ["tier"], registry=r
        )
        self.breaker_open = Gauge(
            f"{p}_breaker_open",
            "1 while the tier's circuit breaker is open or half-open",
            ["tier"],
            registry=r,
        )
        self.breaker_opens = Counter(
            f"{p}_breaker_opens", "Times the circuit breaker opened", ["tier"], registry=r
        )


class StatsRecorder:
    """Counts into :class:`AerospikeStats` (thread-safe) and, if given, :class:`AerospikeMetrics`."""

    def __init__(self, tier: str, metrics: AerospikeMetrics | None) -> None:
        self._tier = tier
        self._metrics = metrics
        self._stats = AerospikeStats()
        self._lock = threading.Lock()

    def snapshot(self) -> AerospikeStats:
        with self._lock:
            return AerospikeStats(
                **{f.name: getattr(self._stats, f.name) for f in fields(AerospikeStats)}
            )

    def _add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + n)

    def round_trip(self, op: str) -> None:
        self._add("round_trips")
        if self._metrics:
            self._metrics.round_trips.labels(self._tier, op).inc()

    def retry(self) -> None:
        self._add("retries")
        if self._metrics:
            self._metrics.retries.labels(self._tier).inc()

    def failure(self, kind: str, n: int = 1) -> None:
        """kind: transient, config, skipped, deadline, row or connect."""
        stat = {
            "transient": "transient_errors",
            "config": "config_errors",
            "skipped": "skipped_calls",
            "deadline": "deadline_skips",
            "row": "row_errors",
        }
        if kind in stat:
            self._add(stat[kind], n)
        if self._metrics and n:
            self._metrics.failures.labels(self._tier, kind).inc(n)

    def stop_writes_drop(self, n: int = 1) -> None:
        self._add("stop_writes_drops", n)
        if self._metrics and n:
            self._metrics.stop_writes_drops.labels(self._tier).inc(n)

    def segmented(self, op: str, n: int = 1) -> None:
        self._add("segmented_writes" if op == "put" else "segmented_reads", n)
        if self._metrics and n:
            self._metrics.segmented_blocks.labels(self._tier, op).inc(n)

    def broken_manifest(self) -> None:
        self._add("broken_manifests")
        if self._metrics:
            self._metrics.broken_manifests.labels(self._tier).inc()

    def orphan_cleanup(self, n: int) -> None:
        self._add("orphan_cleanups", n)
        if self._metrics and n:
            self._metrics.orphan_cleanups.labels(self._tier).inc(n)

    def skipped_puts(self, n: int) -> None:
        """Blocks not uploaded: the namespace already held them complete (the store's
        ``kvtier_tier_puts_skipped_total`` counts them too)."""
        self._add("skipped_puts", n)

    def breaker_changed(self, opened: bool, is_open: bool) -> None:
        if opened:
            self._add("breaker_opens")
            if self._metrics:
                self._metrics.breaker_opens.labels(self._tier).inc()
        if self._metrics:
            self._metrics.breaker_open.labels(self._tier).set(1 if is_open else 0)
