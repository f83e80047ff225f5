"""The router's live scaling signals: fed by its engines and requests, read by ``/scaling`` and ``/metrics``.

Where each figure comes from:

* the engine pool's accounting (``EnginePool.begin`` / ``first_byte``): an
  attempt's uncached prompt tokens and when its engine answered;
* :class:`SignalsMiddleware`: when the client got the first byte of a
  successful answer (TTFT, measured by the router from the request's arrival);
* the pool's ``/metrics`` scrapes of each engine: waiting, KV usage, the
  engine's own G1 and shared-tier hit counters (``router/engine_stats.py``);
* the router's own counters (``kvtier_router_prompt_tokens``,
  ``kvtier_router_matched_tokens``): the fleet's hit rates as the router
  sees them (what the engine it picked was believed to hold).

NOTE: an attempt is tied to its request by a context variable the middleware
sets, so the pool's accounting calls need no request handle: the proxy's
``begin`` / ``first_byte`` run inside the request's context (the relay too,
on a copy of it). Attempts outside a request (none today) are not tracked.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.router.config import RouterConfig
from kvtier.router.engine_stats import CounterWindow, EngineStats, hit_rates, parse_engine_stats
from kvtier.router.metrics import RouterMetrics
from kvtier.router.scaling import ScalingTarget, recommend_replicas
from kvtier.router.signals import Attempt, SignalTracker

ROUTER_COUNTER_SAMPLE_S = 1.0


@dataclass
class _RequestTrace:
    arrived: float
    attempt: Attempt | None = None


_TRACE: ContextVar[_RequestTrace | None] = ContextVar("kvtier_router_request", default=None)


def scaling_target(config: RouterConfig) -> ScalingTarget:
    """The recommendation's target from the router's configuration."""
    return ScalingTarget(
        ttft_target_s=config.ttft_target_s,
        min_replicas=config.min_replicas,
        max_replicas=config.max_replicas,
        target_utilization=config.target_utilization,
    )


class RouterSignals:
    """The signals of one router (touched only on its event loop).

    Args:
        config: The router's configuration (engines, window, target).
        metrics: The router's metrics (its token counters give the fleet's hit rates).
        clock: Monotonic seconds.
    """

    def __init__(
        self,
        config: RouterConfig,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.target = scaling_target(config)
        self.clock = clock
        self.tracker = SignalTracker(window_s=config.signals_window_s, start=clock())
        self._metrics = metrics
        self._stats: dict[str, EngineStats] = {}
        self._engine_counters = {e.url: CounterWindow(config.signals_window_s)
                                 for e in config.engines}  # fmt: skip
        self._router_counters = CounterWindow(config.signals_window_s)
        self._router_sampled = -float("inf")
        for e in config.engines:
            self.tracker.add_engine(e.url)

    # ---- feeding ---------------------------------------------------------------------------

    def begin(self, url: str, prefill_tokens: int) -> None:
        """The current request was sent to ``url`` with ``prefill_tokens`` to compute there."""
        trace = _TRACE.get()
        if trace is None:
            return
        now = self.clock()
        if trace.attempt is not None:
            self.tracker.prefill_done(trace.attempt, now)
        trace.attempt = self.tracker.begin(url, prefill_tokens, now)

    def first_byte(self, url: str) -> None:
        """``url`` answered the current request's attempt (or the attempt ended)."""
        trace = _TRACE.get()
        if trace is not None and trace.attempt is not None and trace.attempt.engine == url:
            self.tracker.prefill_done(trace.attempt, self.clock())

    def answered(self, trace: _RequestTrace) -> None:
        """The client got the first byte of a successful answer."""
        if trace.attempt is not None:
            now = self.clock()
            self.tracker.answered(trace.attempt, now - trace.arrived, now)

    def engine_scraped(self, url: str, metrics_text: str) -> None:
        """An engine's ``/metrics`` was read (by a health check)."""
        stats = parse_engine_stats(metrics_text)
        if stats is None:
            return
        now = self.clock()
        self._stats[url] = stats
        if stats.counters:  # NOTE: engines may join at runtime (POST /engines)
            window = self._engine_counters.get(url)
            if window is None:
                window = self._engine_counters[url] = CounterWindow(self.config.signals_window_s)
            window.add(now, stats.counters)
        self._sample_router_counters(now)

    def _sample_router_counters(self, now: float) -> None:
        if now - self._router_sampled < ROUTER_COUNTER_SAMPLE_S:
            return
        self._router_sampled = now
        # NOTE: read from the counters themselves, not the registry: a registry read
        # would collect this module's own collector, which reads here again.
        values = {"prompt": 0.0, "g1": 0.0, "shared": 0.0}
        for counter in (self._metrics.prompt_tokens, self._metrics.matched_tokens):
            for family in counter.collect():
                for s in family.samples:
                    if s.name.endswith("_total"):
                        values[s.labels.get("source", "prompt")] += s.value
        self._router_counters.add(now, values)

    # ---- reading ---------------------------------------------------------------------------

    def report(self, engines: Sequence[Any]) -> dict[str, Any]:
        """Per-engine and fleet signals and the recommendation, JSON-ready (``GET /scaling``).

        Args:
            engines: The pool's engines (``url``, ``role``, ``healthy``, ``warming``,
                ``in_flight``).
        """
        now = self.clock()
        self._sample_router_counters(now)
        snap = self.tracker.snapshot(now)
        # NOTE: an engine warming up (POST /engines) is healthy but not routed to yet
        serving = [e for e in engines
                   if e.healthy and not e.warming and e.role in ("both", "prefill")]  # fmt: skip
        per_engine = {}
        usages = []
        for e in engines:
            sig = snap.engines.get(e.url)
            stats = self._stats.get(e.url)
            window = self._engine_counters.get(e.url)
            if stats is not None and stats.kv_usage is not None and e.healthy:
                usages.append(stats.kv_usage)
            per_engine[e.url] = {
                "role": e.role,
                "healthy": e.healthy,
                "warming": e.warming,
                "in_flight": e.in_flight,
                **(asdict(sig) if sig is not None else {}),
                "engine_waiting": stats.waiting if stats is not None else None,
                "engine_running": stats.running if stats is not None else None,
                "kv_usage": stats.kv_usage if stats is not None else None,
                "hit_rate": hit_rates(window, now) if window else {"g1": None, "shared": None},
            }
        kv_usage = sum(usages) / len(usages) if usages else None
        rec = recommend_replicas(snap, len(serving), self.target, kv_usage)
        rc = self._router_counters
        return {
            "window_s": snap.window_s,
            "engines": per_engine,
            "fleet": {
                "engines": len(engines),
                "ready_replicas": len(serving),
                "queue_depth": snap.queue_depth,
                "prefill_tokens_in_flight": snap.prefill_tokens_in_flight,
                "ttft_p50_s": snap.ttft_p50_s,
                "ttft_p99_s": snap.ttft_p99_s,
                "ttft_samples": snap.ttft_samples,
                "demand_tokens_per_s": snap.demand_tokens_per_s,
                "capacity_tokens_per_s": snap.capacity_tokens_per_s,
                "kv_usage": kv_usage,
                "hit_rate": {
                    "g1": rc.ratio(now, "g1", "prompt"),
                    "shared": rc.ratio(now, "shared", "prompt"),
                },
            },
            "recommendation": {**asdict(rec), "target": asdict(self.target)},
        }


class SignalsMiddleware:
    """Times each generation request's first byte to the client (pure ASGI).

    Args:
        app: The app it wraps.
        signals: Where the samples go.
    """

    def __init__(self, app: ASGIApp, signals: RouterSignals) -> None:
        self.app = app
        self.signals = signals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        trace = _RequestTrace(self.signals.clock())
        token = _TRACE.set(trace)
        status = 0
        done = False

        async def timed_send(message: Message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
            elif (
                message["type"] == "http.response.body"
                and not done
                and status == 200
                and (message.get("body") or not message.get("more_body"))
            ):
                done = True
                self.signals.answered(trace)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            _TRACE.reset(token)


# ---- Prometheus ------------------------------------------------------------------------------

_ENGINE_GAUGES = {
    "queue_depth": ("kvtier_router_engine_queue_depth",
                    "Requests routed to the engine awaiting their first byte"),
    "prefill_tokens_in_flight": ("kvtier_router_engine_prefill_tokens_in_flight",
                                 "Uncached prompt tokens of those requests"),
    "demand_tokens_per_s": ("kvtier_router_engine_prefill_demand_tokens_per_second",
                            "Uncached prompt tokens routed to the engine per second (window)"),
    "capacity_tokens_per_s": ("kvtier_router_engine_prefill_capacity_tokens_per_second",
                              "Measured prefill throughput: tokens answered per busy second"),
    "kv_usage": ("kvtier_router_engine_kv_usage", "Share of the engine's KV memory in use (0-1)"),
    "engine_waiting": ("kvtier_router_engine_waiting",
                       "Requests waiting in the engine's own queue (its /metrics)"),
}  # fmt: skip
_FLEET_GAUGES = {
    "queue_depth": ("kvtier_router_fleet_queue_depth",
                    "Requests routed awaiting their first byte, all engines"),
    "prefill_tokens_in_flight": ("kvtier_router_fleet_prefill_tokens_in_flight",
                                 "Uncached prompt tokens of those requests"),
    "demand_tokens_per_s": ("kvtier_router_fleet_prefill_demand_tokens_per_second",
                            "Uncached prompt tokens routed per second (window)"),
    "capacity_tokens_per_s": ("kvtier_router_fleet_prefill_capacity_tokens_per_second",
                              "Mean measured prefill throughput of one engine"),
    "kv_usage": ("kvtier_router_fleet_kv_usage", "Mean KV memory usage of healthy engines"),
    "ready_replicas": ("kvtier_router_ready_replicas",
                       "Healthy engines that prefill (both or prefill role), not warming"),
}  # fmt: skip


class ScalingCollector:
    """Exports :meth:`RouterSignals.report` as gauges at every scrape.

    Args:
        signals: The router's signals.
        engines: Returns the pool's engines (empty before the router starts).
    """

    def __init__(self, signals: RouterSignals, engines: Callable[[], Sequence[Any]]) -> None:
        self.signals = signals
        self.engines = engines

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self.signals.report(self.engines())))

    def _families(self, report: dict[str, Any] | None) -> list[Metric]:
        out: list[Metric] = []
        for key, (name, doc) in _ENGINE_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["engine"])
            for url, e in (report or {}).get("engines", {}).items():
                if e.get(key) is not None:
                    g.add_metric([url], e[key])
            out.append(g)
        for key, (name, doc) in _FLEET_GAUGES.items():
            g = GaugeMetricFamily(name, doc)
            if report is not None and report["fleet"][key] is not None:
                g.add_metric([], report["fleet"][key])
            out.append(g)
        ttft_e = GaugeMetricFamily("kvtier_router_engine_ttft_seconds",
                                   "TTFT of answered requests over the window, by quantile",
                                   labels=["engine", "quantile"])  # fmt: skip
        ttft_f = GaugeMetricFamily("kvtier_router_fleet_ttft_seconds",
                                   "TTFT of answered requests over the window, by quantile",
                                   labels=["quantile"])  # fmt: skip
        hits_e = GaugeMetricFamily("kvtier_router_engine_hit_rate",
                                   "Prompt tokens the engine found in G1 / loaded from the shared "
                                   "tier (its own counters), over the window",
                                   labels=["engine", "source"])  # fmt: skip
        hits_f = GaugeMetricFamily("kvtier_router_fleet_hit_rate",
                                   "Prompt tokens the picked engine was believed to hold, by "
                                   "where (the router's view), over the window",
                                   labels=["source"])  # fmt: skip
        rec = GaugeMetricFamily("kvtier_router_recommended_replicas",
                                "Replicas the fleet should run (docs/fleet.md: scaling signals)")  # fmt: skip
        if report is not None:
            for url, e in report["engines"].items():
                for q, key in (("0.5", "ttft_p50_s"), ("0.99", "ttft_p99_s")):
                    if e.get(key) is not None:
                        ttft_e.add_metric([url, q], e[key])
                for source, v in e["hit_rate"].items():
                    if v is not None:
                        hits_e.add_metric([url, source], v)
            f = report["fleet"]
            for q, key in (("0.5", "ttft_p50_s"), ("0.99", "ttft_p99_s")):
                if f[key] is not None:
                    ttft_f.add_metric([q], f[key])
            for source, v in f["hit_rate"].items():
                if v is not None:
                    hits_f.add_metric([source], v)
            rec.add_metric([], report["recommendation"]["replicas"])
        return [*out, ttft_e, ttft_f, hits_e, hits_f, rec]
