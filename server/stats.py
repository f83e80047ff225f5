"""The server's figures: cumulative snapshots from the metrics registry, and their history.

One :class:`StatsSource` reads the Prometheus registry (server and store
metrics) and the store's usage into a :class:`Snapshot`. A :class:`History`
samples it once per interval from a thread and keeps ``history_s`` seconds of
snapshots; rates over any window are differences of two snapshots. The Stats
RPC, ``/api/stats`` (the dashboard) and ``kvtier stats`` all read from here,
so they show the same figures.

Hit rates (server side; see ``docs/server.md``):

* **lookup hit rate**: keys found by Lookup calls (prefix semantics) / keys asked.
* **get hit rate**: blocks sent by Get / keys asked — the load hit rate of
  the server's clients.
* **per tier**: of the keys that reached a tier (a lower tier is only asked
  about what the tiers above missed), the share it had.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from kvtier.store import TieredStore

_Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class TierFigures:
    """Cumulative figures of one store tier."""

    name: str
    used_bytes: int
    capacity_bytes: int | None
    blocks: int | None
    get_hits: int
    get_misses: int
    contains_hits: int
    contains_misses: int
    evictions: int
    errors: int
    bytes_read: int
    bytes_written: int


@dataclass(frozen=True)
class TenantFigures:
    """Cumulative figures of one tenant label."""

    name: str
    requests: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0
    get_keys: int = 0
    get_hits: int = 0


@dataclass(frozen=True)
class Snapshot:
    """Every cumulative figure at one moment (``t``: wall-clock seconds)."""

    t: float
    lookup_keys: int
    lookup_hits: int
    get_keys: int
    get_hits: int
    bytes_in: int
    bytes_out: int
    requests: int
    errors: int
    tiers: list[TierFigures]
    tenants: list[TenantFigures]


@dataclass(frozen=True)
class Rates:
    """Rates between two snapshots. A hit rate is ``None`` when nothing was asked."""

    window_s: float
    lookup_hit_rate: float | None
    get_hit_rate: float | None
    bytes_in_per_s: float
    bytes_out_per_s: float
    requests_per_s: float
    errors_per_s: float
    tiers: dict[str, dict[str, float | None]] = field(default_factory=dict)
    tenants: dict[str, dict[str, float]] = field(default_factory=dict)


def _ratio(hits: float, asked: float) -> float | None:
    return hits / asked if asked > 0 else None


def rates(old: Snapshot, new: Snapshot) -> Rates:
    """What happened between ``old`` and ``new``."""
    dt = max(new.t - old.t, 1e-9)
    old_tiers = {t.name: t for t in old.tiers}
    tiers: dict[str, dict[str, float | None]] = {}
    for t in new.tiers:
        o = old_tiers.get(t.name)
        gh = t.get_hits - (o.get_hits if o else 0)
        gm = t.get_misses - (o.get_misses if o else 0)
        ch = t.contains_hits - (o.contains_hits if o else 0)
        cm = t.contains_misses - (o.contains_misses if o else 0)
        tiers[t.name] = {
            "get_hit_rate": _ratio(gh, gh + gm),
            "lookup_hit_rate": _ratio(ch, ch + cm),
            "used_bytes": float(t.used_bytes),
            "evictions_per_s": (t.evictions - (o.evictions if o else 0)) / dt,
            "errors_per_s": (t.errors - (o.errors if o else 0)) / dt,
            "read_bytes_per_s": (t.bytes_read - (o.bytes_read if o else 0)) / dt,
            "written_bytes_per_s": (t.bytes_written - (o.bytes_written if o else 0)) / dt,
        }
    old_tenants = {t.name: t for t in old.tenants}
    tenants: dict[str, dict[str, float]] = {}
    for tn in new.tenants:
        o2 = old_tenants.get(tn.name, TenantFigures(tn.name))
        tenants[tn.name] = {
            "requests_per_s": (tn.requests - o2.requests) / dt,
            "bytes_per_s": (tn.bytes_in + tn.bytes_out - o2.bytes_in - o2.bytes_out) / dt,
        }
    return Rates(
        window_s=dt,
        lookup_hit_rate=_ratio(
            new.lookup_hits - old.lookup_hits, new.lookup_keys - old.lookup_keys
        ),
        get_hit_rate=_ratio(new.get_hits - old.get_hits, new.get_keys - old.get_keys),
        bytes_in_per_s=(new.bytes_in - old.bytes_in) / dt,
        bytes_out_per_s=(new.bytes_out - old.bytes_out) / dt,
        requests_per_s=(new.requests - old.requests) / dt,
        errors_per_s=(new.errors - old.errors) / dt,
        tiers=tiers,
        tenants=tenants,
    )


class StatsSource:
    """Reads a :class:`Snapshot` from the registry and the store.

    Args:
        registry: Holds the server's and the store's metrics.
        store: For usage (bytes, capacity, blocks) per tier.
        clock: Wall clock (seconds).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        store: TieredStore,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._store = store
        self._clock = clock

    def _samples(self) -> dict[str, dict[_Labels, float]]:
        out: dict[str, dict[_Labels, float]] = {}
        for metric in self._registry.collect():
            for s in metric.samples:
                if s.name.endswith("_created"):
                    continue
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    def snapshot(self) -> Snapshot:
        """Every figure, now."""
        samples = self._samples()

        def total(name: str, **match: str) -> int:
            n = 0.0
            for labels, v in samples.get(name, {}).items():
                d = dict(labels)
                if all(d.get(k) == want for k, want in match.items()):
                    n += v
            return int(n)

        tenants: dict[str, dict[str, int]] = {}

        def add(tenant: str, key: str, v: float) -> None:
            tenants.setdefault(tenant, {})
            tenants[tenant][key] = tenants[tenant].get(key, 0) + int(v)

        for labels, v in samples.get("kvtier_server_requests_total", {}).items():
            d = dict(labels)
            add(d["tenant"], "requests", v)
            if d["code"] != "OK":
                add(d["tenant"], "errors", v)
        for labels, v in samples.get("kvtier_server_block_bytes_total", {}).items():
            d = dict(labels)
            add(d["tenant"], "bytes_in" if d["direction"] == "in" else "bytes_out", v)
        for labels, v in samples.get("kvtier_server_keys_total", {}).items():
            d = dict(labels)
            kind = "keys" if d["kind"] == "requested" else "hits"
            add(d["tenant"], f"{d['op']}_{kind}", v)

        tiers = []
        usage = self._store.usage()
        for tier in self._store.tiers:
            u = usage[tier.name]
            tiers.append(
                TierFigures(
                    name=tier.name,
                    used_bytes=u.used_bytes,
                    capacity_bytes=u.capacity_bytes,
                    blocks=u.num_blocks,
                    get_hits=total(
                        "kvtier_tier_ops_total", tier=tier.name, op="get", outcome="hit"
                    ),
                    get_misses=total(
                        "kvtier_tier_ops_total", tier=tier.name, op="get", outcome="miss"
                    ),
                    contains_hits=total(
                        "kvtier_tier_ops_total", tier=tier.name, op="contains", outcome="hit"
                    ),
                    contains_misses=total(
                        "kvtier_tier_ops_total", tier=tier.name, op="contains", outcome="miss"
                    ),
                    evictions=total("kvtier_evictions_total", tier=tier.name),
                    errors=total("kvtier_tier_errors_total", tier=tier.name)
                    + total("kvtier_corrupt_blocks_total", tier=tier.name),
                    bytes_read=total("kvtier_tier_bytes_total", tier=tier.name, op="get"),
                    bytes_written=total("kvtier_tier_bytes_total", tier=tier.name, op="put"),
                )
            )
        tenant_rows = [
            TenantFigures(name=name, **{k: v for k, v in figs.items()})
            for name, figs in sorted(tenants.items())
        ]
        return Snapshot(
            t=self._clock(),
            lookup_keys=sum(t.lookup_keys for t in tenant_rows),
            lookup_hits=sum(t.lookup_hits for t in tenant_rows),
            get_keys=sum(t.get_keys for t in tenant_rows),
            get_hits=sum(t.get_hits for t in tenant_rows),
            bytes_in=sum(t.bytes_in for t in tenant_rows),
            bytes_out=sum(t.bytes_out for t in tenant_rows),
            requests=sum(t.requests for t in tenant_rows),
            errors=sum(t.errors for t in tenant_rows),
            tiers=tiers,
            tenants=tenant_rows,
        )


class History:
    """Snapshots taken every ``interval_s`` by a daemon thread, ``history_s`` seconds of them.

    Args:
        source: What to sample.
        history_s: How far back to keep.
        interval_s: Sampling period.
    """

    def __init__(self, source: StatsSource, history_s: int, interval_s: float = 1.0) -> None:
        self.source = source
        self.interval_s = interval_s
        self._points: deque[Snapshot] = deque(maxlen=max(2, int(history_s / interval_s) + 1))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the first sample now and keep sampling in the background."""
        self.sample()
        self._thread = threading.Thread(target=self._run, name="kvtier-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> Snapshot:
        """Take one snapshot and append it."""
        snap = self.source.snapshot()
        with self._lock:
            self._points.append(snap)
        return snap

    def points(self) -> list[Snapshot]:
        with self._lock:
            return list(self._points)

    def recent(self, window_s: float = 10.0) -> Rates | None:
        """Rates from the oldest sample within ``window_s`` to a fresh snapshot, or ``None``."""
        now = self.source.snapshot()
        pts = self.points()
        older = [p for p in pts if now.t - p.t <= window_s and now.t - p.t > 0]
        if not older:
            older = pts[-1:]
        if not older or older[0].t >= now.t:
            return None
        return rates(older[0], now)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def dashboard_json(
    history: History,
    *,
    meta: dict[str, Any],
    top_tenants: int = 10,
    viewer: str | None = None,
) -> dict[str, Any]:
    """What ``/api/stats`` returns: the latest figures, recent rates and the series.

    ``viewer``: the metrics label of the tenant asking; its row is the only
    tenant row shown (as the Stats call shows a non-admin). ``None``: every tenant.
    """
    pts = history.points()
    now = history.source.snapshot()
    series = []
    for old, new in itertools.pairwise(pts):
        r = rates(old, new)
        series.append(
            {
                "t": new.t,
                "lookup_hit_rate": r.lookup_hit_rate,
                "get_hit_rate": r.get_hit_rate,
                "bytes_in_per_s": r.bytes_in_per_s,
                "bytes_out_per_s": r.bytes_out_per_s,
                "requests_per_s": r.requests_per_s,
                "errors_per_s": r.errors_per_s,
                "tiers": r.tiers,
            }
        )
    recent = history.recent()
    recent_tenants = recent.tenants if recent is not None else {}
    tenants = sorted(
        [t for t in now.tenants if viewer is None or t.name == viewer],
        key=lambda t: (
            -recent_tenants.get(t.name, {}).get("bytes_per_s", 0.0),
            -(t.bytes_in + t.bytes_out),
            -t.requests,
        ),
    )[:top_tenants]
    return {
        **meta,
        "t": now.t,
        "interval_s": history.interval_s,
        "totals": {k: v for k, v in asdict(now).items() if k not in ("tiers", "tenants", "t")},
        "tiers": [asdict(t) for t in now.tiers],
        "tenants": [
            {**asdict(t), **recent_tenants.get(t.name, {"requests_per_s": 0.0, "bytes_per_s": 0.0})}
            for t in tenants
        ],
        "recent": asdict(recent) if recent is not None else None,
        "series": series,
    }
