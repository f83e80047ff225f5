"""Routing in the fleet simulation: the shipped router's own policies, and the KV index it learns.

The simulated router *is* ``kvtier router``'s: every choice goes through
:class:`kvtier.router.policy.Router` (``round_robin``, ``least_loaded``,
``cache_aware``), fed what the shipped router feeds it — for each engine its
load (requests in flight), the prompt tokens queued there for prefill, the
prefix its G1 holds (from the engines' KV events: stored / evicted block
keys) and the prefix the shared tier holds — so a simulated ``cache_aware``
run predicts the router users run, with its weights
(:class:`kvtier.router.policy.Weights`, ``RouterConfig``'s knobs)::

      hit(e)  = max(G1 prefix of e, shared_hit_weight x shared-tier prefix)
      cost(e) = (prompt - hit(e)) + pending_prefill_tokens(e) + decode_cost_tokens x load(e)

among engines within ``max_imbalance`` requests of the least loaded. For the
P/D decode pool the same cost scores what each engine would load.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.bench.fleet.engine import SimEngine
from kvtier.bench.fleet.request import Role, SimRequest
from kvtier.router.config import POLICIES
from kvtier.router.policy import Candidate, Weights
from kvtier.router.policy import Router as ShippedRouter


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
    """Chooses an engine of one pool for each request (the shipped policy, simulated engines).

    Args:
        policy: One of :data:`POLICIES`.
        engines: The pool.
        index: The KV index fed by every engine's events.
        weights: ``cache_aware``'s knobs (the shipped defaults unless given).
        min_load_tokens: A tier hit shorter than this is not loaded (as engines do).
    """

    def __init__(
        self,
        policy: str,
        engines: Sequence[SimEngine],
        index: KvIndex,
        weights: Weights | None = None,
        min_load_tokens: int = 256,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
        if not engines:
            raise ValueError("a router needs at least one engine")
        self.policy = policy
        self.engines = list(engines)
        self.pool = {e.eid for e in engines}
        self.index = index
        self.min_load_tokens = min_load_tokens
        self._router = ShippedRouter(policy, weights)  # type: ignore[arg-type]

    def choose(self, req: SimRequest, role: Role, tier_tokens: int) -> SimEngine:
        """The engine for ``req`` in ``role``; sets ``req.est_tokens`` (the prefill it queues there).

        Args:
            req: The request.
            role: What the engine will do with it.
            tier_tokens: Leading prompt tokens the shared tier can supply (0: no tier).
        """
        bs = self.engines[0].spec.block_tokens
        p = req.prompt_tokens
        limit = (p if role is Role.DECODE else p - 1) // bs
        matched = self.index.match(req.keys, limit, self.pool)
        shared = tier_tokens if tier_tokens >= max(1, self.min_load_tokens) else 0
        cands = [Candidate(e, matched.get(e.eid, 0) * bs, shared) for e in self.engines]
        answer = 1 if role is Role.PREFILL else req.answer_tokens  # what it holds G1 for
        decision = self._router.pick(cands, p, answer_tokens=answer)  # type: ignore[arg-type]
        req.est_tokens = 0 if role is Role.DECODE else max(0, p - decision.hit_tokens)
        return decision.engine  # type: ignore[return-value]
