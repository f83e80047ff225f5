"""What the vLLM connector's scheduler side tells its worker side each step, and back.

vLLM runs the two sides in separate processes (scheduler in ``EngineCore``,
worker in ``VllmWorker-0``) and pickles what passes between them once per
step::

    scheduler ── StepPlan (in vLLM's KVConnectorMetadata) ──► worker
              loads: which objects to place into which blocks, sync or async
              saves: which objects to gather out of which blocks
    scheduler ◄── WorkerReport (in KVConnectorWorkerMetadata) ── worker
              loads that failed, and at which token; whether the load threads are stuck

Everything is planned on the scheduler side, which holds the request state
(``request_state.py``): keys, the lookup, the save plan. The worker only
moves the bytes it is told to move. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.connectors.prefix import ObjectRef


@dataclass(frozen=True)
class LoadSpec:
    """Place tokens ``[start, end)`` of a request from ``objects`` into its blocks.

    Attributes:
        request_id: vLLM's request id.
        start: First token to place (vLLM's own, block-aligned, local hit).
        end: One past the last; vLLM computes from here (at least the prompt's last token).
        objects: The stored objects covering ``[start, end)``, in order
            (empty: nothing can be loaded, every block is reported failed).
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
class SaveSpec:
    """Gather ``objects`` of a request out of its blocks (after this step's forward) and store them.

    Attributes:
        request_id: vLLM's request id.
        objects: What to save, each ``[start, end)`` under its key.
        block_ids: The request's block table.
        after_failed_load: The scheduler knew, when it planned this, that the
            request's load failed (so vLLM recomputes what the load left
            out). Until then the worker drops the request's saves: KV computed
            in a step whose load failed attended to blocks that were never
            written.
        release: The request has finished; vLLM keeps its blocks until the
            worker reports these gathered (``get_finished``).
        verify: Stored objects vLLM computed in this step because sampled
            verification stopped their load (``connectors/verify.py``): gathered
            like saves, then compared with their stored blocks, not stored.
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

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass
class WorkerReport:
    """What the worker saw in one step (merged over workers with ``merge``).

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
    "lookups_deferred",  # lookups still in flight when vLLM asked: asked again next step
    "lookup_timeouts",  # lookups past connector.lookup_timeout_s: a miss
    "refused_lookups",  # lookups not started, every lookup thread stuck on a tier: a miss
    "loads",  # loads started
    "loaded_tokens",  # tokens placed into vLLM's cache
    "failed_tokens",  # tokens offered that failed to load (recomputed)
    "load_failures",  # loads that ended before their last token
    "loaded_bytes",  # encoded bytes placed
    "saved_chunks",  # objects queued for saving
    "dropped_saves",  # objects not saved: after a failed load, or the save queue was full
    "verify_chunks",  # objects computed instead of loaded and handed to the verifier
)
"""Counters both sides keep and hand to vLLM's stats (``vllm_metrics.py``)."""


class Counters:
    """Running totals since the last ``take`` (per process; not thread-safe: the step thread's)."""

    def __init__(self) -> None:
        self._values = dict.fromkeys(COUNTERS, 0.0)
        self._load_seconds: list[float] = []
        self.totals = dict.fromkeys(COUNTERS, 0.0)

    def add(self, name: str, n: float = 1.0) -> None:
        """Counts ``n`` more ``name`` (one of ``COUNTERS``)."""
        self._values[name] += n
        self.totals[name] += n

    def load_took(self, seconds: float) -> None:
        """One load ended after ``seconds``."""
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
