"""Routing policies: which engine gets a request, and why.

* ``round_robin``: the next engine in turn.
* ``least_loaded``: the fewest requests in flight (the router's count, or the
  engine's running + waiting from its ``/metrics`` if higher); ties in turn.
* ``cache_aware``: the lowest estimated cost, in prompt tokens of work::

      hit(e)  = max(G1 prefix of e, shared_hit_weight x shared-tier prefix)
      cost(e) = (prompt - hit(e))                  the prefill this request needs there
              + pending_prefill_tokens(e)          prefills queued there before it
              + decode_cost_tokens x load(e)       requests it is already serving

  among the engines whose load is within ``max_imbalance`` of the least
  loaded one, so a hot prefix spreads instead of melting its engine (the
  second engine computes the prefix once, then holds it too).

The policy sees an engine only through :class:`Routable` (its load and its
queued prefill), so the fleet simulation (``bench/fleet/router.py``) runs
this very code on simulated engines.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvtier.router.config import Policy

# Why an engine was picked (the ``reason`` label of kvtier_router_decisions_total).
REASONS = (
    "round_robin",  # round_robin policy
    "least_loaded",  # least_loaded policy, or cache_aware with no prefix anywhere
    "g1_hit",  # cache_aware: the engine with the longest G1 prefix
    "shared_hit",  # cache_aware: the shared tier's prefix made the difference
    "load",  # cache_aware: an engine with a longer G1 prefix was passed over for load
    "no_keys",  # cache_aware without prompt keys (no tokenizer, unparsable body)
)


class Routable(Protocol):
    """What a policy reads of an engine (``engines.Engine``; a simulated engine)."""

    @property
    def load(self) -> int: ...

    @property
    def pending_prefill_tokens(self) -> int: ...


E = TypeVar("E", bound=Routable)


@dataclass(frozen=True)
class Candidate(Generic[E]):
    """An engine and what it holds of the request's prompt."""

    engine: E
    g1_tokens: int = 0
    shared_tokens: int = 0


@dataclass(frozen=True)
class Decision(Generic[E]):
    """The engine picked, why, and the prompt tokens it is believed to hold."""

    engine: E
    reason: str
    hit_tokens: int = 0
    g1_tokens: int = 0
    shared_tokens: int = 0


@dataclass(frozen=True)
class Weights:
    """The knobs of ``cache_aware`` (``RouterConfig`` documents them)."""

    decode_cost_tokens: int = 256
    shared_hit_weight: float = 0.8
    max_imbalance: int = 4


class Router:
    """Picks engines by one policy; keeps the round-robin turn.

    Args:
        policy: The policy.
        weights: ``cache_aware``'s knobs.
    """

    def __init__(self, policy: Policy, weights: Weights | None = None) -> None:
        self.policy = policy
        self.weights = weights or Weights()
        self._turn = itertools.count()

    def _in_turn(self, engines: Sequence[Candidate[E]]) -> list[Candidate[E]]:
        """``engines`` rotated by the turn (so ties go round robin)."""
        k = next(self._turn) % len(engines)
        return [*engines[k:], *engines[:k]]

    def pick(
        self, candidates: Sequence[Candidate[E]], prompt_tokens: int, have_keys: bool = True
    ) -> Decision[E]:
        """The engine for one request.

        Args:
            candidates: Healthy engines that may serve it (at least one), with
                their prefix matches (zeros when unknown).
            prompt_tokens: Its prompt length (0 when unknown).
            have_keys: Whether the matches were computed (``cache_aware`` only).

        Raises:
            ValueError: without candidates.
        """
        if not candidates:
            raise ValueError("no engine to pick from")
        if self.policy == "round_robin":
            c = self._in_turn(candidates)[0]
            return Decision(c.engine, "round_robin")
        rotated = self._in_turn(candidates)
        if self.policy == "least_loaded":
            c = min(rotated, key=lambda c: c.engine.load)
            return Decision(c.engine, "least_loaded")
        return self._cache_aware(rotated, prompt_tokens, have_keys)

    def _cache_aware(
        self, rotated: list[Candidate[E]], prompt_tokens: int, have_keys: bool
    ) -> Decision[E]:
        w = self.weights
        least = min(c.engine.load for c in rotated)
        eligible = [c for c in rotated if c.engine.load <= least + w.max_imbalance]

        def hit(c: Candidate[E]) -> int:
            return max(c.g1_tokens, int(w.shared_hit_weight * c.shared_tokens))

        def cost(c: Candidate[E]) -> float:
            e = c.engine
            return (
                max(0, prompt_tokens - hit(c))
                + e.pending_prefill_tokens
                + w.decode_cost_tokens * e.load
            )

        best = min(eligible, key=cost)
        top_g1 = max(c.g1_tokens for c in rotated)
        if not have_keys:
            reason = "no_keys"
        elif top_g1 == 0 and best.shared_tokens == 0:
            reason = "least_loaded"
        elif best.g1_tokens < top_g1:
            reason = "load"  # the shared tier is the same for all: only load can explain it
        elif best.g1_tokens > 0 and best.g1_tokens >= int(w.shared_hit_weight * best.shared_tokens):
            reason = "g1_hit"
        else:
            reason = "shared_hit"
        return Decision(best.engine, reason, hit(best), best.g1_tokens, best.shared_tokens)
