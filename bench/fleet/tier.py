"""The shared KV tier seen from the fleet: what it holds, and the network that moves KV.

:class:`SharedTier` holds chunks (``chunk_tokens`` tokens each, named by the
chain key of their last block, so a key names a whole prefix) in one LRU
bounded by capacity. A chunk becomes visible to lookups only when its write
has landed. Lookups have prefix semantics (stop at the first missing chunk).

:class:`Network` times transfers. The tier is one first-come-first-served
server of ``aggregate_gbps`` (reads and writes share it); each engine has a
link of ``link_gbps`` (its NIC and the placing of KV into its cache), also
first come first served. The bytes of a transfer pass through both, as in a
pipeline: each queue serves them for ``n / its bandwidth`` once it is free,
and the transfer lands ``latency`` after the later of the two finishes.
(NOTE: the two queues are independent on purpose: one engine's busy link
must not hold the tier back from serving the others.) A peer-to-peer
transfer (P/D without the tier) passes through both engines' links and not
the tier. Every transfer is logged, so the bandwidth the tier needed can be
read off afterwards.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.bench.fleet.costs import TierSpec


@dataclass(frozen=True)
class Transfer:
    """One logged transfer: bytes moved over ``[start_s, end_s]``."""

    kind: str  # "read" | "write" | "peer"
    start_s: float
    end_s: float
    nbytes: int


class SharedTier:
    """Chunk keys in an LRU with the time each became readable. Not thread-safe."""

    def __init__(self, capacity_chunks: int) -> None:
        if capacity_chunks < 1:
            raise ValueError("capacity_chunks must be >= 1")
        self.capacity = capacity_chunks
        self.chunks: OrderedDict[int, float] = OrderedDict()
        self.evictions = 0

    def lookup(self, keys: Sequence[int], now: float) -> int:
        """Leading ``keys`` readable at ``now`` (prefix semantics)."""
        n = 0
        chunks = self.chunks
        for k in keys:
            ready = chunks.get(k)
            if ready is None or ready > now:
                break
            n += 1
        return n

    def has(self, key: int) -> bool:
        """True when the chunk is stored or being written."""
        return key in self.chunks

    def ready_s(self, key: int) -> float | None:
        """When the chunk is (or becomes) readable; None if absent."""
        return self.chunks.get(key)

    def touch(self, keys: Sequence[int]) -> None:
        """Marks chunks as just read (LRU recency)."""
        for k in keys:
            if k in self.chunks:
                self.chunks.move_to_end(k)

    def put(self, key: int, ready_s: float) -> None:
        """Stores a chunk that becomes readable at ``ready_s``; evicts LRU chunks when full."""
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return
        self.chunks[key] = ready_s
        while len(self.chunks) > self.capacity:
            self.chunks.popitem(last=False)
            self.evictions += 1


class Network:
    """Times transfers between engines and the tier (see the module docstring)."""

    def __init__(self, spec: TierSpec, engines: int) -> None:
        self.spec = spec
        self._tier_bps = spec.aggregate_gbps * 1e9
        self._link_bps = spec.link_gbps * 1e9
        self.tier_free_s = 0.0
        self.link_free_s = [0.0] * engines
        self.log: list[Transfer] = []

    def transfer_s(self, nbytes: int) -> float:
        """Seconds one transfer takes on an idle network (the routers' estimate)."""
        if nbytes <= 0:
            return 0.0
        return self.spec.latency_s + nbytes / min(self._tier_bps, self._link_bps)

    def _link(self, engine: int, nbytes: int, now: float) -> float:
        """Queues ``nbytes`` on ``engine``'s link; returns when they are through."""
        done = max(now, self.link_free_s[engine]) + nbytes / self._link_bps
        self.link_free_s[engine] = done
        return done

    def _logged(self, kind: str, nbytes: int, end: float, rate_bps: float) -> float:
        """Logs the bytes as flowing at ``rate_bps`` up to ``end``; returns when they land."""
        self.log.append(Transfer(kind, end - nbytes / rate_bps, end, nbytes))
        return end + self.spec.latency_s

    def tier(self, engine: int, nbytes: int, now: float, kind: str) -> float:
        """A read from or write to the tier by ``engine``; returns when it lands."""
        tier_done = max(now, self.tier_free_s) + nbytes / self._tier_bps
        self.tier_free_s = tier_done
        end = max(tier_done, self._link(engine, nbytes, now))
        return self._logged(kind, nbytes, end, min(self._tier_bps, self._link_bps))

    def peer(self, src: int, dst: int, nbytes: int, now: float) -> float:
        """A direct transfer from ``src``'s memory to ``dst``'s; returns when it lands."""
        end = max(self._link(src, nbytes, now), self._link(dst, nbytes, now))
        return self._logged("peer", nbytes, end, self._link_bps)
