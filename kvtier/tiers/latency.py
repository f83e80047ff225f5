"""A tier that answers late: another tier behind a fixed added latency.

For measuring what a slow tier does to an engine — a remote tier across a
congested network, a disk under contention — without one: ``get`` (and, if
asked, ``contains`` and ``put``) waits the configured time before the inner
tier answers. Deadlines hold as for any tier that reads key by key: a call
waits at most until its deadline and then returns misses, so a caller sees
exactly what it would see of a slow tier that honours the contract.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvtier.tiers.base import EvictedKeyListener, EvictionListener, Tier, TierUsage


class LatencyTier(Tier):
    """``inner`` with ``get_s`` (``contains_s``, ``put_s``) seconds added to every call.

    Args:
        inner: The tier that holds the blocks.
        get_s: Added to every ``get`` call (one batch = one wait).
        contains_s: Added to every ``contains`` / ``prefix_length`` call.
        put_s: Added to every ``put`` call (on the store's background writer).
        name: Label; the inner tier's by default.
    """

    fast = False  # never called on an engine's step thread for writes

    def __init__(
        self,
        inner: Tier,
        *,
        get_s: float = 0.0,
        contains_s: float = 0.0,
        put_s: float = 0.0,
        name: str | None = None,
    ) -> None:
        if min(get_s, contains_s, put_s) < 0:
            raise ValueError("added latencies must be >= 0")
        self.inner = inner
        self.get_s = get_s
        self.contains_s = contains_s
        self.put_s = put_s
        self.name = name or inner.name
        self.verifies_reads = inner.verifies_reads

    @staticmethod
    def _wait(seconds: float, deadline: float | None) -> bool:
        """Sleeps ``seconds`` or until ``deadline``; ``False`` if the deadline cut it short."""
        if seconds <= 0:
            return deadline is None or time.monotonic() < deadline
        until = time.monotonic() + seconds
        if deadline is not None and deadline < until:
            time.sleep(max(0.0, deadline - time.monotonic()))
            return False
        time.sleep(seconds)
        return True

    def contains(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bool]:
        if not self._wait(self.contains_s, deadline):
            return [False] * len(keys)
        return self.inner.contains(keys, deadline=deadline)

    def get(self, keys: Sequence[bytes], *, deadline: float | None = None) -> list[bytes | None]:
        if not self._wait(self.get_s, deadline):
            return [None] * len(keys)
        return self.inner.get(keys, deadline=deadline)

    def put(self, items: Sequence[tuple[bytes, bytes]]) -> list[bool]:
        self._wait(self.put_s, None)
        return self.inner.put(items)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(keys)

    def report_bad(self, keys: Sequence[bytes]) -> int:
        return self.inner.report_bad(keys)  # a remote tier inside tells its server why

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def set_eviction_listener(self, listener: EvictionListener | None) -> None:
        self.inner.set_eviction_listener(listener)

    def set_evicted_key_listener(self, listener: EvictedKeyListener | None) -> None:
        self.inner.set_evicted_key_listener(listener)

    def check_integrity(self) -> None:
        self.inner.check_integrity()

    def close(self) -> None:
        self.inner.close()
