"""Routing policies: which engine gets a request, and why.

* ``round_robin``: the next engine in turn.
* ``least_loaded``: the fewest requests in flight (the router's count, or the
  engine's running + waiting from its ``/metrics`` if higher); ties in turn.
* ``cache_aware``: the lowest estimated cost, in prompt tokens of work::

      hit(e)  = max(G1 prefix of e, shared_hit_weight x shared-tier prefix)
      cost(e) = (prompt - hit(e))                  the prefill this request needs there
              + pending_prefill_tokens(e)          prefills queued there before it
              + decode_cost_tokens x load(e)       requests it is already serving
              + memory_wait(e)                     answers it must wait for, G1 being full

  among the engines whose load is within ``max_imbalance`` of the least
  loaded one, so a hot prefix spreads instead of melting its engine (the
  second engine computes the prefix once, then holds it too).

  ``memory_wait``: an engine admits a request only when its G1 has free
  blocks for the whole prompt (the bundled engine; vLLM admits and then
  preempts a running request when blocks run out). When the requests in flight there already reserve
  so much that this one does not fit, it waits until the oldest of them
  have *finished* (not merely started answering). Meanwhile the requests
  admitted before it evict the least recently used blocks, so the G1 prefix
  found there may be gone when its turn comes: under memory pressure a G1
  hit is only counted up to what the requests before it and itself leave
  of G1 after writing what they do not find there (``memory_wait``'s
  ``room``), and the answers it waits for add ``memory_wait_tokens`` per
  token. Without this, on engines whose G1 holds one or two conversations,
  a request chased a prefix onto an engine that could not even admit it,
  queued behind whole answers and often found its prefix evicted.

  NOTE: ``memory_wait_tokens`` is 16 although one decode step costs about
  170 prompt tokens of compute (the CPU profile of ``bench/fleet``): the
  engine computes for others while a request waits, and a request sent
  away from its prefix costs its user's later rounds their hits, which the
  cost does not see. ``bench/router_sim.py`` (the router bench's workload on
  simulated engines, G1 1,800-8,000 tokens, two loads, 100 seeds) compares
  16 with 160, which gave up hits on a busy fleet. Against the cost without
  these terms, TTFT p99 was no higher than round robin's in more of the runs
  in 6 of the 10 cells (1,800 tokens: 86-96 % of the runs against 24-45 %),
  as often in 3, less often in 1 (3,000 tokens, busy: 60 % against 70 %);
  hit rates within 0.02, but 0.03-0.05 lower at 1,800 tokens, where the
  prefixes it no longer chases did not survive anyway (bench/RESULTS.md).

The policy sees an engine only through :class:`Routable` (its load, its
queued prefill, its G1 capacity and what the router's requests reserve
there), so the fleet simulation (``bench/fleet/router.py``) runs
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
    "memory",  # cache_aware: ... passed over because the request would wait there for G1 memory
    "no_keys",  # cache_aware without prompt keys (no tokenizer, unparsable body)
)


@dataclass(frozen=True)
class Reservation:
    """KV memory a request in flight holds on its engine, as the router counts it.

    Attributes:
        kv_tokens: Prompt plus answer tokens (the blocks it pins until it ends).
        answer_tokens: Tokens it may still generate (its ``max_tokens``).
        new_tokens: Of ``kv_tokens``, those not counted as a G1 hit when it was
            routed: the blocks it takes from the free or least recently used ones.
    """

    kv_tokens: int
    answer_tokens: int
    new_tokens: int = -1  # -1: all of kv_tokens

    @property
    def allocates(self) -> int:
        """Blocks' tokens it takes from the free or least recently used ones."""
        return self.kv_tokens if self.new_tokens < 0 else self.new_tokens


class Routable(Protocol):
    """What a policy reads of an engine (``engines.Engine``; a simulated engine)."""

    @property
    def load(self) -> int: ...

    @property
    def pending_prefill_tokens(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens its G1 holds (0: unknown, then memory is not weighed)."""
        ...

    @property
    def reservations(self) -> Sequence[Reservation]:
        """The requests the router has in flight there, oldest first."""
        ...


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
    memory_wait_tokens: int = 16


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
        self,
        candidates: Sequence[Candidate[E]],
        prompt_tokens: int,
        have_keys: bool = True,
        answer_tokens: int = 0,
    ) -> Decision[E]:
        """The engine for one request.

        Args:
            candidates: Healthy engines that may serve it (at least one), with
                their prefix matches (zeros when unknown).
            prompt_tokens: Its prompt length (0 when unknown).
            have_keys: Whether the matches were computed (``cache_aware`` only).
            answer_tokens: Most tokens it may generate (its ``max_tokens``; 0
                when unknown): with the prompt, the G1 memory it needs.

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
        return self._cache_aware(rotated, prompt_tokens, answer_tokens, have_keys)

    def _cache_aware(
        self, rotated: list[Candidate[E]], prompt_tokens: int, answer_tokens: int, have_keys: bool
    ) -> Decision[E]:
        w = self.weights
        least = min(c.engine.load for c in rotated)
        eligible = [c for c in rotated if c.engine.load <= least + w.max_imbalance]
        need = prompt_tokens + answer_tokens
        scores = [_score(c, prompt_tokens, need, w) for c in eligible]
        best = min(scores, key=lambda s: s.cost)  # ties: the first in turn
        c = best.candidate
        top = max(rotated, key=lambda x: x.g1_tokens)
        if not have_keys:
            reason = "no_keys"
        elif top.g1_tokens == 0 and c.shared_tokens == 0:
            reason = "least_loaded"
        elif c.g1_tokens < top.g1_tokens:
            # the shared tier is the same for all: only load or memory can explain it
            top_score = next((s for s in scores if s.candidate is top), None)
            reason = "memory" if top_score is not None and top_score.memory_wait else "load"
        elif best.g1_tokens > 0 and best.g1_tokens >= int(w.shared_hit_weight * c.shared_tokens):
            reason = "g1_hit"
        else:
            reason = "shared_hit"
        return Decision(c.engine, reason, best.hit_tokens, best.g1_tokens, c.shared_tokens)


@dataclass(frozen=True)
class _Score(Generic[E]):
    candidate: Candidate[E]
    cost: float
    hit_tokens: int
    g1_tokens: int  # the G1 prefix counted (what survives until it is admitted)
    memory_wait: int


def memory_wait(engine: Routable, need: int, new: int, memory_wait_tokens: int) -> tuple[int, int]:
    """What waiting for G1 memory on ``engine`` costs a request.

    Args:
        engine: The engine.
        need: Tokens of G1 the request pins (prompt + answer).
        new: Of those, the tokens not already in G1 there.
        memory_wait_tokens: ``Weights.memory_wait_tokens``.

    Returns:
        ``(wait, room)``: the answers of the oldest requests in flight that
        must finish before it fits, in prompt tokens of work (0: it fits now,
        or the capacity is unknown), and how much of what G1 holds now can
        still be there when it is admitted: the capacity less everything the
        requests before it and itself will write (least recently used first
        out).
    """
    cap = engine.kv_capacity_tokens
    if cap <= 0:
        return 0, need
    held = engine.reservations
    free = cap - sum(r.kv_tokens for r in held)
    room = max(0, cap - sum(r.allocates for r in held) - new)
    if need <= free:
        return 0, room
    short, wait = need - free, 0
    for r in held:  # oldest first: they were admitted first and finish first
        wait += r.answer_tokens * memory_wait_tokens
        short -= r.kv_tokens
        if short <= 0:
            break
    return wait, room


def _score(c: Candidate[E], prompt_tokens: int, need: int, w: Weights) -> _Score[E]:
    e = c.engine
    new = need - max(c.g1_tokens, int(w.shared_hit_weight * c.shared_tokens))
    wait, room = memory_wait(e, need, new, w.memory_wait_tokens)
    g1 = c.g1_tokens if not wait else min(c.g1_tokens, room)
    hit = max(g1, int(w.shared_hit_weight * c.shared_tokens))
    cost = (
        max(0, prompt_tokens - hit)
        + e.pending_prefill_tokens
        + w.decode_cost_tokens * e.load
        + wait
    )
    return _Score(c, cost, hit, g1, wait)
