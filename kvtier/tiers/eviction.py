"""Eviction policies for tiers with a byte capacity.

A policy only orders keys; the tier owns the data and the byte accounting.
Policies are not thread-safe on their own: the tier calls them under its lock.
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import OrderedDict


class EvictionPolicy(abc.ABC):
    """Chooses which key to evict next."""

    refreshed_by_reads: bool = True
    """Whether :meth:`access` can move a key away from eviction (a tier shared
    by several processes then marks reads on the block's file, see the disk tier)."""

    @abc.abstractmethod
    def insert(self, key: bytes) -> None:
        """A new key was stored."""

    @abc.abstractmethod
    def access(self, key: bytes) -> None:
        """A stored key was read."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> None:
        """A key was removed (deleted or evicted)."""

    @abc.abstractmethod
    def victim(self) -> bytes | None:
        """The key to evict next, or ``None`` if the policy tracks no keys."""

    @abc.abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used: reads and writes refresh a key."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self) -> bytes | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """First in, first out: reads do not refresh a key."""

    refreshed_by_reads = False

    def access(self, key: bytes) -> None:
        return None


class LFUPolicy(EvictionPolicy):
    """Least frequently used, ties broken by age (lazy-deletion heap, O(log n))."""

    def __init__(self) -> None:
        self._counts: dict[bytes, int] = {}
        self._heap: list[tuple[int, int, bytes]] = []
        self._tick = itertools.count()

    def insert(self, key: bytes) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        heapq.heappush(self._heap, (self._counts[key], next(self._tick), key))

    def access(self, key: bytes) -> None:
        if key in self._counts:
            self.insert(key)
        if len(self._heap) > 4 * len(self._counts) + 64:
            # Drop stale entries so the heap stays proportional to the keys.
            self._heap = [(c, t, k) for c, t, k in self._heap if self._counts.get(k) == c]
            heapq.heapify(self._heap)

    def remove(self, key: bytes) -> None:
        self._counts.pop(key, None)

    def victim(self) -> bytes | None:
        while self._heap:
            count, _, key = self._heap[0]
            if self._counts.get(key) == count:
                return key
            heapq.heappop(self._heap)  # stale entry
        return None

    def __len__(self) -> int:
        return len(self._counts)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name (``lru``, ``fifo``, ``lfu``)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None
