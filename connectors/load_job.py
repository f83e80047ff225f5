"""One request's load from the store: fetched on a bounded pool, placed on the step thread.

A load is a small state machine with one deadline::

    fetching ──(every group fetched and placed)──────────────► done: all tokens
       │  ──(a group missing, corrupt, or failed to place)──► done: the tokens before it
       └──(deadline passes with a group still in flight)────► done: the tokens before it
                                                               (later groups abandoned:
                                                                never placed)

Objects are fetched in groups of 1, 1, 2, 4, ... objects (``fetch_groups``),
each group one batched ``store.get`` on a pool thread, so the first group
can be placed while later ones are still being read. Placing (decode,
dequantize, scatter into the paged cache) happens only in ``advance``, on the
engine's step thread, in order: whatever ``advance`` has placed is exactly
what the engine may use; the rest is recomputed.

The pool is bounded (``Fetcher``): an abandoned fetch keeps its thread until
the tier's own deadline returns it (the load deadline plus the tier's slack,
for a tier that honours it), and other loads use the other threads. A fetch
abandoned before it started never runs. When every thread is held by an
abandoned fetch — a tier stuck past its deadlines — the connector refuses
new loads (a miss, counted) rather than queueing them behind it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import KvtierError
from kvtier.prefix import ObjectRef
from kvtier.store import TieredStore

# Places fetched blocks for ``objects`` (in order) into the cache for tokens
# ``[lo, hi)``; returns (tokens placed from ``lo``, bytes placed, error or None).
PlaceFn = Callable[[Sequence[bytes | None], Sequence[ObjectRef], int, int], "Placed"]


@dataclass(frozen=True)
class Placed:
    """What one ``PlaceFn`` call placed."""

    tokens: int
    nbytes: int
    error: str | None = None


def fetch_groups(n: int) -> list[tuple[int, int]]:
    """Object indices ``0..n-1`` as ``(start, stop)`` groups of 1, 1, 2, 4, ... objects.

    Small groups first let placing start while later objects are still being
    read; doubling keeps the number of tier calls (round trips, for a network
    tier) logarithmic in the prefix length.
    """
    groups = []
    size = 1
    start = 0
    while start < n:
        stop = min(n, start + size)
        groups.append((start, stop))
        if len(groups) > 1:
            size *= 2
        start = stop
    return groups


Fetch = concurrent.futures.Future[list[bytes | None]]
Lookup = concurrent.futures.Future[list[bool]]


class Fetcher:
    """Bounded pools of I/O threads for ``store.get`` and ``store.contains``, with a wake-up.

    Lookups (``contains``) have threads of their own: on one shared pool a
    request's lookup — a hit's too — queued behind every block group other
    requests' loads had submitted (a 3,000-token prefix is five groups), so
    while a cold engine loaded its first prefixes its hits waited for their
    loads and, past ``lookup_timeout_s``, became misses that recomputed their
    whole prompt (bench/RESULTS.md, "Warm start").

    Args:
        store: Where blocks come from.
        workers: Threads for loads.
        lookup_workers: Threads for lookups.
    """

    def __init__(self, store: TieredStore, workers: int, lookup_workers: int = 2) -> None:
        self._store = store
        self._workers = workers
        self._lookup_workers = lookup_workers
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="kvtier-load"
        )
        self._lookup_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=lookup_workers, thread_name_prefix="kvtier-lookup"
        )
        self._lock = threading.Lock()
        # abandoned while running: they hold a thread (of the loads' pool, of the lookups')
        self._stuck: set[concurrent.futures.Future[Any]] = set()
        self._stuck_lookups: set[concurrent.futures.Future[Any]] = set()
        self._lookups: set[concurrent.futures.Future[Any]] = set()  # running or queued
        self.wakeup = threading.Event()  # set whenever a fetch ends

    @property
    def saturated(self) -> bool:
        """True when every load thread is held by an abandoned fetch (a new one would never start)."""
        with self._lock:
            return len(self._stuck) >= self._workers

    @property
    def lookups_saturated(self) -> bool:
        """True when every lookup thread is held by an abandoned lookup."""
        with self._lock:
            return len(self._stuck_lookups) >= self._lookup_workers

    @property
    def stuck(self) -> int:
        """Threads held by abandoned fetches and lookups."""
        with self._lock:
            return len(self._stuck) + len(self._stuck_lookups)

    def submit(self, keys: list[bytes], deadline: float) -> Fetch:
        """Starts ``store.get(keys, deadline=deadline)`` on a pool thread."""
        future = self._pool.submit(self._get, keys, deadline)
        future.add_done_callback(self._done)
        return future

    def submit_contains(self, keys: list[bytes], deadline: float) -> Lookup:
        """Starts ``store.contains(keys, deadline=deadline)`` on a lookup thread."""
        future = self._lookup_pool.submit(self._contains, keys, deadline)
        with self._lock:
            if not future.done():
                self._lookups.add(future)
        future.add_done_callback(self._done)
        return future

    def abandon(self, future: concurrent.futures.Future[Any]) -> None:
        """Gives up on a fetch: cancelled if it has not started, else counted as stuck until it ends."""
        if future.cancel() or future.done():
            return
        with self._lock:
            (self._stuck_lookups if future in self._lookups else self._stuck).add(future)
        if future.done():  # it ended in between: its callback may have run already
            with self._lock:
                self._stuck.discard(future)
                self._stuck_lookups.discard(future)

    def _get(self, keys: list[bytes], deadline: float) -> list[bytes | None]:
        if time.monotonic() >= deadline:
            return [None] * len(keys)  # queued past its deadline: do no I/O
        return self._store.get(keys, deadline=deadline)

    def _contains(self, keys: list[bytes], deadline: float) -> list[bool]:
        if time.monotonic() >= deadline:
            return [False] * len(keys)
        return self._store.contains(keys, deadline=deadline)

    def _done(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._stuck.discard(future)
            self._stuck_lookups.discard(future)
            self._lookups.discard(future)
        self.wakeup.set()

    def shutdown(self) -> None:
        """Stops taking work; threads stuck in a tier are left to finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class LoadJob:
    """A request's load: tokens ``[start, end)`` from ``objects`` (see the module docstring).

    Attributes:
        request_id: The engine's request id.
        start: First token to place (what the engine already has).
        end: One past the last token to place.
        objects: The stored objects covering ``[start, end)``, in order.
        deadline: ``time.monotonic()`` instant by which the load must end.
    """

    request_id: str
    start: int
    end: int
    objects: list[ObjectRef]
    deadline: float
    groups: list[tuple[int, Fetch]] = field(default_factory=list)
    fetcher: Fetcher | None = None
    placed: int = 0  # tokens placed from ``start``
    nbytes: int = 0
    error: str | None = None
    done: bool = False

    def begin(self, fetcher: Fetcher) -> None:
        """Submits every group's fetch."""
        self.fetcher = fetcher
        for a, b in fetch_groups(len(self.objects)):
            keys: list[bytes] = [o.key for o in self.objects[a:b]]
            self.groups.append((a, fetcher.submit(keys, self.deadline)))

    def ready(self) -> bool:
        """Whether ``advance`` has something to do: a group fetched, or the deadline passed."""
        if self.done or not self.groups:
            return True
        return self.groups[0][1].done() or time.monotonic() >= self.deadline

    def advance(self, place: PlaceFn) -> bool:
        """Places every group whose fetch has ended, in order; returns True once the load is over.

        Never blocks: a group still in flight before the deadline is left for
        a later call; one still in flight after it ends the load.
        """
        while not self.done and self.groups:
            first, future = self.groups[0]
            if not future.done():
                if time.monotonic() >= self.deadline:
                    self._fail(
                        "timed out: the load deadline passed with blocks still being fetched"
                    )
                break
            self.groups.pop(0)
            try:
                blocks = future.result()
            except KvtierError as e:
                self._fail(f"fetch failed: {e}")
                break
            objs = self.objects[first : first + len(blocks)]
            lo = self.start + self.placed
            hi = min(self.end, objs[-1].end)
            placed = place(blocks, objs, lo, hi)
            self.placed += placed.tokens
            self.nbytes += placed.nbytes
            if placed.error is not None:
                self._fail(placed.error)
        if not self.groups and not self.done:
            self.done = True
            if self.start + self.placed < self.end and self.error is None:
                self.error = "fewer tokens stored than expected"
        return self.done

    def _fail(self, error: str) -> None:
        self.error = error
        self.done = True
        self.abandon()

    def abandon(self) -> None:
        """Drops the fetches still in flight: their blocks are never placed."""
        for _, future in self.groups:
            if self.fetcher is not None:
                self.fetcher.abandon(future)
            else:
                future.cancel()
        self.groups = []
