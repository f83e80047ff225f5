"""Replicas that start warm: a joining engine loads the fleet's hottest prefixes before traffic.

::

    every routed request ──► HotPrefixes.observe(prompt ids, tokens some engine already held)
                              (bounded: the least recently hit prefixes are forgotten)

    POST /engines {"url", "warm": true}
        pool.add(engine, warming=True)        not routed to while warming
        Warmer.warm(engine):
            prefixes = HotPrefixes.hottest(budget = warm_fraction x its G1 tokens,
                                           at most warm_max_prefixes)
            for each: POST /v1/completions {prompt: ids, max_tokens: 1}
                      its connector loads the prefix from the shared tier, its
                      prefix cache keeps it in G1 (engine-agnostic: kvtier or vLLM)
            ends at the last prefix, at warm_deadline_s, or as soon as traffic
            needs the engine (no other engine serving, or every other one has
            warm_cancel_load requests in flight); then warming = False

A prefix is counted when a request is routed to an engine that holds it (in
G1 or the shared tier, as ``cache_aware`` found it), or when an earlier
request's prompt started with it (``HotPrefixes.repeats``): a prefix two
requests share. The second matters on a busy fleet, where a document's
later questions are routed while its first is still queued, so no engine
holds it yet: on a 2-vCPU host without bf16, the router's index saw 3 of the
8 primed documents as hits, and warm-up handed over only those 3. The score
of a prefix is hits x length (prompt tokens it saves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import httpx
import xxhash
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvtier.router.engines import Engine, EnginePool

log = logging.getLogger(__name__)

MIN_PREFIX_TOKENS = 16  # shorter hits are not worth a warm-up request
MAX_PREFIX_TOKENS = 8192  # a longer prefix is kept to this many tokens
MAX_TOTAL_TOKENS = 2_000_000  # tokens of every prefix kept, at most (4 bytes each)
REPEAT_BLOCK_TOKENS = 16  # repeats are found in whole blocks of this many tokens
REPEAT_CAPACITY = 1 << 17  # prefix hashes remembered for repeats (8 bytes each, and the dict's)
WARM_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_POLL_S = 0.05


@dataclass
class _Hot:
    tokens: int
    hits: int = 0


class HotPrefixes:
    """Hit counts of prompt prefixes, bounded (not thread-safe: the router's loop).

    A prefix is kept as its ids packed 4 bytes each (the dict key), so the
    memory is bounded by ``capacity`` prefixes and ``MAX_TOTAL_TOKENS``.

    Args:
        capacity: Prefixes remembered; the least recently hit are forgotten.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._hot: OrderedDict[bytes, _Hot] = OrderedDict()
        self._tokens = 0
        self._seen: OrderedDict[int, None] = OrderedDict()  # prefix hashes, least recent first

    def __len__(self) -> int:
        return len(self._hot)

    def repeats(self, ids: list[int]) -> int:
        """Tokens of the longest prefix of ``ids`` (whole blocks of
        ``REPEAT_BLOCK_TOKENS``, at most ``MAX_PREFIX_TOKENS``) that an earlier prompt
        given here started with; ``ids``'s prefixes are remembered for later prompts."""
        data = array("I", ids[:MAX_PREFIX_TOKENS]).tobytes()
        step = 4 * REPEAT_BLOCK_TOKENS
        h = xxhash.xxh3_64()
        found = 0
        for end in range(step, len(data) + 1, step):
            h.update(data[end - step : end])
            d = h.intdigest()
            if d in self._seen:
                self._seen.move_to_end(d)
                if found == end - step:  # a prefix: every block before it was seen too
                    found = end
            else:
                self._seen[d] = None
        while len(self._seen) > REPEAT_CAPACITY:
            self._seen.popitem(last=False)
        return found // 4

    def observe(self, ids: list[int], hit_tokens: int) -> None:
        """A request whose first ``hit_tokens`` prompt tokens some engine already held."""
        n = min(hit_tokens, len(ids), MAX_PREFIX_TOKENS)
        if n < MIN_PREFIX_TOKENS:
            return
        key = array("I", ids[:n]).tobytes()
        entry = self._hot.get(key)
        if entry is None:
            entry = self._hot[key] = _Hot(n)
            self._tokens += n
        entry.hits += 1
        self._hot.move_to_end(key)
        while len(self._hot) > self._capacity or self._tokens > MAX_TOTAL_TOKENS:
            _, old = self._hot.popitem(last=False)
            self._tokens -= old.tokens

    def hottest(self, budget_tokens: int | None, max_prefixes: int) -> list[list[int]]:
        """The prefixes worth most (hits x length) within a token budget (None: no budget);
        a prefix another chosen one starts with is left out (it comes with it), and one that
        extends a chosen one takes its place (G1 holds the longer once: the budget counts
        only what it adds)."""
        ranked = sorted(self._hot.items(), key=lambda kv: (kv[1].hits * kv[1].tokens, kv[1].tokens))
        chosen: list[bytes] = []
        used = 0
        for key, h in reversed(ranked):
            if any(c.startswith(key) for c in chosen):
                continue
            extended = [c for c in chosen if key.startswith(c)]
            adds = h.tokens - sum(len(c) // 4 for c in extended)
            if budget_tokens is not None and used + adds > budget_tokens:
                continue
            if not extended and len(chosen) >= max_prefixes:
                continue
            chosen = [c for c in chosen if c not in extended] + [key]
            used += adds
        return [array("I", c).tolist() for c in chosen]


class WarmMetrics:
    """Counters of warm-ups (``/metrics`` and ``GET /warm_start``; names in docs/router.md)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prefixes = Counter(
            "kvtier_router_warm_prefixes", "Prefixes joining engines were warmed with",
            registry=registry,
        )  # fmt: skip
        self.tokens = Counter(
            "kvtier_router_warm_tokens", "Prompt tokens of those prefixes", registry=registry
        )
        self.loaded_tokens = Counter(
            "kvtier_router_warm_loaded_tokens",
            "Of those, tokens the engine reported reused (loaded from the shared tier) "
            "rather than computed",
            registry=registry,
        )
        self.runs = Counter(
            "kvtier_router_warm_runs",
            "Warm-ups by how they ended (done, deadline, cancelled, failed)",
            ["outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "kvtier_router_warm_duration_seconds",
            "Time from an engine joining to its first traffic",
            buckets=WARM_BUCKETS,
            registry=registry,
        )


@dataclass
class WarmRun:
    """One engine's warm-up, as ``GET /warm_start`` shows it."""

    url: str
    state: str = "waiting"  # waiting | warming | done | deadline | cancelled | failed
    planned: int = 0
    prefixes: int = 0
    tokens: int = 0
    loaded_tokens: int = 0
    budget_tokens: int | None = None
    started: float = field(default_factory=time.monotonic)
    duration_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "planned_prefixes": self.planned,
            "prefixes": self.prefixes,
            "tokens": self.tokens,
            "loaded_tokens": self.loaded_tokens,
            "budget_tokens": self.budget_tokens,
            "duration_s": self.duration_s,
        }


class Warmer:
    """Warms engines that join the router.

    Args:
        pool: The engines (the joining one is in it, ``warming``).
        hot: The fleet's hit statistics.
        client: The HTTP client to the engines.
        metrics: Where warm-ups are counted.
        max_prefixes: At most this many prefixes per warm-up.
        fraction: Share of the engine's G1 tokens warm-up may fill.
        deadline_s: Longest warm-up.
        cancel_load: Traffic needs the engine when every other serving engine
            has this many requests in flight (or there is none).
        headers: Sent to the engine (an API key).
    """

    def __init__(
        self,
        pool: EnginePool,
        hot: HotPrefixes,
        client: httpx.AsyncClient,
        metrics: WarmMetrics,
        *,
        max_prefixes: int,
        fraction: float,
        deadline_s: float,
        cancel_load: int,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.pool = pool
        self.hot = hot
        self.client = client
        self.metrics = metrics
        self.max_prefixes = max_prefixes
        self.fraction = fraction
        self.deadline_s = deadline_s
        self.cancel_load = cancel_load
        self.headers = headers or {}
        self.runs: dict[str, WarmRun] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, engine: Engine) -> WarmRun:
        """Warms ``engine`` in the background (it must be ``warming``)."""
        run = self.runs[engine.url] = WarmRun(engine.url)
        task = asyncio.get_running_loop().create_task(self.warm(engine, run))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return run

    async def stop(self) -> None:
        """Cancels the warm-ups in progress (the router stops)."""
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def needed(self, engine: Engine) -> bool:
        """Traffic needs ``engine`` now: no other engine of its role serves, or all are busy."""
        roles = ("both",) if engine.role == "both" else (engine.role, "both")
        others = [e for e in self.pool.serving(roles) if e is not engine]
        return all(e.load >= self.cancel_load for e in others)

    async def warm(self, engine: Engine, run: WarmRun) -> None:
        """Runs one warm-up to its end; the engine takes traffic afterwards, however it ended."""
        deadline = run.started + self.deadline_s
        try:
            outcome = await self._until_needed(engine, self._load_prefixes(engine, run), deadline)
        except Exception:  # a failed warm-up is a cold engine, never a router failure
            log.exception("warm-up of %s failed", engine.url)
            outcome = "failed"
        finally:
            engine.warming = False
        run.state = outcome
        run.duration_s = time.monotonic() - run.started
        self.metrics.runs.labels(outcome).inc()
        self.metrics.duration.observe(run.duration_s)
        log.warning("engine %s warm-up %s: %d prefixes, %d tokens (%d loaded) in %.2f s",
                    engine.url, outcome, run.prefixes, run.tokens, run.loaded_tokens,
                    run.duration_s)  # fmt: skip

    async def _until_needed(self, engine: Engine, work: Any, deadline: float) -> str:
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_POLL_S)
                if done:
                    result: str = task.result()
                    return result
                if time.monotonic() >= deadline:
                    return "deadline"
                if engine.healthy and self.needed(engine):
                    return "cancelled"
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _load_prefixes(self, engine: Engine, run: WarmRun) -> str:
        while not engine.healthy:
            await asyncio.sleep(_POLL_S)  # the deadline bounds it
        capacity = engine.kv_capacity_tokens
        run.budget_tokens = int(self.fraction * capacity) if capacity > 0 else None
        prefixes = self.hot.hottest(run.budget_tokens, self.max_prefixes)
        run.planned = len(prefixes)
        run.state = "warming"
        for ids in prefixes:
            body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
            r = await self.client.post(
                engine.url + "/v1/completions", json=body, headers=self.headers
            )
            if r.status_code != 200:
                log.warning("warm-up request to %s failed (%d): %.200s", engine.url,
                            r.status_code, r.text)  # fmt: skip
                continue
            usage = r.json().get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            run.prefixes += 1
            run.tokens += len(ids)
            self.metrics.prefixes.inc()
            self.metrics.tokens.inc(len(ids))
            if isinstance(cached, int):
                run.loaded_tokens += cached
                self.metrics.loaded_tokens.inc(cached)
        return "done"

    def snapshot(self) -> dict[str, Any]:
        """``GET /warm_start``: each joining engine's warm-up."""
        return {
            "engines": {u: r.to_json() for u, r in self.runs.items()},
            "hot_prefixes": len(self.hot),
        }
