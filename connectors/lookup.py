"""Prefix lookups off the scheduling thread: answered, or still in flight.

The scheduler side (``scheduler_side.py``) asks for a request's stored
prefix when its engine considers admitting it. The
lookup is one batched ``contains`` per tier: microseconds for the CPU and
disk tiers, a round trip for a network tier, and up to a timeout for a tier
that has stopped answering. It runs on a lookup thread (the ``Fetcher``'s own
for lookups: never queued behind other requests' loads),
and the scheduling thread waits for it at most ``WAIT_S``: a local tier's
answer arrives within that, so its hit is admitted in the same step; a slow
one leaves the request waiting — ``poll`` answers None, the adapter tells its
engine to ask again next step — while the running requests keep stepping.
A lookup not answered by its deadline is a miss, counted. A request whose
engine already holds all but less than a chunk of its prompt does not wait a
step for a slow answer (``poll(wait=False)``, ``scheduler_side.py`` says why).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.connectors.load_job import Fetcher
from kvtier.connectors.load_job import Lookup as LookupFuture
from kvtier.connectors.request_state import RequestState
from kvtier.connectors.verify import Quarantine
from kvtier.errors import KvtierError
from kvtier.metrics import StoreMetrics
from kvtier.prefix import StoredPrefix, longest_stored_prefix

log = logging.getLogger(__name__)

WAIT_S = 0.005
"""How long the scheduling thread waits for a lookup before deferring its request a step."""


@dataclass
class LookupStats:
    """What happened to lookups that did not simply answer."""

    deferred: int = 0  # polls answered None: the lookup was still in flight
    not_waited: int = 0  # still in flight, and the request was admitted without it
    timeouts: int = 0  # lookups past their deadline: served as a miss
    refused: int = 0  # lookups not started, every I/O thread stuck on a tier: a miss


@dataclass
class _Pending:
    keys: list[bytes]
    future: LookupFuture
    deadline: float  # monotonic
    started: float = field(default_factory=time.perf_counter)


class AsyncLookups:
    """The lookups in flight, one per request.

    Args:
        fetcher: The I/O threads (lookups have their own, so none waits behind a load).
        timeout_s: One lookup's deadline, retries included.
        metrics: ``kvtier_lookups_total`` and the ``lookup`` stage.
        quarantine: Keys never reported present (the verifier's), if any.
        on_count: Told ``"deferred"``, ``"not_waited"``, ``"timeout"`` or ``"refused"`` as
            they happen.
    """

    def __init__(
        self,
        fetcher: Fetcher,
        *,
        timeout_s: float,
        metrics: StoreMetrics,
        quarantine: Quarantine | None = None,
        on_count: Callable[[str], None] | None = None,
    ) -> None:
        self._fetcher = fetcher
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._quarantine = quarantine
        self._on_count = on_count
        self._pending: dict[str, _Pending] = {}
        self.stats = LookupStats()

    def poll(
        self, request_id: str, state: RequestState, *, wait: bool = True
    ) -> StoredPrefix | None:
        """The request's stored prefix, or None while its lookup is in flight.

        With ``wait`` the request waits for it (its engine asks again next step:
        ``deferred``); without, a lookup not answered within ``WAIT_S`` is left to end on
        its own (it holds its thread until its deadline at most) and the request is
        admitted without it (``not_waited``).
        """
        pending = self._pending.get(request_id)
        if pending is None:
            _, keys = state.lookup_keys()
            if not keys:
                return self._answer(state, keys, [])
            if self._fetcher.lookups_saturated:  # every lookup thread is stuck on a tier: a miss
                self._count("refused")
                return self._answer(state, keys, [False] * len(keys))
            deadline = time.monotonic() + self._timeout_s
            pending = _Pending(keys, self._fetcher.submit_contains(keys, deadline), deadline)
            self._pending[request_id] = pending
            concurrent.futures.wait([pending.future], timeout=WAIT_S)
        timed_out = False
        if not pending.future.done():
            if time.monotonic() < pending.deadline:
                if not wait:
                    del self._pending[request_id]  # not abandoned: slow, not stuck
                    self._count("not_waited")
                    return None
                self._count("deferred")
                return None
            self._fetcher.abandon(pending.future)  # the tier ignored its deadline
            timed_out = True
        del self._pending[request_id]
        self._metrics.stage_latency.labels("lookup").observe(time.perf_counter() - pending.started)
        present = [False] * len(pending.keys)
        if timed_out:
            self._count("timeout")
        else:
            try:
                present = pending.future.result()
            except (KvtierError, ValueError, RuntimeError) as e:  # the store counts tier errors
                log.warning("kvtier lookup failed, served as a miss: %s", e)
        return self._answer(state, pending.keys, present, "timeout" if timed_out else None)

    def cancel(self, request_id: str) -> None:
        """Forgets the request's lookup (it finished or was aborted while it ran)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._fetcher.abandon(pending.future)

    def any_answered(self) -> bool:
        """Whether a lookup in flight has an answer waiting to be polled."""
        return any(p.future.done() for p in self._pending.values())

    def _count(self, what: str) -> None:
        field_name = {"deferred": "deferred", "not_waited": "not_waited", "timeout": "timeouts",
                      "refused": "refused"}[what]  # fmt: skip
        setattr(self.stats, field_name, getattr(self.stats, field_name) + 1)
        if self._on_count is not None:
            self._on_count(what)

    def _answer(
        self,
        state: RequestState,
        keys: list[bytes],
        present: list[bool],
        outcome: str | None = None,
    ) -> StoredPrefix:
        limit = state.num_prompt_tokens
        # keys the verifier found wrong are not loaded (another writer may have put them back)
        if self._quarantine is not None and len(self._quarantine):
            present = [p and k not in self._quarantine for k, p in zip(keys, present, strict=True)]
        prefix = longest_stored_prefix(state.keys, limit, present, state.page_tokens)
        if outcome is None:
            outcome = "miss" if not prefix.num_tokens else "partial"
            if prefix.num_tokens == limit:
                outcome = "hit"
        self._metrics.lookups.labels(outcome).inc()
        return prefix
