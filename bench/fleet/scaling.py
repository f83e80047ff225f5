"""Autoscaling in the fleet simulation: the router's scaling signals against engine utilisation.

A :class:`ScalingFleet` is a colocated fleet whose size an autoscaler
changes while it serves. The autoscaler is modelled on Kubernetes' HPA (what
``docs/fleet.md`` deploys), the same for both metrics:

* every ``sync_s`` it computes a desired count from its metric; a change
  within ``tolerance`` (10 %) of the current count is ignored;
* up: at once, at most ``max(2 x current, current + 4)`` per sync (HPA's
  default scale-up policy); a new replica takes ``startup_s`` to become ready
  (it is paid for while it starts) and starts with an empty G1 — with the
  shared tier it loads the fleet's prefixes from there instead of computing them;
* down: to the highest desired count of the last ``scale_down_window_s``
  (HPA's stabilisation window); starting replicas are cancelled first, then
  the least busy ready ones leave the router and drain their requests.

The two metrics:

* ``signals``: :func:`kvtier.router.scaling.recommend_replicas` — the
  function ``kvtier router`` serves as ``kvtier_router_recommended_replicas``
  — over a :class:`kvtier.router.signals.SignalTracker` fed as the router
  feeds it (each request's uncached prompt tokens when routed, its TTFT at
  its first token), read as an HPA external metric with an average-value
  target of 1 (desired = the recommendation);
* ``utilization``: the engines' busy fraction (their step loop busy, as GPU
  utilisation reads), averaged over the ready engines and ``util_window_s``,
  against ``target_utilization`` (HPA's resource formula:
  ``desired = ceil(current x utilisation / target)``).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvtier.bench.fleet.costs import EngineSpec, TierSpec
from kvtier.bench.fleet.engine import SimEngine
from kvtier.bench.fleet.g1 import G1Cache
from kvtier.bench.fleet.metrics import percentile
from kvtier.bench.fleet.model import Fleet, FleetSpec, SimResult
from kvtier.bench.fleet.request import SimRequest
from kvtier.bench.fleet.workload import Session, WorkloadSpec, build_sessions
from kvtier.router.config import RouterConfig
from kvtier.router.scaling import ScalingTarget, recommend_replicas
from kvtier.router.signals import Attempt, SignalTracker

AUTOSCALERS = ("signals", "utilization")
NEW_REPLICA_S = 60.0  # a replica's first minute: what warm or cold start changes
_ROUTER_DEFAULTS = RouterConfig.__dataclass_fields__


def _router_default(name: str) -> Any:
    return _ROUTER_DEFAULTS[name].default


@dataclass(frozen=True)
class AutoscalerSpec:
    """How the fleet is scaled.

    Attributes:
        kind: ``signals`` or ``utilization``.
        initial_replicas: Ready replicas at the start.
        min_replicas: Fewest replicas.
        max_replicas: Most replicas.
        startup_s: From a replica's creation to its first request.
        sync_s: Seconds between two decisions (HPA's sync period).
        scale_down_window_s: Scale-down stabilisation window.
        tolerance: Relative change ignored.
        ttft_target_s: ``signals``: the router's TTFT target.
        signals_window_s: ``signals``: the router's signal window.
        capacity_utilization: ``signals``: the router's target_utilization.
        target_utilization: ``utilization``: the busy fraction aimed for.
        util_window_s: ``utilization``: averaging window of the busy fraction.
    """

    kind: str
    initial_replicas: int = 4
    min_replicas: int = 2
    max_replicas: int = 32
    startup_s: float = 60.0
    sync_s: float = 15.0
    scale_down_window_s: float = 120.0
    tolerance: float = 0.1
    ttft_target_s: float = 2.5
    signals_window_s: float = field(default_factory=lambda: _router_default("signals_window_s"))
    capacity_utilization: float = field(
        default_factory=lambda: _router_default("target_utilization")
    )
    target_utilization: float = 0.7
    util_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.kind not in AUTOSCALERS:
            raise ValueError(f"unknown autoscaler {self.kind!r}; known: {', '.join(AUTOSCALERS)}")
        if not 1 <= self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("need 1 <= min_replicas <= initial_replicas <= max_replicas")
        if min(self.startup_s, self.scale_down_window_s, self.tolerance) < 0 or self.sync_s <= 0:
            raise ValueError("startup_s, scale_down_window_s, tolerance >= 0 and sync_s > 0")
        if not 0 < self.target_utilization <= 1 or self.util_window_s <= 0:
            raise ValueError("target_utilization in (0, 1] and util_window_s > 0")

    def target(self) -> ScalingTarget:
        """The router's scaling target (``signals``)."""
        return ScalingTarget(
            ttft_target_s=self.ttft_target_s,
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            target_utilization=self.capacity_utilization,
        )


@dataclass
class Timeline:
    """What the autoscaler saw and did at each sync."""

    t: list[float] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    provisioned: list[int] = field(default_factory=list)
    desired: list[int] = field(default_factory=list)
    metric: list[float] = field(default_factory=list)  # recommendation or mean utilisation
    utilization: list[float] = field(default_factory=list)  # mean busy fraction of ready engines
    capacity: list[float | None] = field(default_factory=list)  # measured, tokens/s per engine


class ScalingFleet(Fleet):
    """A colocated fleet of at most ``autoscaler.max_replicas`` engines, scaled while it runs.

    Args:
        engine: Engine constants.
        tier: Tier constants.
        mode: ``colocated`` or ``colocated+tier``.
        policy: Routing policy (the shipped router's).
        sessions: The workload.
        autoscaler: How it is scaled.
    """

    def __init__(
        self,
        engine: EngineSpec,
        tier: TierSpec,
        mode: str,
        policy: str,
        sessions: Sequence[Session],
        autoscaler: AutoscalerSpec,
    ) -> None:
        if mode not in ("colocated", "colocated+tier"):
            raise ValueError("a scaling fleet is colocated (with or without the tier)")
        # NOTE: twice the maximum: a draining replica keeps its engine until it is idle
        spec = FleetSpec(engines=2 * autoscaler.max_replicas, mode=mode, policy=policy)
        super().__init__(engine, tier, spec, sessions)
        self.scaler = autoscaler
        self.target = autoscaler.target()
        self.tracker = SignalTracker(window_s=autoscaler.signals_window_s)
        self.ready: set[int] = set()
        self.starting: dict[int, float] = {}  # eid -> when it was created
        self.ready_at: dict[int, list[float]] = {}  # eid -> when it became ready (not initial)
        self.draining: set[int] = set()
        self.timeline = Timeline()
        self.counts: list[tuple[float, int]] = [(0.0, 0)]  # (time, replicas paid for)
        self._attempts: dict[int, Attempt] = {}
        self._desired: deque[tuple[float, int]] = deque()
        self._busy: deque[tuple[float, dict[int, float]]] = deque()
        self._remaining = sum(len(s.turns) for s in self.sessions)
        for eid in range(autoscaler.initial_replicas):
            self.ready.add(eid)
            self.tracker.add_engine(eid)
        self._pool_changed()

    # ---- the pool ------------------------------------------------------------------------------

    def _pool_changed(self) -> None:
        # the shipped policy picks among the ready engines only
        self.front.engines = [self.engines[e] for e in sorted(self.ready)]
        self.front.pool = set(self.ready)
        paid = len(self.ready) + len(self.starting) + len(self.draining)
        if self.counts[-1][1] != paid:
            self.counts.append((self.now, paid))

    def _free_engine(self) -> int | None:
        busy = self.ready | self.starting.keys() | self.draining
        return next((e.eid for e in self.engines if e.eid not in busy), None)

    def _create(self) -> None:
        eid = self._free_engine()
        if eid is None:
            return
        self.starting[eid] = self.now
        self.schedule(self.now + self.scaler.startup_s, self._became_ready, (eid, self.now))
        self._pool_changed()

    def _became_ready(self, arg: tuple[int, float]) -> None:
        eid, created = arg
        if self.starting.get(eid) != created:
            return  # cancelled meanwhile
        del self.starting[eid]
        self.ready.add(eid)
        self.ready_at.setdefault(eid, []).append(self.now)
        self.tracker.add_engine(eid)
        self._pool_changed()

    def _remove(self, count: int) -> None:
        for eid in sorted(self.starting, key=self.starting.__getitem__, reverse=True)[:count]:
            del self.starting[eid]
            count -= 1
        idle_first = sorted(self.ready, key=lambda e: (self.engines[e].in_flight, -e))
        for eid in idle_first[: max(0, min(count, len(self.ready) - 1))]:
            self.ready.discard(eid)
            self.draining.add(eid)
            if self.engines[eid].in_flight == 0:
                self._stopped(self.engines[eid])
        self._pool_changed()

    def _stopped(self, engine: SimEngine) -> None:
        """A drained replica is gone: its G1 with it (a new one on this engine starts empty)."""
        self.draining.discard(engine.eid)
        self.tracker.remove_engine(engine.eid)
        old = engine.g1
        for key in list(old.lru) + list(old.refs):
            self.index.evicted(engine.eid, key)
        engine.g1 = G1Cache(old.capacity, old.on_stored, old.on_evicted)
        self._pool_changed()

    # ---- requests (what the router's signals see) ---------------------------------------------

    def _arrive(self, arg: tuple[Session, int]) -> None:
        super()._arrive(arg)
        req = self.requests[-1]
        self._attempts[req.rid] = self.tracker.begin(req.prefill_engine, req.est_tokens, self.now)

    def prompt_done(self, engine: SimEngine, req: SimRequest) -> None:
        super().prompt_done(engine, req)
        attempt = self._attempts.pop(req.rid, None)
        if attempt is not None:
            self.tracker.answered(attempt, self.now - req.arrival_s, self.now)

    def finished(self, engine: SimEngine, req: SimRequest) -> None:
        super().finished(engine, req)
        self._remaining -= 1
        if engine.eid in self.draining and engine.in_flight == 0:
            self._stopped(engine)

    # ---- the autoscaler ------------------------------------------------------------------------

    def run(self) -> SimResult:
        self.schedule(self.scaler.sync_s, self._sync, None)
        return super().run()

    def _utilization(self) -> float:
        """Mean busy fraction of the ready engines over ``util_window_s``."""
        now = self.now
        self._busy.append((now, {e.eid: e.busy_s for e in self.engines}))
        while len(self._busy) > 2 and self._busy[1][0] <= now - self.scaler.util_window_s:
            self._busy.popleft()
        t0, before = self._busy[0]
        if now <= t0 or not self.ready:
            return 0.0
        fractions = [(self.engines[e].busy_s - before[e]) / (now - t0) for e in self.ready]
        return min(1.0, sum(fractions) / len(fractions))

    def _kv_usage(self) -> float:
        """Mean share of the ready engines' G1 held by requests (what engines export)."""
        used = [(len(g.refs) + g.reserved) / g.capacity
                for g in (self.engines[e].g1 for e in self.ready)]  # fmt: skip
        return sum(used) / len(used)

    def _sync(self, _: Any) -> None:
        s, now = self.scaler, self.now
        current = len(self.ready) + len(self.starting)
        util = self._utilization()
        snap = self.tracker.snapshot(now)  # fed in both runs; followed only by ``signals``
        if s.kind == "signals":
            rec = recommend_replicas(snap, len(self.ready), self.target, self._kv_usage())
            desired, metric = rec.replicas, float(rec.replicas)
        else:
            desired = math.ceil(len(self.ready) * util / s.target_utilization - 1e-9)
            metric = util
        if current and abs(desired / current - 1) <= s.tolerance:
            desired = current
        desired = min(s.max_replicas, max(s.min_replicas, desired))
        self._desired.append((now, desired))
        while self._desired and self._desired[0][0] <= now - s.scale_down_window_s:
            self._desired.popleft()
        if desired < current:
            desired = min(current, max(d for _, d in self._desired))
        desired = min(desired, max(2 * current, current + 4))
        if desired > current:
            for _ in range(desired - current):
                self._create()
        elif desired < current:
            self._remove(current - desired)
        tl = self.timeline
        tl.t.append(now)
        tl.ready.append(len(self.ready))
        tl.provisioned.append(len(self.ready) + len(self.starting) + len(self.draining))
        tl.desired.append(desired)
        tl.metric.append(metric)
        tl.utilization.append(util)
        tl.capacity.append(snap.capacity_tokens_per_s)
        if self._remaining > 0:
            self.schedule(now + s.sync_s, self._sync, None)

    # ---- results -------------------------------------------------------------------------------

    def replica_minutes(self, end_s: float) -> float:
        """Replica-minutes paid for (starting, ready and draining) from 0 to ``end_s``."""
        total = 0.0
        points = [*self.counts, (end_s, self.counts[-1][1])]
        for (t0, n), (t1, _) in itertools.pairwise(points):
            total += n * max(0.0, min(t1, end_s) - t0)
        return total / 60.0


def run_scaling(
    engine: EngineSpec,
    tier: TierSpec,
    mode: str,
    policy: str,
    sessions: Sequence[Session],
    autoscaler: AutoscalerSpec,
    spike: tuple[float, float, float],
) -> dict[str, Any]:
    """One scaled run's figures: TTFT during the spike and overall, replica-minutes, timeline."""
    fleet = ScalingFleet(engine, tier, mode, policy, sessions, autoscaler)
    result = fleet.run()
    reqs = result.requests
    end = max(r.finish_s for r in reqs)
    start_s, end_s, _ = spike

    def ttft(rs: list[SimRequest]) -> list[float]:
        return [r.first_token_s - r.arrival_s for r in rs]

    during = [r for r in reqs if start_s <= r.arrival_s < end_s]
    # requests a replica served in its first NEW_REPLICA_S after it became ready
    fresh = [r for r in reqs if any(t <= r.arrival_s < t + NEW_REPLICA_S
                                    for t in fleet.ready_at.get(r.prefill_engine, ()))]  # fmt: skip
    before = [r for r in reqs if r.arrival_s < start_s]
    tl = fleet.timeline
    return {
        "requests": len(reqs),
        "requests_in_spike": len(during),
        "ttft_p50_s": _p(ttft(reqs), 50),
        "ttft_p99_s": _p(ttft(reqs), 99),
        "ttft_p50_spike_s": _p(ttft(during), 50),
        "ttft_p99_spike_s": _p(ttft(during), 99),
        "ttft_p99_before_spike_s": _p(ttft(before), 99),
        "replica_minutes": fleet.replica_minutes(end),
        "new_replicas": {
            "requests": len(fresh),
            "hit_rate": _hit_rate(fresh),
            "ttft_p50_s": _p(ttft(fresh), 50),
            "ttft_p99_s": _p(ttft(fresh), 99),
        },
        "max_replicas": max(n for _, n in fleet.counts),
        "span_s": end,
        "hit_rate": _hit_rate(reqs),
        "timeline": asdict(tl),
        "ttft_p99_by_arrival": _binned_p99(reqs, autoscaler.sync_s),
    }


def _hit_rate(reqs: list[SimRequest]) -> float | None:
    prompt = sum(r.prompt_tokens for r in reqs)
    return sum(r.g1_tokens + r.tier_tokens for r in reqs) / prompt if prompt else None


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def _binned_p99(reqs: list[SimRequest], bin_s: float) -> dict[str, list[float]]:
    """TTFT p99 of the requests arriving in each ``bin_s`` (bins with requests only)."""
    bins: dict[int, list[float]] = {}
    for r in reqs:
        bins.setdefault(int(r.arrival_s // bin_s), []).append(r.first_token_s - r.arrival_s)
    keys = sorted(bins)
    return {"t": [k * bin_s for k in keys], "p99_s": [percentile(bins[k], 99) for k in keys]}


# ---- the comparison -----------------------------------------------------------------------------

#: Each autoscaler's knob, the values swept (a cost / TTFT frontier), and its default:
#: ``signals`` the router's ``target_utilization``, ``utilization`` the busy fraction aimed for.
SWEEPS: dict[str, tuple[str, tuple[float, ...]]] = {
    "signals": ("capacity_utilization", (0.7, 0.55, 0.4, 0.3)),
    "utilization": ("target_utilization", (0.9, 0.8, 0.7, 0.55)),
}
DEFAULTS = {
    "signals": _router_default("target_utilization"),
    "utilization": AutoscalerSpec.__dataclass_fields__["target_utilization"].default,
}


@dataclass(frozen=True)
class ScalingScenario:
    """The traffic spike both autoscalers face.

    Attributes:
        workload: Sessions' shape; its ``session_rate`` is the steady rate and its
            ``sessions`` is ignored (sessions come from the rate and the duration).
        duration_s: Seconds of arrivals.
        spike: ``(start_s, end_s, factor)`` of the arrival rate.
        seeds: One run per seed (figures are means over them).
        mode: ``colocated+tier`` (new replicas load prefixes from the tier) or ``colocated``.
        policy: The router's policy.
    """

    workload: WorkloadSpec
    duration_s: float = 600.0
    spike: tuple[float, float, float] = (180.0, 360.0, 3.0)
    seeds: tuple[int, ...] = (0, 1)
    mode: str = "colocated+tier"
    policy: str = "cache_aware"

    def sessions(self, seed: int) -> list[Session]:
        """The workload of one seed, spike included."""
        wl = replace(self.workload, spike=self.spike, seed=seed, sessions=1)
        return build_sessions(
            replace(wl, sessions=max(1, round(wl.sessions_until(self.duration_s))))
        )


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _over_seeds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds of the headline figures; the first seed's timeline."""
    keys = ("ttft_p99_spike_s", "ttft_p50_spike_s", "ttft_p99_s", "ttft_p99_before_spike_s",
            "replica_minutes", "hit_rate")  # fmt: skip
    out: dict[str, Any] = {k: _mean([r[k] for r in runs]) for k in keys}
    out["max_replicas"] = max(r["max_replicas"] for r in runs)
    caps = [c for r in runs for c in r["timeline"]["capacity"] if c is not None]
    out["capacity_range"] = [min(caps), max(caps)] if caps else None  # tokens/s per engine
    out["requests"] = sum(r["requests"] for r in runs)
    out["per_seed"] = {k: [r[k] for r in runs] for k in ("ttft_p99_spike_s", "replica_minutes")}
    fresh = [r["new_replicas"] for r in runs]
    out["new_replicas"] = {
        "requests": sum(f["requests"] for f in fresh),
        "hit_rate": _mean([f["hit_rate"] for f in fresh]),
        "ttft_p99_s": _mean([f["ttft_p99_s"] for f in fresh]),
    }
    out["timeline"] = runs[0]["timeline"]
    out["ttft_p99_by_arrival"] = runs[0]["ttft_p99_by_arrival"]
    return out


def compare_autoscalers(
    engine: EngineSpec, tier: TierSpec, scenario: ScalingScenario, base: AutoscalerSpec
) -> dict[str, Any]:
    """Both autoscalers on the same spike: defaults, knob sweeps, and new replicas without the tier.

    Returns:
        ``{"signals": {...}, "utilization": {...}, "sweep": {kind: [...]},
        "replica_start": {"tier": {...}, "no_tier": {...}}, "config": {...}}``.
    """
    sessions = {seed: scenario.sessions(seed) for seed in scenario.seeds}

    def runs(kind: str, value: float, mode: str) -> list[dict[str, Any]]:
        knob = SWEEPS[kind][0]
        knobs: dict[str, Any] = {knob: value}
        spec = replace(base, kind=kind, **knobs)
        return [run_scaling(engine, tier, mode, scenario.policy, sessions[seed], spec,
                            scenario.spike) for seed in scenario.seeds]  # fmt: skip

    out: dict[str, Any] = {"sweep": {}}
    for kind, (knob, values) in SWEEPS.items():
        points = []
        for v in sorted({*values, DEFAULTS[kind]}, reverse=True):
            summary = _over_seeds(runs(kind, v, scenario.mode))
            if v == DEFAULTS[kind]:
                out[kind] = {knob: v, **summary}
            points.append({knob: v, **{k: summary[k] for k in ("ttft_p99_spike_s",
                          "replica_minutes", "max_replicas", "capacity_range")}})  # fmt: skip
        out["sweep"][kind] = points
    no_tier = _over_seeds(runs("signals", DEFAULTS["signals"], "colocated"))
    out["replica_start"] = {
        "tier": {k: out["signals"][k] for k in ("new_replicas", "ttft_p99_spike_s")},
        "no_tier": {k: no_tier[k] for k in ("new_replicas", "ttft_p99_spike_s")},
    }
    out["config"] = {
        "autoscaler": {k: v for k, v in asdict(base).items() if k != "kind"},
        "defaults": DEFAULTS,
        "duration_s": scenario.duration_s,
        "spike": scenario.spike,
        "seeds": scenario.seeds,
        "mode": scenario.mode,
        "policy": scenario.policy,
        "steady_session_rate": scenario.workload.session_rate,
        "sessions": [len(s) for s in sessions.values()],
    }
    return out
