"""Routing policies of the fleet, and the KV index a cache-aware router learns from events.

* ``round_robin``: engines in turn.
* ``least_loaded``: the fewest requests in flight (queued or admitted); ties in turn.
* ``cache_aware``: the best estimated time to first token, where an engine's
  estimate is the compute of what it would not have cached, plus the load of
  what the shared tier would supply, plus ``alpha`` x the prefill work already
  queued there::

      est(e) = compute(P - cached(e)) + load(tier part) + alpha * queued_prefill_s(e)

  ``cached(e)`` is the longest prefix held in ``e``'s G1 (from the engines' KV
  events: stored / evicted block keys) or, when longer by at least
  ``min_load_tokens``, what the shared tier holds (any engine can load it).
  Only engines within ``imbalance`` requests of the least loaded are
  candidates, so a hot prefix spills to other engines instead of melting one.
  For the P/D decode pool the estimate is the handoff load of what the engine
  does not hold already.

Ties go to the engine with fewer requests in flight, then in turn, so no
policy favours low engine ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fleet_engine import SimEngine
from fleet_request import Role, SimRequest

POLICIES = ("round_robin", "least_loaded", "cache_aware")


class KvIndex:
    """Block key -> engines whose G1 holds it, kept from the engines' KV events."""

    def __init__(self) -> None:
        self.holders: dict[int, set[int]] = {}

    def stored(self, eid: int, key: int) -> None:
        """Engine ``eid`` cached a block with ``key``."""
        h = self.holders.get(key)
        if h is None:
            self.holders[key] = {eid}
        else:
            h.add(eid)

    def evicted(self, eid: int, key: int) -> None:
        """Engine ``eid`` evicted the block with ``key``."""
        h = self.holders.get(key)
        if h is not None:
            h.discard(eid)
            if not h:
                del self.holders[key]

    def match(self, keys: Sequence[int], limit: int, pool: set[int]) -> dict[int, int]:
        """Engine -> leading blocks of ``keys[:limit]`` it holds, for engines of ``pool`` (> 0 only)."""
        if limit <= 0:
            return {}
        first = self.holders.get(keys[0])
        if not first:
            return {}
        cands = first & pool
        out: dict[int, int] = {}
        j = 1
        while cands and j < limit:
            h = self.holders.get(keys[j])
            if h is None:
                break
            if not cands.issubset(h):  # NOTE: no new set in the common case
                nxt = cands & h
                for e in cands - nxt:
                    out[e] = j
                cands = nxt
            j += 1
        for e in cands:
            out[e] = j
        return out


class Router:
    """Chooses an engine of one pool for each request.

    Args:
        policy: One of :data:`POLICIES`.
        engines: The pool.
        index: The KV index fed by every engine's events.
        transfer_s: Estimated seconds to move ``n`` bytes of KV into an engine (0 for 0).
        alpha: Weight of the queued work in ``cache_aware``'s estimate.
        imbalance: ``cache_aware`` considers only engines with at most this many more
            requests in flight than the least loaded one.
        min_load_tokens: A tier hit shorter than this is not loaded (as engines do).
    """

    def __init__(
        self,
        policy: str,
        engines: Sequence[SimEngine],
        index: KvIndex,
        transfer_s: Callable[[int], float],
        alpha: float = 1.0,
        imbalance: int = 4,
        min_load_tokens: int = 256,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        if not engines:
            raise ValueError("a router needs at least one engine")
        if alpha < 0 or imbalance < 0:
            raise ValueError("alpha and imbalance must be >= 0")
        self.policy = policy
        self.engines = list(engines)
        self.pool = {e.eid for e in engines}
        self.index = index
        self.transfer_s = transfer_s
        self.alpha = alpha
        self.imbalance = imbalance
        self.min_load_tokens = min_load_tokens
        self._turn = 0

    def _rotation(self) -> list[SimEngine]:
        i = self._turn % len(self.engines)
        self._turn += 1
        return self.engines[i:] + self.engines[:i]

    def choose(self, req: SimRequest, role: Role, tier_tokens: int) -> SimEngine:
        """The engine for ``req`` in ``role``; sets ``req.est_s`` (its estimated prefill work).

        Args:
            req: The request.
            role: What the engine will do with it.
            tier_tokens: Leading prompt tokens the shared tier can supply (0: no tier).
        """
        order = self._rotation()
        if self.policy == "round_robin":
            chosen = order[0]
        elif self.policy == "least_loaded":
            chosen = min(order, key=lambda e: e.in_flight)  # min keeps the first of ties
        else:
            return self._cache_aware(req, role, tier_tokens, order)
        if role is not Role.DECODE:
            g1_tokens = chosen.g1.match(req.keys, self._limit(chosen, req, role))
            req.est_s = self._estimate(
                chosen, req, role, tier_tokens, g1_tokens * chosen.spec.block_tokens
            )
        return chosen

    @staticmethod
    def _limit(engine: SimEngine, req: SimRequest, role: Role) -> int:
        p = req.prompt_tokens if role is Role.DECODE else req.prompt_tokens - 1
        return p // engine.spec.block_tokens

    def _estimate(
        self, engine: SimEngine, req: SimRequest, role: Role, tier_tokens: int, g1_tokens: int
    ) -> float:
        """Seconds of KV work ``req`` brings to ``engine``: compute and loads (no queueing)."""
        spec = engine.spec
        p = req.prompt_tokens
        if role is Role.DECODE:
            return self.transfer_s((p - g1_tokens) * spec.kv_bytes_per_token)
        ext = min(tier_tokens, p - 1) - g1_tokens
        if ext < max(1, self.min_load_tokens):
            ext = 0
        cached = g1_tokens + ext
        return spec.costs.compute_s(cached, p - cached) + self.transfer_s(
            ext * spec.kv_bytes_per_token
        )

    def _cache_aware(
        self, req: SimRequest, role: Role, tier_tokens: int, order: list[SimEngine]
    ) -> SimEngine:
        limit = self._limit(order[0], req, role)
        matched = self.index.match(req.keys, limit, self.pool)
        bs = order[0].spec.block_tokens
        cold = self._estimate(order[0], req, role, tier_tokens, 0)  # the same for every engine
        least = min(e.in_flight for e in order)
        best: SimEngine | None = None
        best_key = (0.0, 0)
        best_est = 0.0
        for e in order:
            if e.in_flight > least + self.imbalance:
                continue
            m = matched.get(e.eid, 0)
            est = self._estimate(e, req, role, tier_tokens, m * bs) if m else cold
            key = (est + self.alpha * e.pending_s, e.in_flight)
            if best is None or key < best_key:
                best, best_key, best_est = e, key, est
        assert best is not None  # the least loaded engine is always a candidate
        req.est_s = best_est if role is not Role.DECODE else 0.0
        return best
