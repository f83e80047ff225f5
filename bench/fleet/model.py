"""The fleet: engines, routers, the shared tier and the discrete-event loop that drives them.

Modes (how a request is served):

* ``colocated``: one engine prefills and decodes; a prefix missing from that
  engine's G1 is recomputed.
* ``colocated+tier``: the same, and engines save the prompt chunks they
  compute to the shared tier and load from it what their G1 lacks.
* ``pd+tier``: a prefill pool computes prompts (G1 hits and tier loads as
  above), produces the first token and saves the whole prompt's KV to the
  tier (its full chunks not stored yet, and the partial last chunk); once
  that write has landed, the decode router picks a decode engine, which
  loads what its own G1 lacks of the prompt and generates the rest.
* ``pd-direct``: P/D without a shared tier: the decode engine pulls the
  prompt's KV from the prefill engine over both links; prefix reuse is only
  within each prefill engine's G1.

Every event is ``(time, sequence, callback, argument)`` on one heap; the
sequence number breaks ties in scheduling order, so a run is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvtier.bench.fleet.costs import EngineSpec, TierSpec
from kvtier.bench.fleet.engine import SimEngine
from kvtier.bench.fleet.request import Phase, Role, SimRequest
from kvtier.bench.fleet.router import KvIndex, Router
from kvtier.bench.fleet.tier import Network, SharedTier, Transfer
from kvtier.bench.fleet.workload import Session
from kvtier.router.policy import Weights

MODES = ("colocated", "colocated+tier", "pd+tier", "pd-direct")


class SimulationError(RuntimeError):
    """The event loop broke one of its invariants (a bug in the simulation)."""


@dataclass(frozen=True)
class FleetSpec:
    """How the fleet is built and routed.

    Attributes:
        engines: Number of engines (both pools together in P/D).
        mode: One of :data:`MODES`.
        policy: Routing policy (``fleet_router.POLICIES``), for every pool.
        prefill_fraction: P/D: share of the engines in the prefill pool.
        weights: ``cache_aware``'s knobs: the shipped router's (``kvtier.router.policy.Weights``).
        save_decode: Also save chunks completed while decoding (kvtier's ``save_decode``).
        macro_steps: Run stretches of decode-only steps as one event (a speed-up of the
            simulation that changes no result; tests compare it with single steps).
    """

    engines: int
    mode: str
    policy: str
    prefill_fraction: float = 0.25
    weights: Weights = field(default_factory=Weights)
    save_decode: bool = False
    macro_steps: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; known: {', '.join(MODES)}")
        if self.engines < (2 if self.disaggregated else 1):
            raise ValueError("P/D needs at least two engines; colocated at least one")
        if not 0 < self.prefill_fraction < 1:
            raise ValueError("prefill_fraction must be in (0, 1)")

    @property
    def disaggregated(self) -> bool:
        """True for the P/D modes."""
        return self.mode.startswith("pd")

    @property
    def uses_tier(self) -> bool:
        """True when engines read and write the shared tier."""
        return self.mode.endswith("+tier")

    @property
    def prefill_engines(self) -> int:
        """Engines in the prefill pool (all of them when colocated)."""
        if not self.disaggregated:
            return self.engines
        return min(self.engines - 1, max(1, round(self.engines * self.prefill_fraction)))


@dataclass
class SimResult:
    """Everything a run produced (``fleet_metrics.summarize`` turns it into figures)."""

    fleet: FleetSpec
    engine_spec: EngineSpec
    tier_spec: TierSpec
    requests: list[SimRequest]
    engines: list[SimEngine]
    transfers: list[Transfer]
    events: int
    end_s: float
    tier_evictions: int
    trace: list[float] | None = field(default=None)


class Fleet:
    """One simulated fleet over one workload. Build, then :meth:`run` once."""

    def __init__(
        self,
        engine: EngineSpec,
        tier: TierSpec,
        fleet: FleetSpec,
        sessions: Sequence[Session],
        trace: bool = False,
    ) -> None:
        if tier.chunk_tokens % engine.block_tokens:
            raise ValueError("the tier's chunk_tokens must be a multiple of block_tokens")
        self.spec = fleet
        self.engine_spec = engine
        self.tier_spec = tier
        self.sessions = list(sessions)
        self.now = 0.0
        self.index = KvIndex()
        self.engines = [
            SimEngine(
                i,
                engine,
                self,
                partial(self.index.stored, i),
                partial(self.index.evicted, i),
                macro_steps=fleet.macro_steps,
            )
            for i in range(fleet.engines)
        ]
        self.network = Network(tier, fleet.engines)
        chunk_bytes = tier.chunk_tokens * engine.kv_bytes_per_token
        self.tier = (
            SharedTier(max(1, int(tier.capacity_gb * 1e9 // chunk_bytes)))
            if fleet.uses_tier
            else None
        )
        n_prefill = fleet.prefill_engines
        router_args: dict[str, Any] = {
            "index": self.index,
            "weights": fleet.weights,
            "min_load_tokens": tier.min_load_tokens,
        }
        self.front = Router(fleet.policy, self.engines[:n_prefill], **router_args)
        self.back = (
            Router(fleet.policy, self.engines[n_prefill:], **router_args)
            if fleet.disaggregated
            else None
        )
        self.requests: list[SimRequest] = []
        self._events: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = 0
        self._count = 0
        self._trace: list[float] | None = [] if trace else None
        self._ran = False

    # ---- the event loop -----------------------------------------------------------------

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any) -> None:
        """Calls ``fn(arg)`` at time ``t`` (never earlier than now)."""
        if t < self.now:
            raise SimulationError(f"event scheduled in the past: {t} < {self.now}")
        heapq.heappush(self._events, (t, self._seq, fn, arg))
        self._seq += 1

    def run(self) -> SimResult:
        """Runs every session to its last turn.

        Raises:
            SimulationError: if time went backwards or a request did not finish exactly once.
        """
        if self._ran:
            raise SimulationError("a Fleet runs once")
        self._ran = True
        for s in self.sessions:
            if s.turns:
                self.schedule(s.arrival_s, self._arrive, (s, 0))
        events = self._events
        while events:
            t, _, fn, arg = heapq.heappop(events)
            if t < self.now:
                raise SimulationError(f"time went backwards: {t} < {self.now}")
            self.now = t
            if self._trace is not None:
                self._trace.append(t)
            fn(arg)
            self._count += 1
        expected = sum(len(s.turns) for s in self.sessions)
        bad = [r.rid for r in self.requests if r.finishes != 1 or r.phase is not Phase.DONE]
        if bad or len(self.requests) != expected:
            raise SimulationError(
                f"{len(self.requests)} of {expected} requests made; not finished once: {bad[:5]}"
            )
        return SimResult(
            fleet=self.spec,
            engine_spec=self.engine_spec,
            tier_spec=self.tier_spec,
            requests=self.requests,
            engines=self.engines,
            transfers=self.network.log,
            events=self._count,
            end_s=self.now,
            tier_evictions=self.tier.evictions if self.tier is not None else 0,
            trace=self._trace,
        )

    # ---- requests ----------------------------------------------------------------------------

    def _arrive(self, arg: tuple[Session, int]) -> None:
        session, turn = arg
        p = session.prompt_tokens(turn)
        a = session.turns[turn].answer_tokens
        keys = session.block_keys(p + a, self.engine_spec.block_tokens)
        req = SimRequest(len(self.requests), session, turn, self.now, p, a, keys)
        self.requests.append(req)
        role = Role.PREFILL if self.spec.disaggregated else Role.FULL
        engine = self.front.choose(req, role, self._tier_tokens(req))
        req.prefill_engine = engine.eid
        if role is Role.FULL:
            req.decode_engine = engine.eid
        engine.enqueue(req, role)

    def _chunk_keys(self, req: SimRequest, num_tokens: int) -> list[int]:
        """Tier keys of the full chunks among the first ``num_tokens`` tokens of ``req``."""
        per = self.tier_spec.chunk_tokens // self.engine_spec.block_tokens
        n = min(num_tokens, len(req.keys) * self.engine_spec.block_tokens)
        return [req.keys[(c + 1) * per - 1] for c in range(n // self.tier_spec.chunk_tokens)]

    def _tier_tokens(self, req: SimRequest) -> int:
        if self.tier is None:
            return 0
        keys = self._chunk_keys(req, req.prompt_tokens)
        return self.tier.lookup(keys, self.now) * self.tier_spec.chunk_tokens

    def _write(self, engine: SimEngine, keys: list[int], extra_tokens: int = 0) -> float:
        """Saves ``keys`` (whole chunks) plus ``extra_tokens`` of transient KV; returns when landed."""
        assert self.tier is not None
        tokens = len(keys) * self.tier_spec.chunk_tokens + extra_tokens
        if tokens == 0:
            return self.now
        nbytes = tokens * self.engine_spec.kv_bytes_per_token
        done = self.network.tier(engine.eid, nbytes, self.now, "write")
        for k in keys:
            self.tier.put(k, done)
        return done

    # ---- EngineHost ----------------------------------------------------------------------------

    def external_match(self, engine: SimEngine, req: SimRequest) -> int:
        """Prompt tokens after ``req.computed`` that the shared tier supplies (0: none)."""
        if self.tier is None:
            return 0
        ext = min(self._tier_tokens(req), req.prompt_tokens - 1) - req.computed
        return ext if ext >= max(1, self.tier_spec.min_load_tokens) else 0

    def start_load(self, engine: SimEngine, req: SimRequest, tokens: int) -> float:
        """Moves ``tokens`` of KV into ``engine``; returns when they land."""
        nbytes = tokens * self.engine_spec.kv_bytes_per_token
        if req.role is Role.DECODE and self.tier is None:
            return self.network.peer(req.prefill_engine, engine.eid, nbytes, self.now)
        if self.tier is not None:
            self.tier.touch(self._chunk_keys(req, req.computed + tokens))
        return self.network.tier(engine.eid, nbytes, self.now, "read")

    def prompt_done(self, engine: SimEngine, req: SimRequest) -> None:
        """Saves what the tier should get once a prompt is computed."""
        if self.tier is None:
            req.handoff_ready_s = self.now
            return
        chunk = self.tier_spec.chunk_tokens
        keys = self._chunk_keys(req, req.prompt_tokens)
        if req.role is Role.PREFILL:
            # P/D: the decode engine needs the whole prompt from the tier.
            new = [k for k in keys if not self.tier.has(k)]
            done = self._write(engine, new, req.prompt_tokens - len(keys) * chunk)
            ready = [self.tier.ready_s(k) for k in keys]
            req.handoff_ready_s = max([done, *(r for r in ready if r is not None)])
        else:
            # As the connector does: save the full chunks this request computed or loaded.
            first = req.g1_tokens // chunk
            self._write(engine, [k for k in keys[first:] if not self.tier.has(k)])

    def finished(self, engine: SimEngine, req: SimRequest) -> None:
        """A request left ``engine``: hand it off (P/D prefill), or start the session's next turn."""
        if req.role is Role.PREFILL and req.answer_tokens > 1:
            self.schedule(req.handoff_ready_s, self._handoff, req)
            return
        if req.role is Role.PREFILL:  # a one-token answer: nothing to decode
            req.phase, req.finish_s = Phase.DONE, self.now
            req.finishes += 1
        if self.spec.save_decode and self.tier is not None:
            keys = self._chunk_keys(req, req.prompt_tokens + req.answer_tokens - 1)
            first = req.prompt_tokens // self.tier_spec.chunk_tokens
            self._write(engine, [k for k in keys[first:] if not self.tier.has(k)])
        session, turn = req.session, req.turn + 1
        if turn < len(session.turns):
            self.schedule(self.now + session.turns[req.turn].think_s, self._arrive, (session, turn))

    def _handoff(self, req: SimRequest) -> None:
        assert self.back is not None
        engine = self.back.choose(req, Role.DECODE, 0)
        req.decode_engine = engine.eid
        engine.enqueue(req, Role.DECODE)


def run_fleet(
    engine: EngineSpec,
    tier: TierSpec,
    fleet: FleetSpec,
    sessions: Sequence[Session],
    trace: bool = False,
) -> SimResult:
    """Builds a :class:`Fleet` and runs it."""
    return Fleet(engine, tier, fleet, sessions, trace=trace).run()
