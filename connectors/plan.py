"""What the connector's scheduler side tells its worker side each step, and back.

The two sides may run in separate processes (vLLM: scheduler in
``EngineCore``, worker in ``VllmWorker-0``; what passes between them is
pickled once per step) or in one (the bundled engine)::

    scheduler side ── StepPlan ──────────────────────────────► worker side
                   loads: which objects to place into which blocks, sync or async
                   saves: which objects to gather out of which blocks
    scheduler side ◄── WorkerReport ─────────────────────────── worker side
                   loads that failed, and at which token; stuck load threads; bad keys

Everything is planned on the scheduler side (``scheduler_side.py``), which
holds the request state: keys, the lookup, the save plan. The worker side
(``worker_side.py``) only moves the bytes it is told to move. Nothing here
imports an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.prefix import ObjectRef


@dataclass(frozen=True)
class PlannedLoad:
    """Place tokens ``[start, end)`` of a request from ``objects`` into its blocks.

    Attributes:
        request_id: The engine's request id.
        start: First token to place (the engine's own, block-aligned, prefix-cache hit).
        end: One past the last; the engine computes from here (at least the prompt's last token).
        objects: The stored objects covering ``[start, end)``, in order
            (empty: nothing can be loaded, the load fails at once).
        block_ids: The request's block table (logical block i -> block id).
        sync: Placed before this step's forward pass, else in the background.
    """

    request_id: str
    start: int
    end: int
    objects: tuple[ObjectRef, ...]
    block_ids: tuple[int, ...]
    sync: bool


@dataclass(frozen=True)
class PlannedSave:
    """Gather ``objects`` of a request out of its blocks (after this step's forward) and store them.

    Attributes:
        request_id: The engine's request id.
        objects: What to save, each ``[start, end)`` under its key.
        block_ids: The request's block table.
        after_failed_load: The scheduler side knew, when it planned this, that
            the request's load failed (so the engine recomputes what the load
            left out). Until then the worker drops the request's saves: KV
            computed in a step whose load failed attended to blocks that were
            never written.
        release: The request has finished; an engine that delays freeing its
            blocks (vLLM) keeps them until the worker reports these gathered.
        verify: Stored objects the engine computed because sampled
            verification stopped their load (``verify.py``): gathered like
            saves, then compared with their stored blocks, not stored.
    """

    request_id: str
    objects: tuple[ObjectRef, ...]
    block_ids: tuple[int, ...]
    after_failed_load: bool = False
    release: bool = False
    verify: tuple[ObjectRef, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """One step's loads and saves."""

    loads: tuple[PlannedLoad, ...] = ()
    saves: tuple[PlannedSave, ...] = ()


@dataclass(frozen=True)
class LoadResult:
    """How one planned load ended (worker side).

    Attributes:
        request_id: The request.
        start: First token it was to place.
        end: One past the last token it was to place.
        placed: Leading tokens from ``start`` now valid in the cache.
        error: Why it stopped early (None when every token was placed).
    """

    request_id: str
    start: int
    end: int
    placed: int
    error: str | None = None

    @property
    def failed(self) -> bool:
        """Fewer tokens were placed than planned."""
        return self.placed < self.end - self.start


@dataclass
class WorkerReport:
    """What the worker saw since its last report (merged over workers with ``merge``).

    Attributes:
        failed_loads: Request id -> first token that was not placed.
        stuck: Every load thread is held by a fetch past its deadline; new
            loads would queue behind a stuck tier, so the scheduler offers none.
        bad_keys: Keys whose stored block sampled verification found wrong
            (deleted from every tier by the worker): the scheduler side
            quarantines them, so its lookups do not offer them again.
    """

    failed_loads: dict[str, int] = field(default_factory=dict)
    stuck: bool = False
    bad_keys: tuple[bytes, ...] = ()

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Both reports: the earliest failure per request; stuck if either is; all bad keys."""
        failed = dict(self.failed_loads)
        for rid, token in other.failed_loads.items():
            failed[rid] = min(token, failed.get(rid, token))
        bad = tuple(dict.fromkeys(self.bad_keys + other.bad_keys))
        return WorkerReport(failed, self.stuck or other.stuck, bad)


COUNTERS = (
    "lookups",  # requests looked up
    "lookup_tokens",  # prompt tokens looked up
    "hit_tokens",  # of those, stored in the tier
    "skipped_requests",  # not cacheable (LoRA, multimodal, prompt embeddings)
    "refused_tokens",  # hits not offered: every load thread was stuck
    "lookups_deferred",  # lookups still in flight when the engine asked: asked again next step
    "lookups_not_waited",  # in flight, less than a chunk to gain: admitted without them
    "lookup_timeouts",  # lookups past connector.lookup_timeout_s: a miss
    "refused_lookups",  # lookups not started, every lookup thread stuck on a tier: a miss
    "loads",  # loads started
    "loaded_tokens",  # tokens placed into the engine's cache
    "failed_tokens",  # tokens offered that failed to load (recomputed)
    "load_failures",  # loads that ended before their last token
    "loaded_bytes",  # encoded bytes placed
    "saved_chunks",  # objects queued for saving
    "dropped_saves",  # objects not saved: after a failed load, or the save queue was full
    "verify_chunks",  # objects computed instead of loaded and handed to the verifier
)
"""Counters both sides keep (vLLM's stats carry them: ``vllm_metrics.py``)."""


class Counters:
    """Running totals: ``totals`` since start, and what was counted since the last ``take``.

    Not thread-safe: the step thread's.

    Args:
        keep_samples: Keep each load's duration for ``take`` (vLLM's
            histogram); without it only the total is kept.
    """

    def __init__(self, keep_samples: bool = True) -> None:
        self._values = dict.fromkeys(COUNTERS, 0.0)
        self._load_seconds: list[float] = []
        self._keep_samples = keep_samples
        self.totals = dict.fromkeys(COUNTERS, 0.0)
        self.load_seconds_total = 0.0

    def add(self, name: str, n: float = 1.0) -> None:
        """Counts ``n`` more ``name`` (one of ``COUNTERS``)."""
        self._values[name] += n
        self.totals[name] += n

    def load_took(self, seconds: float) -> None:
        """One load ended after ``seconds``."""
        self.load_seconds_total += seconds
        if self._keep_samples:
            self._load_seconds.append(seconds)

    def take(self) -> dict[str, object] | None:
        """What was counted since the last call, or None when nothing was."""
        if not any(self._values.values()) and not self._load_seconds:
            return None
        out: dict[str, object] = {
            "counters": {k: v for k, v in self._values.items() if v},
            "load_seconds": self._load_seconds,
        }
        self._values = dict.fromkeys(COUNTERS, 0.0)
        self._load_seconds = []
        return out
