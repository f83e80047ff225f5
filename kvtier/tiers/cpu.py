"""The CPU tier: blocks held in this process's memory, bounded in bytes."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.metrics import StoreMetrics
from kvtier.tiers.base import EvictedKeyListener, EvictionListener, Tier, TierUsage
from kvtier.tiers.eviction import EvictionPolicy, LRUPolicy


class CpuTier(Tier):
    """An in-memory tier with a byte capacity and a pluggable eviction policy.

    Blocks are kept by reference (``put`` takes ownership of immutable
    ``bytes``), so a get is a dictionary lookup, not a copy. A put of a key
    already held is skipped (blocks are content-addressed) and counted.
    Everything stored here was encoded in-process or verified before it was
    put, hence ``verifies_reads``. Read deadlines are accepted and ignored: a
    call costs about a memory lookup per key.

    Args:
        capacity_bytes: Never exceeded; a block larger than this is refused.
        policy: Eviction order; LRU if ``None``.
        name: Metrics label.
    """

    fast = True
    verifies_reads = True

    def __init__(
        self,
        capacity_bytes: int,
        policy: EvictionPolicy | None = None,
        *,
        metrics: StoreMetrics | None = None,
        name: str = "cpu",
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._policy = policy if policy is not None else LRUPolicy()
        self._blocks: dict[bytes, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()
        self._listener: EvictionListener | None = None
        self._key_listener: EvictedKeyListener | None = None
        self._metrics = metrics
        self.evictions = 0
        self.skipped_writes = 0

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        self._listener = listener

    def set_evicted_key_listener(self, listener: EvictedKeyListener | None) -> None:
        self._key_listener = listener

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        blocks = self._blocks
        with self._lock:
            return [k in blocks for k in keys]

    def prefix_length(self, keys: Sequence[bytes], *, deadline: float | None = None) -> int:
        with self._lock:
            n = 0
            for k in keys:
                if k not in self._blocks:
                    break
                n += 1
            return n

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for k in keys:
                block = self._blocks.get(k)
                if block is not None:
                    self._policy.access(k)
                out.append(block)
        return out

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        stored: list[bool] = []
        skipped = skipped_bytes = 0
        with self._lock:
            for key, block in items:
                size = len(block)
                if key in self._blocks:
                    self._policy.access(key)
                    stored.append(True)
                    skipped += 1
                    skipped_bytes += size
                    continue
                if not isinstance(block, bytes):
                    block = bytes(block)
                if size > self.capacity_bytes:
                    stored.append(False)
                    continue
                while self._used + size > self.capacity_bytes:
                    self._evict_one()
                self._blocks[key] = block
                self._used += size
                self._policy.insert(key)
                stored.append(True)
            self.skipped_writes += skipped
        if self._metrics is not None:
            self._metrics.put_skipped(self.name, skipped, skipped_bytes)
        return stored

    def _evict_one(self) -> None:
        victim = self._policy.victim()
        if victim is None:  # pragma: no cover - bookkeeping bug; check_integrity catches it
            raise AssertionError("CPU tier over capacity with nothing to evict")
        block = self._blocks.pop(victim)
        self._policy.remove(victim)
        self._used -= len(block)
        self.evictions += 1
        if self._metrics is not None:
            self._metrics.evictions.labels(self.name).inc()
        if self._listener is not None:
            self._listener(victim, block)
        if self._key_listener is not None:
            self._key_listener(victim)

    def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for k in keys:
                block = self._blocks.pop(k, None)
                if block is not None:
                    self._policy.remove(k)
                    self._used -= len(block)
                    removed += 1
        return removed

    def drain(self) -> list[tuple[bytes, bytes]]:
        """Every block, oldest in policy order first (for write-back on close)."""
        with self._lock:
            return list(self._blocks.items())

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self._used, self.capacity_bytes, len(self._blocks))

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(len(b) for b in self._blocks.values())
            assert total == self._used, f"cpu tier accounts {self._used} B but holds {total} B"
            assert self._used <= self.capacity_bytes, (
                f"cpu tier over capacity: {self._used} > {self.capacity_bytes}"
            )
            assert len(self._policy) == len(self._blocks), "eviction policy and block map disagree"

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._used = 0
